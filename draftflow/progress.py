"""Progress lines in the logs of long stages, and reading them back (`draftflow status`).

Every long stage (build-target, regenerate, extract, train, evaluate) logs, at most every
`every_s` seconds and once at the end, one line in a fixed format:

    progress: 120/400 steps (30.0%), 2.50 steps/s, elapsed 48s, ETA 1m52s | loss 3.21

The rate counts only the work done by this run (a resumed run does not inherit the
speed of work done before it). `parse_progress` reads such a line back; the CLI also
writes `draftflow <stage>: started …` / `finished …` / `failed …` lines, which
`draftflow status` uses to tell running, finished and interrupted jobs apart.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

PROGRESS_RE = re.compile(
    r"progress: (?P<done>\d+)/(?P<total>\d+) (?P<unit>\S+) \((?P<percent>[\d.]+)%\), "
    r"(?P<rate>[\d.]+(?:e[+-]?\d+)?|\?) \S+/s, elapsed (?P<elapsed>\S+), ETA (?P<eta>\S+)(?: \| (?P<extra>.*))?$"
)


def format_seconds(seconds: float) -> str:
    """12 -> '12s', 312 -> '5m12s', 7512 -> '2h05m12s'; nan/inf -> '?'."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    if hours:
        return f"{hours}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def format_rate(rate: float | None) -> str:
    """7321.4 -> '7321', 2.456 -> '2.46', 0.00123 -> '0.00123' (no exponents); None -> '?'."""
    if rate is None:
        return "?"
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}" if rate >= 0.001 else f"{rate:.6f}"


def parse_seconds(text: str) -> float | None:
    """Inverse of format_seconds ('?' -> None)."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if text == "?" or not match or not any(match.groups()):
        return None
    h, m, s = (int(g or 0) for g in match.groups())
    return 3600.0 * h + 60.0 * m + s


@dataclass(frozen=True)
class ProgressLine:
    done: int
    total: int
    unit: str
    rate: float | None  # units per second
    elapsed_s: float | None
    eta_s: float | None
    extra: str = ""

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


def parse_progress(line: str) -> ProgressLine | None:
    match = PROGRESS_RE.search(line.rstrip())
    if not match:
        return None
    g = match.groupdict()
    return ProgressLine(
        done=int(g["done"]),
        total=int(g["total"]),
        unit=g["unit"],
        rate=None if g["rate"] == "?" else float(g["rate"]),
        elapsed_s=parse_seconds(g["elapsed"]),
        eta_s=parse_seconds(g["eta"]),
        extra=g["extra"] or "",
    )


class Progress:
    """Logs done/total, rate and ETA of one unit of work (steps, samples, tokens, prompts).

    `done` counts from 0 or from `resumed` (work found already done); the rate and ETA
    use only what this run did.
    """

    def __init__(
        self,
        total: int,
        unit: str,
        every_s: float = 30.0,
        resumed: int = 0,
        logger: logging.Logger | None = None,
    ):
        self.total, self.unit, self.every_s = int(total), unit, every_s
        self.resumed = self.done = int(resumed)
        self.logger = logger or log
        self.start = time.monotonic()
        self.last: float | None = None

    def rate(self, now: float | None = None) -> float | None:
        elapsed = (now or time.monotonic()) - self.start
        did = self.done - self.resumed
        return did / elapsed if did > 0 and elapsed > 0 else None

    def eta_s(self, now: float | None = None) -> float | None:
        rate = self.rate(now)
        if self.done >= self.total:
            return 0.0
        return (self.total - self.done) / rate if rate else None

    def line(self, now: float | None = None, extra: str = "") -> str:
        now = now or time.monotonic()
        rate = self.rate(now)
        percent = 100.0 * self.done / self.total if self.total else 100.0
        text = (
            f"progress: {self.done}/{self.total} {self.unit} ({percent:.1f}%), "
            f"{format_rate(rate)} {self.unit}/s, "
            f"elapsed {format_seconds(now - self.start)}, ETA {format_seconds(self.eta_s(now))}"
        )
        return f"{text} | {extra}" if extra else text

    def update(self, done: int | None = None, advance: int = 0, extra: str = "", force: bool = False) -> None:
        """Set `done` (or add `advance`); log when `every_s` passed since the last line, at the
        end, or when forced."""
        self.done = int(done) if done is not None else self.done + advance
        now = time.monotonic()
        due = self.last is None or now - self.last >= self.every_s or self.done >= self.total
        if force or due:
            self.last = now
            self.logger.info("%s", self.line(now, extra))
