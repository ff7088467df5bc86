"""DFlash's training objective: many anchored blocks per sample in one forward, a cross-entropy
per block position with exponentially decaying weights, and simulated acceptance.

Notation: tokens x_0 .. x_{T-1}, loss mask m_t, the target's greedy token g_{t+1} = argmax z_t
(z_t: the target's logits after reading x_0 .. x_t, from the stored final state).

* Anchors (`choose_anchors`, in the data loader): up to `anchors_per_sample` positions a with
  m_a = 1 and a <= T - 2, drawn at random when there are more (evaluation: evenly spaced).
  As at inference, the anchor is the last verified token, itself an assistant token.
* Block at a: ids [x_a, MASK × (B-1)] at positions a .. a+B-1; context: the target's states of
  the rows t < a (`dflash.AnchoredBlocks`).
* Label of block row k = 1 .. B-1: g_{a+k} (labels "target", what speculators' DFlash trainer
  uses: the target's own greedy token, from the stored final states) or x_{a+k} (labels "data",
  SpecForge and the paper, whose data the target itself generated), or the target's whole
  distribution softmax(z_{a+k-1}) (labels "soft": the cross-entropy against it, as our EAGLE-3
  trains; its logits recomputed per chunk from the stored final states and the shared LM head).
* Weight: m_{a+k} for a+k < T. The loss is Σ_k γ_k · (Σ_blocks m · CE_k) / N_k with
  γ_k = exp(-(k-1)/γ) (the paper's decay; SpecForge suggests γ = 7 for B = 16) and N_k the label
  count of row k over the global batch (`block_label_counts`), as the EAGLE-3 objective
  normalizes each TTT step. SpecForge divides by Σ γ_k N_k instead: the same per-position
  balance (N_k hardly varies with k), a different overall scale.
* Weighting "dpace" instead (speculators' DFlash default, `dpace_weights`): row k of a block
  weighs W_k = Σ_{j>=k, m_j} Π_{i<=j} s_i with s_i = (1 - α) q_i + α (s_i = 1 without a label),
  q_i = exp(-CE_i) the drafter's current probability of the label (with soft labels, of the
  target's greedy token: what verification accepts), held constant (no gradient).
  With s_i = q_i, W_k = ∂E[accepted] / ∂log q_k: each row weighs what its improvement adds to the
  expected acceptance of its block. The loss is Σ W · CE / Σ_k N_k.
* Statistics per row k, in the rows of `ttt.STAT_ROWS` so `ttt.summarize` reads them: row k is
  a trial when rows 1 .. k-1 of its block hit the target's greedy token (verification accepts
  a prefix), so α_k = P(row k hits | rows < k hit) and τ = 1 + Σ_k Π_{j≤k} α_j, K = B - 1.

The logits cover the target's whole vocabulary (the engines use the target's LM head), so the
cross-entropy runs in row chunks (`LinearCrossEntropy`): memory O(chunk × V), not O(rows × V).
Forward takes each row's gradient as well, so backward recomputes no logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from draftflow.drafters.dflash import LABELS, WEIGHTINGS, AnchoredBlocks, DFlashDrafter
from draftflow.drafters.ttt import STAT_ROWS, TargetInfo, _logits_fp32


# ---------------------------------------------------------------- anchors (data loader side)


def choose_anchors(loss_mask: np.ndarray, cap: int, rng: np.random.Generator | None) -> np.ndarray:
    """Sorted anchor positions of one sample: loss positions a <= T - 2 (a label follows), at
    most `cap`: a random subset with `rng`, else an evenly spaced one (deterministic)."""
    T = len(loss_mask)
    valid = np.flatnonzero(np.asarray(loss_mask[: max(T - 1, 0)], dtype=bool))
    if len(valid) <= cap:
        return valid
    if rng is None:
        return valid[np.linspace(0, len(valid) - 1, cap).round().astype(np.int64)]
    return np.sort(rng.choice(valid, cap, replace=False))


def pad_anchors(per_sample: list[np.ndarray]) -> torch.Tensor:
    """[B, n_max] int64, -1 where a sample has fewer anchors (a block that counts nowhere)."""
    n = max(1, max((len(a) for a in per_sample), default=0))
    out = torch.full((len(per_sample), n), -1, dtype=torch.int64)
    for b, a in enumerate(per_sample):
        out[b, : len(a)] = torch.from_numpy(np.asarray(a, dtype=np.int64))
    return out


def block_label_positions(anchors: torch.Tensor, block_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [B, n] -> (positions a+k [B, n, B-1] clamped to the sequence, in-range [B, n, B-1]
    for a real anchor with a+k < length), k = 1 .. B-1."""
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[..., None] + k
    ok = (anchors[..., None] >= 0) & (pos < length)
    return pos.clamp(0, length - 1), ok


