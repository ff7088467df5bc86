"""Stage `merge`: weight, cap, truncate, split and shuffle the tokenized datasets.

Inputs are token shards (`{"id", "dataset", "input_ids", "loss_mask"}`, see
docs/ARCHITECTURE.md). Everything is deterministic from `seed`, and every "seeded"
choice is a rank by `sha256(seed, purpose, id)` rather than a random generator, so
the result does not depend on the Python version or on the order of other datasets:

1. per dataset (shards in the order given), the **weight**: w < 1 keeps the
   round(w·n) lowest-ranked samples; w > 1 keeps floor(w) full copies plus the
   lowest-ranked round(frac(w)·n) for one more copy. Copy k ≥ 1 gets id `<id>#k`;
2. **max_merged** keeps the lowest-ranked instances (copies included);
3. **truncation** to `max_seq_len`: `input_ids[:L]` and `loss_mask[:L]`. A token's
   mask depends only on its own role (assistant content or not), so the mask of the
   kept tokens is exactly the prefix; the loss-token count is recomputed from it and
   a sample left with no loss token is **dropped** (it is in no split). A record that
   tokenize already cut (`cut_chars`, its first L tokens exactly) counts as truncated,
   and the manifest's `cut_before_tokenize` counts those records and characters;
4. the **eval split** by `eval_hash` of the id without `#k`, a hash of the id alone
   (no seed): a sample is in eval when its hash / 2^64 < eval_fraction, whatever
   `seed`, the weights, caps, `max_seq_len` or the other datasets are, so the split
   survives re-merges and seed changes, and the copies of one sample never straddle
   train and eval. Only when that gives fewer than `min_eval_samples` distinct
   samples are the next-lowest hashes added (provided at least one sample is left
   for train); that top-up depends on which samples are present;
5. each split is **shuffled** (sorted by a seeded hash of the instance id).

Every other step depends on `seed`: rank = `sha256(seed, purpose, id)`.

Outputs in `--out-dir`: train.jsonl and eval.jsonl (compact JSON, one record per
line, byte-identical for the same inputs and seed), manifest.json (settings,
statistics, and the range plan the extraction fans out over) and stats.csv.

Memory stays small at 90M tokens: the first pass streams the shards once and
spools each truncated record's JSON to an anonymous temp file; only per-sample
metadata stays in memory; the second pass copies the spooled text in shuffled order.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import statistics
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from draftflow.errors import DraftflowError, reject_unknown_keys, where
from draftflow.jsonl import atomic_path, read_jsonl, write_json

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
STATS_COLUMNS = (
    "dataset", "split", "samples", "tokens", "loss_tokens",
    "min_len", "median_len", "mean_len", "max_len", "truncated", "dropped", "rejected",
)  # fmt: skip
TOTAL = "total"  # the `dataset` value of the summary rows in stats.csv


def _dumps(value: Any) -> str:
    """Compact JSON, the one serialization used for records and digests."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class DatasetSettings:
    weight: float = 1.0
    max_merged: int | None = None


@dataclass(frozen=True)
class MergeSettings:
    """The `merge` config section plus each dataset's weight and cap (defaults as in the schema)."""

    seed: int = 0
    max_seq_len: int = 512
    eval_fraction: float = 0.05
    min_eval_samples: int = 8
    samples_per_range: int = 64
    datasets: Mapping[str, DatasetSettings] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> MergeSettings:
        known = {"seed", "max_seq_len", "eval_fraction", "min_eval_samples", "samples_per_range", "datasets"}
        reject_unknown_keys(settings, known, "merge settings")
        datasets = {}
        for name, ds in (settings.get("datasets") or {}).items():
            extra = sorted(set(ds) - {"weight", "max_merged"})
            if extra:
                raise DraftflowError(f"merge settings: datasets.{name}: unknown key(s) {extra}")
            datasets[name] = DatasetSettings(weight=float(ds.get("weight", 1.0)), max_merged=ds.get("max_merged"))
            if datasets[name].weight <= 0:
                raise DraftflowError(f"datasets.{name}.weight must be > 0 (got {ds['weight']})")
            if datasets[name].max_merged is not None and datasets[name].max_merged < 1:
                raise DraftflowError(f"datasets.{name}.max_merged must be >= 1 or null (got {ds['max_merged']})")
        base = {k: v for k, v in settings.items() if k != "datasets"}
        result = cls(**base, datasets=datasets)
        if result.max_seq_len < 1:
            raise DraftflowError(f"merge.max_seq_len must be >= 1 (got {result.max_seq_len})")
        if not 0 <= result.eval_fraction < 1:
            raise DraftflowError(f"merge.eval_fraction must be in [0, 1) (got {result.eval_fraction})")
        if result.min_eval_samples < 0:
            raise DraftflowError(f"merge.min_eval_samples must be >= 0 (got {result.min_eval_samples})")
        if result.samples_per_range < 1:
            raise DraftflowError(f"merge.samples_per_range must be >= 1 (got {result.samples_per_range})")
        return result

    def dataset(self, name: str) -> DatasetSettings:
        return self.datasets.get(name, DatasetSettings())


