"""Acceptance from a served engine's own counters.

Names below were read in the released source of the releases in `CHECKED` (pip download
sglang==0.5.14 / vllm==0.25.1, 0.32.0, 0.33.0) and, for vLLM 0.32.0, against the running CPU
build. Another release is measured as well: what it must satisfy is checked at run time (the
counters exist, and they move while a prompt set with drafts is decoded), and a release outside
`CHECKED` is named in a warning.

SGLang 0.5.14 (`POST /generate` with `input_ids`, `GET /server_info`, before 0.5.6 `/get_server_info`):
- every finished request's `meta_info` carries `spec_verify_ct` (verify forward passes),
  `spec_num_correct_drafts` (accepted draft tokens, bonus excluded),
  `spec_correct_drafts_histogram` (h[a] = verify steps that accepted exactly a drafts),
  `spec_accept_length` (= completion_tokens / spec_verify_ct, the first token included) and
  `completion_tokens`;
- `/server_info` → `version`, the server args (`speculative_algorithm`,
  `speculative_num_steps`, `speculative_eagle_topk`, `speculative_num_draft_tokens`, `tp_size`)
  and `internal_states[i].avg_spec_accept_length` = lifetime (accepted drafts + verify steps) /
  verify steps, refreshed at the scheduler's decode log interval (so it lags; kept as a check).

vLLM 0.25.1 to 0.33.0 (`POST /v1/completions`, `GET /metrics`, `GET /version`; the
spec-decode metrics file is byte-identical in 0.32.0 and 0.33.0): Prometheus counters, labels
`model_name`, `engine` (one series per data-parallel engine):
- `vllm:spec_decode_num_drafts_total` (verify steps that carried drafts),
  `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}` (steps whose draft i,
  0-based, was accepted), `vllm:generation_tokens_total`;
- vLLM's own mean acceptance length is 1 + accepted / drafts; it counts drafts accepted in a
  request's last step past `max_tokens`, which the client never receives.
Counters are global: a unit of work is measured as the difference of two scrapes, with no
other traffic on the server in between.

Both reduce to one `SpecCounts`: verify steps, drafts proposed and accepted, the tokens the
verify steps delivered, and accepted_at[i] = verify steps whose draft i+1 was accepted (chain
drafting: drafts 1..i too).

One acceptance length for every engine (hf, sglang, vllm; DESIGN.md §3): τ = tokens the
verify steps delivered / verify steps, where a request's delivered tokens are its completion
tokens less the first (the prefill's, which no verify step produced), cut at `max_tokens` and
EOS as the client received them. The engines' own definitions are kept beside it as raw
counts (`engine_acceptance_length`): vLLM's 1 + accepted / drafts, SGLang's completion tokens
per verify step. α_i = accepted_at[i] / accepted_at[i-1], with accepted_at[-1] = steps,
assumes every step proposed K drafts (true for chain drafting except where a request's token
budget cut the last step short).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, field

from draftflow.errors import DraftflowError

log = logging.getLogger(__name__)

# Releases whose endpoints and counter names were read in their released source.
CHECKED = {"sglang": ("0.5.14",), "vllm": ("0.25.1", "0.32.0", "0.33.0")}
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}


def release(version: str) -> str:
    """'0.5.14.post2' / 'v0.25.1rc1' / '0.25.1+cu129' -> '0.5.14' / '0.25.1'."""
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(version).strip())
    if not match:
        return str(version)
    return ".".join(g or "0" for g in match.groups())


def check_version(engine: str, version: str | None, where: str) -> str:
    """The release of a served engine. One whose counters were not read here is measured all
    the same (the counters are checked as they are read) and named in a warning."""
    if version is None or not re.match(r"^v?\d+\.\d+", str(version).strip()):
        raise DraftflowError(
            f"{where}: {ENGINE_NAMES[engine]} reported no release ({version!r}); draftflow needs it to "
            "place the drafter's aux layer ids. Is this server really " + ENGINE_NAMES[engine] + "?"
        )
    found = release(version)
    if found not in CHECKED[engine]:
        log.warning(
            "%s: %s %s: its counters were not read in its source here (checked: %s); they are checked as "
            "they are read: present, and moving while drafts are verified", where, ENGINE_NAMES[engine], found,
            ", ".join(CHECKED[engine]),
        )  # fmt: skip
    return found


# ---------------------------------------------------------------- the common counts


@dataclass
class SpecCounts:
    """Speculative-decoding counts of a unit of work (a prompt set at one K and temperature)."""

    k: int
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0  # as the engine counts them (vLLM: past max_tokens too)
    accepted_at: list[int] = field(default_factory=list)  # [K]
    emitted_tokens: int = 0  # tokens the verify steps delivered: completion tokens less each request's first

    def __post_init__(self):
        self.accepted_at = list(self.accepted_at) or [0] * self.k
        if len(self.accepted_at) != self.k:
            raise DraftflowError(f"{len(self.accepted_at)} per-position counts for K = {self.k}")

    def __add__(self, other: "SpecCounts") -> "SpecCounts":
        if other.k != self.k:
            raise DraftflowError(f"cannot add counts at K = {self.k} and K = {other.k}")
        return SpecCounts(
            self.k, self.verify_steps + other.verify_steps, self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens, [a + b for a, b in zip(self.accepted_at, other.accepted_at)],
            self.emitted_tokens + other.emitted_tokens,
        )  # fmt: skip

    @property
    def tau(self) -> float:
        """The one acceptance length (module docstring): delivered tokens per verify step."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 1.0

    @property
    def engine_tau(self) -> float:
        """The engine's own count, 1 + accepted drafts / verify steps (vLLM's mean acceptance length)."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 1.0

    def check_moved(self, where: str) -> None:
        """The run-time check of an engine release: verify steps delivered tokens, so the counters
        must have moved, and within what chain drafting at K allows."""
        if self.emitted_tokens and not self.verify_steps:
            raise DraftflowError(
                f"{where}: {self.emitted_tokens} tokens came from verify steps but the engine's speculative-"
                "decoding counters did not move: this release does not count them where draftflow reads them, "
                "so τ cannot be measured from it. Serve with a release listed in "
                "draftflow/evaluation/engine_counters.py CHECKED, or evaluate with engine hf"
            )
        if self.verify_steps and not self.verify_steps <= self.emitted_tokens <= self.verify_steps * (self.k + 1):
            raise DraftflowError(
                f"{where}: {self.verify_steps} verify steps delivered {self.emitted_tokens} tokens, outside what "
                f"K = {self.k} chain drafting allows ([steps, steps x {self.k + 1}]): the counters mean something "
                "else in this release, or other requests reached the server meanwhile"
            )

    @property
    def reached(self) -> list[int]:
        return [self.verify_steps] + self.accepted_at[:-1]

    @property
    def alpha(self) -> list[float]:
        """Conditional acceptance per position: P(draft i accepted | drafts < i accepted)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def rate_per_position(self) -> list[float]:
        """vLLM's per-position acceptance rate: P(draft i accepted) over all verify steps."""
        return [a / self.verify_steps if self.verify_steps else 0.0 for a in self.accepted_at]

    def as_json(self) -> dict:
        return {
            "acceptance_length": self.tau,
            "engine_acceptance_length": self.engine_tau,
            "alpha": self.alpha,
            "acceptance_rate_per_position": self.rate_per_position,
            "draft_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "accepted": self.accepted_at,
            "reached": self.reached,
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
        }


