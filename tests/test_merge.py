"""Stage `merge`: determinism, weights and caps, truncation, eval split, statistics, ranges, CLI."""

from __future__ import annotations

import csv
import hashlib
import json
import statistics
from pathlib import Path

import pytest

from draftflow import cli
from draftflow.errors import DraftflowError
from draftflow.jsonl import read_json, read_jsonl, write_jsonl
from draftflow.data.merge import MergeSettings, base_id, merge, range_digest


def record(dataset: str, i: int, length: int, loss_from: int | None = None, loss_to: int | None = None) -> dict:
    """A tokenized record: tokens 1000*i + position; loss on [loss_from, loss_to) (default: second half)."""
    loss_from = length // 2 if loss_from is None else loss_from
    loss_to = length if loss_to is None else loss_to
    return {
        "id": f"{dataset}-{i:016x}",
        "dataset": dataset,
        "input_ids": [1000 * i + t for t in range(length)],
        "loss_mask": [int(loss_from <= t < loss_to) for t in range(length)],
    }


def shard(path: Path, records: list[dict]) -> Path:
    write_jsonl(path, records)
    return path


def dataset_shards(tmp_path: Path, name: str, n: int, shards: int = 2, length=lambda i: 6 + i % 7) -> list:
    """`n` records of `name` spread over `shards` files; returns merge inputs [(name, path), …]."""
    records = [record(name, i, length(i)) for i in range(n)]
    per = -(-n // shards)
    return [
        (name, shard(tmp_path / "in" / name / f"shard-{k}.jsonl.zst", records[k * per : (k + 1) * per]))
        for k in range(shards)
    ]


def settings(**overrides) -> MergeSettings:
    values = {"seed": 0, "max_seq_len": 64, "eval_fraction": 0.2, "min_eval_samples": 0, "samples_per_range": 8}
    return MergeSettings.from_dict({**values, **overrides})


def split_records(out: Path, split: str) -> list[dict]:
    return list(read_jsonl(out / f"{split}.jsonl"))


def all_ids(out: Path) -> list[str]:
    return [r["id"] for split in ("train", "eval") for r in split_records(out, split)]


# ---------------------------------------------------------------- determinism


def test_same_seed_is_byte_identical_and_another_seed_reorders(tmp_path):
    inputs = dataset_shards(tmp_path, "A", 40) + dataset_shards(tmp_path, "B", 30)
    merge(inputs, settings(seed=7), tmp_path / "one")
    merge(inputs, settings(seed=7), tmp_path / "two")
    merge(inputs, settings(seed=8), tmp_path / "other")
    for name in ("train.jsonl", "eval.jsonl", "manifest.json", "stats.csv"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name

    # one compact record per line, with the documented keys in order
    first = (tmp_path / "one" / "train.jsonl").read_text().splitlines()[0]
    assert first.startswith('{"id":"') and ", " not in first
    assert list(json.loads(first)) == ["id", "dataset", "input_ids", "loss_mask"]

    same = [r["id"] for r in split_records(tmp_path / "one", "train")]
    other = [r["id"] for r in split_records(tmp_path / "other", "train")]
    common = set(same) & set(other)
    assert len(common) > 40
    assert [i for i in same if i in common] != [i for i in other if i in common]
    # nothing lost or invented: both seeds merge the same 70 samples
    assert sorted(all_ids(tmp_path / "one")) == sorted(all_ids(tmp_path / "other"))
    assert len(all_ids(tmp_path / "one")) == 70
    # shuffled across datasets, not dataset after dataset
    datasets = [r["dataset"] for r in split_records(tmp_path / "one", "train")]
    assert datasets != sorted(datasets) and datasets != sorted(datasets, reverse=True)


# ---------------------------------------------------------------- weights and caps


def test_weight_below_one_keeps_a_rounded_seeded_subset(tmp_path):
    inputs = dataset_shards(tmp_path, "A", 10)
    merge(inputs, settings(datasets={"A": {"weight": 0.25}}), tmp_path / "a")  # 2.5 rounds half up: 3
    merge(inputs, settings(datasets={"A": {"weight": 0.25}}, seed=1), tmp_path / "b")
    kept_a, kept_b = all_ids(tmp_path / "a"), all_ids(tmp_path / "b")
    assert len(kept_a) == len(set(kept_a)) == 3 and len(kept_b) == 3
    assert set(kept_a) <= {record("A", i, 1)["id"] for i in range(10)}
    assert set(kept_a) != set(kept_b)  # the subset depends on the seed
    manifest = read_json(tmp_path / "a" / "manifest.json")
    assert manifest["datasets"]["A"]["input_samples"] == 10
    assert manifest["datasets"]["A"]["selected"] == 3


def test_weight_above_one_repeats_with_suffixes_that_never_straddle_splits(tmp_path):
    inputs = dataset_shards(tmp_path, "A", 10)
    out = tmp_path / "out"
    merge(inputs, settings(datasets={"A": {"weight": 2.5}}, eval_fraction=0.3), out)
    ids = all_ids(out)
    originals = {record("A", i, 1)["id"] for i in range(10)}
    assert len(ids) == len(set(ids)) == 25
    assert {i for i in ids if "#" not in i} == originals
    assert {i[:-2] for i in ids if i.endswith("#1")} == originals
    third = {i[:-2] for i in ids if i.endswith("#2")}
    assert len(third) == 5 and third <= originals

    train = {base_id(r["id"]) for r in split_records(out, "train")}
    eval_ = {base_id(r["id"]) for r in split_records(out, "eval")}
    assert eval_ and train and not train & eval_
    # a repeat is the same sample: same tokens and mask as its original
    by_id = {r["id"]: r for split in ("train", "eval") for r in split_records(out, split)}
    some = sorted(third)[0]
    assert by_id[some + "#2"]["input_ids"] == by_id[some]["input_ids"]
    assert by_id[some + "#2"]["loss_mask"] == by_id[some]["loss_mask"]
    assert read_json(out / "manifest.json")["datasets"]["A"]["all"]["repeats"] == 15


def test_max_merged_caps_after_the_weight(tmp_path):
    inputs = dataset_shards(tmp_path, "A", 10) + dataset_shards(tmp_path, "B", 5)
    out = tmp_path / "out"
    merge(inputs, settings(datasets={"A": {"weight": 2, "max_merged": 7}, "B": {"max_merged": 100}}), out)
    ids = all_ids(out)
    assert sum(i.startswith("A-") for i in ids) == 7
    assert sum(i.startswith("B-") for i in ids) == 5
    manifest = read_json(out / "manifest.json")
    assert manifest["datasets"]["A"]["selected"] == 7
    assert manifest["total"]["all"]["samples"] == 12


# ---------------------------------------------------------------- truncation


def test_truncation_keeps_the_mask_of_the_kept_tokens_and_drops_samples_without_loss(tmp_path):
    records = [
        record("A", 0, 20, loss_from=5, loss_to=9),  # loss 5..8 kept, 15.. cut (set below)
        record("A", 1, 20, loss_from=14, loss_to=20),  # every loss token beyond L: dropped
        record("A", 2, 10, loss_from=0, loss_to=0),  # never had a loss token: dropped
        record("A", 3, 12, loss_from=11, loss_to=12),  # exactly L tokens, last one is loss
    ]
    records[0]["loss_mask"][15:] = [1] * 5
    path = shard(tmp_path / "A.jsonl.zst", records)
    out = tmp_path / "out"
    merge([("A", path)], settings(max_seq_len=12, eval_fraction=0), out)

    written = {r["id"]: r for r in split_records(out, "train")}
    assert set(written) == {records[0]["id"], records[3]["id"]}
    first = written[records[0]["id"]]
    assert first["input_ids"] == records[0]["input_ids"][:12]
    assert first["loss_mask"] == [0] * 5 + [1] * 4 + [0] * 3
    assert written[records[3]["id"]] == records[3]

    stats = read_json(out / "manifest.json")["datasets"]["A"]
    assert stats["all"]["truncated"] == 1  # kept samples that were cut; the dropped one is not kept
    assert stats["all"]["dropped"] == 2
    assert stats["train"]["loss_tokens"] == 4 + 1
    assert stats["train"]["max_len"] == 12


# ---------------------------------------------------------------- eval split


def test_eval_split_of_a_dataset_is_stable_when_another_dataset_is_added(tmp_path):
    a = dataset_shards(tmp_path, "A", 60)
    b = dataset_shards(tmp_path, "B", 40)
    merge(a, settings(eval_fraction=0.25, min_eval_samples=5), tmp_path / "alone")
    merge(b + a, settings(eval_fraction=0.25, min_eval_samples=5), tmp_path / "joined")

    def eval_of_a(out):
        return {r["id"] for r in split_records(out, "eval") if r["dataset"] == "A"}

    assert eval_of_a(tmp_path / "alone") == eval_of_a(tmp_path / "joined")
    assert 5 <= len(eval_of_a(tmp_path / "alone")) < 60


def test_eval_split_is_a_seedless_hash_of_the_sample_id(tmp_path):
    """The rule (docs: merge.py step 4): eval iff sha256("eval\\0" + id)[:8] / 2^64 < eval_fraction.
    Changing merge.seed, weights or max_seq_len reshuffles but moves no sample between splits."""
    inputs = dataset_shards(tmp_path, "A", 200)
    merge(inputs, settings(seed=0, eval_fraction=0.2), tmp_path / "s0")
    merge(inputs, settings(seed=12345, eval_fraction=0.2, max_seq_len=9), tmp_path / "s1")
    merge(inputs, settings(seed=7, eval_fraction=0.2, datasets={"A": {"weight": 1.5}}), tmp_path / "s2")

    def base_ids(out, split):
        return {base_id(r["id"]) for r in split_records(out, split)}

    ids = [f"A-{i:016x}" for i in range(200)]
    pinned = {i for i in ids if int.from_bytes(hashlib.sha256(f"eval\0{i}".encode()).digest()[:8], "big") < 0.2 * 2**64}
    assert 20 < len(pinned) < 60
    for out in ("s0", "s1", "s2"):
        assert base_ids(tmp_path / out, "eval") == pinned, out
        assert base_ids(tmp_path / out, "train") == set(ids) - pinned, out
    # the seed still shuffles
    assert all_ids(tmp_path / "s0") != all_ids(tmp_path / "s1")


def test_min_eval_samples_tops_up_eval_only_when_train_keeps_samples(tmp_path):
    inputs = dataset_shards(tmp_path, "A", 10)
    merge(inputs, settings(eval_fraction=0, min_eval_samples=3), tmp_path / "topped")
    assert len(split_records(tmp_path / "topped", "eval")) == 3
    assert len(split_records(tmp_path / "topped", "train")) == 7
    # the top-up takes the lowest hashes: the same samples a small eval_fraction picks first
    merge(inputs, settings(eval_fraction=0, min_eval_samples=4), tmp_path / "more")
    assert set(all_ids(tmp_path / "topped")) == set(all_ids(tmp_path / "more"))
    assert {r["id"] for r in split_records(tmp_path / "topped", "eval")} < {
        r["id"] for r in split_records(tmp_path / "more", "eval")
    }

    few = dataset_shards(tmp_path, "F", 3)
    merge(few, settings(eval_fraction=0, min_eval_samples=3), tmp_path / "few")
    assert len(split_records(tmp_path / "few", "train")) == 3
    assert (tmp_path / "few" / "eval.jsonl").read_bytes() == b""


# ---------------------------------------------------------------- manifest and stats.csv


def test_manifest_statistics_match_a_hand_computation(tmp_path):
    records = [
        record("A", 0, 3),  # loss 1..2 -> 2
        record("A", 1, 5),  # loss 2..4 -> 3
        record("A", 2, 10),  # cut to 8, loss 5..7 -> 3
        record("A", 3, 8),  # loss 4..7 -> 4
        record("A", 4, 6, loss_from=0, loss_to=0),  # dropped
    ]
    inputs = [
        ("A", shard(tmp_path / "A.jsonl.zst", records)),
        ("B", shard(tmp_path / "B.jsonl.zst", [record("B", 0, 4)])),
    ]
    out = tmp_path / "out"
    merge(inputs, settings(max_seq_len=8, eval_fraction=0, samples_per_range=3), out)
    manifest = read_json(out / "manifest.json")

    a = manifest["datasets"]["A"]["train"]
    assert a == {
        "samples": 4, "tokens": 3 + 5 + 8 + 8, "loss_tokens": 2 + 3 + 3 + 4,
        "min_len": 3, "median_len": 6.5, "mean_len": 6.0, "max_len": 8,
        "truncated": 1, "dropped": 0, "repeats": 0,
    }  # fmt: skip
    assert manifest["datasets"]["A"]["all"]["dropped"] == 1
    assert manifest["datasets"]["A"]["eval"]["samples"] == 0
    total = manifest["total"]["all"]
    assert (total["samples"], total["tokens"], total["loss_tokens"]) == (5, 28, 14)
    assert total["median_len"] == statistics.median([3, 5, 8, 8, 4]) and total["dropped"] == 1
    assert manifest["settings"]["max_seq_len"] == 8

    with open(out / "stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["dataset"], r["split"]) for r in rows] == [
        (d, s) for d in ("A", "B", "total") for s in ("train", "eval", "all")
    ]
    row = rows[0]
    assert (row["samples"], row["tokens"], row["loss_tokens"], row["median_len"], row["truncated"]) == (
        "4", "24", "12", "6.5", "1",
    )  # fmt: skip
    assert rows[1]["min_len"] == ""  # an empty split has no lengths
    assert rows[-1]["dropped"] == "1"


def test_rejected_source_records_are_counted_per_dataset(tmp_path):
    inputs = dataset_shards(tmp_path, "A", 6) + dataset_shards(tmp_path, "B", 4, shards=1)
    rejects_a = [tmp_path / "A-0.rejects.jsonl", tmp_path / "A-1.rejects.jsonl"]
    write_jsonl(rejects_a[0], [{"line": 2, "field": None, "reason": "not valid JSON", "raw": "{"}] * 3)
    write_jsonl(rejects_a[1], [])
    rejects_b = tmp_path / "B-0.rejects.jsonl"
    write_jsonl(rejects_b, [])
    out = tmp_path / "out"
    assert cli.main(["merge", *(f"--input={n}={p}" for n, p in inputs),
                     f"--rejects=A={rejects_a[0]}", f"--rejects=A={rejects_a[1]}", f"--rejects=B={rejects_b}",
                     "--settings", json.dumps({"max_seq_len": 64}), "--out-dir", str(out)]) == 0  # fmt: skip
    manifest = read_json(out / "manifest.json")
    assert manifest["datasets"]["A"]["rejected"] == 3 and manifest["datasets"]["B"]["rejected"] == 0
    assert manifest["total"]["rejected"] == 3
    with open(out / "stats.csv", newline="") as f:
        rows = {(r["dataset"], r["split"]): r["rejected"] for r in csv.DictReader(f)}
    assert rows[("A", "all")] == "3" and rows[("B", "all")] == "0" and rows[("total", "all")] == "3"
    assert rows[("A", "train")] == rows[("A", "eval")] == ""  # rejects belong to no split

    with pytest.raises(DraftflowError, match="rejects file .*nope.jsonl \\(dataset A\\) does not exist"):
        merge(inputs, settings(), tmp_path / "out2", rejects=[("A", tmp_path / "nope.jsonl")])


# ---------------------------------------------------------------- ranges


def test_ranges_chunk_each_split_and_digest_their_records(tmp_path):
    inputs = dataset_shards(tmp_path, "A", 10, shards=1)
    out = tmp_path / "out"
    merge(inputs, settings(eval_fraction=0, samples_per_range=4), out)
    plan = read_json(out / "manifest.json")["ranges"]
    assert plan["eval"] == []
    train = split_records(out, "train")
    assert [(r["name"], r["start"], r["end"], r["samples"]) for r in plan["train"]] == [
        ("rows_0-4", 0, 4, 4), ("rows_4-8", 4, 8, 4), ("rows_8-10", 8, 10, 2),
    ]  # fmt: skip
    for r in plan["train"]:
        chunk = train[r["start"] : r["end"]]
        assert r["tokens"] == sum(len(x["input_ids"]) for x in chunk)
        assert r["digest"] == range_digest(chunk)


def test_only_the_range_holding_a_changed_record_changes_its_digest(tmp_path):
    records = [record("A", i, 6 + i % 5) for i in range(12)]
    out_before, out_after = tmp_path / "before", tmp_path / "after"
    merge(
        [("A", shard(tmp_path / "v1.jsonl.zst", records))], settings(eval_fraction=0, samples_per_range=4), out_before
    )
    changed = records[5]["id"]
    records[5]["input_ids"][0] += 1  # same id, one token different
    merge([("A", shard(tmp_path / "v2.jsonl.zst", records))], settings(eval_fraction=0, samples_per_range=4), out_after)

    before = read_json(out_before / "manifest.json")["ranges"]["train"]
    after = read_json(out_after / "manifest.json")["ranges"]["train"]
    order = [r["id"] for r in split_records(out_after, "train")]
    position = order.index(changed)
    for b, a in zip(before, after, strict=True):
        assert (a["digest"] != b["digest"]) == (a["start"] <= position < a["end"]), a["name"]


# ---------------------------------------------------------------- errors and CLI


def test_a_malformed_record_is_reported_with_file_line_and_field(tmp_path):
    bad = record("A", 1, 6)
    bad["loss_mask"] = bad["loss_mask"][:-1]
    path = shard(tmp_path / "A.jsonl.zst", [record("A", 0, 6), bad])
    with pytest.raises(DraftflowError, match=r"A\.jsonl\.zst:2: field 'loss_mask': 5 mask values for 6 input_ids"):
        merge([("A", path)], settings(), tmp_path / "out")
    with pytest.raises(DraftflowError, match=r"record of dataset 'A' in a shard given as --input B="):
        merge([("B", path)], settings(), tmp_path / "out")


def test_cli_merge_writes_the_four_outputs_and_reports_errors(tmp_path, capsys):
    ((name, path),) = dataset_shards(tmp_path, "A", 12, shards=1)
    out = tmp_path / "merged"
    args = ["merge", "--input", f"A={path}", "--out-dir", str(out)]
    assert (
        cli.main(
            [
                *args,
                "--settings",
                json.dumps({"seed": 3, "min_eval_samples": 2, "datasets": {"A": {"weight": 1.0, "max_merged": None}}}),
            ]
        )
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["eval.jsonl", "manifest.json", "stats.csv", "train.jsonl"]
    manifest = read_json(out / "manifest.json")
    assert manifest["settings"]["seed"] == 3 and manifest["total"]["eval"]["samples"] == 2

    assert cli.main([*args, "--settings", '{"max_seq_length": 8}']) == 1
    assert "unknown key(s) ['max_seq_length']" in capsys.readouterr().err
    missing = ["merge", "--input", f"A={tmp_path / 'nope.jsonl.zst'}", "--settings", "{}", "--out-dir", str(out)]
    assert cli.main(missing) == 1
    assert "nope.jsonl.zst (dataset A) does not exist" in capsys.readouterr().err