def label_weights(loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, n, B-1] bool: block row k of anchor a has a label (a real anchor, a+k < T, m_{a+k})."""
    pos, ok = block_label_positions(anchors, block_size, loss_mask.shape[1])
    return ok & torch.gather(loss_mask.bool()[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos)


def block_label_counts(loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B-1] int64: labels of each block row over the batch (the loss normalizer N_k)."""
    return label_weights(loss_mask, anchors, block_size).sum(dim=(0, 1)).to(torch.int64)


def dpace_weights(ce: torch.Tensor, rows: tuple[torch.Tensor, ...], labelled: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's weight of every labelled row, [R] in the order of `rows` (labelled.nonzero()).

    ce [R]: each labelled row's cross-entropy (detached here); labelled [B, n, K] bool.
    W_k = Σ_{j>=k} m_j Π_{i<=j} s_i, s_i = (1 - alpha) exp(-CE_i) + alpha, s_i = 1 where m_i = 0."""
    s = torch.ones(labelled.shape, dtype=ce.dtype, device=ce.device)  # [B, n, K]
    s[rows] = (1.0 - alpha) * torch.exp(-ce.detach()) + alpha
    reach = s.cumprod(dim=2) * labelled  # Π_{i<=j} s_i, only where row j has a label
    return reach.flip(2).cumsum(2).flip(2)[rows]  # suffix sums over j >= k


# ---------------------------------------------------------------- target side


def _logits(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows @ weight.T in fp32 at least (float64 stays float64: exact tests)."""
    if torch.float64 in (rows.dtype, weight.dtype):
        return rows.double() @ weight.double().T
    return _logits_fp32(rows, weight)


class ArgmaxHead(nn.Module):
    """The target's frozen LM head on stored final states: only its greedy token (full vocab).

    keep_final (labels "soft"): TargetInfo's first field carries the final states themselves
    [B, T, H] instead of probabilities; the objective recomputes the target's logits for its
    labelled rows only, chunk by chunk, rather than holding [B, T, V] (V = 49,152 for SmolLM2:
    200 MB of float32 for one 1,024-token sample)."""

    def __init__(self, weight: torch.Tensor, keep_final: bool = False):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone(), persistent=False)  # [V, H]
        self.keep_final = keep_final

    @torch.no_grad()
    def forward(self, final: torch.Tensor, chunk_tokens: int = 4096) -> TargetInfo:
        B, T, H = final.shape
        rows = final.reshape(B * T, H).split(chunk_tokens)
        argmax = torch.cat([_logits(r, self.weight).argmax(-1) for r in rows]).view(B, T)
        return TargetInfo(final if self.keep_final else final.new_zeros(B, T, 0), argmax)


def ce_chunk_stats(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's forward: logits z [c, V] (fp32 or float64), labels y [c] -> (log-sum-exp [c],
    cross-entropy [c], argmax [c])."""
    lse = torch.logsumexp(z, dim=-1)
    return lse, lse - z.gather(1, y[:, None])[:, 0], z.argmax(-1)


def ce_chunk_grad(z: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's dCE/dz = softmax(z) - onehot(y), [c, V] in `dtype`. Written out of place for
    `torch.compile` to fuse into one pass over z (the eager path, `hard_ce_chunk`, works in place
    instead: no [c, V] temporaries)."""
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == y[:, None]  # [c, V]
    return (torch.exp(z - lse[:, None]) - onehot.to(z.dtype)).to(dtype)


