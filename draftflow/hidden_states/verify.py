"""`draftflow verify`: check every stored hidden-state sample against its range index.

For each entry of DIR/*/rows_*/index.json (and DIR/rows_*/index.json): the store
file exists, its size and file checksum match the index, and its header shape
matches the index (length) and range meta (L, H). With --decode, also decompress
it, check the raw-payload checksum and that every value is finite; for fp8 files also
that the scales are sane (`storage.fp8_problem`: no NaN codes, exponents in range, all-zero
rows at scale 1, no row squeezed below the scale quantize_fp8 would choose).

--repair recomputes exactly the bad samples, in place: it deletes their store files and
runs, for each, the one extraction batch that held it (the same records, target, settings
and batch_tokens the range index records), so the recomputed file is bit-identical when
the engine is deterministic. Range folders, and so every Snakemake output downstream,
stay as they are. A recomputed sample that differs from its index entry (an engine that
is not bit-reproducible) gets its entry updated and is reported, with the command that
retrains on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftflow.errors import DraftflowError
from draftflow.jsonl import write_json
from draftflow.hidden_states.storage import (
    IndexEntry,
    SampleStore,
    decode_sample,
    find_range_dirs,
    fp8_problem,
    read_header,
    read_range_index,
    store_root_of,
    verify_checksum,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BadSample:
    range: str  # range folder
    sample_id: str
    key: str
    path: str  # store file
    reason: str


@dataclass
class VerifyReport:
    hidden_states: str
    decode: bool
    ranges: int = 0
    samples: int = 0  # index entries checked
    files: int = 0  # distinct store files checked (repeated samples share one)
    bad: list[BadSample] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "bad_count": len(self.bad)}


@dataclass(frozen=True)
class _Expect:
    """What the index says one store file must contain."""

    path: Path
    entry: IndexEntry
    num_layers: int | None  # L from the range meta
    hidden_size: int | None  # H from the range meta


def check_file(expect: _Expect, decode: bool) -> str | None:
    """The reason a store file is bad, or None when it is good."""
    e = expect.entry
    try:
        data = expect.path.read_bytes()
    except FileNotFoundError:
        return "missing store file"
    except OSError as err:
        return f"unreadable: {err.strerror}"
    if len(data) != e.nbytes:
        return f"size {len(data)} bytes, index says {e.nbytes}"
    if not verify_checksum(e.checksum, data):
        return "file checksum mismatch"
    try:
        header = read_header(data)
    except ValueError as err:
        return f"bad header: {err}"
    if header.length != e.length:
        return f"header length {header.length}, index says {e.length}"
    if expect.num_layers is not None and header.num_layers != expect.num_layers:
        return f"header L={header.num_layers}, range meta says {expect.num_layers}"
    if expect.hidden_size is not None and header.hidden_size != expect.hidden_size:
        return f"header H={header.hidden_size}, range meta says {expect.hidden_size}"
    if header.loss_tokens != e.loss_tokens:
        return f"header loss_tokens {header.loss_tokens}, index says {e.loss_tokens}"
    if header.payload_checksum is not None and not verify_checksum(header.payload_checksum, data[header.data_offset :]):
        return "payload checksum mismatch (damaged before it was indexed)"
    if decode:
        try:
            sample = decode_sample(data, check=True, fp8_codes=True)
        except ValueError as err:
            return f"does not decode: {err}"
        problem = fp8_problem(sample.fp8) if sample.fp8 is not None else None
        if problem is not None:
            return f"bad fp8 data: {problem}"
        if not bool(torch.isfinite(sample.hidden).all()):
            return "non-finite hidden-state values"
    return None


def _expectations(hidden_states_dir: Path, store_root: Path | None) -> tuple[list[Path], list[tuple[Path, _Expect]]]:
    range_dirs = find_range_dirs(hidden_states_dir)
    checks = []
    for range_dir in range_dirs:
        meta, entries = read_range_index(range_dir)
        store = SampleStore(store_root or store_root_of(range_dir, meta))
        L, H = meta.get("num_layers_captured"), meta.get("hidden_size")
        checks += [(range_dir, _Expect(store.path(e.key), e, L, H)) for e in entries]
    return range_dirs, checks


def verify_hidden_states(
    hidden_states_dir: Path,
    decode: bool = False,
    store_root: Path | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """Check every indexed sample under `hidden_states_dir`; see the module docstring."""
    hidden_states_dir = Path(hidden_states_dir)
    if not hidden_states_dir.is_dir():
        raise DraftflowError(f"{hidden_states_dir}: not a folder")
    range_dirs, checks = _expectations(hidden_states_dir, store_root)
    if not range_dirs:
        raise DraftflowError(f"{hidden_states_dir}: no rows_*/index.json found (nor */rows_*/index.json)")

    # One check per distinct file: repeated samples (dataset weight > 1) share a key.
    unique: dict[Path, _Expect] = {}
    for _, expect in checks:
        unique.setdefault(expect.path, expect)
    workers = workers or min(8, os.cpu_count() or 1)
    # zstd and the checksums release the GIL, so threads overlap I/O and decoding.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        reasons = dict(zip(unique, pool.map(lambda x: check_file(x, decode), unique.values())))

    report = VerifyReport(
        str(hidden_states_dir), decode, ranges=len(range_dirs), samples=len(checks), files=len(unique)
    )
    for range_dir, expect in checks:
        reason = reasons[expect.path]
        if reason is None and expect.entry != unique[expect.path].entry:
            # Same file, another index entry: re-check against this entry's own size/checksum.
            reason = check_file(expect, decode=False)
        if reason is not None:
            e = expect.entry
            report.bad.append(BadSample(str(range_dir), e.sample_id, e.key, str(expect.path), reason))
    return report


@dataclass
class RepairResult:
    identical: list[BadSample] = field(default_factory=list)  # recomputed bit for bit
    changed: list[BadSample] = field(default_factory=list)  # recomputed, other bytes: index entry updated
    failed: list[tuple[BadSample, str]] = field(default_factory=list)  # could not be recomputed, and why
    deleted: list[BadSample] = field(default_factory=list)  # old index: file deleted for re-extraction to redo


def _owner_batches(keys: list[str], lengths: list[int], batch_tokens: int, bad_keys: set[str]) -> list[list[int]]:
    """The extraction batches (positions in the range) that first held each bad key: the batch
    whose run wrote it, so recomputing that batch alone reproduces its numerics."""
    from draftflow.engines.capture import plan_batches

    chosen, seen = [], set()
    for batch in plan_batches(lengths, batch_tokens):
        owned = {keys[p] for p in batch if keys[p] in bad_keys and keys[p] not in seen}
        if owned:
            chosen.append(batch)
            seen |= owned
    return chosen


def repair_range(
    range_dir: Path,
    bad: list[BadSample],
    target: Path | None = None,
    device: str | None = None,
    engine_factory=None,
) -> RepairResult:
    """Recompute the bad samples of one range (see the module docstring)."""
    from draftflow.engines.capture import capture_settings, make_capture_engine
    from draftflow.gpu import claim_gpus
    from draftflow.hidden_states.extract import extract_range, read_records, resolve_devices, resolve_from
    from draftflow.hidden_states.storage import sample_key, settings_digest, write_range_index
    from draftflow.target import target_identity

    result = RepairResult()
    meta, entries = read_range_index(range_dir)
    settings = meta.get("extract_settings")
    if not settings or "records" not in meta:  # an index written before ranges recorded them
        for b in bad:
            Path(b.path).unlink(missing_ok=True)
        result.deleted += bad
        return result
    settings = dict(settings, **({"device": device} if device else {}))
    target = Path(target) if target else resolve_from(range_dir, meta["target_dir"])
    if not (target / "config.json").is_file():
        result.failed += [(b, f"target folder {target} not found: pass --target") for b in bad]
        return result
    expected = meta["capture_settings"]["target_identity"]
    if target_identity(target) != expected:
        why = f"{target} is not the target these samples were extracted with ({expected})"
        result.failed += [(b, why) for b in bad]
        return result
    records = read_records(resolve_from(range_dir, meta["records"]), int(meta["start"]), int(meta["end"]))
    digest = settings_digest(capture_settings(settings))
    keys = [sample_key(digest, r.input_ids) for r in records]
    if digest != meta["settings_digest"]:
        why = "the recorded settings no longer give this range's store digest: rerun its extraction"
        result.failed += [(b, why) for b in bad]
        return result
    by_id = {r.sample_id: k for r, k in zip(records, keys)}
    usable = [b for b in bad if by_id.get(b.sample_id) == b.key]
    result.failed += [
        (b, f"{meta['records']} no longer holds this sample as extracted (re-merged?): rerun the workflow")
        for b in bad if b not in usable
    ]  # fmt: skip
    if not usable:
        return result

    store = SampleStore(store_root_of(range_dir, meta))
    for key in {b.key for b in usable}:
        store.delete(key)
    batches = _owner_batches(keys, [len(r.input_ids) for r in records], int(settings.get("batch_tokens", 16384)),
                             {b.key for b in usable})  # fmt: skip
    factory = engine_factory or make_capture_engine
    wants_gpu = settings.get("device", "auto") != "cpu" and int(settings.get("gpus_per_job", 0)) > 0
    new: dict[str, IndexEntry] = {}
    with claim_gpus(int(settings["gpus_per_job"]) if wants_gpu else 0, None) as claim:
        engine = factory(settings, target, resolve_devices(settings.get("device", "auto"), claim.ids))
        try:
            for batch in batches:
                outcome = extract_range(
                    [records[p] for p in batch], engine, store, settings, label=f"repair {range_dir}"
                )
                new.update({e.key: e for e in outcome.entries})
        finally:
            engine.close()

    updated = list(entries)
    for b in usable:
        if b.key not in new:
            result.failed.append((b, "the engine failed on it again (see the log)"))
            continue
        for i, e in enumerate(updated):
            if e.sample_id == b.sample_id:
                fresh = dataclasses.replace(new[b.key], sample_id=e.sample_id)
                (result.identical if fresh == e else result.changed).append(b)
                updated[i] = fresh
    if result.changed:
        write_range_index(range_dir, updated, meta)
    return result


def repair(report: VerifyReport, target: Path | None = None, device: str | None = None,
           engine_factory=None) -> RepairResult:  # fmt: skip
    """`verify --repair`: recompute every bad sample of the report, range by range."""
    total = RepairResult()
    by_range: dict[str, list[BadSample]] = {}
    for b in report.bad:
        by_range.setdefault(b.range, []).append(b)
    for range_dir, bad in by_range.items():
        part = repair_range(Path(range_dir), bad, target, device, engine_factory)
        total.identical += part.identical
        total.changed += part.changed
        total.failed += part.failed
        total.deleted += part.deleted
    return total


def remove_bad_samples(report: VerifyReport) -> int:
    """Delete the store files of bad samples so extraction recomputes them; returns the count deleted."""
    removed = 0
    for path in sorted({b.path for b in report.bad}):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.add_argument("--hidden-states", type=Path, required=True, metavar="DIR", help="e.g. results/hidden_states")
    parser.add_argument("--decode", action="store_true", help="also decompress, check raw checksums and finiteness")
    parser.add_argument(
        "--repair", action="store_true",
        help="recompute the bad samples in place (their extraction batches only); downstream outputs stay valid",
    )  # fmt: skip
    parser.add_argument(
        "--target", type=Path, help="--repair: the target model folder (default: recorded in the index)"
    )
    parser.add_argument("--device", help="--repair: torch device for the recompute (default: the extraction's)")
    parser.add_argument("--output", type=Path, metavar="REPORT.json", help="write the report as JSON")
    parser.add_argument("--store", type=Path, metavar="DIR", help="store folder (default: from each index)")
    parser.add_argument("--workers", type=int, default=None, help="checker threads (default: min(8, CPUs))")


def main(args: argparse.Namespace) -> int:
    report = verify_hidden_states(args.hidden_states, decode=args.decode, store_root=args.store, workers=args.workers)
    if args.output:
        write_json(args.output, report.to_json())
    what = "decoded and checked" if args.decode else "checked"
    print(f"{what} {report.samples} samples ({report.files} files) in {report.ranges} ranges: {len(report.bad)} bad")
    for b in report.bad:
        print(f"BAD {b.range} {b.sample_id} {b.key}: {b.reason}")
    if not (report.bad and args.repair):
        return 0 if report.ok else 1
    result = repair(report, args.target, args.device)
    for b in result.identical:
        print(f"REPAIRED {b.range} {b.sample_id} {b.key}: recomputed bit for bit")
    for b in result.changed:
        print(f"CHANGED {b.range} {b.sample_id} {b.key}: recomputed with other bytes; its index entry was updated")
    for b, why in result.failed:
        print(f"NOT REPAIRED {b.range} {b.sample_id} {b.key}: {why}")
    for b in result.deleted:
        print(f"DELETED {b.range} {b.sample_id} {b.key}: its range index predates repair information; "
              "rerun that range's extraction (`snakemake --forcerun extract`) to recompute it")  # fmt: skip
    fixed = len(result.identical) + len(result.changed)
    print(f"repaired {fixed} of {len(report.bad)} bad samples ({len(result.identical)} bit for bit)")
    if fixed and not result.changed:
        print("range indexes are unchanged: nothing downstream needs to rerun")
    if result.changed:
        print("the drafter was trained on the originals of the changed samples; to retrain: snakemake --forcerun train")
    return 1 if result.failed or result.deleted else 0
