"""`draftflow train`: train a drafter on extracted hidden states: EAGLE-3 (DESIGN.md §3) or
DFlash (`draftflow.drafters.dflash`), chosen by the settings' `method`.

Runs as a plain process (one CPU or GPU) or under torchrun (DDP; FSDP optional), gloo on CPU.

Data: samples are read by `storage.HiddenStateReader` in DataLoader workers. Micro-batches
of about `batch_tokens` tokens are planned from the index lengths only, deterministically per
(seed, epoch): EAGLE-3 packs shuffled samples into rows (`packing`), DFlash pads one sample per
row (samples sorted by length within windows, so padding stays small). One optimizer step consumes world_size × grad_accum
micro-batches; rank r takes its `grad_accum` of them, so the global batch does not depend on
how it is spread over processes, and the loss is normalized by the global loss-token count
(one tiny all-reduce per step) so that DDP equals single-process training on that batch.

State: checkpoints (model, optimizer, scheduler, data position, RNG) live in
`--state-dir/run-<fingerprint>/`, outside the rule's outputs: a killed run resumes from the
latest checkpoint, while a run with other settings or data starts afresh in its own folder.

Methods: both read the same range folders through the same reader; each selects the stored aux
layers it needs by id (a range may store more), so one extraction serves both. EAGLE-3 runs the
training-time test (`ttt`); DFlash trains anchored blocks (`dflash_loss`), whose anchors the data
loader draws (seeded by the batch's content, the seed and the epoch: a resume redraws them).

Output (`--output DIR`): config.json + model.safetensors (the SGLang layout, no embedding),
metrics.jsonl (one row per logged step and per evaluation) and eval.json (final held-out
evaluation with the simulated acceptance length).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from draftflow.config import OPERATIONAL_KEYS, TRAIN_KEYS_ADDED_LATER
from draftflow.drafters.batching import AnchorPlan, Batch, SampleDataset, collate_rows, reader_layers
from draftflow.drafters.checkpoint import load_target_tensors, save_drafter, target_config
from draftflow.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashSettings, loss_decay
from draftflow.drafters.eagle3 import VARIANT_FLAGS, Eagle3Config, Eagle3Drafter
from draftflow.drafters.losses import LOSSES
from draftflow.drafters.packing import Rows, batch_shape, plan_packed
from draftflow.errors import DraftflowError, reject_unknown_keys
from draftflow.gpu import warn_if_gpus_idle
from draftflow.jsonl import atomic_path, fsync_dir, read_json, write_json
from draftflow.progress import Progress as ProgressLog
from draftflow.threads import default_threads, split_threads
from draftflow.drafters.ttt import STAT_ROWS, TTT_ATTENTIONS, TargetHead, TTTObjective, summarize
from draftflow.drafters.vocab import DraftVocab, load_vocab

log = logging.getLogger(__name__)

# Settings that change how a run reports, not what it computes: left out of the fingerprint
# (and of the rule's rerun-triggering params: draftflow.config.OPERATIONAL_KEYS["train"]).
OPERATIONAL = OPERATIONAL_KEYS["train"]
# How the global batch is spread over processes: the fingerprint keeps only their product
# (micro-batches per optimizer step), so a checkpoint resumes on another number of GPUs.
PLACEMENT = {"gpus", "nodes", "grad_accum", "fsdp"}
METHODS = ("eagle3", "dflash")


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class TrainSettings:
    """config `train` (config.schema.yaml) plus `aux_layer_ids` (and `grad_accum`)."""

    aux_layer_ids: tuple[int, ...]
    gpus: int = 0
    nodes: int = 1
    num_hidden_layers: int = 1
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    step_weight_decay: float = 0.8
    loss: str = "soft_ce"  # a name of drafters.losses.LOSSES
    # the temperature of the target distribution the loss matches (ttt.TargetHead); 0: its argmax alone
    target_temperature: float = 1.0
    # keep the draft LM head at the target's rows (speculators' recipe) instead of training it
    freeze_lm_head: bool = False
    # the draft LM head's learning rate as a share of learning_rate: between the frozen head (0,
    # freeze_lm_head) and one trained like the rest (1), for a head that overfits small data
    lm_head_lr_scale: float = 1.0
    # speculators' EAGLE-3 recipe norms (drafters.eagle3.VARIANT_FLAGS); all off = SGLang's layout
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = True  # the schema's default (BENCHMARKS.md "The embedded default itself")
    # EAGLE-3's micro-batches: packed rows (packing.plan_packed), or padded: one sample a row in
    # length-sorted windows, the recipe before packing, kept to measure packing against
    batching: str = "packed"
    epochs: float = 1.0
    batch_tokens: int = 8192
    learning_rate: float = 1e-4
    adam_beta2: float = 0.999
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    warmup_ratio: float = 0.02
    schedule: str = "cosine"
    grad_clip: float = 0.5
    seed: int = 0
    num_workers: int = 2
    eval_every_steps: int = 0
    save_every_steps: int = 200
    log_every_steps: int = 10
    fsdp: bool = False
    compile: bool | str = "auto"  # torch.compile norms, MLPs and the loss: "auto" = on CUDA only
    ttt_attention: str = "auto"  # EAGLE-3's TTT attention kernel (speed only): auto or ttt.TTT_ATTENTIONS
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    on_bad_sample: str = "fail"  # a missing or damaged stored sample: stop (fail) or leave it out and count (skip)
    method: str = "eagle3"  # eagle3 | dflash
    dflash: dict | None = None  # config `train.dflash` (method dflash)

    @classmethod
    def from_dict(cls, settings: dict) -> "TrainSettings":
        known = {f.name: f for f in dataclasses.fields(cls)}
        reject_unknown_keys(settings, known, "train --settings")
        if "aux_layer_ids" not in settings:
            raise DraftflowError("train --settings: 'aux_layer_ids' is required (the extracted aux layers, in order)")
        values = dict(settings, aux_layer_ids=tuple(int(i) for i in settings["aux_layer_ids"]))
        if values.get("method", "eagle3") not in METHODS:
            raise DraftflowError(f"train --settings: 'method' must be one of {list(METHODS)}, got {values['method']!r}")
        s = cls(**values)
        if s.method == "dflash":
            DFlashSettings.from_dict(s.dflash)  # refuses unknown or invalid keys now, not mid-run
            eagle_keys = (*VARIANT_FLAGS, "loss", "batching", "target_temperature", "freeze_lm_head", "lm_head_lr_scale")
            eagle_only = [k for k in eagle_keys if getattr(s, k) != known[k].default]
            if eagle_only:
                raise DraftflowError(
                    f"train --settings: {', '.join(eagle_only)} apply to EAGLE-3 only; DFlash trains with "
                    "cross-entropy against the target as train.dflash.labels says: leave them at their defaults"
                )
        if list(s.aux_layer_ids) != sorted(set(s.aux_layer_ids)):
            raise DraftflowError(
                f"train --settings: 'aux_layer_ids' {list(s.aux_layer_ids)} must be strictly increasing: "
                "serving engines concatenate captured layers in layer order"
            )
        if s.compile not in ("auto", True, False):
            raise DraftflowError(f"train --settings: 'compile' must be auto, true or false, got {s.compile!r}")
        if s.ttt_attention not in ("auto", *TTT_ATTENTIONS):
            raise DraftflowError(
                f"train --settings: 'ttt_attention' must be auto or one of {', '.join(TTT_ATTENTIONS)}, "
                f"got {s.ttt_attention!r}"
            )
        if s.loss not in LOSSES:
            raise DraftflowError(f"train --settings: 'loss' must be one of {', '.join(LOSSES)}, got {s.loss!r}")
        if s.on_bad_sample not in ("fail", "skip"):
            raise DraftflowError(f"train --settings: 'on_bad_sample' must be fail or skip, got {s.on_bad_sample!r}")
        if s.batching not in ("packed", "padded"):
            raise DraftflowError(f"train --settings: 'batching' must be packed or padded, got {s.batching!r}")
        if s.schedule not in ("cosine", "linear", "constant"):
            raise DraftflowError(f"train --settings: 'schedule' must be cosine, linear or constant, got {s.schedule!r}")
        for name in ("ttt_steps", "batch_tokens", "grad_accum", "num_hidden_layers", "log_every_steps"):
            if getattr(s, name) < 1:
                raise DraftflowError(f"train --settings: '{name}' must be >= 1")
        if s.epochs <= 0:
            raise DraftflowError("train --settings: 'epochs' must be > 0")
        if s.target_temperature < 0:
            raise DraftflowError(
                f"train --settings: 'target_temperature' must be >= 0 (0: the target's argmax), got {s.target_temperature}"
            )
        if s.lm_head_lr_scale <= 0:
            raise DraftflowError(
                f"train --settings: 'lm_head_lr_scale' must be > 0, got {s.lm_head_lr_scale}; "
                "to keep the head at the target's rows set freeze_lm_head: true"
            )
        if s.freeze_lm_head and s.lm_head_lr_scale != 1.0:
            raise DraftflowError(
                "train --settings: freeze_lm_head and lm_head_lr_scale both set: a frozen head has no learning "
                "rate; leave lm_head_lr_scale at 1"
            )
        return s

    def fingerprint_dict(self) -> dict:
        # batching: in run_fingerprint's own key, where it was before it could be set
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in OPERATIONAL | PLACEMENT | {"batching"}}
        if self.method == "eagle3":  # as before methods existed: EAGLE-3 resume state stays valid
            out.pop("method"), out.pop("dflash")
        for key, default in TRAIN_KEYS_ADDED_LATER.items():  # at their defaults: resume state as before
            if out[key] == default:
                out.pop(key)
        return out

    @property
    def dflash_settings(self) -> DFlashSettings:
        return DFlashSettings.from_dict(self.dflash)

    @property
    def packs(self) -> bool:
        """Micro-batch rows hold several samples (EAGLE-3 unless `batching: padded`)."""
        return self.method == "eagle3" and self.batching == "packed"

    @property
    def stat_steps(self) -> int:
        """Columns of the training statistics: TTT steps, or the drafting rows of a DFlash block."""
        return self.dflash_settings.block_size - 1 if self.method == "dflash" else self.ttt_steps

    @property
    def loss_decay(self) -> float:
        """Weight ratio of consecutive steps / block rows in the loss (for `ttt.summarize`)."""
        return loss_decay(self.dflash_settings.loss_decay_gamma) if self.method == "dflash" else self.step_weight_decay


# ---------------------------------------------------------------- data
# (Batch, collate and the DataLoader's dataset: `batching`; packed rows: `packing`)


def plan_batches(
    lengths: np.ndarray, batch_tokens: int, seed: int, epoch: int, shuffle: bool = True
) -> list[list[int]]:
    """Pack sample indices into micro-batches of at most `batch_tokens` padded tokens.

    Deterministic in (lengths, batch_tokens, seed, epoch). Samples are shuffled, sorted by length
    inside windows of 1024 (little padding, still random), packed greedily, and the batch order
    is shuffled. A sample longer than `batch_tokens` gets a batch of its own.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    batches: list[list[int]] = []
    window = 1024
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        current: list[int] = []
        longest = 0
        for i in chunk.tolist():
            longest_if = max(longest, int(lengths[i]))
            if current and longest_if * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current, longest_if = [], int(lengths[i])
            current.append(i)
            longest = longest_if
        if current:
            batches.append(current)
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