# ---------------------------------------------------------------- seeded hashing


def seeded_hash(seed: int, purpose: str, key: str) -> int:
    """A 64-bit rank for `key`, fixed by (seed, purpose) and independent of everything else."""
    digest = hashlib.sha256(f"{seed}\0{purpose}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def eval_hash(sample_id: str) -> int:
    """The eval-split rank of a sample: the first 8 bytes of sha256("eval\\0" + id), big-endian.

    Deliberately not seeded: changing `merge.seed` reshuffles but never moves a sample
    between train and eval (a drafter's eval figures stay comparable across seeds).
    """
    return int.from_bytes(hashlib.sha256(f"eval\0{sample_id}".encode()).digest()[:8], "big")


def base_id(sample_id: str) -> str:
    """The id without a repeat suffix: `B1-ab12#2` -> `B1-ab12`."""
    return sample_id.split("#", 1)[0]


# ---------------------------------------------------------------- samples


@dataclass(frozen=True)
class Sample:
    """One input record after truncation; its JSON lives in the spool at `offset`."""

    id: str
    dataset: str
    length: int  # tokens kept
    loss_tokens: int  # loss tokens kept
    truncated: bool
    offset: int  # into the spool; -1 for a sample without loss tokens (never written)
    cut_chars: int = 0  # rendered characters tokenize never tokenized (bounded work per record)


@dataclass(frozen=True)
class Entry:
    """One merged record: a sample's k-th copy (k = 0 is the original)."""

    sample: Sample
    repeat: int = 0

    @property
    def id(self) -> str:
        return self.sample.id if self.repeat == 0 else f"{self.sample.id}#{self.repeat}"


class Spool:
    """Truncated records' JSON (`input_ids` TAB `loss_mask`) in an anonymous temp file."""

    def __init__(self, folder: Path):
        self._file: IO[bytes] = tempfile.TemporaryFile(dir=folder, prefix=".merge-spool-")
        self._end = 0

    def write(self, ids_json: str, mask_json: str) -> int:
        line = f"{ids_json}\t{mask_json}\n".encode()
        offset, self._end = self._end, self._end + len(line)
        self._file.write(line)
        return offset

    def read(self, offset: int) -> tuple[str, str]:
        self._file.seek(offset)
        ids_json, mask_json = self._file.readline().decode().rstrip("\n").split("\t")
        return ids_json, mask_json

    def close(self) -> None:
        self._file.close()


def _check_record(record: Any, path: Path, line: int, dataset: str) -> None:
    if not isinstance(record, dict):
        raise DraftflowError(f"{where(path, line)}: expected a JSON object (a tokenized record)")
    for key, kind in (("id", str), ("input_ids", list), ("loss_mask", list)):
        if not isinstance(record.get(key), kind):
            raise DraftflowError(
                f"{where(path, line, key)}: missing or not a {kind.__name__}; is this a tokenize output?"
            )
    if record.get("dataset", dataset) != dataset:
        raise DraftflowError(
            f"{where(path, line, 'dataset')}: record of dataset {record['dataset']!r} in a shard "
            f"given as --input {dataset}=…; check the merge inputs"
        )
    ids, mask = record["input_ids"], record["loss_mask"]
    if len(ids) != len(mask):
        raise DraftflowError(
            f"{where(path, line, 'loss_mask')}: {len(mask)} mask values for {len(ids)} input_ids; "
            "re-run tokenize for this shard"
        )
    if mask.count(0) + mask.count(1) != len(mask):
        raise DraftflowError(f"{where(path, line, 'loss_mask')}: values must be 0 or 1")


def _cut_chars(record: dict, path: Path, line: int, max_seq_len: int) -> int:
    """A record tokenize cut short holds its first max_seq_len tokens (of tokenize's max_seq_len)."""
    cut_chars = record.get("cut_chars", 0)
    if not isinstance(cut_chars, int) or cut_chars < 0:
        raise DraftflowError(f"{where(path, line, 'cut_chars')}: must be a count of characters")
    if cut_chars and len(record["input_ids"]) < max_seq_len:
        raise DraftflowError(
            f"{where(path, line)}: sample {record['id']} was cut to {len(record['input_ids'])} tokens by "
            f"tokenize, fewer than merge.max_seq_len {max_seq_len}: tokenize ran with a smaller "
            "max_seq_len; rerun tokenize with merge's"
        )
    return cut_chars


def read_dataset(name: str, paths: Sequence[Path], max_seq_len: int, spool: Spool) -> list[Sample]:
    """Stream one dataset's shards (in order), truncate each record and spool its JSON."""
    samples = []
    for path in paths:
        try:
            for line, record in enumerate(read_jsonl(path), start=1):
                _check_record(record, path, line, name)
                ids, mask = record["input_ids"], record["loss_mask"]
                cut_chars = _cut_chars(record, path, line, max_seq_len)
                truncated = len(ids) > max_seq_len or cut_chars > 0
                if truncated:
                    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                loss = mask.count(1)
                offset = spool.write(_dumps(ids), _dumps(mask)) if loss else -1
                samples.append(Sample(record["id"], name, len(ids), loss, truncated, offset, cut_chars))
        except FileNotFoundError:
            raise DraftflowError(f"input shard {path} (dataset {name}) does not exist; run `tokenize` first") from None
        except ValueError as e:  # read_jsonl's "file:line: not valid JSON"
            raise DraftflowError(str(e)) from None
    return samples


# ---------------------------------------------------------------- selection


def _round_half_up(x: float) -> int:
    return int(x + 0.5)


def _lowest(items: Sequence, count: int, seed: int, purpose: str, key) -> list:
    """The `count` items with the lowest seeded hash of key(item) (ties keep input order)."""
    return sorted(items, key=lambda item: seeded_hash(seed, purpose, key(item)))[:count]


def apply_weight_and_cap(samples: Sequence[Sample], ds: DatasetSettings, seed: int) -> list[Entry]:
    """Step 1 and 2: the weighted copies of a dataset's samples, capped at max_merged."""
    full, fraction = int(ds.weight), ds.weight - int(ds.weight)
    entries = [Entry(s, k) for k in range(full) for s in samples]
    extra = _round_half_up(fraction * len(samples))
    if extra:
        entries += [Entry(s, full) for s in _lowest(samples, extra, seed, "weight", lambda s: s.id)]
    if ds.max_merged is not None and len(entries) > ds.max_merged:
        entries = _lowest(entries, ds.max_merged, seed, "cap", lambda e: e.id)
    return entries


def eval_ids(entries: Sequence[Entry], settings: MergeSettings) -> set[str]:
    """Step 4: the base ids that go to eval (independent of `settings.seed`)."""
    hashes = {e.sample.id: eval_hash(e.sample.id) for e in entries}
    ranked = sorted(hashes, key=hashes.__getitem__)
    count = sum(h < settings.eval_fraction * 2**64 for h in hashes.values())
    if count < settings.min_eval_samples:
        if len(hashes) > settings.min_eval_samples:
            count = settings.min_eval_samples  # the next-lowest hashes, so a larger fraction picks the same
        else:
            log.warning(
                "only %d distinct samples: cannot put min_eval_samples=%d in eval and keep a train split; "
                "eval gets %d by eval_fraction alone",
                len(hashes), settings.min_eval_samples, count,
            )  # fmt: skip
    return set(ranked[:count])


def shuffle(entries: Sequence[Entry], seed: int) -> list[Entry]:
    """Step 5: a seeded permutation (a sort by hash; ties keep input order)."""
    return sorted(entries, key=lambda e: seeded_hash(seed, "shuffle", e.id))


# ---------------------------------------------------------------- statistics


@dataclass
class Stats:
    """Counts over merged records; `dropped` counts instances removed for lack of loss tokens."""

    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    dropped: int = 0
    repeats: int = 0
    lengths: list[int] = field(default_factory=list)

    def add(self, entry: Entry) -> None:
        s = entry.sample
        self.samples += 1
        self.tokens += s.length
        self.loss_tokens += s.loss_tokens
        self.truncated += s.truncated
        self.repeats += entry.repeat > 0
        self.lengths.append(s.length)

    def merge(self, other: Stats) -> None:
        for name in ("samples", "tokens", "loss_tokens", "truncated", "dropped", "repeats"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.lengths += other.lengths

    def to_dict(self) -> dict[str, Any]:
        lengths = self.lengths
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "min_len": min(lengths) if lengths else None,
            "median_len": float(statistics.median(lengths)) if lengths else None,
            "mean_len": round(self.tokens / self.samples, 3) if self.samples else None,
            "max_len": max(lengths) if lengths else None,
            "truncated": self.truncated,
            "dropped": self.dropped,
            "repeats": self.repeats,
        }


def _stats_by_split(splits: Mapping[str, Sequence[Entry]], dropped: int) -> dict[str, Stats]:
    result = {split: Stats() for split in SPLITS}
    for split, entries in splits.items():
        for entry in entries:
            result[split].add(entry)
    everything = Stats(dropped=dropped)
    for split in SPLITS:
        everything.merge(result[split])
    result["all"] = everything
    return result


# ---------------------------------------------------------------- ranges and writing


@dataclass(frozen=True)
class Range:
    start: int
    end: int  # exclusive
    tokens: int
    digest: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": f"rows_{self.start}-{self.end}",
            "start": self.start,
            "end": self.end,
            "samples": self.end - self.start,
            "tokens": self.tokens,
            "digest": self.digest,
        }


