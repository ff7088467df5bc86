#!/usr/bin/env python3
"""Training throughput of speculators 0.9's own EAGLE-3 trainer on draftflow's hidden states.

The other half of the H200 comparison (`bench/train_throughput.py` is ours): the same drafter
shape (one Llama decoder layer over a Llama-3.1-8B-shaped target: H 4096, 32 heads, 8 kv heads,
intermediate 14336, llama3 RoPE, target vocab 128256, draft vocab 32000), the same samples, the
same TTT steps (7) and the same tokens per optimizer step, trained by speculators itself:

* data: samples fabricated by `bench/train_throughput.py`'s own `fabricate` (same seeds, so the
  same bits: random bf16 hidden [T, 4, H], zstd byte planes through `draftflow.hidden_states.storage`), or any
  draftflow hidden-states folder (`--data`), exported with `draftflow.hidden_states.interop` (what `draftflow
  convert --from draftflow --to speculators` runs) into speculators' on-disk format: a
  `datasets.save_to_disk` folder (`input_ids`, `loss_mask`, `seq_len`) plus
  `hidden_states/hs_{i}.safetensors` (`token_ids` [T] int64, `hidden_states` [T, 4, H] bf16),
  read by speculators' `ArrowDataset` through `hs_connectors.FileTransfer`; the draft vocabulary
  goes beside it as `d2t-{N}.npy` (int64 offsets) / `t2d-{N}.npy` (bool), the names it looks for.
* model and loader: speculators' own CLI path: `TrainConfig.resolve` parses a `speculators
  train` command line, then `speculators.train.cli.parse_vocab_mappings`, `build_draft_model`
  (-> `Eagle3DraftModel.from_training_args`, weights of embed / LM head / final norm from the
  target folder), `create_train_val_loaders` (`MultipackDistributedBatchSamplerV2` packing to
  `--total-seq-len`, `CollateFn` + `shift_batch`, 12 spawn workers, prefetch 4).
* step: `speculators.train.trainer.Trainer.train_epoch`, unchanged: the forward (torch.compile,
  flex attention, fused Triton KL loss) under bf16 autocast, backward, grad clip, optimizer,
  LR scheduler. We wrap the loader only to time how long each step waits in next() and to count
  its tokens, and pass `step_callback` to stamp each step's end (the GPU is synchronized only
  where the timed window opens and closes).

Differences that are speculators' own and kept: its EAGLE-3 recipe adds an RMSNorm over the
concatenated aux states (norm_before_fc) and feeds back post-norm states (norm_output); its
draft LM head is FROZEN (rows of the target head; ours trains it: 4 instead of 6 FLOPs per
weight per token there, and no optimizer state), `--train-lm-head` unfreezes it for an
equal-work run. Its default optimizer is Muon; we run AdamW as ours does (`--optimizer muon`
for its default).

Printed: one JSON line {"trainer": "speculators", "tokens_per_s", "mfu", "host_blocked_share",
"ttt_steps", "batch_tokens", "steps", "versions", ...}. Tokens are sample tokens (as ours counts
them) of the timed steps after `--warmup` (the first holds compilation). MFU uses the FLOP count
of bench/train_throughput.py (the same drafter, so the MFU ratio is the tokens/s ratio).

    # H200 (bench/README.md has the whole sequence)
    PYTHONPATH=/tmp/site:. python3 bench/speculators_compare.py --samples 96
    # CPU check, seconds of work (a venv with speculators 0.9 and its dependencies)
    PYTHONPATH=. /tmp/specvenv/bin/python bench/speculators_compare.py --tiny
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

log = logging.getLogger("speculators_compare")

# As bench/train_throughput.py: LLAMA_31_8B / TINY (+ the layer count speculators reads)
SHAPES = {
    "llama8b": {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "num_hidden_layers": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "draft_vocab_size": 32000, "seq_len": 2048,
    },
    "tiny": {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 1024, "num_hidden_layers": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024,
        "rope_theta": 10000.0, "rope_scaling": None, "draft_vocab_size": 256, "seq_len": 128,
    },
}  # fmt: skip
AUX_LAYER_IDS = [1, 15, 28]  # draftflow numbering (output of decoder layer i from 0), as train_throughput
PEAK_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0}  # dense, SXM (as train_throughput)


# ---------------------------------------------------------------- data


def fabricate_target(target_dir: Path, shape: dict, seed: int, device: str) -> None:
    """A Llama-shaped target folder with what either trainer reads of it: config.json and the
    embedding, LM head and final norm (random; model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    if (target_dir / "config.json").is_file() and (target_dir / "model.safetensors").is_file():
        return
    target_dir.mkdir(parents=True, exist_ok=True)
    V, H = shape["vocab_size"], shape["hidden_size"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": shape["intermediate_size"],
        "num_attention_heads": shape["num_attention_heads"], "num_key_value_heads": shape["num_key_value_heads"],
        "head_dim": H // shape["num_attention_heads"], "num_hidden_layers": shape["num_hidden_layers"],
        "vocab_size": V, "max_position_embeddings": shape["max_position_embeddings"],
        "rms_norm_eps": shape["rms_norm_eps"], "rope_theta": shape["rope_theta"], "rope_scaling": shape["rope_scaling"],
        "initializer_range": 0.02, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    }  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {
        "model.embed_tokens.weight": randn(V, H),
        "lm_head.weight": randn(V, H),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
    }
    save_file(tensors, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    (target_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def fabricate_vocab(vocab_path: Path, shape: dict, seed: int) -> None:
    """A draft vocabulary (draftflow's safetensors format) from Zipf-like token counts."""
    import numpy as np

    from draftflow.drafters.vocab import save_vocab, select_draft_vocab

    if vocab_path.is_file():
        return
    counts = np.random.default_rng(seed).zipf(1.3, size=shape["vocab_size"]).astype(np.int64)
    save_vocab(select_draft_vocab(counts, shape["draft_vocab_size"]), vocab_path)


def _ours_fabricate():
    """`fabricate(root, lengths, H, V)` of bench/train_throughput.py: the samples ours trains on."""
    path = Path(__file__).with_name("train_throughput.py")
    spec = importlib.util.spec_from_file_location("_draftflow_train_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fabricate


def fabricate_samples(data_dir: Path, n: int, shape: dict) -> str:
    """n samples of seq_len tokens in data_dir (store + rows_0/index.json), made by ours' recipe."""
    from draftflow.hidden_states.storage import find_range_dirs

    if find_range_dirs(data_dir):
        return "existing"
    data_dir.mkdir(parents=True, exist_ok=True)
    _ours_fabricate()(data_dir, [shape["seq_len"]] * n, shape["hidden_size"], shape["vocab_size"])
    return "bench/train_throughput.py:fabricate"


def export_speculators(data_dir: Path, vocab_path: Path, spec_dir: Path, workers: int) -> int:
    """draftflow -> speculators with draftflow.hidden_states.interop (as `draftflow convert` does), and the vocab as .npy."""
    import numpy as np

    from draftflow.hidden_states.interop import SIDECAR, ConvertOptions, convert
    from draftflow.hidden_states.storage import find_range_dirs, sample_lengths
    from draftflow.drafters.vocab import load_vocab

    n = sample_lengths(find_range_dirs(data_dir))["total_samples"]
    sidecar = spec_dir / SIDECAR
    if not (sidecar.is_file() and len(json.loads(sidecar.read_text())["samples"]) == n):
        if spec_dir.exists():
            shutil.rmtree(spec_dir)
        # --copy-final: the final state's bits go over unchanged (random data: no final norm to undo)
        convert("draftflow", "speculators", data_dir, spec_dir, ConvertOptions(copy_final=True, workers=workers))
    vocab = load_vocab(vocab_path)
    np.save(spec_dir / f"d2t-{vocab.size}.npy", vocab.d2t.astype(np.int64))
    np.save(spec_dir / f"t2d-{vocab.size}.npy", vocab.t2d.astype(bool))
    return n


# ---------------------------------------------------------------- timing hooks


class StepClock:
    """Step-end stamps. The GPU is synchronized only where the timed window opens and closes
    (after step `warmup` and the last step), so that speculators' loop keeps its own overlap of
    host work with the GPU queue, as ours does in bench/train_throughput.py."""

    def __init__(self, sync, sync_at: set[int]):
        self.sync = sync
        self.sync_at = sync_at  # 1-based step counts after which to synchronize
        self.data_wait: list[float] = []
        self.tokens: list[int] = []
        self.ends: list[float] = []
        self.t0 = 0.0

    def start(self) -> None:
        self.sync()
        self.t0 = time.perf_counter()

    def step_done(self) -> None:  # Trainer.train_epoch's step_callback: after optimizer + scheduler step
        if len(self.ends) + 1 in self.sync_at:
            self.sync()
        self.ends.append(time.perf_counter())


class TimedLoader:
    """Stands in for the trainer's DataLoader (what train_epoch reads of it: len, batch_sampler,
    iteration); records each step's wall time blocked in next() and its sample tokens."""

    def __init__(self, loader, clock: StepClock):
        self.loader = loader
        self.clock = clock

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    def __iter__(self):
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.clock.data_wait.append(time.perf_counter() - t0)
            docs = batch["document_ids"]  # [1, total_seq_len], -1 = padding
            # trained positions + the first token of each sample, which shift_batch drops
            self.clock.tokens.append(int((docs != -1).sum()) + int(docs.max()) + 1)
            yield batch


# ---------------------------------------------------------------- speculators


def model_flops_per_token(shape: dict, ttt_steps: int, T: int) -> float:
    """bench/train_throughput.py's count for the same one-layer drafter: 6 x matmul params per
    token per TTT step (q/k/v/o, MLP, LM head), fc once (4x), causal attention attended."""
    H, I = shape["hidden_size"], shape["intermediate_size"]
    d = H // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    per_step = 2 * H * q + 2 * (2 * H * kv) + q * H + 3 * H * I + H * shape["draft_vocab_size"]
    matmul = 4 * len(AUX_LAYER_IDS) * H * H + 6 * ttt_steps * per_step
    attention = sum(12 * q * ((T + 1) / 2 + k) for k in range(ttt_steps))
    return matmul + attention


def default_train_ratio(n: int, per_step: int) -> float:
    """speculators holds out (1 - ratio) for validation (ratio < 1); keep a whole number of full
    batches for training, so that its packer fills every step as ours does."""
    k = ((n - 1) // per_step) * per_step or n - 1
    return (k + 0.5) / n


def speculators_argv(a, spec_dir: Path, target_dir: Path, save_dir: Path, shape: dict, steps: int) -> list[str]:
    """The `speculators train` command line of this run."""
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(target_dir),
        "--data-path", str(spec_dir),
        "--save-path", str(save_dir),
        "--log-dir", str(save_dir / "logs"),
        "--draft-vocab-size", str(shape["draft_vocab_size"]),
        "--num-layers", "1",
        # the same aux layers as ours, in speculators' numbering (hidden_states tuple: 0 = embeddings)
        "--target-layer-ids", *[str(i + 1) for i in AUX_LAYER_IDS],
        # full causal attention within each sample, as ours (speculators defaults to a 2048 sliding window)
        "--full-attention-indices", "0",
        "--ttt-steps", str(a.ttt_steps),
        "--total-seq-len", str(a.batch_tokens),
        "--num-workers", str(a.num_workers),
        "--prefetch-factor", str(a.prefetch_factor),
        "--train-data-ratio", str(a.train_data_ratio),
        "--on-missing", "raise",  # every sample is on disk: never ask a vLLM server
        "--mask-token-id", "0",  # unused by EAGLE-3; given so that no tokenizer is looked for
        "--optimizer", a.optimizer,
        "--lr", "1e-4",
        "--epochs", "1000",
        "--max-steps", str(steps),
        "--log-freq", str(10**9),  # its per-phase profiler synchronizes 6x a step: step 0 only
        "--no-resume-from-checkpoint",
        "--seed", str(a.seed),
    ]  # fmt: skip
    if a.attn_impl:
        argv += ["--draft-attn-impl", a.attn_impl]
    if a.loss_implementation:
        argv += ["--loss-implementation", a.loss_implementation]
    return argv


def unshare_fused_loss_autotuner() -> None:
    """Give speculators' fused loss backward kernel its own autotuner config list.

    speculators 0.9 decorates its forward and backward loss kernels with one
    `triton.autotune(...)` object, so both Autotuners hold the same `configs` list. Under
    torch 2.11's dynamo the compiled step then fails ("ListVariable ... is already tracked
    for mutation"). A fresh autotuner with equal configs, key and pruning changes nothing else.
    """
    import triton
    from speculators.losses import fused

    fused.loss_backward_kernel = triton.autotune(
        configs=fused._tile_configs(),
        key=["n_cols", "OP"],
        prune_configs_by={"early_config_prune": fused._prune_oversized_tiles},
    )(fused.loss_backward_kernel.fn)


def run_speculators(a, spec_dir: Path, target_dir: Path, work: Path, shape: dict) -> dict:
    import torch

    os.environ.setdefault("TQDM_DISABLE", "1")  # its tqdm.rich bar: kept out of logs and timings
    import speculators.train.distributed as spec_dist
    import speculators.train.trainer as spec_trainer
    from hs_connectors import HiddenStatesBackend
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.trainer import Trainer, TrainerConfig

    cuda = torch.cuda.is_available()
    if not cuda:
        # CPU check only (--tiny): its Trainer moves the model to device index `local_rank`,
        # autocasts on "cuda" and profiles step 0 with torch.accelerator synchronizes.
        spec_dist._local_rank = torch.device("cpu")
        reset = spec_trainer._StepTimer.reset
        spec_trainer._StepTimer.reset = lambda self, enabled: reset(self, False)

    if cuda and a.loss_implementation in (None, "fused"):
        unshare_fused_loss_autotuner()

    steps = a.warmup + a.steps
    save_dir = work / "speculators_run"
    shutil.rmtree(save_dir, ignore_errors=True)
    argv = speculators_argv(a, spec_dir, target_dir, save_dir, shape, steps)
    cfg = TrainConfig.resolve(argv)
    args = argparse.Namespace(**cfg.flatten())

    # speculators.train.cli.main up to Trainer(...), minus metric loggers and run.yaml
    set_seed(args.seed, args.deterministic_cuda)
    hidden_states_dtype = getattr(torch, args.hidden_states_dtype)
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
    if draft_vocab_size != shape["draft_vocab_size"]:
        raise SystemExit(f"speculators found a draft vocab of {draft_vocab_size}, expected {shape['draft_vocab_size']}")
    model_class = SpeculatorModel.registry[args.speculator_type]
    draft_model = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    if a.train_lm_head:
        draft_model.lm_head.weight.requires_grad_(True)
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    train_loader, _val_loader = create_train_val_loaders(
        data_path=args.data_path,
        total_seq_len=args.total_seq_len,
        hidden_states_dtype=hidden_states_dtype,
        transfer=transfer,
        vllm_endpoint=args.vllm_endpoint,
        on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path,
        request_timeout=args.request_timeout,
        max_retries=args.max_retries,
        generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=draft_model.config.transformer_layer_config.hidden_size,
        num_target_layers=len(draft_model.target_layer_ids),
        num_workers=args.num_workers,
        prefetch_factor=args.prefetch_factor,
        preprocess=shift_batch,
        train_data_ratio=args.train_data_ratio,
        seed=args.seed,
    )
    train_kwargs, val_kwargs = model_class.get_trainer_kwargs(**vars(args))
    trainer_config = TrainerConfig(
        num_epochs=args.epochs, save_path=args.save_path, lr=args.lr, resume_from_checkpoint=False,
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, optimizer=args.optimizer,
        weight_decay=args.weight_decay, muon_lr=args.muon_lr, muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay, muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn, scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps, scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps, scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
        checkpoint_freq=args.checkpoint_freq, save_best=args.save_best, hidden_states_dtype=hidden_states_dtype,
        log_freq=args.log_freq, fsdp_shard=args.fsdp_shard, gradient_checkpointing=args.gradient_checkpointing,
        max_steps=args.max_steps,
    )  # fmt: skip
    trainer = Trainer(draft_model, trainer_config, train_loader, None)
    if not cuda:
        trainer.device_type = "cpu"
    trainable = sum(p.numel() for p in draft_model.parameters() if p.requires_grad)

    # timed training: Trainer.train_epoch, epoch after epoch, until max_steps
    clock = StepClock(torch.cuda.synchronize if cuda else (lambda: None), sync_at={1, a.warmup, steps})
    trainer.train_loader = TimedLoader(train_loader, clock)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise SystemExit("speculators packed no training batch: more samples are needed")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock.start()
    epoch = 0
    while trainer.global_step < steps:
        trainer.train_epoch(epoch, step_callback=clock.step_done)
        epoch += 1
    n = len(clock.ends)
    if n <= a.warmup:
        raise SystemExit(f"only {n} steps ran; need more than --warmup {a.warmup}")
    t_start = clock.ends[a.warmup - 1] if a.warmup else clock.t0
    wall = clock.ends[-1] - t_start
    tokens = sum(clock.tokens[a.warmup : n])
    blocked = sum(clock.data_wait[a.warmup : n])
    tokens_per_s = tokens / wall
    flops = model_flops_per_token(shape, a.ttt_steps, shape["seq_len"])
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = a.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return {
        "trainer": "speculators",
        "device": name,
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(flops * tokens_per_s / (peak * 1e12), 4) if peak else None,
        "host_blocked_share": round(blocked / wall, 4),
        "step_s": round(wall / (n - a.warmup), 4),
        "ttt_steps": a.ttt_steps,
        "batch_tokens": a.batch_tokens,
        "tokens_per_step": round(tokens / (n - a.warmup), 1),
        "seq_len": shape["seq_len"],
        "steps": n - a.warmup,
        "warmup_steps": a.warmup,
        "first_step_s": round(clock.ends[0] - clock.t0, 2),
        "epochs_touched": epoch,
        "steps_per_epoch": steps_per_epoch,
        "model_flops_per_token": flops,
        "peak_tflops": peak,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "trainable_params": trainable,
        "lm_head_trained": bool(draft_model.lm_head.weight.requires_grad),
        "settings": {
            "attn_impl": args.draft_attn_impl, "loss_fn": args.loss_fn, "loss_implementation": args.loss_implementation,
            "optimizer": args.optimizer, "num_workers": args.num_workers, "prefetch_factor": args.prefetch_factor,
            "norm_before_fc": args.norm_before_fc, "norm_output": args.norm_output,
            "train_data_ratio": args.train_data_ratio, "hidden_states_dtype": args.hidden_states_dtype,
        },  # fmt: skip
        "speculators_argv": argv,
        "versions": versions(),
    }


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("speculators", "hs-connectors", "torch", "transformers", "triton", "datasets", "pyarrow", "pydantic"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU: a check in seconds of work")
    p.add_argument("--root", type=Path, help="bench folder (default /tmp/draftflow-bench; a temp folder with --tiny)")
    p.add_argument("--data", type=Path, help="draftflow hidden states (rows_*/index.json); default ROOT/hidden_states, fabricated if empty")
    p.add_argument("--target", type=Path, help="target folder (config.json + safetensors); default ROOT/target, fabricated if missing")
    p.add_argument("--vocab", type=Path, help="draftflow draft vocab; default ROOT/vocab.safetensors, fabricated if missing")
    p.add_argument("--samples", type=int, help="samples to fabricate (default 96; tiny 24)")
    p.add_argument("--prepare-only", action="store_true", help="fabricate and export, then stop")
    p.add_argument("--steps", type=int, help="timed steps (default 30; tiny 3)")
    p.add_argument("--warmup", type=int, help="untimed steps first, compilation included (default 5; tiny 1)")
    p.add_argument("--ttt-steps", type=int, help="default 7; tiny 3")
    p.add_argument("--batch-tokens", type=int, help="tokens per step, speculators --total-seq-len (default 16384 as ours; tiny 512)")
    p.add_argument("--num-workers", type=int, help="speculators DataLoader workers (default 12, its default; tiny 0)")
    p.add_argument("--prefetch-factor", type=int, default=4)
    p.add_argument("--train-data-ratio", type=float, help="speculators' train share (default: whole full batches)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="adamw as ours (speculators' default: muon)")
    p.add_argument("--train-lm-head", action="store_true", help="unfreeze speculators' draft LM head (ours trains it)")
    p.add_argument("--attn-impl", choices=["simple_flex_attention", "sdpa", "eager"], help="default: speculators' (flex) on GPU, sdpa on CPU")
    p.add_argument("--loss-implementation", choices=["fused", "eager"], help="default: speculators' fused Triton on GPU, eager on CPU")
    p.add_argument("--peak-tflops", type=float, help="bf16 dense peak for MFU (default: by device name)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="export threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="also write the JSON line here")
    a = p.parse_args(argv)
    t = a.tiny
    a.samples = a.samples or (24 if t else 96)
    a.steps = a.steps or (3 if t else 30)
    a.warmup = a.warmup if a.warmup is not None else (1 if t else 5)
    a.ttt_steps = a.ttt_steps or (3 if t else 7)
    a.batch_tokens = a.batch_tokens or (512 if t else 16384)
    a.num_workers = a.num_workers if a.num_workers is not None else (0 if t else 12)
    return a


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    a = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    shape = SHAPES["tiny" if a.tiny else "llama8b"]
    if a.root is None:
        import tempfile

        a.root = Path(tempfile.mkdtemp(prefix="speculators-compare-")) if a.tiny else Path("/tmp/draftflow-bench")
    data_dir = a.data or a.root / "hidden_states"
    target_dir = a.target or a.root / "target"
    vocab_path = a.vocab or a.root / "vocab.safetensors"
    spec_dir = a.root / "speculators"
    a.attn_impl = a.attn_impl or (None if cuda else "sdpa")  # flex attention on CPU needs a C++ toolchain
    a.loss_implementation = a.loss_implementation or (None if cuda else "eager")  # fused = Triton = GPU

    t0 = time.perf_counter()
    fabricate_target(target_dir, shape, a.seed, "cuda" if cuda else "cpu")
    fabricate_vocab(vocab_path, shape, a.seed)
    source = fabricate_samples(data_dir, a.samples, shape)
    t1 = time.perf_counter()
    n = export_speculators(data_dir, vocab_path, spec_dir, a.workers)
    t2 = time.perf_counter()
    log.info("data: %s (%.1f s); %d samples exported to %s (%.1f s)", source, t1 - t0, n, spec_dir, t2 - t1)
    if a.prepare_only:
        return 0
    if a.train_data_ratio is None:
        a.train_data_ratio = default_train_ratio(n, max(1, a.batch_tokens // shape["seq_len"]))

    result = run_speculators(a, spec_dir, target_dir, a.root, shape)
    result.update(samples=n, data=source, prepare_s=round(t2 - t0, 1))
    line = json.dumps(result)
    print(line, flush=True)
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
