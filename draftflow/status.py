"""`draftflow status`: where a run stands, from its files alone (no Snakemake needed).

Reads, under the working directory:
- `<results>/logs/**/*.log`, one per job: the `draftflow <stage>: started (pid P on HOST, …)`,
  `finished` / `failed` lines the CLI writes, and the last `progress:` line of long stages
  (done/total, rate, ETA; draftflow/progress.py);
- `.snakemake/log/*.snakemake.log`, the newest: Snakemake's own "N of M steps done";
- `.snakemake/locks/`: whether a Snakemake run holds the working directory;
- `<results>/merged/manifest.json`: how many extract jobs the range plan has.

A job is `running` while its process lives (same host) or, on another host, while its log
keeps changing; `interrupted` when its process is gone without a finished/failed line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftflow.progress import ProgressLine, format_seconds, parse_progress

START_RE = re.compile(r"draftflow (?P<stage>[\w-]+): started \(pid (?P<pid>\d+) on (?P<host>\S+), (?P<threads>\d+) CPU")
END_RE = re.compile(r"draftflow (?P<stage>[\w-]+): (?P<outcome>finished|failed)")
STEPS_RE = re.compile(r"(?P<done>\d+) of (?P<total>\d+) steps \((?P<percent>[\d.]+%)\) done")
# Pipeline order for the per-stage table; log folders not listed here follow, sorted.
STAGE_ORDER = (
    "build_target", "prepare", "preflight_servers", "regenerate", "tokenize", "merge", "plan_storage",
    "preflight", "extract", "summarize_hidden_states", "vocab", "train", "evaluate", "export", "plots",
)  # fmt: skip
REMOTE_STALE_S = 600.0  # a log on another host unchanged this long: not taken as running
STARTING_S = 120.0  # a log without a `started` line younger than this: a job starting up


@dataclass
class JobStatus:
    rule: str  # the log's first folder (or its name, for top-level logs)
    job: str  # the log path under logs/, without .log
    state: str  # starting | running | done | failed | interrupted | unknown
    stage: str | None = None
    pid: int | None = None
    host: str | None = None
    threads: int | None = None
    progress: dict | None = None  # the last progress line of the current attempt
    eta_s: float | None = None  # the line's ETA less the time since the log was written
    updated_s_ago: float = 0.0


@dataclass
class RunStatus:
    results: str
    snakemake: dict | None  # {"done", "total", "percent", "log", "locked"}
    jobs: list[JobStatus] = field(default_factory=list)
    stages: dict[str, dict] = field(default_factory=dict)  # rule -> {state: count, "total": n?}


def _alive(pid: int, host: str | None) -> bool | None:
    """Whether a process lives; None when it ran on another host."""
    if host not in (None, socket.gethostname()):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def read_job(path: Path, logs: Path, now: float) -> JobStatus:
    rel = path.relative_to(logs).with_suffix("")
    rule = rel.parts[0]
    start, end, progress = None, None, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "draftflow " in line and (m := START_RE.search(line)):
                start, end, progress = m, None, None  # a new attempt (or a torchrun rank)
            elif "draftflow " in line and (m := END_RE.search(line)):
                end = m
            elif "progress: " in line:
                progress = parse_progress(line) or progress
    age = max(0.0, now - path.stat().st_mtime)
    status = JobStatus(rule=rule, job=str(rel), state="unknown", updated_s_ago=round(age, 1))
    if start is not None:
        status.stage, status.host = start["stage"], start["host"]
        status.pid, status.threads = int(start["pid"]), int(start["threads"])
    if start is None:  # the shell opened the log; Python is still importing, or never ran
        status.state = "starting" if age < STARTING_S else "unknown"
    elif end is not None:
        status.state = "done" if end["outcome"] == "finished" else "failed"
    else:
        alive = _alive(status.pid, status.host)
        if alive is None:
            alive = age < REMOTE_STALE_S
        status.state = "running" if alive else "interrupted"
    if progress is not None:
        status.progress = asdict(progress)
        if status.state == "running" and progress.eta_s is not None:
            status.eta_s = max(0.0, progress.eta_s - age)
    return status


def snakemake_progress(workdir: Path) -> dict | None:
    """The last "N of M steps (x%) done" of the newest Snakemake log that ran jobs (a later
    `--report` or "nothing to be done" writes a log without steps), and whether a run holds
    the lock."""
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"), key=lambda p: p.stat().st_mtime)
    locks = workdir / ".snakemake" / "locks"
    locked = locks.is_dir() and any(locks.iterdir())
    for log in reversed(logs[-20:]):
        found = None
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            if m := STEPS_RE.search(line):
                found = m
        if found:
            return {"log": str(log), "locked": locked, "done": int(found["done"]),
                    "total": int(found["total"]), "percent": found["percent"]}  # fmt: skip
        if locked:
            break  # the running Snakemake's own log: no step finished yet
    return {"locked": locked} if locked or logs else None


def planned_jobs(results: Path) -> dict[str, int]:
    """Job counts known from the run's files: extract ranges from the merge manifest."""
    try:
        manifest = json.loads((results / "merged" / "manifest.json").read_text())
        return {"extract": sum(len(v) for v in manifest["ranges"].values())}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def run_status(results: str | Path = "results", workdir: str | Path = ".") -> RunStatus:
    workdir = Path(workdir)
    results_dir = workdir / results
    logs = results_dir / "logs"
    now = time.time()
    jobs = [read_job(p, logs, now) for p in sorted(logs.rglob("*.log"))] if logs.is_dir() else []
    stages: dict[str, dict] = {}
    for job in jobs:
        counts = stages.setdefault(job.rule, {})
        counts[job.state] = counts.get(job.state, 0) + 1
    for rule, total in planned_jobs(results_dir).items():
        stages.setdefault(rule, {})["total"] = total
    order = {name: i for i, name in enumerate(STAGE_ORDER)}
    stages = dict(sorted(stages.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    return RunStatus(str(results), snakemake_progress(workdir), jobs, stages)


# ---------------------------------------------------------------- text


def _count(value: float, unit: str) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale and unit == "tokens":
            return f"{value / scale:.3g}{suffix}"
    return f"{value:g}"


def progress_text(job: JobStatus) -> str:
    p = job.progress
    if not p:
        return "no progress line yet"
    line = ProgressLine(**p)
    rate = "?" if line.rate is None else _count(line.rate, line.unit)
    text = (
        f"{_count(line.done, line.unit)}/{_count(line.total, line.unit)} {line.unit} "
        f"({100 * line.fraction:.1f}%), {rate} {line.unit}/s"
    )
    if job.state == "running":
        text += f", ETA {format_seconds(job.eta_s)}"
    return text


def render(status: RunStatus) -> str:
    out = []
    sm = status.snakemake
    if sm and "total" in sm:
        lock = "; a Snakemake run holds this directory" if sm["locked"] else ""
        out.append(f"Snakemake: {sm['done']} of {sm['total']} steps ({sm['percent']}) done{lock}  [{sm['log']}]")
    elif sm:
        out.append("Snakemake: a run holds this directory (no step finished yet)" if sm["locked"]
                   else "Snakemake: no job finished in the recent runs")
    else:
        out.append("Snakemake: no run log in .snakemake/log (run from the workflow's directory?)")
    running = [j for j in status.jobs if j.state in ("running", "starting")]
    out.append(f"\nrunning jobs ({len(running)}):" if running else "\nrunning jobs: none")
    for job in running:
        if job.state == "starting":
            out.append(f"  {job.job:<40} starting")
            continue
        where = f"pid {job.pid} on {job.host}, {job.threads} threads"
        out.append(f"  {job.job:<40} {progress_text(job)}  ({where}; log updated {format_seconds(job.updated_s_ago)} ago)")
    trouble = [j for j in status.jobs if j.state in ("failed", "interrupted")]
    if trouble:
        out.append(f"\nfailed or interrupted ({len(trouble)}):")
        for job in trouble:
            out.append(f"  {job.job:<40} {job.state}: see {status.results}/logs/{job.job}.log")
    out.append("\nstages:")
    states = ("done", "starting", "running", "failed", "interrupted", "unknown")
    for rule, counts in status.stages.items():
        done = f"{counts.get('done', 0)}/{counts['total']}" if "total" in counts else str(counts.get("done", 0))
        rest = ", ".join(f"{counts[s]} {s}" for s in states[1:] if counts.get(s))
        out.append(f"  {rule:<24} {done} done" + (f", {rest}" if rest else ""))
    if not status.stages:
        out.append(f"  no job logs under {status.results}/logs yet")
    return "\n".join(line for line in out if line is not None)


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.description = (
        "Where a run stands: Snakemake's step count, each running job's progress "
        "(done/total, rate, ETA) and each stage's finished jobs, from the run's logs."
    )
    parser.add_argument("--results", default="results", help="the config's `results` folder (default: results)")
    parser.add_argument("--workdir", type=Path, default=Path("."), help="where Snakemake runs (default: .)")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def main(args: argparse.Namespace) -> int:
    status = run_status(args.results, args.workdir)
    print(json.dumps(asdict(status), indent=1) if args.json else render(status))
    return 0
