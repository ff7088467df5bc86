"""The per-range extraction driver: guards, reuse, resume after SIGKILL, summaries from indexes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftflow import cli
from draftflow.engines.capture import make_capture_engine, plan_batches
from draftflow.errors import DraftflowError
from draftflow.hidden_states.extract import ExtractOptions, extract_range, read_records, run_extract
from draftflow.gpu import FAKE_GPU_COUNT_ENV
from draftflow.hidden_states.storage import SampleStore, decode_sample, read_range_index

AUX = [0, 2, 3]


def build_target(path: Path, hidden: int = 64, layers: int = 4, intermediate: int = 128) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def write_split(path: Path, lengths: list[int], seed: int = 0, prefix: str = "s") -> list[dict]:
    rng = np.random.default_rng(seed)
    records = [
        {"id": f"{prefix}{i}", "dataset": "d", "input_ids": rng.integers(1, 300, size=n).tolist(),
         "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)}
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def settings(**extra) -> dict:
    base = {"engine": "hf", "aux_layer_ids": AUX, "dtype": "float32", "batch_tokens": 64,
            "target_identity": "tiny", "writer_threads": 2}  # fmt: skip
    return {**base, **extra}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("target") / "tiny")


LENGTHS = [12, 5, 30, 9, 17, 22, 5, 40, 11, 8]


@pytest.fixture
def split(tmp_path) -> tuple[Path, list[dict]]:
    path = tmp_path / "merged" / "train.jsonl"
    return path, write_split(path, LENGTHS)


def stored_files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.glob("*/*/*.dfhs"))}


def poisoning_factory(poisoned_tokens: list[int], fed: list[list[int]] | None = None):
    """The real engine factory, plus hooks that put a NaN into decoder layer 0's output for
    the sample whose tokens are `poisoned_tokens`, and record the sequences fed to the model."""

    def factory(s, target_dir, devices):
        engine = make_capture_engine(s, target_dir, devices)
        rows: list[int] = []

        def find_rows(module, args, output):  # on the embedding: which batch rows to poison
            ids = args[0]  # [B, T]
            rows[:] = [b for b in range(ids.shape[0]) if ids[b, : len(poisoned_tokens)].tolist() == poisoned_tokens]
            if fed is not None:
                fed.extend(ids[b].tolist() for b in range(ids.shape[0]))

        def poison(module, args, output):
            out = output[0] if isinstance(output, tuple) else output  # [B, T, H]
            for b in rows:
                out[b, 1, :3] = float("nan")

        engine.body.embed_tokens.register_forward_hook(find_rows)
        engine.body.layers[0].register_forward_hook(poison)
        return engine

    return factory


def test_read_records_parses_only_the_range(tmp_path):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"id": "a", "dataset": "d", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})
    path.write_text("not json\n" + good + "\n" + good.replace('"a"', '"b"') + "\n{broken\n")
    records = read_records(path, 1, 3)
    assert [r.sample_id for r in records] == ["a", "b"] and [r.row for r in records] == [1, 2]
    assert records[0].input_ids.dtype == np.int64 and records[0].loss_mask.tolist() == [0, 1, 1]
    with pytest.raises(DraftflowError, match=r"train.jsonl:4: not valid JSON"):
        read_records(path, 2, 4)
    with pytest.raises(DraftflowError, match="has 4 records, fewer than the range end 9"):
        read_records(path, 0, 9)
    path.write_text(json.dumps({"id": "a", "input_ids": [1, 2], "loss_mask": [1]}) + "\n")
    with pytest.raises(DraftflowError, match=r":1: field 'loss_mask': 1 values for 2 input_ids"):
        read_records(path, 0, 1)


def test_host_slots_are_made_on_first_need_and_then_bound_the_pipeline():
    """Slots are made as the capture loop first asks (pinning overlaps the queued forward), never
    more than `count`: once all are out, the next batch waits for a slot the writers give back."""
    import threading

    from draftflow.hidden_states.extract import _SlotRing

    ring = _SlotRing(2, 8, torch.float32, pinned=False)
    first, second = ring.acquire(), ring.acquire()  # made on demand (CPU: permits)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire()), daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # a third slot is never made
    ring.release(first)
    waiter.join(5)
    assert not waiter.is_alive() and len(got) == 1
    ring.release(second)
    assert ring.acquire() is None and ring.alloc_s == 0.0


def test_nan_capture_fails_naming_the_sample(target, split, tmp_path):
    path, records = split
    bad = records[4]  # 17 tokens: mid-way in length order, after the shorter samples' batches
    with pytest.raises(DraftflowError, match=r"sample s4: non-finite hidden states \(aux layer 2: \d+ of") as err:
        run_extract(path, "train", 0, 10, target, tmp_path / "store", settings(batch_tokens=1),
                    tmp_path / "rows_0-10", engine_factory=poisoning_factory(bad["input_ids"]))  # fmt: skip
    assert "aux layer 0" not in str(err.value)  # captured before the NaN was injected
    assert not (tmp_path / "rows_0-10" / "index.json").exists()
    # Samples captured before the failure stay in the store (all shorter than the bad one).
    assert len(stored_files(tmp_path / "store")) == sum(n < 17 for n in LENGTHS)


def test_nan_capture_skipped_and_recorded(target, split, tmp_path):
    path, records = split
    clean = run_extract(path, "train", 0, 10, target, tmp_path / "clean", settings(), tmp_path / "clean_rows")
    bad = records[4]
    outcome = run_extract(path, "train", 0, 10, target, tmp_path / "store", settings(on_error="skip"),
                          tmp_path / "rows_0-10", engine_factory=poisoning_factory(bad["input_ids"]))  # fmt: skip
    failures = json.loads((tmp_path / "rows_0-10" / "failures.json").read_text())
    assert [(f["sample_id"], f["row"]) for f in failures] == [("s4", 4)]
    assert "non-finite" in failures[0]["reason"]
    meta, entries = read_range_index(tmp_path / "rows_0-10")
    assert [e.sample_id for e in entries] == [f"s{i}" for i in range(10) if i != 4]
    assert meta["counts"]["failed"] == 1 and meta["counts"]["computed"] == 9
    # The other samples, some in the poisoned sample's batch, are exactly the clean run's.
    clean_by_id = {e.sample_id: e for e in clean.entries}
    assert outcome.stats.padded_tokens == clean.stats.padded_tokens  # same batches
    for e in entries:
        assert e.checksum == clean_by_id[e.sample_id].checksum


def test_reuse_across_ranges_computes_only_new_samples(target, split, tmp_path):
    path, records = split
    store = tmp_path / "store"
    first = run_extract(path, "train", 0, 6, target, store, settings(), tmp_path / "rows_0-6")
    assert (first.stats.computed, first.stats.reused) == (6, 0)

    fed: list[list[int]] = []
    s = settings(batch_tokens=1)  # one sample per forward: what ran is exactly what was missing
    second = run_extract(path, "train", 3, 10, target, store, s, tmp_path / "rows_3-10",
                         engine_factory=poisoning_factory([-1], fed))  # fmt: skip
    assert sorted(map(tuple, fed)) == sorted(tuple(records[i]["input_ids"]) for i in range(6, 10))
    meta, entries = read_range_index(tmp_path / "rows_3-10")
    assert meta["counts"] == {"samples": 7, "computed": 4, "reused": 3, "duplicates": 0, "failed": 0}
    assert [e.sample_id for e in entries] == [f"s{i}" for i in range(3, 10)]
    first_by_id = {e.sample_id: e for e in first.entries}
    for e in entries[:3]:  # reused entries point at the first run's files
        assert e == first_by_id[e.sample_id]
    for e, record in zip(entries, records[3:]):
        sample = decode_sample(SampleStore(store).get(e.key), check=True)
        assert sample.input_ids.tolist() == record["input_ids"] and sample.hidden.shape[1:] == (4, 64)

    # A different dtype is a different capture: nothing is reused.
    third = run_extract(path, "train", 3, 10, target, store, settings(dtype="bfloat16"), tmp_path / "rows_bf16")
    assert (third.stats.computed, third.stats.reused) == (7, 0)


def test_repeated_samples_are_stored_once(target, tmp_path):
    path = tmp_path / "train.jsonl"
    recs = write_split(path, [9, 14, 9])
    recs[2] = dict(recs[0], id="s0#1")  # a repeat (dataset weight > 1)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    outcome = run_extract(path, "train", 0, 3, target, tmp_path / "store", settings(), tmp_path / "rows")
    assert (outcome.stats.computed, outcome.stats.duplicates) == (2, 1)
    assert [e.sample_id for e in outcome.entries] == ["s0", "s1", "s0#1"]
    assert outcome.entries[0].key == outcome.entries[2].key
    assert len(stored_files(tmp_path / "store")) == 2


def test_gpus_requested_without_cuda_falls_back_to_cpu(target, split, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(FAKE_GPU_COUNT_ENV, "1")
    path, _ = split
    outcome = run_extract(path, "train", 0, 2, target, tmp_path / "store", settings(gpus_per_job=1),
                          tmp_path / "rows", gpu_lock_dir=tmp_path / "locks")  # fmt: skip
    assert outcome.stats.computed == 2
    assert (tmp_path / "locks" / "gpu-0.lock").exists()  # the fake GPU was claimed
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # and released


def test_a_cpu_extraction_on_a_gpu_host_warns_with_the_key(target, split, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(FAKE_GPU_COUNT_ENV, "2")  # the host has GPUs; gpus_per_job is the schema's 0
    path, _ = split
    with caplog.at_level("WARNING"):
        outcome = run_extract(path, "train", 0, 2, target, tmp_path / "store", settings(gpus_per_job=0),
                              tmp_path / "rows", gpu_lock_dir=tmp_path / "locks")  # fmt: skip
    assert outcome.stats.computed == 2
    assert "extraction runs on the CPU although this host has 2 GPU(s): extract.gpus_per_job is 0" in caplog.text
    assert not (tmp_path / "locks").exists()  # nothing was claimed


N = 24  # samples in the resume test's range


def _extract_cmd(split_path: Path, target: Path, store: Path, output: Path, s: dict) -> list[str]:
    return [
        sys.executable, "-m", "draftflow.cli", "extract", "--input", str(split_path), "--split", "train",
        "--start", "0", "--end", str(N), "--target", str(target), "--store", str(store),
        "--settings", json.dumps(s), "--output", str(output),
    ]  # fmt: skip


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_resume_after_sigkill_is_byte_identical(tmp_path):
    # Big enough that the range takes seconds, so the kill lands mid-range.
    target = build_target(tmp_path / "target", hidden=512, layers=6, intermediate=1024)
    split_path = tmp_path / "train.jsonl"
    write_split(split_path, [int(n) for n in np.random.default_rng(3).integers(100, 220, size=N)])
    s = settings(aux_layer_ids=[1, 2, 4], batch_tokens=300)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def run(store: Path, out: Path) -> subprocess.Popen:
        return subprocess.Popen(_extract_cmd(split_path, target, store, out, s), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip

    victim = run(tmp_path / "store", tmp_path / "rows_0-N")
    deadline = time.monotonic() + 120
    while len(stored_files(tmp_path / "store")) < 3 and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert victim.poll() is None, "the extraction finished before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    before = stored_files(tmp_path / "store")
    assert 3 <= len(before) < N
    assert not (tmp_path / "rows_0-N" / "index.json").exists()

    rerun = subprocess.run(_extract_cmd(split_path, target, tmp_path / "store", tmp_path / "rows_0-N", s),
                           env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the subprocesses: same kernels, same bytes
    try:  # the uninterrupted reference, in this process
        run_extract(split_path, "train", 0, N, target, tmp_path / "full", s, tmp_path / "full_rows")
    finally:
        torch.set_num_threads(threads)
    meta, entries = read_range_index(tmp_path / "rows_0-N")
    assert meta["counts"]["reused"] == len(before)
    assert meta["counts"]["computed"] == N - len(before)
    after, reference = stored_files(tmp_path / "store"), stored_files(tmp_path / "full")
    assert after.keys() == reference.keys() and len(after) == N
    assert all(after[name] == reference[name] for name in after)  # byte-identical
    assert all(before[name] == after[name] for name in before)  # finished samples untouched
    _, full_entries = read_range_index(tmp_path / "full_rows")
    assert entries == full_entries


def test_summarize_reads_indexes_only(target, tmp_path, capsys):
    train, evalp = tmp_path / "merged" / "train.jsonl", tmp_path / "merged" / "eval.jsonl"
    train_recs = write_split(train, [7, 12, 9, 20, 4])
    eval_recs = write_split(evalp, [6, 11], seed=5, prefix="e")
    hs = tmp_path / "hidden_states"
    s = settings()
    run_extract(train, "train", 0, 3, target, hs / "store", s, hs / "train" / "rows_0-3")
    run_extract(train, "train", 3, 5, target, hs / "store", s, hs / "train" / "rows_3-5")
    run_extract(evalp, "eval", 0, 2, target, hs / "store", s, hs / "eval" / "rows_0-2")
    ranges = [hs / "train" / "rows_0-3", hs / "train" / "rows_3-5", hs / "eval" / "rows_0-2"]
    stored = sum(len(b) for b in stored_files(hs / "store").values())
    shutil.rmtree(hs / "store")  # no tensor data may be needed

    rc = cli.main(["summarize-hidden-states", "--ranges", *map(str, ranges),
                   "--output-dir", str(hs), "--max-seq-len", "64"])  # fmt: skip
    assert rc == 0
    config = json.loads((hs / "data_config.json").read_text())
    all_recs = train_recs + eval_recs
    assert config["aux_layer_ids"] == AUX and config["layer_ids"] == AUX + [3]
    assert config["engine"] == "hf" and config["engine_layer_ids"] == [1, 3, 4]
    assert config["final"] == "post_norm" and config["convention"].startswith("aux id i = output of decoder layer i")
    assert (config["num_layers_captured"], config["hidden_size"], config["max_seq_len"]) == (4, 64, 64)
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == 4
    assert config["total_samples"] == 7
    assert config["total_tokens"] == sum(len(r["input_ids"]) for r in all_recs)
    assert config["total_loss_tokens"] == sum(sum(r["loss_mask"]) for r in all_recs)
    assert config["bytes_stored"] == stored and config["bytes_raw"] > stored
    assert config["splits"]["train"]["samples"] == 5 and config["splits"]["eval"]["samples"] == 2
    assert set(config["versions"]) >= {"draftflow", "torch", "engine"}
    lengths = json.loads((hs / "sample_lengths.json").read_text())
    assert lengths["lengths"] == {r["id"]: len(r["input_ids"]) for r in all_recs}
    assert lengths["splits"]["eval"] == {r["id"]: len(r["input_ids"]) for r in eval_recs}

    # A range captured under other settings cannot join the data set.
    run_extract(evalp, "eval", 0, 2, target, hs / "store", settings(dtype="bfloat16"), hs / "other")
    rc = cli.main(["summarize-hidden-states", "--ranges", str(ranges[0]), str(hs / "other"), "--output-dir", str(hs)])
    assert rc == 1
    assert "extracted with different settings" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipeline_stores_exact_captures(target, split, tmp_path):
    # Pinned slots, side-stream copies and deferred checks must store exactly what the GPU produced.
    path, _ = split
    records = read_records(path, 0, 10)
    s = settings(dtype="bfloat16")
    engine = make_capture_engine(s, target, ["cuda:0"])
    store = SampleStore(tmp_path / "store")
    outcome = extract_range(records, engine, store, s, ExtractOptions(batch_tokens=64, writer_threads=2))
    by_id = {e.sample_id: e for e in outcome.entries}
    for batch in plan_batches([len(r.input_ids) for r in records], 64):
        fresh = engine.capture([records[p].input_ids for p in batch])  # same batch, same numerics
        for p, hidden in zip(batch, fresh):
            stored = decode_sample(store.get(by_id[records[p].sample_id].key), check=True).hidden
            assert torch.equal(stored, hidden.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipeline_stores_fp8_quantized_on_the_gpu(target, split, tmp_path):
    # fp8: the GPU quantizes, the slot carries codes + scale exponents; the files hold exactly those.
    from draftflow.hidden_states.storage import quantize_fp8

    path, _ = split
    records = read_records(path, 0, 10)
    s = settings(dtype="bfloat16", storage="fp8")
    engine = make_capture_engine(s, target, ["cuda:0"])
    store = SampleStore(tmp_path / "store")
    options = ExtractOptions(batch_tokens=64, writer_threads=2, storage="fp8")
    outcome = extract_range(records, engine, store, s, options)
    by_id = {e.sample_id: e for e in outcome.entries}
    for batch in plan_batches([len(r.input_ids) for r in records], 64):
        fresh = engine.capture([records[p].input_ids for p in batch])
        for p, hidden in zip(batch, fresh):
            stored = decode_sample(store.get(by_id[records[p].sample_id].key), check=True, fp8_codes=True)
            q = quantize_fp8(hidden, check=False)
            assert torch.equal(stored.fp8.codes, q.codes.cpu()) and torch.equal(stored.fp8.exps, q.exps.cpu())
            assert torch.equal(stored.hidden, q.dequantize())


# ---- the target by content; repair in place (issue 12) ------------------------------------------


def test_a_moved_or_copied_target_reuses_every_stored_sample(split, tmp_path):
    path, _ = split
    target = build_target(tmp_path / "models" / "tiny")
    s = {k: v for k, v in settings().items() if k != "target_identity"}  # as the rule passes them
    first = run_extract(path, "train", 0, 10, target, tmp_path / "store", s, tmp_path / "rows_a")
    assert first.stats.computed == 10
    copy = tmp_path / "elsewhere" / "copy-of-tiny"
    shutil.copytree(target, copy)
    moved = tmp_path / "moved"
    target.rename(moved)
    for folder in (copy, moved):
        again = run_extract(path, "train", 0, 10, folder, tmp_path / "store", s, tmp_path / f"rows_{folder.name}")
        assert (again.stats.computed, again.stats.reused) == (0, 10)
        assert again.entries == first.entries


def _flip(path: Path, offset_from_end: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


def test_verify_repair_recomputes_exactly_the_damaged_samples_in_place(target, split, tmp_path, capsys):
    from draftflow.hidden_states.storage import checksum, write_range_index

    path, _ = split
    hs = tmp_path / "hs"
    s = {k: v for k, v in settings(batch_tokens=48).items() if k != "target_identity"}
    run_extract(path, "train", 0, 10, target, hs / "store", s, hs / "train" / "rows_0-10")
    range_dir = hs / "train" / "rows_0-10"
    meta, entries = read_range_index(range_dir)
    store = SampleStore(hs / "store")
    originals = {e.key: store.get(e.key) for e in entries}
    index_before = (range_dir / "index.json").read_bytes()
    damaged, missing = entries[2], entries[7]
    _flip(store.path(damaged.key))
    store.path(missing.key).unlink()
    others = {e.key: store.path(e.key).stat().st_mtime_ns for e in entries if e not in (damaged, missing)}

    rc = cli.main(["verify", "--hidden-states", str(hs), "--repair"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"REPAIRED {range_dir} {damaged.sample_id} {damaged.key}: recomputed bit for bit" in out
    assert f"REPAIRED {range_dir} {missing.sample_id} {missing.key}" in out
    assert "nothing downstream needs to rerun" in out
    for key, data in originals.items():
        assert store.get(key) == data, key
    assert {k: store.path(k).stat().st_mtime_ns for k in others} == others  # only the bad ones were written
    assert (range_dir / "index.json").read_bytes() == index_before  # the range (a Snakemake output) is untouched
    assert cli.main(["verify", "--hidden-states", str(hs), "--decode"]) == 0

    # Another model under the recorded path: refused, nothing deleted.
    _flip(store.path(damaged.key))
    other = build_target(tmp_path / "other", hidden=32)
    rc = cli.main(["verify", "--hidden-states", str(hs), "--repair", "--target", str(other)])
    assert rc == 1 and "is not the target these samples were extracted with" in capsys.readouterr().out
    assert store.path(damaged.key).exists()

    # A recompute that differs from what the index recorded (an engine that is not bit-reproducible,
    # simulated by an index entry that no longer matches): the entry is updated and reported.
    entries = [dataclasses.replace(e, checksum="xxh3_128:" + "0" * 32) if e == damaged else e for e in entries]
    write_range_index(range_dir, entries, meta)
    rc = cli.main(["verify", "--hidden-states", str(hs), "--repair"])
    out = capsys.readouterr().out
    assert rc == 0 and f"CHANGED {range_dir} {damaged.sample_id}" in out and "snakemake --forcerun train" in out
    assert read_range_index(range_dir)[1][2].checksum == checksum(store.get(damaged.key))
    assert cli.main(["verify", "--hidden-states", str(hs), "--decode"]) == 0


def test_fp8_samples_get_the_read_checks_and_repair_bit_for_bit(target, split, tmp_path, capsys):
    # issue 12's checks hold for fp8 files: reads compare the file hash with the index, re-indexing
    # checks the header's payload checksum, and verify --repair rewrites the same fp8 bytes.
    from draftflow.hidden_states.storage import BadRead, HiddenStateReader, read_header, storage_of_file

    path, _ = split
    hs = tmp_path / "hs"
    s = {k: v for k, v in settings(dtype="bfloat16", storage="fp8").items() if k != "target_identity"}
    run_extract(path, "train", 0, 10, target, hs / "store", s, hs / "train" / "rows_0-10")
    range_dir = hs / "train" / "rows_0-10"
    _, entries = read_range_index(range_dir)
    store = SampleStore(hs / "store")
    victim = entries[4]
    assert storage_of_file(store.path(victim.key)) == "fp8"
    assert read_header(store.get(victim.key)).payload_checksum is not None
    original = store.get(victim.key)
    _flip(store.path(victim.key))

    bad = HiddenStateReader([range_dir]).read(4)
    assert isinstance(bad, BadRead) and "file checksum differs" in bad.reason and bad.sample_id == victim.sample_id
    with pytest.raises(DraftflowError, match="payload checksum mismatch"):
        store.entry_for(victim.key, victim.sample_id)

    assert cli.main(["verify", "--hidden-states", str(hs), "--repair"]) == 0
    assert f"REPAIRED {range_dir} {victim.sample_id} {victim.key}: recomputed bit for bit" in capsys.readouterr().out
    assert store.get(victim.key) == original
    assert cli.main(["verify", "--hidden-states", str(hs), "--decode"]) == 0
