"""Micro-batches of stored samples: `collate` turns `storage.Sample`s into a `Batch` (rows of one
sample, or packed rows from `packing`; DFlash anchors drawn per `AnchorPlan`), and
`reader_layers` says which stored aux layers a drafter reads. Shared by training (its
DataLoader: `SampleDataset`, `collate_rows`) and evaluation, which does not depend on the trainer.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from draftflow.drafters.packing import Rows
from draftflow.drafters.ttt import step_token_counts
from draftflow.errors import DraftflowError, where


@dataclass
class Batch:
    """A micro-batch of B rows (right padding: padding has loss_mask 0). EAGLE-3 packs several
    samples into a row (`doc` says which); DFlash has one sample per row."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool
    aux: torch.Tensor  # [B, T, n_aux*H], stored dtype
    final: torch.Tensor  # [B, T, H], stored dtype
    step_tokens: torch.Tensor  # [steps] int64: loss tokens per TTT step / block row (for global normalization)
    tokens: int  # real (unpadded) tokens
    bad: tuple = ()  # storage.BadRead of samples that could not be read (left out of the tensors)
    anchors: torch.Tensor | None = None  # [B, n] int64 DFlash block anchors, -1: padding
    doc: torch.Tensor | None = None  # [B, T] int64 packed rows: the token's sample within its row, -1: padding
    # [n] the largest anchor of each anchor column, as host integers: the attention's context lengths
    # without reading the anchors back from the GPU (a plain tuple, which DDP leaves where it is)
    anchor_column_max: tuple[int, ...] | None = None

    def _tensors(self) -> list[str]:
        return [k for k in _TENSORS if getattr(self, k) is not None]

    def pin_memory(self) -> "Batch":
        return dataclasses.replace(self, **{k: getattr(self, k).pin_memory() for k in self._tensors()})

    def to(self, device, non_blocking: bool = True) -> "Batch":
        return dataclasses.replace(
            self, **{k: getattr(self, k).to(device, non_blocking=non_blocking) for k in self._tensors()}
        )

    def extra(self) -> tuple:
        """Method-specific arguments of the objective after the normalizer (DFlash: anchors;
        EAGLE-3: the packed rows' sample ids)."""
        if self.anchors is not None:
            return (self.anchors, self.anchor_column_max)
        return () if self.doc is None else (self.doc,)


_TENSORS = ("input_ids", "loss_mask", "aux", "final", "step_tokens", "anchors", "doc")


@dataclass(frozen=True)
class AnchorPlan:
    """How the data loader draws DFlash anchors: at random per (seed, epoch, batch content), or
    evenly spaced (epoch None: evaluation)."""

    block_size: int
    per_sample: int
    seed: int = 0
    epoch: int | None = None


def collate(
    reads: list, ttt_steps: int, sample_shape: tuple | None = None,
    layers: Sequence[int] | None = None, anchors: AnchorPlan | None = None, rows: Rows | None = None,
    pad_to: tuple[int, int] | None = None,
) -> Batch:  # fmt: skip
    """storage.Sample (or BadRead) list -> Batch of the samples; bad reads in `bad`.

    rows: positions into `reads` for each batch row: several samples a row are packed one after
    the other, with `doc` ids (`packing`; None when every row holds one sample); None: one sample
    per row, padded to the longest. pad_to: (rows, tokens) the batch has at least (empty rows
    and padding have no loss tokens).
    A micro-batch whose every sample is bad becomes one 1-token row without loss tokens
    (`sample_shape` = (L, H, dtype name)), so every process still runs its step. layers: which
    stored aux layers (indexes into the stored order) the drafter reads, default all; anchors:
    draw DFlash anchors (then `step_tokens` counts each block row's labels; one sample per row).
    """
    from draftflow.hidden_states.storage import DTYPES, BadRead

    bad = tuple(r for r in reads if isinstance(r, BadRead))
    packed = rows is not None
    if rows is None:
        rows = [[i] for i in range(len(reads))]
    rows = [[reads[i] for i in row if not isinstance(reads[i], BadRead)] for row in rows]
    rows = [row for row in rows if row]  # [B][samples of the row]
    samples = [s for row in rows for s in row]
    if packed and anchors is not None:
        raise ValueError("collate: DFlash anchors need one sample per row")
    if samples:
        B, T = len(rows), max(sum(len(s.input_ids) for s in row) for row in rows)
        first = samples[0].hidden  # [T, L, H]
        L, H, dtype = first.shape[1], first.shape[2], first.dtype
    else:
        B, T = 1, 1
        L, H, dtype = sample_shape[0], sample_shape[1], DTYPES[sample_shape[2]]
    if pad_to is not None:
        B, T = max(B, pad_to[0]), max(T, pad_to[1])
    layers = list(range(L - 1)) if layers is None else list(layers)
    every_layer = layers == list(range(L - 1))
    ids = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    # the two large tensors are written once: no zero fill first (only padding is zeroed), and in
    # a DataLoader worker they live in shared memory from the start
    shared = torch.utils.data.get_worker_info() is not None
    aux = _batch_tensor((B, T, len(layers) * H), dtype, shared)
    final = _batch_tensor((B, T, H), dtype, shared)
    doc = torch.full((B, T), -1, dtype=torch.int64)
    for b, row in enumerate(rows):
        start = 0
        for d, s in enumerate(row):
            n = s.input_ids.shape[0]
            span = slice(start, start + n)
            ids[b, span] = torch.from_numpy(s.input_ids)
            mask[b, span] = torch.from_numpy(s.loss_mask.astype(bool))
            into = aux[b, span].view(n, len(layers), H)  # s.aux: [n, L - 1, H], a view of s.hidden
            if every_layer:
                into.copy_(s.aux)
            else:
                for j, layer in enumerate(layers):
                    into[:, j] = s.aux[:, layer]
            final[b, span] = s.final
            doc[b, span] = d
            start += n
        aux[b, start:] = 0
        final[b, start:] = 0
    aux[len(rows) :] = 0  # rows added by pad_to, or the one empty row of an all-bad batch
    final[len(rows) :] = 0
    tokens = int(sum(s.input_ids.shape[0] for s in samples))
    if anchors is None:
        # rows of one sample each need no sample masks: attention keeps its plain causal kernel
        doc = doc if packed and any(len(row) > 1 for row in rows) else None
        return Batch(ids, mask, aux, final, step_token_counts(mask, ttt_steps, doc), tokens, bad, doc=doc)
    from draftflow.drafters.dflash_loss import block_label_counts, choose_anchors, pad_anchors

    rng = None
    if anchors.epoch is not None:
        content = zlib.crc32(b"".join(s.input_ids.tobytes() for s in samples))
        rng = np.random.default_rng([anchors.seed, anchors.epoch, content])
    chosen = pad_anchors([choose_anchors(s.loss_mask, anchors.per_sample, rng) for s in samples] or [np.zeros(0)])
    counts = block_label_counts(mask, chosen, anchors.block_size)
    column_max = tuple(chosen.max(dim=0).values.tolist()) if chosen.numel() else None
    return Batch(ids, mask, aux, final, counts, tokens, bad, chosen, anchor_column_max=column_max)


