"""Drafter training throughput: tokens/s, model FLOPs utilization, and time waiting on data.

An EAGLE-3 drafter for a Llama-3.1-8B-shaped target (H 4096, 32 heads, 8 KV heads,
intermediate 14336, target vocab 128256, draft vocab 32000, llama3 RoPE) trained with the real
training step (draftflow.drafters.train.train_step: target LM head, 7-step TTT, AdamW, bf16 autocast) on
2048-token samples of random bf16 hidden states, written through the storage API into a
temporary store and read back compressed from disk by DataLoader workers.

Two timed phases of the same step:
  compute-only: a few batches kept on the device, cycled (no data loading at all);
  end-to-end:   batches from disk through the DataLoader (decode, collate, pin, copy).
data_wait_share = 1 - compute-only step time / end-to-end step time (goal <= 0.05);
host_blocked_share = share of end-to-end wall time the training loop sat in next(loader).
thread_cpu_share_* = the training thread's CPU time over wall time, per phase: near 1, the step is
host-bound (launching kernels, Python); far below, the thread waits (on the GPU, a sync or the GIL).
--profile: 2 steps of each phase under torch.profiler, the top kernels to stderr, and the GPU's
kernel time per step beside wall time (`profile` in the JSON): where the fresh phase's extra time goes.

Read-time verification (every read's file checksum against its index, as training does):
`--verify-reads both` runs the end-to-end phase four times, alternating on / off / on / off,
each with a fresh DataLoader and one untimed step first, and reports both tokens/s and
`verify_cost` = 1 - on / off (goal < 0.02). `on` (the default) and `off` run one phase.

FLOPs counted (model FLOPs, for MFU): 6 x matmul parameters per token per TTT step
(q/k/v/o, MLP, LM head; fc once per token, 4x as its input needs no gradient) plus causal
attention actually attended (12 x heads x head_dim x visible keys per token per step: the
prefix and the chain's own diagonal). Not counted: the target LM head (reported as
target_head_flops_per_token), masked-out attention work, norms and softmax.

--method dflash: a DFlash drafter for the same target instead (5 Qwen3-style layers reading 5
target layers spread from 1 to N-3, as the reference Qwen3-8B drafter; block 16; 512 anchors per
sample; the target's LM head over the whole vocabulary), with its real objective
(draftflow.drafters.dflash_loss) and data loader (anchors drawn in collate). Its model FLOPs:
fc + per-layer context K/V over every sample token, 6 x layer parameters per block row, causal-free
attention over the visible context + the block, and 4 x H x V per labelled row (the frozen LM head:
forward and input gradient). Tokens/s counts sample tokens (as EAGLE-3's), not block rows.

    python bench/train_throughput.py                   # GPU: 8B shape (H200: a few minutes)
    python bench/train_throughput.py --method dflash   # the same for DFlash
    python bench/train_throughput.py --tiny [--method dflash]   # any machine, seconds (CPU if no CUDA)
    python bench/train_throughput.py --verify-reads both   # the cost of read-time checksums, side by side
    python bench/train_throughput.py --lengths mixed --batching padded   # mixed lengths, as before packing
    python bench/train_throughput.py --method dflash --shape smollm2-135m --dflash-layers 1 --dflash-labels soft

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from draftflow.config import default_aux_layer_ids  # noqa: E402
from draftflow.drafters.dflash import DFlashConfig, DFlashDrafter, loss_decay, spread_target_layer_ids  # noqa: E402
from draftflow.drafters.dflash_loss import ArgmaxHead, DFlashObjective  # noqa: E402
from draftflow.drafters.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402
from draftflow.hidden_states.storage import HiddenStateReader, SampleStore, encode_sample, sample_key, write_range_index  # noqa: E402
from draftflow.drafters.train import (  # noqa: E402
    DistEnv, TrainSettings, make_loader, make_optimizer, plan_micro_batches, train_step, ttt_attention, use_compile,
)  # fmt: skip
from draftflow.drafters.ttt import TTT_ATTENTIONS, TargetHead, TTTObjective  # noqa: E402

LLAMA_31_8B = {
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip
LLAMA_31_8B["num_hidden_layers"] = 32
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 1024, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "num_hidden_layers": 8}  # fmt: skip
SMOLLM2_135M = {  # issue 32's real target (bench/README.md §6): what its DFlash recipes train against
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "vocab_size": 49152, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "num_hidden_layers": 30,
}  # fmt: skip
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "smollm2-135m": SMOLLM2_135M}
PEAK_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0}  # dense, SXM


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a quick check on CPU")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b",
                   help="the target's shape (--tiny overrides it); smollm2-135m: 576 wide, vocabulary 49,152")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 2048; tiny 128)")
    p.add_argument("--batch-tokens", type=int, help="tokens per step (default 16384, dflash 8192; tiny 512)")
    p.add_argument("--samples", type=int, help="samples on disk (default 48; tiny 16)")
    p.add_argument("--steps", type=int, help="timed steps per phase (default 20; tiny 3)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 3; tiny 1)")
    p.add_argument("--method", choices=["eagle3", "dflash"], default="eagle3")
    p.add_argument("--lengths", choices=["fixed", "mixed"], default="fixed",
                   help="fixed: every sample --seq-len tokens; mixed: uniform in [seq-len/8, seq-len]")  # fmt: skip
    p.add_argument("--batching", choices=["packed", "padded"], default="packed",
                   help="EAGLE-3: packed rows (training's), or one sample a padded row, length-sorted (before packing)")  # fmt: skip
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--ttt-attention", choices=["auto", *TTT_ATTENTIONS], default="auto",
                   help="EAGLE-3: the training-time test's attention (ttt.unroll; flex: GPU only); "
                        "auto: what train.ttt_attention auto picks (chunked-gqa on CUDA)")
    p.add_argument("--dflash-layers", type=int, help="DFlash draft layers (default 5; tiny 2)")
    p.add_argument("--block-size", type=int, help="DFlash block size (default 16; tiny 8)")
    p.add_argument("--anchors", type=int, help="DFlash anchors per sample (default 512; tiny 32)")
    p.add_argument("--dflash-labels", choices=["target", "soft"], default="target",
                   help="train.dflash.labels: the target's greedy token, or its whole distribution (soft: "
                        "the target's logits recomputed per chunk, the eager chunk passes)")
    p.add_argument("--draft-vocab", type=int, help="default 32000; tiny 256")
    p.add_argument("--workers", type=int, default=8, help="DataLoader worker processes")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="train.compile (auto: on CUDA)")
    p.add_argument("--data-dir", type=Path, help="where to write the store (default: a temp folder)")
    p.add_argument("--peak-tflops", type=float, help="bf16 dense peak for MFU (default: by device name)")
    p.add_argument("--profile", action="store_true", help="also print the top kernels of 2 steps to stderr")
    p.add_argument("--fused-ce", choices=["auto", "on", "off"], default="auto",
                   help="DFlash: the cross-entropy's per-chunk passes compiled (dflash_loss.FusedChunks); auto: when compiled, as training does")
    p.add_argument("--verify-reads", choices=["on", "off", "both"], default="on",
                   help="check each read's file checksum (training always does); both: side by side")  # fmt: skip
    a = p.parse_args(argv)
    t = a.tiny
    a.seq_len = a.seq_len or (128 if t else 2048)
    # DFlash: 512 blocks of 16 rows per 2048-token sample make a batch 4x as many rows as tokens
    a.batch_tokens = a.batch_tokens or (512 if t else 8192 if a.method == "dflash" else 16384)
    a.samples = a.samples or (16 if t else 48)
    a.steps = a.steps or (3 if t else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if t else 3)
    a.draft_vocab = a.draft_vocab or (256 if t else 32000)
    a.dflash_layers = a.dflash_layers or (2 if t else 5)
    a.block_size = a.block_size or (8 if t else 16)
    a.anchors = a.anchors or (32 if t else 512)
    if t:
        a.ttt_steps = min(a.ttt_steps, 3)
        a.workers = min(a.workers, 1)
    return a


def sample_lengths(n: int, T: int, mixed: bool) -> list[int]:
    """n samples of T tokens, or (mixed) uniform in [T/8, T] like conversations cut at max_seq_len."""
    if not mixed:
        return [T] * n
    return np.random.default_rng(0).integers(max(1, T // 8), T + 1, size=n).tolist()


def fabricate(root: Path, lengths: list[int], H: int, V: int, L: int = 4) -> tuple[Path, float]:
    """Samples of these lengths, random bf16 hidden [T, L, H], through the storage API. Returns (range dir, stored/raw)."""
    store = SampleStore(root / "store")
    n = len(lengths)

    def one(i: int):
        T = lengths[i]
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, V, (T,), generator=g).numpy()
        mask = (np.arange(T) >= T // 4).astype(np.uint8)
        hidden = torch.randn(T, L, H, generator=g).to(torch.bfloat16)
        key = sample_key("bench", ids)
        return store.put(key, encode_sample(ids, mask, hidden)).entry(f"bench-{i}", key)

    with ThreadPoolExecutor(16) as pool:
        entries = list(pool.map(one, range(n)))
    range_dir = root / "rows_0"
    write_range_index(range_dir, entries, {"settings_digest": "bench", "store_root": str(root / "store"),
                                           "num_layers_captured": L, "hidden_size": H})  # fmt: skip
    return range_dir, sum(e.nbytes for e in entries) / sum(e.raw_nbytes for e in entries)


def model_flops_per_token(cfg: Eagle3Config, ttt_steps: int, T: int) -> float:
    H, I, q, kv = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    )
    mid = 2 * H * q + 2 * (2 * H * kv) + q * H + 3 * H * I
    extra = (cfg.num_hidden_layers - 1) * (H * q + 2 * H * kv + q * H + 3 * H * I)
    per_step = mid + extra + H * cfg.draft_vocab_size
    matmul = 4 * len(cfg.aux_layer_ids) * H * H + 6 * ttt_steps * per_step
    attention = sum(12 * q * ((T + 1) / 2 + k) * cfg.num_hidden_layers for k in range(ttt_steps))
    return matmul + attention


def dflash_flops_per_token(cfg: DFlashConfig, T: int, anchors: int) -> float:
    """Model FLOPs per sample token of one DFlash step (see the module docstring)."""
    H, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim  # fmt: skip
    L, B, K = cfg.num_hidden_layers, cfg.block_size, len(cfg.target_layer_ids)
    n = min(anchors, T)  # anchors per sample (every loss position when fewer)
    layer = H * q + 2 * H * kv + q * H + 3 * H * I
    context = 4 * K * H * H + L * 6 * (2 * H * kv)  # fc (input needs no gradient), context K/V
    visible = (T - 1) / 2 + B  # mean context before a uniform anchor, plus the block
    rows = n * B * (L * 6 * layer + 12 * q * visible * L) + n * (B - 1) * 4 * H * cfg.vocab_size
    return context + rows / T


def build_dflash(a, shape: dict, device, dtype):
    ids = spread_target_layer_ids(shape["num_hidden_layers"], a.dflash_layers)
    cfg = DFlashConfig.from_target(shape, num_hidden_layers=a.dflash_layers, target_layer_ids=ids,
                                   block_size=a.block_size, mask_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    V, H = cfg.vocab_size, cfg.hidden_size
    head_weight = torch.randn(V, H, dtype=dtype) * 0.02
    drafter.set_target(torch.randn(V, H, dtype=dtype) * 0.02, head_weight)
    head = ArgmaxHead(head_weight, keep_final=a.dflash_labels == "soft").to(device)
    return cfg, drafter, head


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts(cuda: bool) -> dict:
    stats = torch.cuda.memory_stats() if cuda else {}
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}


def counts_since(before: dict, cuda: bool) -> dict:
    now = allocator_counts(cuda)
    return {k: now[k] - before[k] for k in ALLOCATOR_COUNTS}


def profile_steps(next_batch, step, sync, cuda: bool, label: str, steps: int = 2) -> dict:
    """`steps` training steps under torch.profiler (the first batch fetched before it starts):
    the top ops to stderr; wall and GPU kernel seconds per step (kernel time summed over the
    profile's device events: overlapping streams would count twice, the step uses one)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    batch = next_batch(0)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(batch)
            if i + 1 < steps:
                batch = next_batch(i + 1)
        sync()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    print(f"--- profile: {label} batches, {steps} steps", file=sys.stderr)
    print(averages.table(sort_by=key if cuda else "self_cpu_time_total", row_limit=30), file=sys.stderr)
    kernel_us = sum(getattr(e, key) for e in averages) if cuda else 0.0
    return {"wall_s_per_step": round(wall / steps, 4), "gpu_kernel_s_per_step": round(kernel_us / 1e6 / steps, 4)}


def main(argv=None) -> None:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = TINY if a.tiny else SHAPES[a.shape]
    dtype = torch.bfloat16 if cuda else torch.float32
    compiled = use_compile({"on": True, "off": False}.get(a.compile, "auto"), device)
    # soft labels run the eager chunk passes (DFlashObjective turns the fused ones off for them)
    fused_ce = (a.method == "dflash" and a.dflash_labels != "soft"
                and (compiled if a.fused_ce == "auto" else a.fused_ce == "on"))  # fmt: skip
    a.ttt_attention = ttt_attention(a.ttt_attention, device, compiled)  # the kernel the workflow would train with
    if a.method == "dflash":
        cfg, drafter, head = build_dflash(a, shape, device, dtype)
        aux_ids = tuple(cfg.target_layer_ids)
    else:
        aux_ids = (1, 15, 28) if shape is LLAMA_31_8B else tuple(default_aux_layer_ids(shape["num_hidden_layers"]))
        cfg = Eagle3Config.from_target(shape, draft_vocab_size=a.draft_vocab, aux_layer_ids=list(aux_ids),
                                       ttt_steps=a.ttt_steps)  # fmt: skip
    H, V = cfg.hidden_size, cfg.vocab_size

    root = Path(tempfile.mkdtemp(prefix="draftflow-train-bench-", dir=a.data_dir))
    try:
        t0 = time.perf_counter()
        lengths = sample_lengths(a.samples, a.seq_len, a.lengths == "mixed")
        range_dir, ratio = fabricate(root, lengths, H, V, L=len(aux_ids) + 1)
        fabricate_s = time.perf_counter() - t0

        if a.method == "dflash":
            drafter.to(device)
            dflash = {"num_hidden_layers": a.dflash_layers, "block_size": a.block_size, "mask_token_id": 0,
                      "anchors_per_sample": a.anchors}  # fmt: skip
            s = TrainSettings(aux_layer_ids=aux_ids, batch_tokens=a.batch_tokens, num_workers=a.workers,
                              method="dflash", dflash=dflash)  # fmt: skip
            objective = DFlashObjective(drafter, loss_decay(7.0), a.dflash_labels, compile=compiled, fused_ce=fused_ce)
        else:
            torch.manual_seed(0)
            drafter = Eagle3Drafter(cfg)
            drafter.embed_tokens.weight = torch.randn(V, H, dtype=dtype) * 0.02
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[torch.randperm(V)[: a.draft_vocab]] = True
            drafter.set_vocab(torch.nonzero(t2d)[:, 0] - torch.arange(a.draft_vocab), t2d)
            head = TargetHead(torch.randn(V, H, dtype=dtype) * 0.02, t2d).to(device)
            drafter.to(device)
            objective = TTTObjective(drafter, a.ttt_steps, 0.8, compile=compiled, attention=a.ttt_attention)
            s = TrainSettings(
                aux_layer_ids=aux_ids, ttt_steps=a.ttt_steps, batch_tokens=a.batch_tokens, num_workers=a.workers,
                batching=a.batching,
            )
        total = a.warmup + 2 * a.steps
        opt, sched = make_optimizer(drafter, s, total, fused=cuda)
        env = DistEnv(device=device)

        reader = HiddenStateReader([range_dir], verify=a.verify_reads != "off")
        packed = s.packs
        epochs = math.ceil((a.warmup + a.steps) / max(1, len(plan_micro_batches(reader.lengths, s, 0))))
        batches = [b for e in range(epochs + 1) for b in plan_micro_batches(reader.lengths, s, e)]
        loader = iter(make_loader(reader, batches, s, device, epoch=0))

        def sync():
            if cuda:
                torch.cuda.synchronize()

        def step(batch):
            return train_step(objective, head, [batch], opt, sched, env, s.grad_clip)

        # warm-up (allocator, kernels), then compute-only on device-resident batches
        resident = [next(loader).to(device) for _ in range(min(4, a.warmup + 1))]
        for i in range(a.warmup):
            step(resident[i % len(resident)])
        sync()
        alloc0 = allocator_counts(cuda)
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(a.steps):
            stats, _ = step(resident[i % len(resident)])
        sync()
        alloc_compute = counts_since(alloc0, cuda)
        compute_s = (time.perf_counter() - t0) / a.steps
        compute_cpu_share = (time.thread_time() - c0) / (compute_s * a.steps)
        resident_tokens = sum(b.tokens for b in resident) / len(resident)
        if cuda:
            torch.cuda.reset_peak_memory_stats()

        # end-to-end: from disk through the DataLoader
        def end_to_end(batch_iter) -> tuple[int, float, float, torch.Tensor]:
            nonlocal e2e_cpu_s, alloc_e2e
            blocked, tokens = 0.0, 0
            sync()
            alloc0 = allocator_counts(cuda)
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(a.steps):
                tb = time.perf_counter()
                batch = next(batch_iter).to(device)
                blocked += time.perf_counter() - tb
                tokens += batch.tokens
                stats, _ = step(batch)
            sync()
            e2e_cpu_s = time.thread_time() - c0
            alloc_e2e = counts_since(alloc0, cuda)
            return tokens, time.perf_counter() - t0, blocked, stats

        e2e_cpu_s, alloc_e2e = 0.0, {}

        verify_phases = {}
        if a.verify_reads == "both":
            for verify in (True, False, True, False):
                phase_reader = HiddenStateReader([range_dir], verify=verify)
                phase_iter = iter(make_loader(phase_reader, batches, s, device, packed=packed))
                step(next(phase_iter).to(device))  # untimed: worker start-up
                t, w, _, _ = end_to_end(phase_iter)
                verify_phases.setdefault(verify, []).append(t / w)
                del phase_iter
        tokens, wall, blocked, stats = end_to_end(loader)
        e2e_s = wall / a.steps
        loss = (stats[0] / stats[1].clamp(min=1)).sum().item()
        profiled = {}
        if a.profile:
            profiled["resident"] = profile_steps(lambda i: resident[i % len(resident)], step, sync, cuda, "resident")
            fresh = iter(make_loader(reader, batches, s, device, epoch=1))
            profiled["fresh"] = profile_steps(lambda i: next(fresh).to(device), step, sync, cuda, "fresh")
            del fresh
    finally:
        shutil.rmtree(root, ignore_errors=True)

    tokens_per_s = tokens / wall
    if a.method == "dflash":
        flops = dflash_flops_per_token(cfg, a.seq_len, a.anchors)
    else:
        # attention grows with the sample: the token-weighted mean length stands for T
        flops = model_flops_per_token(cfg, a.ttt_steps, sum(n * n for n in lengths) / sum(lengths))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = a.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    result = {
        "bench": "train_throughput",
        "device": name,
        "torch": torch.__version__,
        "shape": "tiny" if a.tiny else a.shape,
        "method": a.method, "dflash_labels": a.dflash_labels if a.method == "dflash" else None,
        "hidden_size": H, "target_vocab": V,
        **({"draft_layers": a.dflash_layers, "block_size": a.block_size, "anchors_per_sample": a.anchors,
            "target_layer_ids": list(aux_ids), "draft_vocab": V} if a.method == "dflash" else
           {"draft_vocab": a.draft_vocab, "ttt_steps": a.ttt_steps, "ttt_attention": a.ttt_attention}),
        "seq_len": a.seq_len, "lengths": a.lengths, "mean_length": round(float(np.mean(lengths)), 1),
        "batching": "packed" if packed else "padded", "batch_tokens": a.batch_tokens, "workers": a.workers,
        "compile": compiled, "fused_ce": fused_ce, "steps": a.steps,
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_s_compute_only": round(resident_tokens / compute_s, 1),
        "step_s": round(e2e_s, 4),
        "step_s_compute_only": round(compute_s, 4),
        "data_wait_share": round(max(0.0, 1 - compute_s / e2e_s), 4),
        "host_blocked_share": round(blocked / wall, 4),
        "thread_cpu_share_compute_only": round(compute_cpu_share, 4),
        "thread_cpu_share_end_to_end": round(e2e_cpu_s / wall, 4),
        **({"profile": profiled} if profiled else {}),
        # the caching allocator's slow paths per phase: a retry frees cached blocks (a device-wide
        # sync) and calls cudaMalloc again
        **({"allocator_compute_only": alloc_compute, "allocator_end_to_end": alloc_e2e} if cuda else {}),
        "model_flops_per_token": flops,
        "target_head_flops_per_token": 2 * H * V,
        "mfu": round(flops * tokens_per_s / (peak * 1e12), 4) if peak else None,
        "peak_tflops": peak,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "stored_over_raw": round(ratio, 3),
        "verify_reads": a.verify_reads,
        **({
            "tokens_per_s_verify": round(float(np.mean(verify_phases[True])), 1),
            "tokens_per_s_no_verify": round(float(np.mean(verify_phases[False])), 1),
            "verify_cost": round(1 - float(np.mean(verify_phases[True])) / float(np.mean(verify_phases[False])), 4),
        } if verify_phases else {}),
        "fabricate_s": round(fabricate_s, 1),
        "last_loss": round(loss, 4),
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
