"""`draftflow vocab`: the draft vocabulary of the EAGLE-3 drafter (DESIGN.md §3).

The drafter's LM head predicts only N target tokens: the N most frequent tokens among the
loss-masked (assistant) tokens of the merged training split. Two tensors map between the
vocabularies, in the layout SGLang and SpecForge load:

* `d2t` int64 [N]: d2t[i] = target_id(i) - i (offsets, so target_id = i + d2t[i]);
* `t2d` bool [V]: True for target ids that are in the draft vocabulary.

Draft ids are ordered by target id (ascending), so draft id i is the i-th set bit of t2d.
Selection is deterministic: frequency descending, ties broken by the lower target id; when
fewer than N distinct tokens occur, the lowest unused target ids pad the vocabulary.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftflow.errors import DraftflowError, where
from draftflow.jsonl import atomic_path, read_json, read_jsonl, write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftVocab:
    d2t: np.ndarray  # [N] int64: target_id - draft_id
    t2d: np.ndarray  # [V] bool

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_ids(self) -> np.ndarray:
        """[N] int64: the target id of every draft id."""
        return self.d2t + np.arange(self.size, dtype=np.int64)

    def target_to_draft(self) -> np.ndarray:
        """[V] int64: the draft id of every target id, -1 where the token is not in the draft vocab."""
        out = np.full(self.t2d.shape[0], -1, dtype=np.int64)
        out[self.target_ids] = np.arange(self.size, dtype=np.int64)
        return out


def target_vocab_size(target_dir: str | Path) -> int:
    """`vocab_size` from the target's config.json (or its `text_config`, for multimodal wrappers)."""
    path = Path(target_dir) / "config.json"
    try:
        cfg = read_json(path)
    except FileNotFoundError:
        raise DraftflowError(f"{path}: missing; --target must be the target model folder") from None
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise DraftflowError(f"{where(path, field='vocab_size')}: missing or not a positive integer")
    return size


def count_loss_tokens(path: str | Path, vocab_size: int) -> np.ndarray:
    """[V] int64 counts of loss-masked tokens in a JSONL(.zst) file of {"input_ids", "loss_mask"}."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for line_no, record in enumerate(read_jsonl(path), start=1):
        try:
            ids = np.asarray(record["input_ids"], dtype=np.int64)
            mask = np.asarray(record["loss_mask"], dtype=bool)
        except KeyError as e:
            raise DraftflowError(f"{where(path, line_no, e.args[0])}: missing") from None
        if ids.shape != mask.shape:
            raise DraftflowError(
                f"{where(path, line_no, 'loss_mask')}: length {mask.size} differs from input_ids ({ids.size})"
            )
        masked = ids[mask]
        if masked.size and (masked.min() < 0 or masked.max() >= vocab_size):
            bad = int(masked.max() if masked.max() >= vocab_size else masked.min())
            raise DraftflowError(
                f"{where(path, line_no, 'input_ids')}: token id {bad} outside the target vocabulary "
                f"[0, {vocab_size}); was the data tokenized for another model?"
            )
        counts += np.bincount(masked, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: np.ndarray, size: int) -> DraftVocab:
    """Top-`size` ids by count (ties: lower id first), sorted by id; zero-count ids pad in id order."""
    V = counts.shape[0]
    if not 1 <= size <= V:
        raise ValueError(f"draft vocab size {size} must be in [1, {V}]")
    ids = np.arange(V, dtype=np.int64)
    # lexsort: last key is primary. Unseen ids all tie at 0 and so come last, lowest id first.
    order = np.lexsort((ids, -counts))
    chosen = np.sort(order[:size])
    t2d = np.zeros(V, dtype=bool)
    t2d[chosen] = True
    return DraftVocab(d2t=chosen - np.arange(size, dtype=np.int64), t2d=t2d)


def save_vocab(vocab: DraftVocab, path: str | Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {"d2t": torch.from_numpy(vocab.d2t.copy()), "t2d": torch.from_numpy(vocab.t2d.copy())}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "draftflow-draft-vocab"})


def load_vocab(path: str | Path) -> DraftVocab:
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise DraftflowError(f"{path}: draft vocabulary missing; run `draftflow vocab`") from None
    for key in ("d2t", "t2d"):
        if key not in tensors:
            raise DraftflowError(f"{where(path, field=key)}: missing from the draft vocabulary file")
    vocab = DraftVocab(d2t=tensors["d2t"].astype(np.int64), t2d=tensors["t2d"].astype(bool))
    target_ids = vocab.target_ids
    if (
        vocab.size != int(vocab.t2d.sum())
        or (np.diff(target_ids) <= 0).any()
        or target_ids[0] < 0
        or target_ids[-1] >= vocab.t2d.shape[0]
        or not vocab.t2d[target_ids].all()
    ):
        raise DraftflowError(f"{path}: d2t and t2d do not describe the same sorted draft vocabulary")
    return vocab


def build_vocab(input_path: str | Path, target_dir: str | Path, draft_vocab_size: int, output: str | Path) -> dict:
    """Count, select, and write `output` (safetensors) plus `output` with suffix .json (stats)."""
    V = target_vocab_size(target_dir)
    size = draft_vocab_size
    if size > V:
        log.info("draft_vocab_size %d exceeds the target vocabulary (%d); using %d", size, V, V)
        size = V
    counts = count_loss_tokens(input_path, V)
    vocab = select_draft_vocab(counts, size)
    draft_counts = counts[vocab.target_ids]
    total = int(counts.sum())
    distinct = int((counts > 0).sum())
    stats = {
        "input": str(input_path),
        "requested_size": draft_vocab_size,
        "draft_vocab_size": size,
        "target_vocab_size": V,
        "loss_tokens": total,
        "distinct_loss_tokens": distinct,
        "covered_loss_tokens": int(draft_counts.sum()),
        "coverage": float(draft_counts.sum() / total) if total else 0.0,
        "padded": max(0, size - distinct),
        "counts": draft_counts.tolist(),  # per draft id, i.e. in target-id order
    }
    save_vocab(vocab, output)
    write_json(Path(output).with_suffix(".json"), stats)
    log.info(
        "draft vocab: %d of %d target tokens, covering %.2f%% of %d loss tokens (%d distinct, %d padded)",
        size, V, 100 * stats["coverage"], total, distinct, stats["padded"],
    )  # fmt: skip
    return stats


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument("--input", required=True, type=Path, help="merged train.jsonl")
    parser.add_argument("--target", required=True, type=Path, help="target model folder (config.json)")
    parser.add_argument("--settings", required=True, type=settings_arg, help='{"draft_vocab_size": N}')
    parser.add_argument("--output", required=True, type=Path, help="draft_vocab.safetensors (+ .json stats)")


def main(args: argparse.Namespace) -> int:
    size = args.settings.get("draft_vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DraftflowError(f"--settings: 'draft_vocab_size' must be a positive integer, got {size!r}")
    build_vocab(args.input, args.target, size, args.output)
    return 0