@dataclass
class EpochPlan:
    epoch: int
    batches: list[Rows]  # all micro-batches of the epoch, global order
    steps: int  # optimizer steps taken in this epoch

    def rank_batches(self, step: int, rank: int, world_size: int, grad_accum: int) -> list[Rows]:
        """This rank's micro-batches of the epoch's `step`-th optimizer step."""
        group = world_size * grad_accum
        start = step * group + rank * grad_accum
        return self.batches[start : start + grad_accum]


def plan_padded(lengths: np.ndarray, s: TrainSettings, epoch: int, shuffle: bool = True) -> list[Rows]:
    """`plan_batches` as rows: one sample per row (DFlash; EAGLE-3 before packing)."""
    return [[[i] for i in batch] for batch in plan_batches(lengths, s.batch_tokens, s.seed, epoch, shuffle)]


def plan_micro_batches(lengths: np.ndarray, s: TrainSettings, epoch: int, shuffle: bool = True) -> list[Rows]:
    """The method's micro-batches, each as its rows of sample indices: EAGLE-3 packs samples into
    rows (`packing.plan_packed`) unless `batching` is padded; DFlash has one sample per row
    (`plan_padded`)."""
    if not s.packs:
        return plan_padded(lengths, s, epoch, shuffle)
    return plan_packed(lengths, s.batch_tokens, s.seed, epoch, shuffle)