def range_digest(records: Iterable[Mapping[str, Any]]) -> str:
    """sha256 over the records' `[id, input_ids, loss_mask]` (compact JSON, one per line).

    What `merge` writes into the range plan; recompute it from a split file to check that
    a range still holds the records it was planned with.
    """
    h = hashlib.sha256()
    for r in records:
        h.update((_dumps([r["id"], r["input_ids"], r["loss_mask"]]) + "\n").encode())
    return h.hexdigest()


def write_split(path: Path, entries: Sequence[Entry], spool: Spool, samples_per_range: int) -> list[Range]:
    """Write one split file from the spool and return its range plan."""
    ranges = []
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for start in range(0, len(entries), samples_per_range):
            chunk = entries[start : start + samples_per_range]
            h = hashlib.sha256()
            for entry in chunk:
                ids_json, mask_json = spool.read(entry.sample.offset)
                id_json = _dumps(entry.id)
                out.write(
                    f'{{"id":{id_json},"dataset":{_dumps(entry.sample.dataset)},'
                    f'"input_ids":{ids_json},"loss_mask":{mask_json}}}\n'
                )
                # same bytes as range_digest() over the written records
                h.update(f"[{id_json},{ids_json},{mask_json}]\n".encode())
            tokens = sum(e.sample.length for e in chunk)
            ranges.append(Range(start, start + len(chunk), tokens, h.hexdigest()))
    return ranges