# ---------------------------------------------------------------- SGLang


SGLANG_META_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_correct_drafts_histogram")


def sglang_request_counts(meta: dict, k: int, where: str) -> SpecCounts:
    """One finished request's `meta_info` -> counts. A request that needed no verify step (one
    token, or finished at prefill) has no spec fields in 0.5.14: zero counts."""
    if not meta.get("spec_verify_ct"):
        if "completion_tokens" in meta and int(meta["completion_tokens"]) <= 1:
            return SpecCounts(k)
        raise DraftflowError(
            f"{where}: the answer's meta_info has no spec_verify_ct: the server does not run speculative "
            f"decoding (started without --speculative-algorithm EAGLE3?) or does not report it"
        )
    missing = [key for key in SGLANG_META_KEYS if key not in meta]
    if missing:
        raise DraftflowError(f"{where}: meta_info lacks {missing}; not the SGLang release this was checked against")
    steps, correct = int(meta["spec_verify_ct"]), int(meta["spec_num_correct_drafts"])
    hist = [int(x) for x in meta["spec_correct_drafts_histogram"]]  # h[a]: steps accepting exactly a
    if len(hist) > k + 1 or sum(hist) != steps or sum(a * n for a, n in enumerate(hist)) != correct:
        raise DraftflowError(
            f"{where}: inconsistent counters: histogram {hist} for {steps} verify steps, {correct} accepted "
            f"drafts, K = {k}"
        )
    if "completion_tokens" not in meta:
        raise DraftflowError(f"{where}: meta_info lacks completion_tokens; not the SGLang release this was checked against")
    accepted_at = [sum(hist[i + 1 :]) for i in range(k)]
    counts = SpecCounts(k, steps, steps * k, correct, accepted_at, max(int(meta["completion_tokens"]) - 1, 0))
    counts.check_moved(where)
    return counts


def sglang_server_k(info: dict) -> tuple[int, int]:
    """(K drafts per verify step, topk) from `/server_info`; chain drafting (topk 1) drafts
    speculative_num_steps tokens (= num_draft_tokens - 1)."""
    algorithm = info.get("speculative_algorithm")
    if not algorithm:
        return 0, 0
    topk = int(info.get("speculative_eagle_topk") or 1)
    num_draft = info.get("speculative_num_draft_tokens")
    k = int(num_draft) - 1 if topk == 1 and num_draft else int(info.get("speculative_num_steps") or 0)
    return k, topk