def _batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised tensor; `shared`: in shared memory, as torch's default_collate allocates
    in a worker, so that handing the batch to the training process copies nothing (otherwise
    the DataLoader moves it there: one more copy of every batch, ~400 MB for DFlash at 8B)."""
    if not shared:
        return torch.empty(shape, dtype=dtype)
    numel = math.prod(shape)
    proto = torch.empty(0, dtype=dtype)
    return proto.new(proto._typed_storage()._new_shared(numel, device=proto.device)).view(shape)


class SampleDataset(torch.utils.data.Dataset):
    """Index -> storage.Sample, or a BadRead (checked, not raised, in the workers: the main
    process decides, with range and sample id); the reader pickles to workers."""

    def __init__(self, reader):
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key: tuple[int, int]):
        """(row, sample index) -> (row, Sample or BadRead): the row travels to `collate_rows`."""
        row, i = key
        return row, self.reader.read(i)


def collate_rows(pairs: list, shape: tuple[int, int] | None, **kwargs) -> Batch:
    """DataLoader collate: `SampleDataset` items of one micro-batch -> `collate` with their rows.
    shape: packed, (rows, tokens) of every micro-batch (`packing.batch_shape`); None: one sample a row."""
    reads = [read for _, read in pairs]
    if shape is None:
        return collate(reads, **kwargs)
    rows: dict[int, list[int]] = {}  # row -> positions in `reads`
    for position, (row, _) in enumerate(pairs):
        rows.setdefault(row, []).append(position)
    return collate(reads, rows=list(rows.values()), pad_to=shape, **kwargs)


def reader_layers(range_dirs: Sequence[Path], cfg, label: str) -> list[int] | None:
    """Where the drafter's aux layers sit among the layers the ranges store (None: all of them,
    in order). Ranges may store more layers than a method reads (extraction captures the union
    of every method's layers); every range must store them in the same order."""
    from draftflow.hidden_states.storage import read_range_index

    want = [int(i) for i in cfg.aux_layer_ids]
    found = None
    for d in range_dirs:
        meta, _ = read_range_index(d)
        stored_count = (meta.get("num_layers_captured") or 0) - 1
        ids = meta.get("aux_layer_ids")
        if ids is None and stored_count != len(want):
            raise DraftflowError(
                f"{d / 'index.json'}: records no aux_layer_ids for its {stored_count} aux layers, so the drafter's "
                f"{want} cannot be picked among them; re-extract the range"
            )
        stored = want if ids is None else list(ids)
        if meta.get("hidden_size") != cfg.hidden_size or stored_count != len(stored) or not set(want) <= set(stored):
            where_ = where(d / "index.json", field="meta.aux_layer_ids")
            raise DraftflowError(
                f"{where_}: {label} hidden states store aux layers {stored} (+ final) with H={meta.get('hidden_size')}; "
                f"the drafter reads aux layers {want} with H={cfg.hidden_size}: extract them (extract.aux_layer_ids"
                " / train.dflash.target_layer_ids) or train on these"
            )
        if found is not None and stored != found:
            raise DraftflowError(f"{d / 'index.json'}: stores aux layers {stored}, other ranges {found}; re-extract it")
        found = stored
    if found is None or found == want:
        return None
    return [found.index(i) for i in want]