def write_stats_csv(path: Path, stats: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
    """stats[dataset][split] -> one CSV row each (None -> empty cell)."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(STATS_COLUMNS)
        for dataset, by_split in stats.items():
            for split, row in by_split.items():
                values = {"dataset": dataset, "split": split, **row}
                writer.writerow(["" if values[c] is None else values[c] for c in STATS_COLUMNS])


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class MergeResult:
    manifest: dict[str, Any]
    out_dir: Path


def group_inputs(inputs: Sequence[tuple[str, Path]]) -> dict[str, list[Path]]:
    """`[(dataset, shard), …]` -> {dataset: [shards in the order given]}, datasets in first-seen order."""
    grouped: dict[str, list[Path]] = {}
    for name, path in inputs:
        grouped.setdefault(name, []).append(Path(path))
    return grouped


def count_rejects(rejects: Sequence[tuple[str, Path]]) -> dict[str, int]:
    """Records `prepare` rejected per dataset: one JSON line per record in its rejects files."""
    counts: dict[str, int] = {}
    for name, path in rejects:
        try:
            with open(path, "rb") as f:
                counts[name] = counts.get(name, 0) + sum(1 for line in f if line.strip())
        except FileNotFoundError:
            raise DraftflowError(f"rejects file {path} (dataset {name}) does not exist; run `prepare` first") from None
    return counts


def merge(
    inputs: Sequence[tuple[str, Path]],
    settings: MergeSettings,
    out_dir: Path,
    rejects: Sequence[tuple[str, Path]] = (),
) -> MergeResult:
    """Run the whole stage: read the shards, write train/eval JSONL, manifest.json and stats.csv.

    `rejects`: (dataset, prepare's rejects file) pairs, counted into the manifest."""
    out_dir = Path(out_dir)
    rejected = count_rejects(rejects)
    out_dir.mkdir(parents=True, exist_ok=True)
    spool = Spool(out_dir)
    try:
        per_dataset: dict[str, dict[str, Any]] = {}
        kept: list[Entry] = []
        for name, paths in group_inputs(inputs).items():
            samples = read_dataset(name, paths, settings.max_seq_len, spool)
            selected = apply_weight_and_cap(samples, settings.dataset(name), settings.seed)
            with_loss = [e for e in selected if e.sample.loss_tokens > 0]
            per_dataset[name] = {
                "input_samples": len(samples),
                "selected": len(selected),
                "dropped": len(selected) - len(with_loss),
                "rejected": rejected.get(name, 0),
                "cut_before_tokenize": {
                    "records": sum(s.cut_chars > 0 for s in samples),
                    "chars": sum(s.cut_chars for s in samples),
                },
            }
            kept += with_loss

        in_eval = eval_ids(kept, settings)
        splits = {
            "train": shuffle([e for e in kept if e.sample.id not in in_eval], settings.seed),
            "eval": shuffle([e for e in kept if e.sample.id in in_eval], settings.seed),
        }
        if not splits["train"]:
            raise DraftflowError(
                f"merge left no training samples ({len(kept)} kept, {len(splits['eval'])} in eval); "
                "add data, raise datasets.*.weight / max_merged, or lower merge.eval_fraction / min_eval_samples"
            )
        ranges = {
            split: write_split(out_dir / f"{split}.jsonl", entries, spool, settings.samples_per_range)
            for split, entries in splits.items()
        }
    finally:
        spool.close()

    manifest = build_manifest(inputs, settings, splits, per_dataset, ranges, rejects)
    write_json(out_dir / "manifest.json", manifest)
    write_stats_csv(out_dir / "stats.csv", stats_table(manifest))
    log_summary(manifest)
    return MergeResult(manifest, out_dir)


def build_manifest(
    inputs: Sequence[tuple[str, Path]],
    settings: MergeSettings,
    splits: Mapping[str, Sequence[Entry]],
    per_dataset: Mapping[str, Mapping[str, int]],
    ranges: Mapping[str, Sequence[Range]],
    rejects: Sequence[tuple[str, Path]] = (),
) -> dict[str, Any]:
    datasets = {}
    for name, counts in per_dataset.items():
        own = {split: [e for e in entries if e.sample.dataset == name] for split, entries in splits.items()}
        ds = settings.dataset(name)
        datasets[name] = {
            "input_samples": counts["input_samples"],
            "rejected": counts["rejected"],
            "cut_before_tokenize": counts["cut_before_tokenize"],
            "selected": counts["selected"],
            "weight": ds.weight,
            "max_merged": ds.max_merged,
            **{split: s.to_dict() for split, s in _stats_by_split(own, counts["dropped"]).items()},
        }
    total_dropped = sum(c["dropped"] for c in per_dataset.values())
    return {
        "settings": {
            "seed": settings.seed,
            "max_seq_len": settings.max_seq_len,
            "eval_fraction": settings.eval_fraction,
            "min_eval_samples": settings.min_eval_samples,
            "samples_per_range": settings.samples_per_range,
            "datasets": {n: {"weight": d.weight, "max_merged": d.max_merged} for n, d in settings.datasets.items()},
        },
        "inputs": [{"dataset": name, "path": str(path)} for name, path in inputs],
        "rejects": [{"dataset": name, "path": str(path)} for name, path in rejects],
        "files": {split: f"{split}.jsonl" for split in SPLITS},
        "datasets": datasets,
        "total": {
            "input_samples": sum(c["input_samples"] for c in per_dataset.values()),
            "rejected": sum(c["rejected"] for c in per_dataset.values()),
            "cut_before_tokenize": {
                key: sum(c["cut_before_tokenize"][key] for c in per_dataset.values()) for key in ("records", "chars")
            },
            "selected": sum(c["selected"] for c in per_dataset.values()),
            **{split: s.to_dict() for split, s in _stats_by_split(splits, total_dropped).items()},
        },
        "ranges": {split: [r.to_dict() for r in ranges[split]] for split in SPLITS},
    }


def stats_table(manifest: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{dataset or "total": {split or "all": stats}} from a manifest, for stats.csv.

    `rejected` (source records `prepare` rejected) belongs to no split: it fills the "all" row."""
    rows = {name: ds for name, ds in manifest["datasets"].items()}
    rows[TOTAL] = manifest["total"]
    return {
        name: {
            split: {**entry[split], "rejected": entry.get("rejected") if split == "all" else None}
            for split in (*SPLITS, "all")
        }
        for name, entry in rows.items()
    }


def log_summary(manifest: Mapping[str, Any]) -> None:
    for name, ds in manifest["datasets"].items():
        log.info(
            "%s: %d input (%d rejected by prepare) -> %d selected (%d repeats, weight %g), %d truncated, "
            "%d dropped; train %d / eval %d",
            name, ds["input_samples"], ds["rejected"], ds["selected"], ds["all"]["repeats"], ds["weight"],
            ds["all"]["truncated"], ds["all"]["dropped"], ds["train"]["samples"], ds["eval"]["samples"],
        )  # fmt: skip
        if ds["rejected"]:
            log.warning("%s: %d malformed source records were rejected (prepare's rejects files)", name, ds["rejected"])
        if not ds["input_samples"]:
            log.warning("%s: no samples reached merge; the dataset contributes nothing", name)
    total = manifest["total"]
    log.info(
        "merged: train %d samples / %d tokens (%d ranges), eval %d samples / %d tokens (%d ranges)",
        total["train"]["samples"], total["train"]["tokens"], len(manifest["ranges"]["train"]),
        total["eval"]["samples"], total["eval"]["tokens"], len(manifest["ranges"]["eval"]),
    )  # fmt: skip


# ---------------------------------------------------------------- CLI


def input_arg(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected DATASET=FILE, got {text!r}")
    return name, Path(path)


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument(
        "--input", dest="inputs", action="append", type=input_arg, required=True, metavar="DATASET=SHARD_FILE",
        help="a tokenized shard of a dataset; repeat for every shard, in order",
    )  # fmt: skip
    parser.add_argument(
        "--rejects", action="append", type=input_arg, default=[], metavar="DATASET=REJECTS_FILE",
        help="a prepare rejects file of a dataset (counted into the manifest); repeat for every shard",
    )  # fmt: skip
    parser.add_argument("--settings", type=settings_arg, required=True, help="merge settings as a JSON object")
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for train/eval JSONL, manifest, stats")


def main(args: argparse.Namespace) -> int:
    merge(args.inputs, MergeSettings.from_dict(args.settings), args.out_dir, args.rejects)
    return 0
