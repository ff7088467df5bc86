"""Hidden-state storage: lossless codec, content keys, crash-safe store, range indexes, reader."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from draftflow.hidden_states import storage
from draftflow.errors import DraftflowError
from draftflow.hidden_states.storage import (
    HiddenStateReader,
    SampleStore,
    byte_planes,
    checksum,
    compression_params,
    decode_sample,
    encode_sample,
    encode_sample_parts,
    read_header,
    read_range_index,
    sample_key,
    sample_lengths,
    settings_digest,
    summarize,
    write_range_index,
)

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.dtype])


def activations(T: int, L: int = 4, H: int = 64, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """Activation-like data: per-channel scales with a few outlier channels, a residual stream shared by layers."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(H, generator=g) * 0.7)
    scale[torch.randint(0, H, (2,), generator=g)] *= 20  # outlier channels, as in real LLMs
    stream = torch.randn(T, 1, H, generator=g) * scale
    return (stream + 0.3 * torch.randn(T, L, H, generator=g) * scale).to(dtype)


def make_sample(T: int, seed: int = 0, L: int = 4, H: int = 64, dtype=torch.bfloat16):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128_000, T)
    mask = (rng.random(T) < 0.6).astype(np.uint8)
    return ids, mask, activations(T, L, H, seed, dtype)


# ---------------------------------------------------------------- codec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact_including_nan_payloads_and_negative_zero(dtype):
    ids, mask, hidden = make_sample(33, dtype=dtype)
    raw = bits(hidden).clone()
    # Special values by bit pattern: -0.0, +-inf, quiet and signalling NaNs with payloads.
    if dtype == torch.float32:
        specials = [0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800123, 0xFFC0BEEF]
        raw.view(-1)[: len(specials)] = torch.tensor(specials, dtype=torch.int64).to(torch.int32)
    else:
        specials = (
            [0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x7F81, 0xFFEE]
            if dtype == torch.bfloat16
            else [0x8000, 0x7C00, 0xFC00, 0x7E01, 0x7C05, 0xFDEE]
        )
        raw.view(-1)[: len(specials)] = torch.tensor(specials, dtype=torch.int32).to(torch.int16)
    hidden = raw.view(dtype)
    assert torch.isnan(hidden).any() and (hidden.view(-1)[0] == 0) and torch.signbit(hidden.view(-1)[0])

    sample = decode_sample(encode_sample(ids, mask, hidden), check=True)

    assert sample.hidden.dtype == dtype and sample.hidden.shape == (33, 4, 64)
    assert torch.equal(bits(sample.hidden), raw)
    assert np.array_equal(sample.input_ids, ids) and sample.input_ids.dtype == np.int64
    assert np.array_equal(sample.loss_mask, mask) and sample.loss_mask.dtype == np.uint8
    assert torch.equal(bits(sample.aux), raw[:, :-1]) and torch.equal(bits(sample.final), raw[:, -1])


@pytest.mark.parametrize("T", [1, 4096])
def test_one_token_and_long_samples(T):
    ids, mask, hidden = make_sample(T, L=4, H=64 if T == 1 else 128)
    data = encode_sample(ids, mask, hidden)
    header = read_header(data)
    assert header.shape == tuple(hidden.shape) and header.loss_tokens == int(mask.sum())
    sample = decode_sample(data, check=True)
    assert torch.equal(bits(sample.hidden), bits(hidden))
    assert np.array_equal(sample.input_ids, ids)


def test_byte_planes_compress_structured_activations_better_than_plain_zstd():
    ids, mask, hidden = make_sample(1024, L=4, H=256)
    raw_bytes = bits(hidden).numpy().tobytes()
    stored = len(encode_sample(ids, mask, hidden, level=1))
    plain = len(zstandard.ZstdCompressor(level=1).compress(raw_bytes))
    assert stored / len(raw_bytes) < 0.72
    assert stored < 0.95 * plain


def test_low_mantissa_plane_is_stored_raw_when_zstd_cannot_shrink_it():
    ids, mask, hidden = make_sample(2048, L=4, H=256)
    sections = {s["name"]: s for s in read_header(encode_sample(ids, mask, hidden)).sections}
    assert sections["hidden.plane0"]["codec"] == "zstd"  # sign + exponent
    assert sections["hidden.plane1"]["codec"] == "raw"  # low mantissa bits: near-random