@dataclass(frozen=True)
class FusedChunks:
    """`ce_chunk_stats` and `ce_chunk_grad` compiled: one or two passes over each [c, V] logit
    chunk instead of eager mode's several (on an H100 the eager passes were ~100 ms of a 0.78 s
    DFlash step at the 8B bench shape; BENCHMARKS.md, "What the profiles found")."""

    stats: Callable
    grad: Callable

    @classmethod
    def compiled(cls) -> "FusedChunks":
        return cls(torch.compile(ce_chunk_stats, dynamic=True), torch.compile(ce_chunk_grad, dynamic=True))


# A chunk's outputs: (cross-entropy [c], argmax [c], the label's hard cross-entropy [c], and with a
# gradient to take dCE/dz [c, V], else None).
ChunkResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def hard_ce_chunk(z: torch.Tensor, y: torch.Tensor, grad_dtype: torch.dtype | None,
                  fused: FusedChunks | None) -> ChunkResult:  # fmt: skip
    """One chunk against hard labels y [c]: logits z [c, V] (overwritten on the eager path). With
    `grad_dtype`, also dCE/dz = softmax(z) - onehot(y) in that dtype."""
    lse, ce, pred = (fused.stats if fused is not None else ce_chunk_stats)(z, y)
    if grad_dtype is None:
        return ce, pred, ce, None
    if fused is not None:
        return ce, pred, ce, fused.grad(z, lse, y, grad_dtype)
    dz = z.sub_(lse[:, None]).exp_()  # softmax in place
    dz[torch.arange(dz.shape[0], device=dz.device), y] -= 1.0
    return ce, pred, ce, dz.to(grad_dtype)