def samples_of(batch: Rows) -> list[int]:
    """A micro-batch's sample indices, row by row."""
    return [i for row in batch for i in row]


def plan_epochs(lengths: np.ndarray, s: TrainSettings, world_size: int) -> list[EpochPlan]:
    """Every epoch's plan; a fractional last epoch takes that share of its steps."""
    group = world_size * s.grad_accum
    plans = []
    for e in range(math.ceil(s.epochs)):
        batches = plan_micro_batches(lengths, s, e)
        steps = len(batches) // group
        if steps == 0:
            raise DraftflowError(
                f"only {len(batches)} micro-batches of {s.batch_tokens} tokens for {world_size} process(es) × "
                f"grad_accum {s.grad_accum}: add training data or lower train.batch_tokens"
            )
        frac = s.epochs - e
        if frac < 1:
            steps = max(1, round(frac * steps))
        plans.append(EpochPlan(e, batches, steps))
    return plans


def make_loader(
    reader, batch_lists: list[Rows], s: TrainSettings, device: torch.device,
    layers: Sequence[int] | None = None, epoch: int | None = None, packed: bool | None = None,
):  # fmt: skip
    """DataLoader over fixed micro-batches: worker processes decode, the main process pins.
    layers: the stored aux layers to read (`reader_layers`); epoch: of training (None: evaluation);
    packed: rows of several samples with `doc` ids (default: `s.packs`)."""
    from functools import partial

    workers = s.num_workers
    anchors = None
    if s.method == "dflash":
        d = s.dflash_settings
        anchors = AnchorPlan(d.block_size, d.anchors_per_sample, s.seed, epoch)
    packed = s.packs if packed is None else packed
    keyed = [[(r, i) for r, row in enumerate(rows) for i in row] for rows in batch_lists]
    return torch.utils.data.DataLoader(
        SampleDataset(reader),
        batch_sampler=keyed,
        collate_fn=partial(
            collate_rows, shape=batch_shape(reader.lengths, s.batch_tokens) if packed else None,
            ttt_steps=s.ttt_steps, sample_shape=reader.sample_shape, layers=layers, anchors=anchors,
        ),  # fmt: skip
        num_workers=workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
    )


# ---------------------------------------------------------------- fresh drafters
# (drafter folders and the target's tensors: `checkpoint`)