def test_decode_rejects_corruption_and_truncation():
    ids, mask, hidden = make_sample(64)
    data = bytearray(encode_sample(ids, mask, hidden))
    with pytest.raises(ValueError, match="size"):
        decode_sample(bytes(data[:-1]))
    with pytest.raises(ValueError, match="magic"):
        decode_sample(b"XXXX" + bytes(data[4:]))
    data[-10] ^= 0x01  # a bit flip in the raw low-mantissa plane: only the payload checksum sees it
    with pytest.raises(ValueError, match="checksum"):
        decode_sample(bytes(data), check=True)


def test_encode_rejects_inconsistent_inputs():
    ids, mask, hidden = make_sample(8)
    with pytest.raises(ValueError, match="length"):
        encode_sample(ids[:-1], mask, hidden)
    with pytest.raises(ValueError, match="dtype"):
        encode_sample(ids, mask, hidden.to(torch.float64))
    with pytest.raises(ValueError, match=r"\[T, L, H\]"):
        encode_sample(ids, mask, hidden[:, 0])


def legacy_encode(ids, mask, hidden: torch.Tensor, level: int = 1, payload_checksum: bool = True) -> bytes:
    """Frozen copy of encode_sample as of format version 1's first release (strided byte planes, one join),
    plus the header's optional `payload_checksum` (files written before it lack the key)."""
    ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
    mask = np.ascontiguousarray(np.asarray(mask, dtype=np.uint8).reshape(-1))
    itemsize = hidden.element_size()
    as_int = hidden.contiguous().view(INT_VIEW[hidden.dtype]).numpy()
    cols = as_int.reshape(-1).view(np.uint8).reshape(-1, itemsize)
    planes = [np.ascontiguousarray(cols[:, itemsize - 1 - k]) for k in range(itemsize)]
    zc = zstandard.ZstdCompressor(compression_params=compression_params(level))

    def pack(name, raw):
        raw = memoryview(np.ascontiguousarray(raw)).cast("B")
        n, probe = len(raw), 1 << 18
        if n > 4 * probe and len(zc.compress(raw[n // 2 : n // 2 + probe])) > 0.99 * probe:
            return {"name": name, "codec": "raw", "nbytes": n, "raw_nbytes": n}, raw
        packed = zc.compress(raw)
        if len(packed) < n:
            return {"name": name, "codec": "zstd", "nbytes": len(packed), "raw_nbytes": n}, packed
        return {"name": name, "codec": "raw", "nbytes": n, "raw_nbytes": n}, raw

    sections = [pack("input_ids", ids), pack("loss_mask", mask)]
    sections += [pack(f"hidden.plane{k}", plane) for k, plane in enumerate(planes)]
    T, L, H = hidden.shape
    header = {
        "T": T, "L": L, "H": H, "dtype": str(hidden.dtype).removeprefix("torch."), "loss_tokens": int(mask.sum()),
        "codec": "zstd-byteplanes", "level": level, "raw_checksum": checksum(ids, mask, as_int),
        "sections": [meta for meta, _ in sections],
    }  # fmt: skip
    if payload_checksum:
        header["payload_checksum"] = checksum(*(d for _, d in sections))
    header_bytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    parts = [struct.pack("<4sHI", b"DFHS", 1, len(header_bytes)), header_bytes] + [d for _, d in sections]
    return b"".join(parts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [0, 1, 33, 700])
def test_parts_join_to_the_unchanged_file_format(dtype, T):
    # T=700, H=512: 1.4 MB planes, past the probe threshold: a zstd exponent plane and raw mantissa planes.
    ids, mask, hidden = make_sample(T, seed=T, H=512 if T > 100 else 64, dtype=dtype)
    parts = encode_sample_parts(ids, mask, hidden)
    expected = legacy_encode(ids, mask, hidden)
    assert b"".join(parts) == expected == encode_sample(ids, mask, hidden)
    assert len(parts) == 3 + hidden.element_size()  # preamble + header, ids, mask, one per byte plane
    if T == 700:
        codecs = [s["codec"] for s in read_header(expected).sections]
        assert codecs[2] == "zstd" and codecs[-1] == "raw"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [0, 1, 5])
def test_byte_planes_are_the_bytes_of_each_element_most_significant_first(dtype, T):
    hidden = make_sample(T, dtype=dtype, H=8)[2]
    cols = bits(hidden).numpy().reshape(-1).view(np.uint8).reshape(-1, hidden.element_size())
    planes = byte_planes(hidden)
    assert len(planes) == hidden.element_size()
    for k, plane in enumerate(planes):
        assert plane.dtype == np.uint8 and plane.flags.c_contiguous
        assert np.array_equal(plane, cols[:, -1 - k])


def test_parts_never_alias_the_callers_memory():
    # extract.py hands the writer a view of a pinned slot that is reused once the write returns.
    ids, mask, hidden = make_sample(700, H=512)
    before = encode_sample(ids, mask, hidden)
    parts = encode_sample_parts(ids, mask, hidden)
    hidden.zero_()
    ids[:] = 0
    mask[:] = 0
    assert b"".join(parts) == before


def test_put_writes_parts_unjoined_with_the_checksum_of_the_joined_file(tmp_path):
    store = SampleStore(tmp_path)
    ids, mask, hidden = make_sample(700, H=512)
    parts = encode_sample_parts(ids, mask, hidden)
    data = b"".join(parts)
    key = sample_key("p", ids)
    put = store.put(key, parts)
    assert store.get(key) == data and put.nbytes == len(data)
    assert put.checksum == checksum(data) and store.entry_for(key, "s") == put.entry("s", key)
    assert checksum(*parts, algorithm="blake2b128") == checksum(data, algorithm="blake2b128")
    assert store.put(key, data) == put == store.put(key, tuple(parts))  # bytes, as before; a tuple too
    pieces = [data[i : i + 3] for i in range(0, 60, 3)] + [memoryview(data)[60:]]  # header split over parts
    assert store.put(key, pieces) == put
    assert list(store.root.glob("*/*/.*")) == []  # no temp files left


def test_put_loops_on_partial_writes(tmp_path, monkeypatch):
    calls = []

    def short_writev(fd, buffers):  # writes at most 1000 bytes, often ending inside a buffer
        chunk = b"".join(bytes(b) for b in buffers)[: 1000 - 7 * (len(calls) % 3)]
        calls.append(len(chunk))
        return os.write(fd, chunk)

    monkeypatch.setattr(storage.os, "writev", short_writev)
    store = SampleStore(tmp_path)
    ids, mask, hidden = make_sample(40)
    parts = encode_sample_parts(ids, mask, hidden)
    put = store.put(sample_key("w", ids), parts)
    assert store.get(sample_key("w", ids)) == b"".join(parts) and put.checksum == checksum(b"".join(parts))
    assert len(calls) > 5


def test_put_rejects_malformed_parts_and_leaves_nothing(tmp_path):
    store = SampleStore(tmp_path)
    ids, mask, hidden = make_sample(20)
    parts = encode_sample_parts(ids, mask, hidden)
    with pytest.raises(ValueError, match="size"):
        store.put("abcdef", parts[:-1])  # a section missing
    with pytest.raises(ValueError, match="magic"):
        store.put("abcdef", [b"XXXX", bytes(parts[0])[4:], *parts[1:]])
    with pytest.raises(ValueError, match="short"):
        store.put("abcdef", [])
    assert list(tmp_path.rglob("*")) == []


# ---------------------------------------------------------------- keys


def test_content_keys_follow_settings_and_tokens():
    s1 = settings_digest({"target": "llama", "layers": [1, 15, 28], "dtype": "bfloat16"})
    assert s1 == settings_digest({"dtype": "bfloat16", "layers": [1, 15, 28], "target": "llama"})  # key order
    s2 = settings_digest({"target": "llama", "layers": [2, 15, 28], "dtype": "bfloat16"})
    ids = [1, 2, 3]
    assert sample_key(s1, ids) == sample_key(s1, np.array(ids, dtype=np.int32))  # dtype of the list
    assert sample_key(s1, ids) != sample_key(s2, ids)
    assert sample_key(s1, ids) != sample_key(s1, [1, 2, 4])
    assert sample_key(s1, ids) != sample_key(s1, [1, 2])
    assert len(sample_key(s1, ids)) == 64


# ---------------------------------------------------------------- store


def test_store_put_get_and_entry_without_decoding(tmp_path):
    store = SampleStore(tmp_path / "store")
    ids, mask, hidden = make_sample(50)
    key = sample_key("d" * 64, ids)
    assert not store.contains(key)
    data = encode_sample(ids, mask, hidden)
    put = store.put(key, data)

    assert store.contains(key)
    assert store.path(key) == tmp_path / "store" / key[:2] / key[2:4] / f"{key}.dfhs"
    assert store.get(key) == data and put.nbytes == len(data)
    entry = store.entry_for(key, "s0")
    assert entry == put.entry("s0", key)
    assert (entry.length, entry.loss_tokens) == (50, int(mask.sum()))
    assert entry.raw_nbytes == 50 * 8 + 50 + hidden.numel() * 2
    with pytest.raises(ValueError, match="magic|short"):
        store.put(key, b"not a sample")


def test_leftover_temp_file_is_not_a_sample_and_is_cleaned_up(tmp_path):
    store = SampleStore(tmp_path)
    ids, mask, hidden = make_sample(10)
    key = sample_key("x", ids)
    final = store.path(key)
    final.parent.mkdir(parents=True)
    tmp = final.with_name(f".{final.name}.tmp-4242-deadbeef")  # what a killed put() leaves
    tmp.write_bytes(encode_sample(ids, mask, hidden)[:100])

    assert not store.contains(key)
    assert list(store.keys()) == []
    assert store.cleanup_temp(older_than_s=3600) == 0  # a fresh temp may belong to a live writer
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    assert store.cleanup_temp(older_than_s=3600) == 1
    assert not tmp.exists()


WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    from draftflow.hidden_states.storage import SampleStore, encode_sample, encode_sample_parts, sample_key
    store = SampleStore(sys.argv[1])
    i = 0
    while True:
        rng = np.random.default_rng(i)
        T = int(rng.integers(1, 400))
        ids = rng.integers(0, 1000, T)
        hidden = torch.from_numpy(rng.standard_normal((T, 4, 256), dtype=np.float32)).to(torch.bfloat16)
        encode = encode_sample_parts if i % 2 else encode_sample  # writev of parts, and one bytes object
        store.put(sample_key("crash", ids), encode(ids, ids % 2, hidden))
        i += 1
    """)


def test_sigkill_during_writes_leaves_only_complete_files(tmp_path):
    root = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)])
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(list(root.glob("*/*/*.dfhs"))) < 20:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = SampleStore(root)
    keys = list(store.keys())
    assert len(keys) >= 20
    for key in keys:  # every file under a final name is complete and bit-exact
        sample = decode_sample(store.get(key), check=True)
        assert sample_key("crash", sample.input_ids) == key
        assert np.array_equal(sample.loss_mask, sample.input_ids % 2)


STUCK_WRITER = textwrap.dedent("""
    import os, sys, time, numpy as np, torch
    from draftflow.hidden_states import storage
    store = storage.SampleStore(sys.argv[1])
    ids = np.arange(50)

    def stuck(src, dst):  # this writer stops after fsync, before the rename
        print("written", flush=True)
        time.sleep(600)

    os.replace = stuck
    store.put(storage.sample_key("stuck", ids), storage.encode_sample(ids, ids % 2, torch.ones(50, 4, 8)))
    """)


def _temps(root: Path) -> list[Path]:
    return sorted(root.glob("*/*/.*.tmp-*"))


def _start_stuck_writer(root: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STUCK_WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    return proc


def test_a_dead_writers_temp_file_is_removed_at_the_next_start_and_a_live_ones_kept(tmp_path):
    from draftflow.hidden_states.preflight import PreflightContext, PreflightSettings, check_free_disk

    root = tmp_path / "store"
    store = SampleStore(root)
    live = _start_stuck_writer(root)
    dead = _start_stuck_writer(root)
    try:
        dead.kill()  # SIGKILL: nothing of the writer runs any more
        dead.wait()
        temps = _temps(root)
        assert len(temps) == 2 and not list(store.keys())
        plan = {"total": {"bytes_expected": 10**6}}
        free_disk = check_free_disk(PreflightContext(plan, tmp_path, PreflightSettings()))
        assert free_disk.details["store_bytes"] == 0  # preflight: temp files are not stored samples
        # Fresh files, no waiting for an age: the dead writer is checked, not guessed.
        assert store.cleanup_temp() == 1
        (kept,) = _temps(root)
        assert f"~{live.pid}~" in kept.name  # the live writer's file stays
        other_host = kept.with_name(kept.name.replace(storage._HOST, "elsewhere", 1))
        kept.rename(other_host)  # a writer on another host sharing the store: cannot be checked, kept
        assert store.cleanup_temp() == 0
        other_host.rename(kept)
    finally:
        live.kill()
        live.wait()
    assert store.cleanup_temp() == 1 and _temps(root) == []


# ---------------------------------------------------------------- indexes and reader


def build_ranges(tmp_path: Path, lengths=((5, 1, 40), (7, 300))) -> tuple[Path, list[tuple]]:
    """Two ranges under tmp/hs/train with a store at tmp/hs/store; returns (hidden_states_dir, samples)."""
    hs = tmp_path / "hs"
    store = SampleStore(hs / "store")
    digest = settings_digest({"t": 1})
    samples, start = [], 0
    for r, range_lengths in enumerate(lengths):
        entries = []
        for j, T in enumerate(range_lengths):
            ids, mask, hidden = make_sample(T, seed=100 * r + j)
            key = sample_key(digest, ids)
            entries.append(store.put(key, encode_sample(ids, mask, hidden)).entry(f"d-{r}-{j}", key))
            samples.append((f"d-{r}-{j}", key, ids, mask, hidden))
        meta = {"settings_digest": digest, "store_root": (hs / "store").resolve(), "num_layers_captured": 4,
                "hidden_size": 64, "layer_ids": [1, 2, 3]}  # fmt: skip
        write_range_index(hs / "train" / f"rows_{start}-{start + len(entries)}", entries, meta)
        start += len(entries)
    return hs, samples


def test_range_index_round_trip_and_relative_store_root(tmp_path):
    hs, samples = build_ranges(tmp_path)
    meta, entries = read_range_index(hs / "train" / "rows_0-3")
    assert meta["store_root"] == "../../store"  # relative: the results folder can move
    assert meta["format_version"] == 1 and meta["layer_ids"] == [1, 2, 3]
    assert [e.sample_id for e in entries] == ["d-0-0", "d-0-1", "d-0-2"]
    assert [e.length for e in entries] == [5, 1, 40]
    with pytest.raises(ValueError, match="lacks"):
        write_range_index(tmp_path / "r", entries, {"store_root": "x"})


def test_lengths_and_summary_come_from_indexes_only(tmp_path):
    hs, samples = build_ranges(tmp_path)
    ranges = [hs / "train" / "rows_0-3", hs / "train" / "rows_3-5"]
    import shutil

    shutil.rmtree(hs / "store")  # no tensor data at all
    lengths = sample_lengths(ranges)
    assert lengths["lengths"] == {"d-0-0": 5, "d-0-1": 1, "d-0-2": 40, "d-1-0": 7, "d-1-1": 300}
    assert lengths["total_tokens"] == 353 and lengths["total_samples"] == 5
    assert lengths["total_loss_tokens"] == sum(int(s[3].sum()) for s in samples)
    summary = summarize(ranges)
    assert summary["total_tokens"] == 353 and summary["max_length"] == 300 and summary["min_length"] == 1
    assert 0 < summary["compression_ratio"] < 1
    assert summary["meta"]["layer_ids"] == [1, 2, 3] and summary["meta"]["hidden_size"] == 64


def test_reader_random_access_and_index_lengths_without_store_files(tmp_path):
    hs, samples = build_ranges(tmp_path)
    ranges = [hs / "train" / "rows_0-3", hs / "train" / "rows_3-5"]
    reader = HiddenStateReader(ranges)
    assert len(reader) == 5
    for i in [4, 0, 2, -1]:  # any order
        sample_id, key, ids, mask, hidden = samples[i]
        got = reader[i]
        assert torch.equal(bits(got.hidden), bits(hidden))
        assert np.array_equal(got.input_ids, ids) and np.array_equal(got.loss_mask, mask)
    with pytest.raises(IndexError):
        reader[5]

    SampleStore(hs / "store").delete(samples[3][1])
    reader = HiddenStateReader(ranges)  # opening needs only the indexes
    assert reader.lengths.tolist() == [5, 1, 40, 7, 300]
    assert reader.loss_tokens.tolist() == [int(s[3].sum()) for s in samples]
    assert reader.sample_ids == [s[0] for s in samples]
    with pytest.raises(DraftflowError, match="missing"):
        reader[3]


def _collate(batch):
    return [(s.input_ids.copy(), s.hidden.clone()) for s in batch]


def test_reader_in_dataloader_with_two_worker_processes(tmp_path):
    hs, samples = build_ranges(tmp_path)
    reader = HiddenStateReader([hs / "train" / "rows_0-3", hs / "train" / "rows_3-5"])
    loader = torch.utils.data.DataLoader(reader, batch_size=2, num_workers=2, collate_fn=_collate)
    got = [item for batch in loader for item in batch]
    assert len(got) == 5
    for (ids, hidden), (_, _, want_ids, _, want_hidden) in zip(got, samples):
        assert np.array_equal(ids, want_ids) and torch.equal(bits(hidden), bits(want_hidden))
