"""Stage `preflight`: refuse to start an extraction that cannot finish.

Extraction runs for days; finding out after 3 TB that the disk is full, or that a stray
server holds the GPUs, is what this stage prevents. Preflight is a list of named checks
(`CHECKS`), each a function of a `PreflightContext` returning a `CheckResult`; the stage
runs them all, reports every failure at once, and writes preflight.json only when all pass.

check_free_disk: the filesystem holding `--path` (or its nearest existing parent, as the
folder may not exist yet) must have `planned × (1 + free_disk_margin)` bytes free, where
`planned` is the storage plan's expected (compressed) total, which depends on
`extract.storage`. Sample files already in the content-keyed store (`--path/store`, if
present) are reused rather than rewritten, so their size is subtracted from the plan
first. Only complete sample files of the plan's storage mode count: a killed writer's temp
files (`.<key>.dfhs.tmp-…`, removed by the next extraction) are not samples, and lossless
files are never reused by an fp8 run, nor the reverse. This is an estimate: store files of
the same mode left by an older, incompatible run also count, which makes the check
optimistic after such a run.
Without a storage plan (`--plan` left out, e.g. a preflight before regeneration) it is skipped.

Server checks (`draftflow.engines.servers.server_checks`), when the settings carry the config's
`regenerate` section with `engine: openai`: every `regenerate.openai.endpoints` entry answers
GET <endpoint>/models within `server_timeout_s` and serves `regenerate.openai.model` (with
the API key from the variable `api_key_env` names, if any). An openai engine without
endpoints is refused too.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftflow.checks import CheckResult
from draftflow.errors import DraftflowError, reject_unknown_keys
from draftflow.jsonl import read_json, write_json
from draftflow.hidden_states.plan import format_bytes

log = logging.getLogger(__name__)

STORE_DIR = "store"  # the content-keyed sample store inside the hidden-states folder
SAMPLE_SUFFIX = ".dfhs"  # draftflow.hidden_states.storage.SUFFIX (not imported: that module loads torch)


@dataclass(frozen=True)
class PreflightSettings:
    free_disk_margin: float = 0.1
    regenerate: Mapping[str, Any] | None = None  # the config's `regenerate` section: server checks
    server_timeout_s: float = 10.0  # per endpoint check

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> PreflightSettings:
        reject_unknown_keys(settings, cls.__dataclass_fields__, "preflight settings")
        result = cls(**settings)
        if result.free_disk_margin < 0:
            raise DraftflowError(f"extract.free_disk_margin must be >= 0 (got {result.free_disk_margin})")
        if result.regenerate is not None and not isinstance(result.regenerate, Mapping):
            raise DraftflowError("preflight settings: 'regenerate' must be the config's regenerate section (an object)")
        if result.server_timeout_s <= 0:
            raise DraftflowError(f"preflight settings: server_timeout_s must be > 0 (got {result.server_timeout_s})")
        return result


@dataclass(frozen=True)
class PreflightContext:
    """What every check may look at."""

    plan: Mapping[str, Any] | None  # storage_plan.json (None: no plan yet, disk not checked)
    path: Path  # where hidden states will be written
    settings: PreflightSettings


Check = Callable[[PreflightContext], CheckResult]


# ---------------------------------------------------------------- free disk


def nearest_existing(path: Path) -> Path:
    """`path`, or the closest parent folder that exists (the output folder may not yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def stored_sample_bytes(store: Path, storage: str | None = None) -> int:
    """Bytes of the complete sample files in a store (`ab/cd/<key>.dfhs`; temp files start
    with '.'), only those stored in `storage` mode when given (None: a plan from before
    storage modes, every sample file)."""
    if storage is not None:
        from draftflow.hidden_states.storage import storage_of_file  # loads torch: only when needed
    total = 0
    for path in Path(store).glob(f"*/*/*{SAMPLE_SUFFIX}"):
        if path.name.startswith("."):
            continue
        try:
            size = path.lstat().st_size
        except FileNotFoundError:  # removed meanwhile
            continue
        if storage is None or storage_of_file(path) == storage:
            total += size
    return total


def check_free_disk(ctx: PreflightContext) -> CheckResult:
    if ctx.plan is None:
        return CheckResult("free_disk", True, "no storage plan given: free disk not checked", {"skipped": True})
    planned = int(ctx.plan["total"]["bytes_expected"])
    margin = ctx.settings.free_disk_margin
    storage = ctx.plan.get("storage")
    in_store = stored_sample_bytes(Path(ctx.path) / STORE_DIR, storage)
    needed = math.ceil(max(0, planned - in_store) * (1 + margin))
    measured = nearest_existing(ctx.path)
    free = shutil.disk_usage(measured).free
    details = {
        "path": str(ctx.path),
        "measured_at": str(measured),
        "planned_bytes": planned,
        "store_bytes": in_store,
        "storage": storage,
        "margin": margin,
        "needed_bytes": needed,
        "free_bytes": free,
    }
    summary = (
        f"need {format_bytes(needed)} (planned {format_bytes(planned)} - {format_bytes(in_store)} already in "
        f"the store{f' as {storage}' if storage else ''}, + {margin:.0%} margin), {format_bytes(free)} free at {measured}"
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


# ---------------------------------------------------------------- servers


def check_openai_endpoints_configured(ctx: PreflightContext) -> CheckResult:
    openai = (ctx.settings.regenerate or {}).get("openai") or {}
    endpoints = list(openai.get("endpoints") or [])
    if endpoints:
        message = f"regenerate.openai.endpoints: {endpoints}"
        return CheckResult("openai_endpoints", True, message, {"endpoints": endpoints})
    return CheckResult(
        "openai_endpoints", False,
        "regenerate.engine is 'openai' but regenerate.openai.endpoints is empty: list the servers' base "
        "URLs, e.g. [http://127.0.0.1:30000/v1]",
        {"endpoints": []},
    )  # fmt: skip


def server_checks_for(settings: PreflightSettings) -> list[Check]:
    """The endpoint checks the `regenerate` section asks for (none unless its engine is openai)."""
    if not settings.regenerate or settings.regenerate.get("engine", "hf") != "openai":
        return []
    from draftflow.engines.servers import server_checks  # loaded only for server checks

    return [check_openai_endpoints_configured, *server_checks(dict(settings.regenerate), settings.server_timeout_s)]


# The fixed checks; `checks_for` adds the ones the settings ask for (servers).
CHECKS: list[Check] = [check_free_disk]


def checks_for(settings: PreflightSettings) -> list[Check]:
    return [*CHECKS, *server_checks_for(settings)]


# ---------------------------------------------------------------- the stage


def run_checks(ctx: PreflightContext, checks: Sequence[Check] = CHECKS) -> list[CheckResult]:
    results = [check(ctx) for check in checks]
    for r in results:
        (log.info if r.ok else log.error)("%s: %s: %s", r.name, "ok" if r.ok else "FAILED", r.message)
    return results


def preflight(
    plan: Mapping[str, Any] | None, path: Path, settings: PreflightSettings, checks: Sequence[Check] | None = None
) -> dict[str, Any]:
    """Run every check (default: `checks_for(settings)`); raise DraftflowError listing the
    failures, else return the report."""
    if checks is None:
        checks = checks_for(settings)
    results = run_checks(PreflightContext(plan, Path(path), settings), checks)
    failed = [r for r in results if not r.ok]
    if failed:
        raise DraftflowError("preflight refused to start extraction:\n" + "\n".join(f"  {r.message}" for r in failed))
    return {"ok": True, "path": str(path), "checks": [asdict(r) for r in results]}


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument(
        "--plan", type=Path, default=None,
        help="storage_plan.json from plan-storage (left out: the free-disk check is skipped)",
    )  # fmt: skip
    parser.add_argument("--path", type=Path, required=True, help="hidden-states folder extraction will write")
    parser.add_argument(
        "--settings", type=settings_arg, required=True,
        help='e.g. {"free_disk_margin": 0.1, "regenerate": <config regenerate section>, "server_timeout_s": 10}',
    )  # fmt: skip
    parser.add_argument("--output", type=Path, required=True, help="preflight.json to write when every check passes")


def main(args: argparse.Namespace) -> int:
    plan = None
    if args.plan is not None:
        try:
            plan = read_json(args.plan)
        except FileNotFoundError:
            raise DraftflowError(f"storage plan {args.plan} does not exist; run `plan-storage` first") from None
    report = preflight(plan, args.path, PreflightSettings.from_dict(args.settings))
    write_json(args.output, report)
    return 0
