"""`draftflow verify`: check every stored hidden-state sample against its range index.

For each entry of DIR/*/rows_*/index.json (and DIR/rows_*/index.json): the store
file exists, its size and file checksum match the index, and its header shape
matches the index (length) and range meta (L, H). With --decode, also decompress
it, check the raw-payload checksum and that every value is finite; for fp8 files also
that the scales are sane (`storage.fp8_problem`: no NaN codes, exponents in range, all-zero
rows at scale 1, no row squeezed below the scale quantize_fp8 would choose).

--repair deletes the bad store files; the extraction driver skips samples whose
file exists, so rerunning extraction (`snakemake --forcerun extract`) recomputes
exactly the deleted ones.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--repair", action="store_true", help="delete bad store files so re-extraction recomputes them")
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
    if report.bad and args.repair:
        removed = remove_bad_samples(report)
        print(f"removed {removed} bad store files; rerun extraction to recompute them, e.g.")
        print("  snakemake --forcerun extract   (present samples are reused, only the removed ones are recomputed)")
    return 0 if report.ok else 1