def build_drafter(
    s: TrainSettings, target_dir: Path, vocab: DraftVocab, embed_dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Drafter, TargetHead, Eagle3Config]:
    """A fresh drafter (seeded) with the target's frozen embedding, plus the target's LM head."""
    from draftflow.target import target_identity

    tcfg = target_config(target_dir)
    cfg = Eagle3Config.from_target(
        tcfg, draft_vocab_size=vocab.size, aux_layer_ids=list(s.aux_layer_ids), num_hidden_layers=s.num_hidden_layers,
        ttt_steps=s.ttt_steps, target=target_identity(target_dir), target_path=str(Path(target_dir).resolve()),
    )  # fmt: skip
    cfg = dataclasses.replace(cfg, **{k: getattr(s, k) for k in VARIANT_FLAGS})
    if vocab.t2d.shape[0] != cfg.vocab_size:
        raise DraftflowError(
            f"draft vocabulary covers {vocab.t2d.shape[0]} target ids, the target has {cfg.vocab_size}"
        )
    if vocab.size != min(s.draft_vocab_size, cfg.vocab_size):
        raise DraftflowError(
            f"the draft vocabulary file has {vocab.size} tokens but train.draft_vocab_size is {s.draft_vocab_size}; "
            "rebuild it with `draftflow vocab`"
        )
    torch.manual_seed(s.seed)
    drafter = Eagle3Drafter(cfg)
    tensors = load_target_tensors(target_dir)
    if tuple(tensors["embed"].shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftflowError(
            f"{target_dir}: embedding shape {tuple(tensors['embed'].shape)} does not match config.json"
        )
    drafter.embed_tokens.weight = tensors["embed"].to(embed_dtype)
    target_ids = torch.from_numpy(vocab.target_ids)
    with torch.no_grad():  # start from the target's head rows: logits begin in the right space
        drafter.lm_head.weight.copy_(tensors["lm_head"][target_ids].float())
    # frozen, the head stays the target's rows: make_optimizer and DDP skip it, export still writes it
    drafter.lm_head.weight.requires_grad_(not s.freeze_lm_head)
    drafter.set_vocab(torch.from_numpy(vocab.d2t), torch.from_numpy(vocab.t2d))
    return drafter, TargetHead(tensors["lm_head"], torch.from_numpy(vocab.t2d), s.target_temperature), cfg


def _load_tokenizer(path: Path | None):
    """The target's tokenizer when the folder has one (DFlash picks its mask token from it)."""
    if path is None or not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_dflash(
    s: TrainSettings, target_dir: Path, tokenizer_dir: Path | None = None, embed_dtype: torch.dtype = torch.float32
):
    """A fresh DFlash drafter (seeded) with the target's frozen embedding and LM head, plus the
    target's greedy-token head for the labels."""
    from draftflow.drafters.dflash import resolve_mask_token
    from draftflow.drafters.dflash_loss import ArgmaxHead
    from draftflow.target import target_identity

    d = s.dflash_settings
    tcfg = target_config(target_dir)
    tensors = load_target_tensors(target_dir)
    mask_id, mask_token = resolve_mask_token(
        _load_tokenizer(tokenizer_dir or target_dir), tensors["embed"].shape[0], d.mask_token_id, tensors["embed"]
    )
    cfg = DFlashConfig.from_target(
        tcfg, num_hidden_layers=d.num_hidden_layers, target_layer_ids=list(s.aux_layer_ids), block_size=d.block_size,
        mask_token_id=mask_id, mask_token=mask_token, target=target_identity(target_dir),
        target_path=str(Path(target_dir).resolve()),
    )  # fmt: skip
    cfg.extra["labels"] = d.labels
    cfg.extra["loss_weighting"] = d.loss_weighting
    torch.manual_seed(s.seed)
    drafter = DFlashDrafter(cfg)
    if tuple(tensors["embed"].shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftflowError(
            f"{target_dir}: embedding shape {tuple(tensors['embed'].shape)} does not match config.json"
        )
    drafter.set_target(tensors["embed"].to(embed_dtype), tensors["lm_head"].to(embed_dtype))
    log.info("DFlash: %d layers, block %d, target layers %s, mask token %d (%s)", cfg.num_hidden_layers,
             cfg.block_size, cfg.target_layer_ids, mask_id, mask_token)  # fmt: skip
    return drafter, ArgmaxHead(tensors["lm_head"], keep_final=d.labels == "soft"), cfg


# ---------------------------------------------------------------- distributed


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_distributed(gpus: int) -> DistEnv:
    """Read torchrun's environment; one GPU per process when gpus > 0, else CPU with gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if gpus > 0:
        if not torch.cuda.is_available():
            raise DraftflowError(
                f"train.gpus is {gpus} but no CUDA device is visible; set train.gpus: 0 to train on CPU"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = os.environ.get("DRAFTFLOW_DIST_BACKEND") or (
            "nccl" if device.type == "cuda" else "gloo"
        )  # launch-train sets it
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, world, local, device)


def make_objective(drafter, s: TrainSettings, compile: bool = False, attention: str | None = "chunked") -> nn.Module:
    """The method's training forward: `(loss, stats [len(STAT_ROWS), s.stat_steps])`; `attention`:
    EAGLE-3's TTT attention (`ttt_attention`; DFlash has none)."""
    if s.method == "dflash":
        from draftflow.drafters.dflash_loss import DFlashObjective

        d = s.dflash_settings
        # compiled training also compiles the cross-entropy's chunk passes (FusedChunks): on the H200
        # 5% faster a step at the same loss (BENCHMARKS.md, issue 34)
        return DFlashObjective(drafter, s.loss_decay, d.labels, compile=compile, weighting=d.loss_weighting,
                               dpace_alpha=d.dpace_alpha, fused_ce=compile)  # fmt: skip
    return TTTObjective(drafter, s.ttt_steps, s.step_weight_decay, compile=compile, loss=s.loss, attention=attention)


def ttt_attention(setting: str, device: torch.device, compile: bool) -> str:
    """EAGLE-3's TTT attention kernel: the same attention (and loss) by every kernel, so this is a
    speed choice. auto: on CUDA the chunked SDPA path with grouped kv heads (on the H200 1.04x the
    expanded heads' tokens/s at the same loss, 10 GiB less memory: BENCHMARKS.md, issue 34); elsewhere
    the chunked path with expanded heads (`ttt.unroll`), which keeps CPU-trained drafters bit-identical."""
    if setting == "auto":
        return "chunked-gqa" if device.type == "cuda" else "chunked"
    if setting == "flex" and (device.type != "cuda" or not compile):
        raise DraftflowError(
            "train.ttt_attention: flex trains only on a CUDA device with train.compile on (FlexAttention has "
            f"no eager backward); this run has device {device.type}, compile {compile}. "
            "Set train.ttt_attention: auto"
        )
    return setting


def wrap_parallel(objective: TTTObjective, env: DistEnv, fsdp: bool) -> nn.Module:
    if env.world_size == 1:
        return objective
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        drafter = objective.drafter
        layers = drafter.layers if isinstance(drafter, DFlashDrafter) else [drafter.midlayer, *drafter.layers.values()]
        for layer in layers:
            fully_shard(layer)
        return fully_shard(objective)
    # frozen embedding and vocab buffers never change: no per-step buffer broadcast
    ids = [env.device.index] if env.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(objective, device_ids=ids, broadcast_buffers=False)


# ---------------------------------------------------------------- optimization


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def make_optimizer(drafter: Eagle3Drafter, s: TrainSettings, total_steps: int, fused: bool):
    head = drafter.lm_head.weight if s.lm_head_lr_scale != 1.0 else None  # EAGLE-3 only (from_dict)
    scaled_head = head is not None and head.requires_grad
    params = [p for p in drafter.parameters() if p.requires_grad and not (scaled_head and p is head)]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": s.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # norms
    ]
    if scaled_head:  # a third group only then: earlier checkpoints' optimizer state keeps two
        groups.append({"params": [head], "weight_decay": s.weight_decay, "lr": s.learning_rate * s.lm_head_lr_scale})
    opt = torch.optim.AdamW(groups, lr=s.learning_rate, betas=(0.9, s.adam_beta2), fused=fused or None)
    warmup = round(s.warmup_ratio * total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(step, total_steps, warmup, s.schedule, s.min_lr_ratio)
    )
    return opt, sched


def autocast(device: torch.device):
    """bf16 autocast on GPU (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    target_head: TargetHead,
    micro_batches: Sequence[Batch],
    optimizer: torch.optim.Optimizer,
    scheduler,
    env: DistEnv,
    grad_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches (already on the device).

    Returns (summed stats [len(STAT_ROWS), steps], grad norm), device tensors: no host sync.
    """
    normalizer = env.all_reduce(torch.stack([mb.step_tokens for mb in micro_batches]).sum(0).to(env.device))
    stats = None
    for i, mb in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1
        no_sync = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with no_sync:
            with autocast(env.device):
                target = target_head(mb.final)
                loss, s = model(mb.input_ids, mb.loss_mask, mb.aux, target.probs, target.argmax, normalizer, *mb.extra())
            # DDP averages gradients over ranks; the loss is already a global mean
            (loss * env.world_size).backward()
        stats = s if stats is None else stats + s
    params = [p for p in model.parameters() if p.requires_grad]
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return stats, grad_norm


def shard_eval_batches(batches: list[Rows], rank: int, world_size: int) -> tuple[list[Rows], list[bool]]:
    """Round-robin eval batches, padded so every rank runs as many forwards (FSDP gathers
    parameters collectively); padding repeats a batch whose statistics are dropped."""
    if not batches:
        return [], []
    per_rank = -(-len(batches) // world_size)
    idx = [rank + i * world_size for i in range(per_rank)]
    return [batches[j % len(batches)] for j in idx], [j < len(batches) for j in idx]


class BadSamples:
    """What a run does with samples it cannot read: stop naming them (fail) or leave them out and count (skip)."""

    def __init__(self, policy: str, label: str):
        self.policy, self.label = policy, label
        self.skipped: dict[tuple[str, str], str] = {}  # (range, sample id) -> reason

    def handle(self, bad) -> None:
        """`bad`: storage.BadRead records; raises under "fail", else logs each new one once."""
        for b in bad:
            if self.policy == "fail":
                raise DraftflowError(
                    f"{self.label}: a stored sample cannot be read: {b.message()}; "
                    "or set on_bad_sample: skip to leave such samples out and count them"
                )
            if (b.range_dir, b.sample_id) not in self.skipped:
                log.warning("%s: skipping %s", self.label, b.message())
                self.skipped[(b.range_dir, b.sample_id)] = b.reason

    def as_json(self) -> dict:
        return {"skipped_samples": len(self.skipped),
                "skipped": [{"range": r, "sample_id": i, "reason": why} for (r, i), why in self.skipped.items()]}  # fmt: skip


@torch.no_grad()
def evaluate(
    objective: TTTObjective,
    target_head: TargetHead,
    loader,
    env: DistEnv,
    steps: int,
    keep: Sequence[bool],
    bad: BadSamples | None = None,
) -> torch.Tensor:
    """Summed TTT statistics over this rank's eval batches (those marked `keep`), all-reduced."""
    objective.eval()
    total = torch.zeros(len(STAT_ROWS), steps, dtype=torch.float64, device=env.device)
    for batch, kept in zip(loader, keep, strict=True):
        if batch.bad:
            (bad or BadSamples("fail", "evaluation")).handle(batch.bad)
        batch = batch.to(env.device)
        with autocast(env.device):
            target = target_head(batch.final)
            _, s = objective(batch.input_ids, batch.loss_mask, batch.aux, target.probs, target.argmax, None, *batch.extra())
        if kept:
            total += s
    objective.train()
    return env.all_reduce(total)


# ---------------------------------------------------------------- checkpoints


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def use_compile(setting: bool | str, device: torch.device) -> bool:
    """Whether to torch.compile the drafter's pointwise parts and loss. `auto` compiles on CUDA
    and falls back to eager code (with a logged warning) where compilation fails."""
    if setting is False or (setting == "auto" and device.type != "cuda"):
        return False
    if setting == "auto":
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
    return True


def samples_digest(range_dirs) -> str:
    """sha256 of the ranges' sample content keys, in order: what the data is, not how the ranges
    were cut or what their indexes record about the run (counts, timings) that wrote them."""
    from draftflow.hidden_states.storage import read_index_columns

    h = hashlib.sha256()
    for d in range_dirs:
        for key in read_index_columns(Path(d))[1]["key"]:
            h.update(key.encode() + b"\n")
    return h.hexdigest()


def run_fingerprint(s: TrainSettings, world_size: int, train_ranges, eval_ranges, target_dir, vocab_path) -> str:
    """What determines the training trajectory: a resume is only valid under the same fingerprint."""
    from draftflow.target import target_identity

    description = {
        "settings": s.fingerprint_dict(),
        # 2 GPUs x grad_accum 1 and 1 GPU x grad_accum 2 take the same steps on the same batches
        "micro_batches_per_step": world_size * s.grad_accum,
        # FSDP checkpoints hold sharding-aware optimizer state: they resume under FSDP only
        "fsdp": s.fsdp and world_size > 1,
        "train": samples_digest(train_ranges),
        "eval": samples_digest(eval_ranges),
        "target": target_identity(target_dir),
    }
    if s.method == "eagle3":  # the micro-batch plan: older runs padded length-sorted batches
        description["batching"] = s.batching
    if vocab_path is not None:  # DFlash has none
        description["vocab"] = _sha256_file(Path(vocab_path))
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def warn_about_other_checkpoints(state_dir: Path, record: dict) -> None:
    """A fresh start beside checkpoints of other runs: say what differs, so that a user who
    only changed the number of GPUs sees how to resume (keep gpus x grad_accum)."""
    for other in sorted(state_dir.glob("run-*/run.json")):
        if CheckpointDir(other.parent).latest() is None:
            continue
        previous = read_json(other)
        changed = [k for k in ("micro_batches_per_step", "fsdp") if previous.get(k) != record[k]]
        changed += [
            f"settings.{k}" for k, v in record["settings"].items()
            if k not in OPERATIONAL and previous.get("settings", {}).get(k) != v
        ]  # fmt: skip
        hint = ""
        if "micro_batches_per_step" in changed and previous.get("micro_batches_per_step"):
            n = previous["micro_batches_per_step"]
            hint = (f"; to resume it instead, keep GPUs x train.grad_accum = {n} micro-batches per step "
                    f"(now {record['world_size']} x {record['settings']['grad_accum']})")  # fmt: skip
        log.warning(
            "starting a new training run although %s has a checkpoint of a different run (differs in: %s)%s",
            other.parent, ", ".join(changed) or "data, target or vocabulary", hint,
        )  # fmt: skip


@dataclass
class Progress:
    global_step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch of the next step
    epoch_step: int = 0  # index of the next step within its epoch
    best_eval_loss: float = math.inf
    last_eval: dict | None = None  # summary of the latest evaluation


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_state(model: nn.Module, drafter: Eagle3Drafter, fsdp: bool) -> dict[str, torch.Tensor]:
    """The drafter's full state dict (export names). Under FSDP a collective: call it on every
    rank; rank 0 gets the tensors, the others an empty dict."""
    if not fsdp:
        return drafter.export_state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("drafter."): v for k, v in full.items()}


def _model_optim_state(model: nn.Module, drafter: Eagle3Drafter, optimizer, fsdp: bool) -> tuple[dict, dict]:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return gather_state(model, drafter, fsdp), get_optimizer_state_dict(model, optimizer, options=opts)
    return drafter.export_state_dict(), optimizer.state_dict()


class CheckpointDir:
    """run_dir/ckpt/step-N/{state.pt, rng-<rank>.pt}; run_dir/latest.json names the complete one."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.latest_file = self.run_dir / "latest.json"

    def latest(self) -> Path | None:
        if not self.latest_file.is_file():
            return None
        path = self.run_dir / read_json(self.latest_file)["path"]
        return path if (path / "state.pt").is_file() else None

    def save(self, env: DistEnv, model, drafter, optimizer, scheduler, progress: Progress, fsdp: bool) -> Path:
        name = f"ckpt/step-{progress.global_step:09d}"
        folder = self.run_dir / name
        model_state, optim_state = _model_optim_state(model, drafter, optimizer, fsdp)
        if env.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            state = {"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict(),
                     "progress": dataclasses.asdict(progress)}  # fmt: skip
            with atomic_path(folder / "state.pt") as tmp:
                torch.save(state, tmp)
        env.barrier()
        with atomic_path(folder / f"rng-{env.rank}.pt") as tmp:
            torch.save(_rng_state(), tmp)
        env.barrier()
        if env.is_main:  # the pointer moves only once every rank's files are on disk
            previous = self.latest()
            write_json(self.latest_file, {"path": name, "step": progress.global_step})
            if previous is not None and previous != folder:
                shutil.rmtree(previous, ignore_errors=True)
        return folder

    def load(self, env: DistEnv, model, drafter, optimizer, scheduler, fsdp: bool) -> Progress | None:
        folder = self.latest()
        if folder is None:
            return None
        state = torch.load(folder / "state.pt", map_location="cpu", weights_only=False)
        if fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            msd = {f"drafter.{k}": v for k, v in state["model"].items()}
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=state["optimizer"],
                           options=StateDictOptions(full_state_dict=True, strict=False))  # fmt: skip
        else:
            missing, unexpected = drafter.load_state_dict(state["model"], strict=False)
            if missing or unexpected:
                raise DraftflowError(f"{folder}: checkpoint does not match the drafter ({missing}, {unexpected})")
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rng = folder / f"rng-{env.rank}.pt"
        if rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        return Progress(**state["progress"])


# ---------------------------------------------------------------- metrics


class MetricsLog:
    """metrics.jsonl in the run folder (rank 0 writes). On resume, rows after the checkpoint go."""

    def __init__(self, path: Path, env: DistEnv):
        self.path, self.env = Path(path), env

    def truncate_after(self, step: int) -> None:
        if not self.env.is_main or not self.path.is_file():
            return
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        keep = [r for r in rows if r["step"] <= step]
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def write(self, row: dict) -> None:
        if self.env.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


# ---------------------------------------------------------------- the run


@dataclass
class TrainInputs:
    train_ranges: list[Path]
    eval_ranges: list[Path]
    target: Path
    vocab: Path | None  # EAGLE-3's draft vocabulary; DFlash uses the target's whole vocabulary
    state_dir: Path
    output: Path
    tokenizer: Path | None = None  # DFlash's mask token (default: the target folder's tokenizer)


def _without_missing(reader, bad: "BadSamples", label: str):
    """Stat every store file before starting (no reads): missing ones stop the run naming range
    and sample id, or under on_bad_sample: skip are left out of the plan and counted."""
    from draftflow.hidden_states.storage import check_present

    missing = check_present(reader, f"{label} (--{'train' if label == 'training' else 'eval'}-ranges)", bad.policy)
    if not missing:
        return reader
    bad.handle(missing)
    return reader.without(missing)


def run_training(inputs: TrainInputs, s: TrainSettings, env: DistEnv | None = None) -> dict:
    """Train (resuming when the state folder has a checkpoint of this exact run); returns the final eval summary."""
    from draftflow.hidden_states.storage import HiddenStateReader

    env = env or init_distributed(s.gpus)
    cuda = env.device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    embed_dtype = torch.bfloat16 if cuda else torch.float32
    if s.method == "dflash":
        drafter, target_head, cfg = build_dflash(s, inputs.target, inputs.tokenizer, embed_dtype=embed_dtype)
    else:
        if inputs.vocab is None:
            raise DraftflowError("train: EAGLE-3 needs --vocab (draft_vocab.safetensors from `draftflow vocab`)")
        drafter, target_head, cfg = build_drafter(s, inputs.target, load_vocab(inputs.vocab), embed_dtype=embed_dtype)
    train_reader, eval_reader = HiddenStateReader(inputs.train_ranges), HiddenStateReader(inputs.eval_ranges)
    if len(train_reader) == 0:
        raise DraftflowError("no training samples in --train-ranges")
    train_layers = reader_layers(train_reader.range_dirs, cfg, "train")
    eval_layers = reader_layers(eval_reader.range_dirs, cfg, "eval")
    bad_train, bad_eval = BadSamples(s.on_bad_sample, "training"), BadSamples(s.on_bad_sample, "evaluation")
    train_reader = _without_missing(train_reader, bad_train, "training")
    eval_reader = _without_missing(eval_reader, bad_eval, "evaluation")

    plans = plan_epochs(train_reader.lengths, s, env.world_size)
    total_steps = sum(p.steps for p in plans)
    eval_batches, eval_keep = shard_eval_batches(
        plan_micro_batches(eval_reader.lengths, s, 0, shuffle=False), env.rank, env.world_size
    )

    drafter.to(env.device)
    target_head.to(env.device, dtype=torch.bfloat16 if cuda else torch.float32)
    compiled = use_compile(s.compile, env.device)
    attention = ttt_attention(s.ttt_attention, env.device, compiled) if s.method == "eagle3" else None
    objective = make_objective(drafter, s, compile=compiled, attention=attention)
    model = wrap_parallel(objective, env, s.fsdp and env.world_size > 1)
    optimizer, scheduler = make_optimizer(drafter, s, total_steps, fused=cuda)
    fsdp = s.fsdp and env.world_size > 1

    vocab = None if s.method == "dflash" else inputs.vocab  # DFlash drafts over the whole target vocabulary
    fp = run_fingerprint(s, env.world_size, inputs.train_ranges, inputs.eval_ranges, inputs.target, vocab)
    run_dir = Path(inputs.state_dir) / f"run-{fp}"
    if env.is_main:
        record = {"fingerprint": fp, "settings": dataclasses.asdict(s), "world_size": env.world_size,
                  "micro_batches_per_step": env.world_size * s.grad_accum, "fsdp": fsdp,
                  "train_ranges": [str(p) for p in inputs.train_ranges], "target": str(inputs.target)}  # fmt: skip
        if CheckpointDir(run_dir).latest() is None:
            warn_about_other_checkpoints(Path(inputs.state_dir), record)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "run.json", record)
    env.barrier()
    ckpt = CheckpointDir(run_dir)
    metrics = MetricsLog(run_dir / "metrics.jsonl", env)
    progress = ckpt.load(env, model, drafter, optimizer, scheduler, fsdp) or Progress()
    if progress.global_step:
        log.info(
            "resuming from step %d (epoch %d, step %d of it) in %s",
            progress.global_step,
            progress.epoch,
            progress.epoch_step,
            run_dir,
        )
    metrics.truncate_after(progress.global_step)
    env.barrier()
    log.info(
        "training %d steps (%s epochs) on %d process(es), %s; %d train / %d eval samples; %.4gM trainable params",
        total_steps, s.epochs, env.world_size, env.device, len(train_reader), len(eval_reader),
        sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6,
    )  # fmt: skip

    def run_eval(epoch: int) -> dict | None:
        if len(eval_reader) == 0:
            return None
        loader = make_loader(eval_reader, eval_batches, s, env.device, eval_layers)
        stats = evaluate(objective, target_head, loader, env, s.stat_steps, eval_keep, bad_eval)
        summary = summarize(stats, s.loss_decay)
        metrics.write({"kind": "eval", "step": progress.global_step, "epoch": epoch, **summary})
        progress.last_eval = summary
        log.info("eval step %d | loss %.4f | acc %s | alpha %s | tau %.3f", progress.global_step, summary["loss"],
                 _fmt(summary["step_accuracy"]), _fmt(summary["step_alpha"]), summary["tau"])  # fmt: skip
        if summary["loss"] < progress.best_eval_loss:  # the same on every rank (all-reduced)
            progress.best_eval_loss = summary["loss"]
            state = gather_state(model, drafter, fsdp)
            if env.is_main:
                _save_best(drafter, state, run_dir / "best", summary, progress.global_step)
        return summary

    ticker = ProgressLog(total_steps, "steps", resumed=progress.global_step, logger=log)
    ticker.update(progress.global_step, force=True)  # done/total from the start: `draftflow status` sees it
    stats_acc = torch.zeros(len(STAT_ROWS), s.stat_steps, dtype=torch.float64, device=env.device)
    window = {"tokens": 0, "data_s": 0.0, "t0": time.perf_counter(), "steps": 0}
    last_eval = progress.last_eval
    for plan in plans[progress.epoch :]:
        first = progress.epoch_step if plan.epoch == progress.epoch else 0
        mine = [
            b
            for step in range(first, plan.steps)
            for b in plan.rank_batches(step, env.rank, env.world_size, s.grad_accum)
        ]
        batches = iter(make_loader(train_reader, mine, s, env.device, train_layers, plan.epoch))
        for step in range(first, plan.steps):
            t_data = time.perf_counter()
            micro = [next(batches) for _ in range(s.grad_accum)]
            for mb in micro:
                bad_train.handle(mb.bad)
            micro = [mb.to(env.device) for mb in micro]
            window["data_s"] += time.perf_counter() - t_data
            stats, grad_norm = train_step(model, target_head, micro, optimizer, scheduler, env, s.grad_clip)
            stats_acc += stats
            window["tokens"] += sum(mb.tokens for mb in micro)
            window["steps"] += 1
            progress.global_step += 1
            progress.epoch, progress.epoch_step = plan.epoch, step + 1

            if progress.global_step % s.log_every_steps == 0 or progress.global_step == total_steps:
                _log_train(env, metrics, progress, plan.epoch, total_steps, scheduler, stats_acc, grad_norm, window, s,
                           ticker)
                stats_acc.zero_()
                window = {"tokens": 0, "data_s": 0.0, "t0": time.perf_counter(), "steps": 0}
            end_of_epoch = step + 1 == plan.steps
            if end_of_epoch or (s.eval_every_steps and progress.global_step % s.eval_every_steps == 0):
                last_eval = run_eval(plan.epoch)
            if end_of_epoch:
                progress.epoch, progress.epoch_step = plan.epoch + 1, 0
            if (
                s.save_every_steps and progress.global_step % s.save_every_steps == 0
            ) or progress.global_step == total_steps:
                ckpt.save(env, model, drafter, optimizer, scheduler, progress, fsdp)

    if last_eval is None:  # no eval split, or a checkpoint without an evaluation
        last_eval = run_eval(max(0, progress.epoch - 1))
    if last_eval is None:
        log.warning("no eval samples: the summary has no held-out acceptance length")
    summary = {
        "simulated_acceptance_length": last_eval["tau"] if last_eval else None,
        "acceptance_kind": "simulated (teacher-forced on the eval split)",
        **(last_eval or {}),
        "best_eval_loss": progress.best_eval_loss if last_eval else None,
        "steps": progress.global_step,
        "train_tokens": sum(
            int(train_reader.lengths[samples_of(b)].sum())
            for p in plans
            for b in p.batches[: p.steps * env.world_size * s.grad_accum]
        ),
        "world_size": env.world_size,
        "ttt_attention": attention,  # the kernel train.ttt_attention chose (EAGLE-3; None: DFlash)
        "fingerprint": fp,
        "peak_gpu_memory_gib": peak_gpu_memory_gib(env),
        "bad_samples": {"policy": s.on_bad_sample, "train": bad_train.as_json(), "eval": bad_eval.as_json()},
    }
    state = gather_state(model, drafter, fsdp)
    if env.is_main:
        out = Path(inputs.output)
        save_drafter(drafter, out, extra_files={"eval.json": summary}, state=state)
        with atomic_path(out / "metrics.jsonl") as tmp:
            shutil.copyfile(run_dir / "metrics.jsonl", tmp)
        fsync_dir(out)
        log.info("final drafter in %s (simulated tau %s)", out, summary["simulated_acceptance_length"])
    env.barrier()
    return summary


def peak_gpu_memory_gib(env: DistEnv) -> float | None:
    """The largest peak of allocated GPU memory over all ranks (None on CPU)."""
    if env.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(env.device)], dtype=torch.float64, device=env.device)
    if env.world_size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return round(peak.item() / 2**30, 2)


def _save_best(drafter: Eagle3Drafter, state: dict, folder: Path, summary: dict, step: int) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp, dtype=torch.float32, extra_files={"eval.json": dict(summary, step=step)}, state=state)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    fsync_dir(folder.parent)


def _log_train(env, metrics, progress, epoch, total_steps, scheduler, stats_acc, grad_norm, window, s, ticker=None) -> None:
    """Once per log interval: one all-reduce and one host sync."""
    packed = torch.cat(
        [stats_acc.flatten(), torch.tensor([float(window["tokens"])], dtype=torch.float64, device=env.device)]
    )
    packed = env.all_reduce(packed).cpu()
    summary = summarize(packed[:-1].view_as(stats_acc), s.loss_decay)
    tokens = int(packed[-1])
    elapsed = time.perf_counter() - window["t0"]
    row = {
        "kind": "train", "step": progress.global_step, "epoch": epoch, "lr": scheduler.get_last_lr()[0],
        "loss": summary["loss"], "step_loss": summary["step_loss"], "step_accuracy": summary["step_accuracy"],
        "step_alpha": summary["step_alpha"], "tau": summary["tau"], "grad_norm": float(grad_norm),
        "tokens": tokens, "tokens_per_s": tokens / elapsed, "data_wait": window["data_s"] / elapsed,
    }  # fmt: skip
    metrics.write(row)
    details = (
        f"epoch {epoch} | loss {row['loss']:.4f} | acc {_fmt(row['step_accuracy'])} | lr {row['lr']:.2e} | "
        f"{row['tokens_per_s']:.0f} tok/s | grad {row['grad_norm']:.3f} | data {100 * row['data_wait']:.1f}%"
    )
    if ticker is None:
        log.info("step %d/%d | %s", progress.global_step, total_steps, details)
    else:  # `progress: step/total steps (%), rate, elapsed, ETA | …`, read by `draftflow status`
        ticker.update(progress.global_step, extra=details, force=True)


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument(
        "--train-ranges", nargs="+", required=True, type=Path, help="range folders (index.json) to train on"
    )
    parser.add_argument("--eval-ranges", nargs="+", default=[], type=Path, help="held-out range folders")
    parser.add_argument("--target", required=True, type=Path, help="target model folder (embedding, LM head)")
    parser.add_argument("--vocab", type=Path, help="draft_vocab.safetensors from `draftflow vocab` (EAGLE-3)")
    parser.add_argument("--tokenizer", type=Path, help="DFlash: the tokenizer that names its mask token (default: --target)")
    parser.add_argument("--settings", required=True, type=settings_arg, help="config `train` + aux_layer_ids, as JSON")
    parser.add_argument("--state-dir", required=True, type=Path, help="resume state (outside the rule's outputs)")
    parser.add_argument("--output", required=True, type=Path, help="final drafter folder")


def use_threads(settings: TrainSettings, threads: int) -> TrainSettings:
    """This process's threads: DataLoader workers (1 thread each) beside the training loop."""
    compute, workers = split_threads(threads, settings.num_workers)
    if workers != settings.num_workers:
        log.warning("train.num_workers %d does not fit in %d CPU thread(s): using %d DataLoader worker(s)",
                    settings.num_workers, threads, workers)  # fmt: skip
    torch.set_num_threads(compute)
    return dataclasses.replace(settings, num_workers=workers)


def main(args: argparse.Namespace) -> int:
    settings = use_threads(TrainSettings.from_dict(args.settings), getattr(args, "threads", None) or default_threads())
    env = init_distributed(settings.gpus)
    if not env.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    elif settings.gpus == 0:
        warn_if_gpus_idle("training", "train.gpus")
    try:
        inputs = TrainInputs(
            list(args.train_ranges), list(args.eval_ranges), args.target, args.vocab, args.state_dir, args.output,
            args.tokenizer,
        )  # fmt: skip
        run_training(inputs, settings, env)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
