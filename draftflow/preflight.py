"""Stage `preflight`: refuse to start an extraction that cannot finish.

Extraction runs for days; finding out after 3 TB that the disk is full, or that a stray
server holds the GPUs, is what this stage prevents. Preflight is a list of named checks
(`CHECKS`), each a function of a `PreflightContext` returning a `CheckResult`; the stage
runs them all, reports every failure at once, and writes preflight.json only when all pass.

check_free_disk: the filesystem holding `--path` (or its nearest existing parent, as the
folder may not exist yet) must have `planned × (1 + free_disk_margin)` bytes free, where
`planned` is the storage plan's expected (compressed) total. Sample files already in the
content-keyed store (`--path/store`, if present) are reused rather than rewritten, so
their size is subtracted from the plan first. This is an estimate: store files left by an
older, incompatible run also count, which makes the check optimistic after such a run.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftflow.errors import DraftflowError
from draftflow.jsonl import read_json, write_json
from draftflow.plan import format_bytes

log = logging.getLogger(__name__)

STORE_DIR = "store"  # the content-keyed sample store inside the hidden-states folder


@dataclass(frozen=True)
class PreflightSettings:
    free_disk_margin: float = 0.1

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> PreflightSettings:
        unknown = sorted(set(settings) - set(cls.__dataclass_fields__))
        if unknown:
            raise DraftflowError(
                f"preflight settings: unknown key(s) {unknown}; expected {sorted(cls.__dataclass_fields__)}"
            )
        result = cls(**settings)
        if result.free_disk_margin < 0:
            raise DraftflowError(f"extract.free_disk_margin must be >= 0 (got {result.free_disk_margin})")
        return result


@dataclass(frozen=True)
class PreflightContext:
    """What every check may look at."""

    plan: Mapping[str, Any]  # storage_plan.json
    path: Path  # where hidden states will be written
    settings: PreflightSettings


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)


Check = Callable[[PreflightContext], CheckResult]


# ---------------------------------------------------------------- free disk


def nearest_existing(path: Path) -> Path:
    """`path`, or the closest parent folder that exists (the output folder may not yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def folder_bytes(folder: Path) -> int:
    """Total size of the regular files under `folder` (0 if it does not exist); symlinks not followed."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # a writer renamed or removed it meanwhile
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def check_free_disk(ctx: PreflightContext) -> CheckResult:
    planned = int(ctx.plan["total"]["bytes_expected"])
    margin = ctx.settings.free_disk_margin
    in_store = folder_bytes(Path(ctx.path) / STORE_DIR)
    needed = math.ceil(max(0, planned - in_store) * (1 + margin))
    measured = nearest_existing(ctx.path)
    free = shutil.disk_usage(measured).free
    details = {
        "path": str(ctx.path),
        "measured_at": str(measured),
        "planned_bytes": planned,
        "store_bytes": in_store,
        "margin": margin,
        "needed_bytes": needed,
        "free_bytes": free,
    }
    summary = (
        f"need {format_bytes(needed)} (planned {format_bytes(planned)} - {format_bytes(in_store)} already in "
        f"the store, + {margin:.0%} margin), {format_bytes(free)} free at {measured}"
    )
    if free >= needed:
        return CheckResult("free_disk", True, summary, details)
    message = (
        f"not enough free disk for hidden states at {ctx.path}: {summary}. "
        f"Free {format_bytes(needed - free)} there, point `results` at a bigger filesystem, "
        f"lower `extract.free_disk_margin` (now {margin}), or extract fewer samples "
        "(datasets.*.max_merged / weight)."
    )
    return CheckResult("free_disk", False, message, details)


# GPU and server checks join this list.
CHECKS: list[Check] = [check_free_disk]


# ---------------------------------------------------------------- the stage


def run_checks(ctx: PreflightContext, checks: Sequence[Check] = CHECKS) -> list[CheckResult]:
    results = [check(ctx) for check in checks]
    for r in results:
        (log.info if r.ok else log.error)("%s: %s: %s", r.name, "ok" if r.ok else "FAILED", r.message)
    return results


def preflight(
    plan: Mapping[str, Any], path: Path, settings: PreflightSettings, checks: Sequence[Check] = CHECKS
) -> dict[str, Any]:
    """Run every check; raise DraftflowError listing the failures, else return the report."""
    results = run_checks(PreflightContext(plan, Path(path), settings), checks)
    failed = [r for r in results if not r.ok]
    if failed:
        raise DraftflowError("preflight refused to start extraction:\n" + "\n".join(f"  {r.message}" for r in failed))
    return {"ok": True, "path": str(path), "checks": [asdict(r) for r in results]}


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument("--plan", type=Path, required=True, help="storage_plan.json from plan-storage")
    parser.add_argument("--path", type=Path, required=True, help="hidden-states folder extraction will write")
    parser.add_argument("--settings", type=settings_arg, required=True, help='e.g. {"free_disk_margin": 0.1}')
    parser.add_argument("--output", type=Path, required=True, help="preflight.json to write when every check passes")


def main(args: argparse.Namespace) -> int:
    try:
        plan = read_json(args.plan)
    except FileNotFoundError:
        raise DraftflowError(f"storage plan {args.plan} does not exist; run `plan-storage` first") from None
    report = preflight(plan, args.path, PreflightSettings.from_dict(args.settings))
    write_json(args.output, report)
    return 0