def soft_ce_chunk(z: torch.Tensor, z_target: torch.Tensor, y: torch.Tensor,
                  grad_dtype: torch.dtype | None) -> ChunkResult:  # fmt: skip
    """One chunk against the target's distribution: drafter logits z and target logits z_target
    [c, V] (both overwritten), the target's greedy tokens y [c] -> soft cross-entropy
    -Σ p log softmax(z), argmax, the hard cross-entropy of y (D-PACE's confidence), and with
    `grad_dtype` dCE/dz = softmax(z) - p."""
    lse = torch.logsumexp(z, dim=-1)
    pred, label_ce = z.argmax(-1), lse - z.gather(1, y[:, None])[:, 0]
    p = z_target.sub_(torch.logsumexp(z_target, dim=-1, keepdim=True)).exp_()  # softmax in place
    ce = lse - torch.bmm(p[:, None, :], z[:, :, None])[:, 0, 0]  # Σ p z without a [c, V] product
    if grad_dtype is None:
        return ce, pred, label_ce, None
    return ce, pred, label_ce, z.sub_(lse[:, None]).exp_().sub_(p).to(grad_dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """(CE [R], argmax [R], label CE [R]) of logits = hidden @ weight.T against labels, in chunks
    of rows, without keeping [R, V] logits. `weight` is frozen. `fused`: the hard-label chunk
    passes as `FusedChunks` (None: eager, in place). `target_rows` [R, H] (soft labels): the CE is
    against softmax(target_rows @ weight.T), the target's distribution through the same frozen
    head; the labels (the target's greedy tokens) then only give the argmax's hard CE, the third
    output (without target_rows it is the CE itself), never differentiated.

    Each row's CE depends on its own hidden row only, so when `hidden` needs a gradient, forward
    also takes each row's dCE/dhidden = dCE/dz @ weight [R, H] and backward scales it by the
    upstream gradient: no logits are recomputed. LM-head products a chunk: two with hard labels,
    three with soft (the target's logits too), against three and five when backward recomputed."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                fused: FusedChunks | None = None, target_rows: torch.Tensor | None = None):  # fmt: skip
        if target_rows is not None and fused is not None:
            raise ValueError("soft labels run the eager chunk passes (fused=None)")
        grad_dtype = weight.dtype if ctx.needs_input_grad[0] else None
        ces, preds, label_ces, row_grads = [], [], [], []
        for i, (h, y) in enumerate(zip(hidden.split(chunk), labels.split(chunk))):
            z = _logits(h, weight)  # logits [c, V] fp32 (or float64)
            if target_rows is None:
                ce, pred, label_ce, dz = hard_ce_chunk(z, y, grad_dtype, fused)
            else:
                z_target = _logits(target_rows[i * chunk : (i + 1) * chunk], weight)  # [c, V]
                ce, pred, label_ce, dz = soft_ce_chunk(z, z_target, y, grad_dtype)
            if dz is not None:
                row_grads.append((dz @ weight).to(ce.dtype))  # dCE/dhidden [c, H]
            ces.append(ce)
            preds.append(pred)
            label_ces.append(label_ce.detach())
        ce = torch.cat(ces) if ces else hidden.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(torch.cat(row_grads) if row_grads else ce.new_zeros(0, hidden.shape[1]))
        ctx.hidden_dtype = hidden.dtype
        pred = torch.cat(preds) if preds else labels.new_zeros(0)
        label_ce = torch.cat(label_ces) if label_ces else hidden.new_zeros(0, dtype=torch.float32)
        ctx.mark_non_differentiable(pred, label_ce)
        return ce, pred, label_ce

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_pred, _grad_label_ce):
        (row_grad,) = ctx.saved_tensors  # [R, H]
        grad = (grad_ce[:, None].to(row_grad.dtype) * row_grad).to(ctx.hidden_dtype)
        return grad, None, None, None, None, None


# ---------------------------------------------------------------- the objective


class DFlashObjective(nn.Module):
    """The training forward as one module call (what DDP/FSDP wrap): loss and statistics
    [len(STAT_ROWS), B-1], same call as `ttt.TTTObjective` plus the batch's anchors."""

    def __init__(self, drafter: DFlashDrafter, decay: float, labels: str = "target", compile: bool = False,
                 ce_chunk: int = 4096, weighting: str = "decay", dpace_alpha: float = 0.5,
                 fused_ce: bool = False):  # fmt: skip
        super().__init__()
        if labels not in LABELS:
            raise ValueError(f"labels must be one of {LABELS}, got {labels!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.drafter, self.decay, self.labels, self.ce_chunk = drafter, decay, labels, ce_chunk
        self.weighting, self.dpace_alpha = weighting, dpace_alpha
        # compiled per-chunk cross-entropy passes (`FusedChunks`); training turns them on with
        # train.compile (H200: 5% faster a step at the same loss, `bench/train_throughput.py --fused-ce`);
        # soft labels run the eager passes (the compiled ones take hard labels)
        self.fused = FusedChunks.compiled() if fused_ce and labels != "soft" else None
        if compile:
            drafter.compile_pointwise()

    @property
    def steps(self) -> int:
        return self.drafter.block_size - 1

    def block_hidden(self, input_ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor,
                     anchor_column_max: Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
        """The drafting rows of every anchored block: input_ids [B, T], aux [B, T, n*H], anchors
        [B, n] on the same device -> hidden [B, n, K, H] (K = B - 1, before the LM head).
        `anchor_column_max`: the anchors' per-column maximum, known on the host (`AnchoredBlocks`)."""
        d, Bk = self.drafter, self.drafter.block_size
        B, T = input_ids.shape
        n = anchors.shape[1]
        start = anchors.clamp(min=0)
        block_pos = start[..., None] + torch.arange(Bk, device=anchors.device)  # [B, n, Bk]
        ids = torch.full((B, n, Bk), d.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = torch.gather(input_ids, 1, start)
        positions = torch.arange(T, device=anchors.device).expand(B, T)
        context_kv = d.context_kv(d.context(aux), positions)
        attend = AnchoredBlocks(context_kv, anchors, Bk, anchor_column_max=anchor_column_max)
        hidden = d.forward_blocks(ids.view(B, n * Bk), block_pos.view(B, n * Bk), attend)
        return hidden.view(B, n, Bk, -1)[:, :, 1:]  # row 0 holds the anchor's own token: no draft

    def forward(self, input_ids, loss_mask, aux, target_final, target_argmax, normalizer=None, anchors=None,
                anchor_column_max=None):  # fmt: skip
        """input_ids, loss_mask [B, T]; aux [B, T, n*H]; target_argmax [B, T] target ids (z_t's
        argmax); target_final [B, T, H]: the stored final states, read with labels "soft" only
        (`ArgmaxHead(keep_final=True)`); anchors [B, n] (-1: padding); normalizer [B-1] label counts
        (default: this batch's); anchor_column_max: the anchors' per-column maximum as host integers
        (`Batch.anchor_column_max`)."""
        d, Bk = self.drafter, self.drafter.block_size
        T = input_ids.shape[1]
        device = input_ids.device
        if anchors is None:
            raise ValueError("DFlash needs the batch's anchors")
        anchors = anchors.to(device)
        n = anchors.shape[1]
        hidden = self.block_hidden(input_ids, aux, anchors, anchor_column_max)  # [B, n, K, H]

        pos, _ = block_label_positions(anchors, Bk, T)  # [B, n, K]: a + k
        w = label_weights(loss_mask, anchors, Bk)  # [B, n, K]
        greedy = torch.gather(target_argmax[:, None, :].expand(-1, n, -1), 2, (pos - 1).clamp(min=0))  # g_{a+k}: z_{a+k-1}
        labels = greedy if self.labels != "data" else torch.gather(input_ids[:, None, :].expand(-1, n, -1), 2, pos)
        rows = w.nonzero(as_tuple=True)
        target_rows = None
        if self.labels == "soft":  # z_{a+k-1}'s state for each labelled row [R, H]
            if target_final is None or target_final.shape[-1] != hidden.shape[-1]:
                raise ValueError("soft labels need the target's final states (ArgmaxHead(keep_final=True))")
            target_rows = target_final[rows[0], (pos - 1)[rows]]
        ce, pred, label_ce = LinearCrossEntropy.apply(hidden[rows], d.lm_head.weight, labels[rows], self.ce_chunk,
                                                      self.fused, target_rows)  # fmt: skip

        K = Bk - 1
        k_of = rows[2]  # block row (0-based: k - 1) of every labelled row
        loss_sum = torch.zeros(K, dtype=ce.dtype, device=device).index_add(0, k_of, ce)
        if normalizer is None:
            normalizer = w.sum(dim=(0, 1))
        normalizer = normalizer.to(device)
        if self.weighting == "dpace":
            loss = (dpace_weights(label_ce, rows, w, self.dpace_alpha) * ce).sum() / normalizer.sum().clamp(min=1)
        else:
            weights = self.decay ** torch.arange(K, device=device, dtype=ce.dtype)
            loss = (weights * loss_sum / normalizer.clamp(min=1)).sum()

        with torch.no_grad():
            hit = torch.zeros_like(w)
            hit[rows] = pred == greedy[rows]
            chain = hit.int().cumprod(dim=2).bool()  # rows 1..k all hit
            before = torch.cat([torch.ones_like(chain[..., :1]), chain[..., :-1]], dim=2)
            stats = torch.stack([
                loss_sum.detach(), w.sum(dim=(0, 1)), hit.sum(dim=(0, 1)), chain.sum(dim=(0, 1)),
                (before & w).sum(dim=(0, 1)),
            ]).double()  # fmt: skip
        return loss, stats


assert len(STAT_ROWS) == 5  # loss_sum, tokens, correct, chain_hits, chain_trials
