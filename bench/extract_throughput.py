"""Extraction throughput: does writing hidden states keep up with the GPU?

Builds a Llama-3.1-8B-shaped model with random bf16 weights directly on the device (no
download), then measures in one run, on the same model and batch shape:

  (a) forward-only throughput (tokens/s) of the model body,
  (b) end-to-end extraction throughput through draftflow.hidden_states.extract.extract_range: capture,
      checks, device->host copies, byte-plane zstd encoding, fsync'd files in a store on
      local disk,
  (c) bytes on disk / raw hidden-state bytes (bf16).

Goals: (b) >= 0.90 x (a); (c) <= 0.72 lossless, <= 0.40 with `--storage fp8`, <= 0.53 with
`fp8_aux` (the plan's estimate: aux states fp8, the final state lossless). Prints one
JSON line with every figure; with several `--storage` modes, one extraction per mode in the
same process (each right after its own forward-only measurement), under "modes".

fp8 runs also report the reconstruction error: the first batch is captured again, and per
captured state the row-wise relative L2 error ||stored - capture|| / ||capture|| (mean and
max over rows); the stored codes must equal a fresh GPU quantization bit for bit. fp8_aux
(whose writers quantize on the CPU) the same, and its final state must equal the capture's.

Checksums (`--checks`): extraction reads the store only to re-index a sample it reuses (a
resumed or re-merged range), and since files carry a payload checksum that re-index checks it
(`SampleStore.entry_for`: read, payload hash, file hash) instead of trusting the file (read,
file hash). Both are timed on the written files on one thread, side by side
(`reindex_checked_s` / `reindex_unchecked_s`), and the payload hash the writers now add per
file as a share of the writer pool's time in (b) (`payload_hash_share_of_writers`).

    python bench/extract_throughput.py                 # H200: 8B shape, 2048-token samples
    python bench/extract_throughput.py --storage lossless fp8 fp8_aux   # the modes, side by side
    python bench/extract_throughput.py --tiny          # any machine, seconds (CPU if no CUDA)
    python bench/extract_throughput.py --store-dir /local/nvme/tmp --writer-threads 12
    python bench/extract_throughput.py --checks        # + the cost of the stored-file checks

The default run writes ~19 GB (deleted afterwards unless --keep): a short run would be
dominated by the writers' backlog at the end, which a 2,000-sample range amortizes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from draftflow.engines.hf_capture import HfCaptureEngine  # noqa: E402
from draftflow.hidden_states.extract import ExtractOptions, Record, extract_range  # noqa: E402
from draftflow.hidden_states.storage import (  # noqa: E402
    FP8_MODES,
    SampleStore,
    checksum,
    decode_sample,
    quantize_for_storage,
    read_header,
)

LLAMA_31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip
TINY = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model and samples: a quick check on CPU")
    p.add_argument("--samples", type=int, default=None, help="samples to extract (default 400: ~19 GB on disk; tiny 24)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 2048; tiny 128)")
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per forward (default 16384; tiny 512)")
    p.add_argument("--writer-threads", type=int, default=12, help="encoding/writing threads (16-core host: 12)")
    p.add_argument("--ring-slots", type=int, default=ExtractOptions.ring_slots,
                   help="pinned host buffers between the GPU and the writers (one batch each)")  # fmt: skip
    p.add_argument("--compression-level", type=int, default=1)
    p.add_argument("--forward-iters", type=int, default=None, help="timed forwards for (a) (default 10; tiny 5)")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=None, help="default [1, N//2-1, N-4]")
    p.add_argument("--store-dir", type=Path, default=None, help="parent folder of the temporary store (local disk)")
    p.add_argument("--keep", action="store_true", help="keep the store afterwards")
    p.add_argument("--checks", action="store_true", help="also time re-indexing with / without the file checks")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", nargs="+", choices=["lossless", "fp8", "fp8_aux"], default=["lossless"],
                   help="extract.storage mode(s), measured one after the other in this process")  # fmt: skip
    args = p.parse_args(argv)
    defaults = (24, 128, 512, 5) if args.tiny else (400, 2048, 16384, 10)
    for name, value in zip(("samples", "seq_len", "batch_tokens", "forward_iters"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The model body (no LM head) with random weights, created on `device` directly."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, use_cache=False)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def forward_throughput(engine: HfCaptureEngine, batch: int, seq_len: int, vocab: int, iters: int) -> float:
    """(a) tokens/s of the bare forward on [batch, seq_len] (the hooks are idle outside capture)."""
    ids = torch.randint(1, vocab, (batch, seq_len), device=engine.device)
    for _ in range(2):  # warm-up: kernels, allocator
        engine.body(input_ids=ids, use_cache=False)
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(iters):
        engine.body(input_ids=ids, use_cache=False)
    sync(engine.device)
    return iters * batch * seq_len / (time.perf_counter() - t0)


def make_records(n: int, seq_len: int, vocab: int, seed: int) -> list[Record]:
    rng = np.random.default_rng(seed)
    mask = np.ones(seq_len, dtype=np.uint8)
    return [Record(f"bench-{i}", "bench", rng.integers(1, vocab, size=seq_len, dtype=np.int64), mask, i) for i in range(n)]


def verify_first_batch(
    engine: HfCaptureEngine, store: SampleStore, records: list[Record], entries, per_batch: int, storage: str
) -> dict:
    """Recapture the first batch (equal lengths: records 0..per_batch-1) and compare with the
    stored, decoded samples: checks the pinned-buffer / side-stream copy path end to end.

    lossless: stored == capture bit for bit. fp8 / fp8_aux: stored codes and scales == a fresh
    quantization on the capture device (fp8_aux: and its final state == the capture's), and the
    reconstruction error per state."""
    first = records[:per_batch]
    captured = engine.capture([r.input_ids for r in first])  # on the device
    exact, max_diff, errors = True, 0.0, []
    for hidden, entry in zip(captured, entries):
        sample = decode_sample(store.get(entry.key), check=True, fp8_codes=True)
        fresh = hidden.cpu()
        if storage in FP8_MODES:
            q = quantize_for_storage(hidden, storage, check=False)
            exact &= torch.equal(sample.fp8.codes, q.codes.cpu()) and torch.equal(sample.fp8.exps, q.exps.cpu())
            if q.final is not None:  # fp8_aux: the final state kept as captured
                exact &= torch.equal(sample.hidden[:, -1], fresh[:, -1])
            x = fresh.double()
            errors.append((sample.hidden.double() - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-300))  # [T, L]
        else:
            exact &= torch.equal(sample.hidden, fresh)
        max_diff = max(max_diff, (sample.hidden.float() - fresh.float()).abs().max().item())
    out = {"samples": len(first), "bit_exact": bool(exact), "max_abs_diff": max_diff}
    if errors:
        rows = torch.cat(errors)  # [sum T, L]
        names = [f"aux_layer_{i}" for i in engine.aux_layer_ids] + ["final"]
        out["row_relative_l2_error"] = {
            name: {"mean": round(float(rows[:, k].mean()), 5), "max": round(float(rows[:, k].max()), 5)}
            for k, name in enumerate(names)
        }
    return out


GOAL_RATIO = {"lossless": 0.72, "fp8": 0.40, "fp8_aux": 0.53}


class ForwardTimeline:
    """CUDA events around every forward of the target body, on its stream: where the GPU's time
    goes during an extraction (the host's clocks cannot tell a busy GPU from an idle one).

    lead_s: the run's start to the first forward; forward_s: the forwards themselves;
    gap_s: between one forward's end and the next one's start (the GPU idle, or running the
    capture's own small kernels); tail_s: the last forward's end to the run's end."""

    def __init__(self, body: torch.nn.Module):
        self.spans: list[list[torch.cuda.Event]] = []
        self.start, self.end = self._event(), None
        self._hooks = [
            body.register_forward_pre_hook(lambda module, args: self.spans.append([self._event()])),
            body.register_forward_hook(lambda module, args, output: self.spans[-1].append(self._event())),
        ]

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> dict:
        self.end = self._event()
        for hook in self._hooks:
            hook.remove()
        torch.cuda.synchronize()
        forward = [a.elapsed_time(b) / 1e3 for a, b in self.spans]
        gaps = [self.spans[i][1].elapsed_time(self.spans[i + 1][0]) / 1e3 for i in range(len(self.spans) - 1)]
        return {
            "forwards": len(forward),
            "lead_s": round(self.start.elapsed_time(self.spans[0][0]) / 1e3, 3),
            "forward_s": round(sum(forward), 3),
            "gap_s": round(sum(gaps), 3),
            # [index, seconds]: gap i lies between forward i and i + 1 (early ones: the slots' pinning)
            "largest_gaps_s": sorted(([i, round(g, 3)] for i, g in enumerate(gaps)), key=lambda x: -x[1])[:5],
            "tail_s": round(self.spans[-1][1].elapsed_time(self.end) / 1e3, 3),
        }


def extract_once(args, engine, records, aux, raw_hidden: int, per_batch: int, storage: str, forward_tps: float) -> dict:
    """(b) and (c) for one storage mode, in a temp store deleted afterwards unless --keep."""
    device = engine.device
    store_root = Path(tempfile.mkdtemp(prefix=f"draftflow-bench-{storage}-", dir=args.store_dir))
    try:
        settings = {
            "engine": "hf", "aux_layer_ids": aux, "dtype": "bfloat16", "storage": storage,
            "target_identity": f"bench-random-{'tiny' if args.tiny else 'llama31-8b'}-seed{args.seed}",
        }  # fmt: skip
        options = ExtractOptions(
            batch_tokens=args.batch_tokens, compression_level=args.compression_level,
            writer_threads=args.writer_threads, log_every_s=15.0, storage=storage, ring_slots=args.ring_slots,
        )  # fmt: skip
        sync(device)
        timeline = ForwardTimeline(engine.body) if device.type == "cuda" else None
        t0 = time.perf_counter()
        outcome = extract_range(records, engine, SampleStore(store_root), settings, options, label=f"bench-{storage}")
        sync(device)
        extract_s = time.perf_counter() - t0  # every file written and fsync'd
        gpu_timeline = timeline.finish() if timeline is not None else None
        stored = sum(e.nbytes for e in outcome.entries)
        verify = verify_first_batch(engine, SampleStore(store_root), records, outcome.entries, per_batch, storage)
        checks = check_costs(SampleStore(store_root), outcome.entries, extract_s, args.writer_threads) if args.checks else None
        extract_tps = args.samples * args.seq_len / extract_s
        return {
            "storage": storage,
            "forward_tokens_per_s": round(forward_tps, 1),
            "extract_tokens_per_s": round(extract_tps, 1),
            "extract_vs_forward": round(extract_tps / forward_tps, 4),
            "extract_s": round(extract_s, 3),
            "capture_s": round(outcome.stats.capture_s, 3),
            "writer_wait_s": round(outcome.stats.writer_wait_s, 3),
            # where extract_s goes beyond the forwards: before the first batch, pinning, after the last
            **{k: round(getattr(outcome.stats, k), 3) for k in ("setup_s", "pin_s", "drain_s")},
            "forward_only_s": round(args.samples * args.seq_len / forward_tps, 3),  # the same tokens, bare forwards
            **({"gpu_timeline": gpu_timeline} if gpu_timeline else {}),
            "bytes_stored": stored,
            "bytes_raw_payload": sum(e.raw_nbytes for e in outcome.entries),
            "ratio": round(stored / raw_hidden, 4),
            "goals": {
                "extract_vs_forward>=0.90": extract_tps / forward_tps >= 0.90,
                f"ratio<={GOAL_RATIO[storage]}": stored / raw_hidden <= GOAL_RATIO[storage],
            },
            "computed": outcome.stats.computed,
            "verify": verify,
            **({"checks": checks} if checks else {}),
            "store": str(store_root),
        }
    finally:
        if not args.keep:
            shutil.rmtree(store_root, ignore_errors=True)


def check_costs(store: SampleStore, entries, extract_s: float, writer_threads: int, repeat: int = 3) -> dict:
    """Seconds on one thread over every written file (best of `repeat`, alternating): re-index with
    checks (entry_for) and without (read + header + file hash, what entry_for did before), and
    the payload hash alone."""

    def checked():
        for e in entries:
            store.entry_for(e.key, e.sample_id)

    def unchecked():
        for e in entries:
            data = store.get(e.key)
            read_header(data)
            checksum(data)

    payloads = [memoryview(d)[read_header(d).data_offset :] for d in (store.get(e.key) for e in entries)]

    def payload_hash():
        for payload in payloads:
            checksum(payload)

    best = {f: float("inf") for f in (checked, unchecked, payload_hash)}
    for _ in range(repeat):
        for f in best:
            t0 = time.perf_counter()
            f()
            best[f] = min(best[f], time.perf_counter() - t0)
    return {
        "reindex_checked_s": round(best[checked], 4),
        "reindex_unchecked_s": round(best[unchecked], 4),
        "reindex_checked_over_unchecked": round(best[checked] / best[unchecked], 3),
        "payload_hash_s": round(best[payload_hash], 4),
        "payload_hash_share_of_writers": round(best[payload_hash] / (extract_s * writer_threads), 4),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = TINY if args.tiny else LLAMA_31_8B
    dtype = torch.bfloat16
    num_layers = shape["num_hidden_layers"]
    aux = args.aux_layer_ids or [1, num_layers // 2 - 1, num_layers - 4]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    t_build = time.perf_counter()
    model = build_model(shape, device, dtype, args.seed)
    engine = HfCaptureEngine(model, aux, batch_tokens=args.batch_tokens)
    build_s = time.perf_counter() - t_build
    per_batch = max(1, args.batch_tokens // args.seq_len)

    if args.store_dir is not None:
        args.store_dir.mkdir(parents=True, exist_ok=True)
    records = make_records(args.samples, args.seq_len, shape["vocab_size"], args.seed + 1)
    raw_hidden = args.samples * args.seq_len * (len(aux) + 1) * shape["hidden_size"] * 2
    modes, versions = {}, {"torch": torch.__version__, **engine.versions(), "python": sys.version.split()[0]}
    try:
        for storage in args.storage:
            forward_tps = forward_throughput(engine, per_batch, args.seq_len, shape["vocab_size"], args.forward_iters)
            modes[storage] = extract_once(args, engine, records, aux, raw_hidden, per_batch, storage, forward_tps)
    finally:
        engine.close()
    result = {
        "bench": "extract_throughput",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": "tiny-llama" if args.tiny else "llama-3.1-8b-shaped (random bf16)",
        "samples": args.samples, "seq_len": args.seq_len, "batch_tokens": args.batch_tokens,
        "samples_per_forward": per_batch, "aux_layer_ids": aux,
        "writer_threads": args.writer_threads, "ring_slots": args.ring_slots, "compression_level": args.compression_level,
        "bytes_raw_hidden_bf16": raw_hidden,
        "modes": modes,
        "model_build_s": round(build_s, 2),
        "versions": versions,
        "cpu_count": os.cpu_count(),
    }  # fmt: skip
    if len(modes) == 1:  # the flat layout of earlier runs, for one mode
        result.update(next(iter(modes.values())))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