def sglang_avg_accept_length(info: dict) -> float | None:
    """Lifetime `avg_spec_accept_length` (mean over data-parallel ranks that report one)."""
    values = [s["avg_spec_accept_length"] for s in info.get("internal_states") or [] if isinstance(s, dict)
              and s.get("avg_spec_accept_length") is not None]  # fmt: skip
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------- vLLM (Prometheus text)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_GENERATION = "vllm:generation_tokens_total"


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of the Prometheus text exposition format: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, _, labels, value = match.group(1), match.group(2), match.group(3), match.group(4)
        try:
            number = float(value)
        except ValueError:
            continue
        samples.append((name, dict(_LABEL.findall(labels or "")), number))
    return samples


@dataclass
class VllmCounters:
    """One scrape of vLLM's spec-decode counters, summed over engines (data-parallel ranks)."""

    drafts: float
    draft_tokens: float
    accepted: float
    per_pos: list[float]
    generation_tokens: float | None

    @classmethod
    def from_metrics(cls, text: str, where: str) -> "VllmCounters":
        totals: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        for name, labels, value in parse_prometheus(text):
            if name == VLLM_PER_POS:
                pos = int(labels.get("position", -1))
                per_pos[pos] = per_pos.get(pos, 0.0) + value
            elif name in (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED, VLLM_GENERATION):
                totals[name] = totals.get(name, 0.0) + value
        missing = [n for n in (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED) if n not in totals]
        if missing or not per_pos:
            raise DraftflowError(
                f"{where}: no speculative-decoding counters ({', '.join(missing or [VLLM_PER_POS])} missing): "
                "the server runs without --speculative-config, or this vLLM release names them otherwise"
            )
        if sorted(per_pos) != list(range(len(per_pos))):
            raise DraftflowError(f"{where}: {VLLM_PER_POS} has positions {sorted(per_pos)}, expected 0..K-1")
        return cls(totals[VLLM_DRAFTS], totals[VLLM_DRAFT_TOKENS], totals[VLLM_ACCEPTED],
                   [per_pos[i] for i in range(len(per_pos))], totals.get(VLLM_GENERATION))  # fmt: skip

    @property
    def k(self) -> int:
        return len(self.per_pos)

    def since(self, before: "VllmCounters", where: str, received: int | None = None, emitted: int = 0) -> SpecCounts:
        """Counts between two scrapes; a counter that went down means the server restarted.
        received: tokens the client got meanwhile; fewer generation tokens counted than that
        means the counters restarted in between (a lower count would be silently wrong).
        emitted: of those, the tokens verify steps delivered (each request's first excluded)."""
        now, then = asdict(self), asdict(before)
        if received is not None and self.generation_tokens is not None and before.generation_tokens is not None:
            counted = self.generation_tokens - before.generation_tokens
            if counted < received:
                raise DraftflowError(
                    f"{where}: vllm:generation_tokens_total grew by {counted:g} while {received} tokens were "
                    "received: the server's counters restarted during the measurement (engine restart?); "
                    "rerun to measure this set again"
                )
            if counted > received:
                log.warning("%s: %g generation tokens counted, %d received: other requests reached the server; "
                            "acceptance includes them", where, counted, received)  # fmt: skip
        for key in ("drafts", "draft_tokens", "accepted"):
            if now[key] < then[key]:
                raise DraftflowError(
                    f"{where}: vLLM counter {key} went from {then[key]:g} down to {now[key]:g}: the server "
                    "restarted (or reset its metrics) during the measurement; rerun to measure this set again"
                )
        if self.k != before.k or any(a < b for a, b in zip(self.per_pos, before.per_pos)):
            raise DraftflowError(f"{where}: per-position counters went down or changed length: the server restarted")
        counts = SpecCounts(
            self.k, _int(self.drafts - before.drafts), _int(self.draft_tokens - before.draft_tokens),
            _int(self.accepted - before.accepted), [_int(a - b) for a, b in zip(self.per_pos, before.per_pos)],
            emitted,
        )  # fmt: skip
        counts.check_moved(where)
        if sum(counts.accepted_at) != counts.accepted_tokens:
            raise DraftflowError(
                f"{where}: per-position accepted counts {counts.accepted_at} do not add up to the "
                f"{counts.accepted_tokens} accepted tokens: other requests reached the server meanwhile?"
            )
        return counts


def _int(value: float) -> int:
    if not math.isfinite(value) or abs(value - round(value)) > 1e-6:
        raise DraftflowError(f"counter difference {value} is not a whole number")
    return int(round(value))
