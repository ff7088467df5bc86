"""Benchmark: compression ratio and speed of the hidden-state codec (draftflow.hidden_states.storage).

Activations come from a randomly initialized HF LlamaForCausalLM in bf16 (no
downloads): aux layers [1, N//2-1, N-4] + the post-norm final state, i.e. the
[T, 4, H] tensor extraction stores. Reports the stored/raw ratio for plain zstd
and for the byte-plane codec, single-thread encode/decode MB/s (of raw bf16), and
encode throughput of a thread pool (zstd releases the GIL), and what checking a read costs:
the file checksum every training read verifies against its index (`verify_ms_per_sample`,
one hash of the stored bytes) next to decoding it (`decode_ms_per_sample`), as a ratio.

Writer scaling (`--scaling-threads`, on by default): one 8B-shaped sample ([2048, 4, 4096]
bf16 from a 4-layer random Llama with H 4096, aux layers 0, 1, 2) goes through the extraction writer's path,
encode + `SampleStore.put` into a temp store, on 1, 2, … threads: tokens/s per thread
count, encode-only tokens/s, and the GIL time held per sample (a watcher thread that
sleeps 0.2 ms measures how long it waits to run again), whose inverse caps a writer pool
of any size. The capture takes ~1 min on 2 CPU cores; `--cache` keeps it.

fp8 (`extract.storage: fp8`, on by default, `--storage lossless` skips it): the same
samples as fp8 files: stored / raw bf16 (also without the sign chain, for comparison),
encode MB/s from codes the GPU already quantized (the extraction writer's job) and with
CPU quantization, decode MB/s, and the reconstruction error per captured state (row-wise
relative L2 error ||decoded - x|| / ||x||, mean and max over rows).

    .venv/bin/python bench/storage_codec.py --hidden-size 1024 --layers 8          # CPU, minutes
    .venv/bin/python bench/storage_codec.py --only-scaling --cache /tmp/act8b.pt   # writer scaling only
    python bench/storage_codec.py --hidden-size 4096 --layers 32 --device cuda       # Llama-8B-shaped
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from draftflow.hidden_states import storage
from draftflow.hidden_states.storage import (
    CHECKSUM_ALGORITHM,
    SampleStore,
    byte_planes,
    compression_params,
    decode_sample,
    encode_sample,
)

# The writer's encoder: the list of buffers that `SampleStore.put` writes with os.writev; older
# draftflow (before it existed) joined everything into one bytes object.
encode_for_put = getattr(storage, "encode_sample_parts", encode_sample)


def capture(hidden_size: int, layers: int, lengths: list[int], device: str, seed: int = 0) -> list[torch.Tensor]:
    """[T, 4, H] bf16 activations of a random-weight Llama for random token sequences."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden_size, intermediate_size=int(hidden_size * 3.5), num_hidden_layers=layers,
        num_attention_heads=max(1, hidden_size // 128), num_key_value_heads=max(1, hidden_size // 512),
        vocab_size=32_000, max_position_embeddings=max(lengths),
    )  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    # Llama-3-style aux layers for deep models; shallow ones (the scaling sample) take 3 distinct early layers
    aux = [1, layers // 2 - 1, layers - 4] if layers >= 8 else [0, 1, 2]
    out = []
    for T in lengths:
        ids = torch.randint(0, config.vocab_size, (1, T), device=device)
        with torch.no_grad():  # the base model: the LM head is not needed for hidden states
            hs = model.model(ids, output_hidden_states=True).hidden_states
        # hs[i + 1] = output of layer i; hs[-1] = post-norm last state (HF overwrites it)
        out.append(torch.stack([hs[i + 1][0] for i in aux] + [hs[-1][0]], dim=1).cpu().contiguous())
    del model
    return out


def timed(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


class GilWatch:
    """Measures how long other threads hold the GIL: a thread sleeping 0.2 ms at a time that
    wakes more than 1 ms late was waiting for the GIL or for a CPU. On Linux the time it spent
    runnable but off-CPU (/proc schedstat run delay) is subtracted, so a busy machine does
    not count as GIL time."""

    def __init__(self, late_s: float = 0.001):
        self.late_s, self.blocked_s, self._stop = late_s, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _run_delay(fd: int | None) -> float:
        return int(os.pread(fd, 200, 0).split()[1]) / 1e9 if fd is not None else 0.0

    def _run(self) -> None:
        try:
            fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:  # not Linux: CPU contention counts too
            fd = None
        last, delay = time.perf_counter(), self._run_delay(fd)
        while not self._stop.is_set():
            time.sleep(0.0002)
            now, now_delay = time.perf_counter(), self._run_delay(fd)
            if now - last > self.late_s:
                self.blocked_s += max(0.0, now - last - (now_delay - delay))
            last, delay = now, now_delay
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> GilWatch:
        self._thread.start()
        time.sleep(0.05)
        self.blocked_s = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def writer_scaling(
    hidden: torch.Tensor, threads: list[int], samples: int, level: int, store_dir: str | None, repeat: int
) -> dict:
    """The extraction writer's path (encode + put) on thread pools of each size, for one [T, L, H] sample."""
    T = hidden.shape[0]
    ids = np.arange(T) % 128_000
    mask = (ids % 3 != 0).astype(np.uint8)
    reference = encode_sample(ids, mask, hidden, level=level)
    parts = encode_for_put(ids, mask, hidden, level=level)
    joined = parts if isinstance(parts, bytes) else b"".join(parts)
    assert joined == reference, "encode_sample_parts differs from encode_sample"
    assert torch.equal(decode_sample(reference, check=True).hidden.view(torch.int16), hidden.view(torch.int16))

    def encode(_: int) -> None:
        encode_for_put(ids, mask, hidden, level=level)

    root = Path(tempfile.mkdtemp(prefix="draftflow-bench-", dir=store_dir))
    try:
        store = SampleStore(root)

        def write(i: int) -> None:
            key = hashlib.sha256(f"bench-{i}".encode()).hexdigest()
            store.put(key, encode_for_put(ids, mask, hidden, level=level))
            store.delete(key)

        write(-1)  # warm-up: compressors, page cache, folders
        gil_samples = samples
        with GilWatch() as watch:
            t0 = time.perf_counter()
            for i in range(gil_samples):
                write(i)
            one_s = (time.perf_counter() - t0) / gil_samples
        gil_s = watch.blocked_s / gil_samples
        out = {
            "sample": f"[{T}, {hidden.shape[1]}, {hidden.shape[2]}] {str(hidden.dtype).removeprefix('torch.')}",
            "stored_ratio": round(len(reference) / (hidden.numel() * hidden.element_size()), 4),
            "encoder": encode_for_put.__name__,
            "write_ms_per_sample_1_thread": round(one_s * 1e3, 1),
            "gil_held_ms_per_sample": round(gil_s * 1e3, 1),
            "gil_cap_tokens_per_s": round(T / gil_s) if gil_s > 0 else None,
            "encode_tokens_per_s_by_threads": {},
            "write_tokens_per_s_by_threads": {},
        }
        for n in threads:
            with ThreadPoolExecutor(n) as ex:
                for name, fn in (("encode", encode), ("write", write)):
                    jobs = range(samples * n)
                    list(ex.map(fn, range(n)))  # warm every thread
                    best = float("inf")
                    for _ in range(repeat):  # best of: the machine may be shared
                        t0 = time.perf_counter()
                        list(ex.map(fn, jobs))
                        best = min(best, time.perf_counter() - t0)
                    out[f"{name}_tokens_per_s_by_threads"][n] = round(T * len(jobs) / best)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def row_errors(decoded: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """[T, L] relative L2 error of each row (token × state); all-zero rows count as 0."""
    x = original.double()
    norm = x.norm(dim=-1)
    err = (decoded.double() - x).norm(dim=-1)
    return torch.where(norm > 0, err / norm.clamp_min(1e-300), err)


def error_by_layer(errors: list[torch.Tensor]) -> dict:
    """Per captured state: mean and max row relative L2 error over all rows of all samples."""
    rows = torch.cat(errors)  # [sum T, L]
    names = [f"aux{i}" for i in range(rows.shape[1] - 1)] + ["final"]
    return {name: {"mean": round(float(rows[:, k].mean()), 5), "max": round(float(rows[:, k].max()), 5)}
            for k, name in enumerate(names)}  # fmt: skip


def fp8_codec(samples: list[torch.Tensor], ids: list[np.ndarray], level: int, repeat: int) -> dict:
    """fp8 files of the same samples: ratio, speeds, reconstruction error (see the module docstring)."""
    raw = sum(h.numel() * 2 for h in samples)
    quantized = [storage.quantize_fp8(h) for h in samples]
    encoded = [encode_sample(i, i % 2, q, level=level) for i, q in zip(ids, quantized)]
    zstd = zstandard.ZstdCompressor(compression_params=compression_params(level))
    unchained = sum(len(zstd.compress(q.codes.numpy().tobytes())) for q in quantized)
    chained = sum(s["nbytes"] for d in encoded for s in storage.read_header(d).sections if s["name"] == "hidden.fp8")
    errors = []
    for data, q, h in zip(encoded, quantized, samples):
        sample = decode_sample(data, check=True, fp8_codes=True)
        assert torch.equal(sample.fp8.codes, q.codes) and storage.fp8_problem(sample.fp8) is None
        errors.append(row_errors(sample.hidden, h))

    def encode_codes():
        for i, q in zip(ids, quantized):
            encode_sample(i, i % 2, q, level=level)

    def encode_with_quantize():
        for i, h in zip(ids, samples):
            encode_sample(i, i % 2, h, level=level, storage="fp8")

    def decode_all():
        for data in encoded:
            decode_sample(data)

    return {
        "ratio_vs_raw_bf16": round(sum(map(len, encoded)) / raw, 4),
        "codes_plane_vs_raw_bf16": round(chained / raw, 4),
        "codes_plane_without_sign_chain_vs_raw_bf16": round(unchained / raw, 4),
        "encode_MBps_1_thread_codes_given": round(raw / timed(encode_codes, repeat) / 1e6),
        "encode_MBps_1_thread_with_cpu_quantize": round(raw / timed(encode_with_quantize, 1) / 1e6),
        "decode_MBps_1_thread": round(raw / timed(decode_all, repeat) / 1e6),
        "row_relative_l2_error": error_by_layer(errors),
    }


def scaling_sample(args) -> torch.Tensor:
    if args.cache and args.cache.exists():
        return torch.load(args.cache)
    (hidden,) = capture(args.scaling_hidden, args.scaling_layers, [args.scaling_length], args.device)
    if args.cache:
        torch.save(hidden, args.cache)
    return hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scaling-threads", type=int, nargs="*", default=[1, 2], help="none: skip writer scaling")
    parser.add_argument("--scaling-length", type=int, default=2048)
    parser.add_argument("--scaling-hidden", type=int, default=4096)
    parser.add_argument("--scaling-layers", type=int, default=4, help="random-Llama depth, >= 4")
    parser.add_argument("--scaling-samples", type=int, default=4, help="samples per thread per measurement")
    parser.add_argument("--store-dir", default=None, help="where the scaling run's temp store goes")
    parser.add_argument("--cache", type=Path, help="save / load the scaling sample here (torch.save)")
    parser.add_argument("--only-scaling", action="store_true", help="skip the codec comparison")
    parser.add_argument("--storage", nargs="+", choices=["lossless", "fp8"], default=["lossless", "fp8"],
                        help="fp8: also measure fp8 files of the same samples")  # fmt: skip
    args = parser.parse_args()

    scaling = None
    if args.scaling_threads:
        hidden = scaling_sample(args)
        scaling = writer_scaling(
            hidden, args.scaling_threads, args.scaling_samples, args.level, args.store_dir, args.repeat
        )
    if args.only_scaling:
        print(json.dumps({"cpus": os.cpu_count(), "level": args.level, "writer_scaling": scaling}, indent=2))
        return

    t0 = time.perf_counter()
    samples = capture(args.hidden_size, args.layers, args.lengths, args.device)
    capture_s = time.perf_counter() - t0
    raw = sum(h.numel() * 2 for h in samples)
    ids = [np.arange(h.shape[0]) for h in samples]
    encoded = [encode_sample(i, i % 2, h, level=args.level) for i, h in zip(ids, samples)]
    stock = zstandard.ZstdCompressor(level=args.level)  # stock parameters, for comparison with the tuned ones
    stock_planes = sum(min(len(stock.compress(p)), p.size) for h in samples for p in byte_planes(h))
    plain = sum(len(zstandard.ZstdCompressor(level=args.level).compress(h.view(torch.int16).numpy())) for h in samples)
    for data, h in zip(encoded, samples):  # lossless, or the numbers mean nothing
        assert torch.equal(decode_sample(data, check=True).hidden.view(torch.int16), h.view(torch.int16))

    def encode_all():
        for i, h in zip(ids, samples):
            encode_sample(i, i % 2, h, level=args.level)

    def decode_all():
        for data in encoded:
            decode_sample(data)

    def hash_all():  # what HiddenStateReader adds to every read: the file checksum against the index
        for data in encoded:
            storage.checksum(data)

    enc_s, dec_s, hash_s = timed(encode_all, args.repeat), timed(decode_all, args.repeat), timed(hash_all, args.repeat)
    pool = {}
    jobs = [(i, h) for i, h in zip(ids, samples)] * 4
    for n in args.threads:
        with ThreadPoolExecutor(n) as ex:
            s = timed(lambda: list(ex.map(lambda a: encode_sample(a[0], a[0] % 2, a[1], level=args.level), jobs)), 1)
        pool[n] = round(raw * 4 / s / 1e6)
    fp8 = fp8_codec(samples, ids, args.level, args.repeat) if "fp8" in args.storage else None
    print(json.dumps({
        "shape": f"[T, 4, {args.hidden_size}] bf16, T in {args.lengths}",
        "model": f"random Llama, {args.layers} layers, device {args.device} (capture {capture_s:.0f} s)",
        "cpus": os.cpu_count(),
        "level": args.level,
        "checksum": CHECKSUM_ALGORITHM,
        "ratio_plain_zstd": round(plain / raw, 4),
        "ratio_byte_planes_stock_zstd": round(stock_planes / raw, 4),
        "ratio_byte_planes": round(sum(map(len, encoded)) / raw, 4),
        "encode_MBps_1_thread": round(raw / enc_s / 1e6),
        "decode_MBps_1_thread": round(raw / dec_s / 1e6),
        "verify_ms_per_sample": round(hash_s / len(encoded) * 1e3, 3),
        "decode_ms_per_sample": round(dec_s / len(encoded) * 1e3, 3),
        "verify_over_decode": round(hash_s / dec_s, 4),
        "verify_over_encode": round(hash_s / enc_s, 4),
        "encode_MBps_by_threads": pool,
        "writer_scaling": scaling,
        "fp8": fp8,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
