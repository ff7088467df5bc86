"""Packed micro-batches for EAGLE-3 training: several samples share a row; attention and the TTT
loss stay inside each sample (`doc` ids, see `ttt.ttt_loss` and `eagle3.TTTCache`).

Why packing: padding wastes compute unless a batch holds samples of one length, and batches of
one length (each step all short or all long samples) trained a markedly worse drafter on the
embedded default than batches of mixed samples (BENCHMARKS.md, "The embedded default itself").
Packed rows carry mixed samples and little padding.

A micro-batch is at most `max(1, batch_tokens // width)` rows of `width` tokens, `width` = the
longest sample or `batch_tokens` if less (a sample longer than that is a micro-batch of its
own). Samples are shuffled (per seed and epoch) and, a window of them at a time, packed into
rows best-fit decreasing (long samples first, each shorter one into the fullest row it still
fits); the rows are shuffled and dealt out to micro-batches.

Every packed micro-batch has that one shape (padding after each row's last sample, and empty
rows in an epoch's last micro-batch): the compiled step never meets a new shape, which would
recompile it (seconds each) and take new allocator blocks.
"""

from __future__ import annotations

import bisect

import numpy as np

Rows = list[list[int]]  # one micro-batch: each row's sample indices, in row order

WINDOW = 1024  # samples packed together: enough choice to fill rows, still a random mix


def best_fit_decreasing(indices: list[int], lengths: np.ndarray, width: int) -> Rows:
    """`indices` packed into rows of at most `width` tokens: longest first, each into the row it
    fills most (the one with the least room that is enough), a new row when none has room."""
    rows: Rows = []
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for i in sorted(indices, key=lambda i: -int(lengths[i])):  # stable: ties keep the shuffled order
        n = int(lengths[i])
        k = bisect.bisect_left(room, (n, -1))
        if k == len(room):
            rows.append([i])
            free, row = width - n, len(rows) - 1
        else:
            free, row = room.pop(k)
            rows[row].append(i)
            free -= n
        bisect.insort(room, (free, row))
    return rows


def batch_shape(lengths: np.ndarray, batch_tokens: int) -> tuple[int, int]:
    """(rows, tokens per row) of a packed micro-batch: rows as wide as the longest sample, or
    batch_tokens if less, and as many as batch_tokens holds (at least one)."""
    width = min(int(np.max(lengths)), batch_tokens) if len(lengths) else 1
    return max(1, batch_tokens // width), width


def plan_packed(lengths: np.ndarray, batch_tokens: int, seed: int, epoch: int, shuffle: bool = True) -> list[Rows]:
    """Every micro-batch's rows (module docstring). Deterministic in (lengths, batch_tokens, seed,
    epoch); shuffle=False keeps the stored order of samples and rows (evaluation)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return []
    per_batch, width = batch_shape(lengths, batch_tokens)  # a longer sample: a row, and micro-batch, of its own
    rng = np.random.default_rng([seed, epoch])
    order = (rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))).tolist()
    rows: Rows = []
    for start in range(0, len(order), WINDOW):
        rows += best_fit_decreasing(order[start : start + WINDOW], lengths, width)
    if shuffle:
        rows = [rows[i] for i in rng.permutation(len(rows))]
    return [rows[b : b + per_batch] for b in range(0, len(rows), per_batch)]
