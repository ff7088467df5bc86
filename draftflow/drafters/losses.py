"""Per-row training losses of one TTT step (`train.loss`), drafter logits against the target.

Every loss takes logits [..., Vd] (the drafter's, over the draft vocabulary) and p [..., Vd]
(the target's softmax restricted to the draft vocabulary, rows sum to 1) and returns [...]
per-row losses; `draftflow.drafters.ttt` masks, weights and sums them. With q = softmax(logits)
and α = Σ_v min(p_v, q_v), the acceptance probability of one draft under speculative sampling
(temperature 1; the draft token is accepted with min(1, p/q)):

* `soft_ce` — -Σ_v p_v log q_v (= KL(p‖q) + H(p)), EAGLE-3's loss. It rewards q ≈ p everywhere,
  also on the tail that never decides acceptance.
* `tv` — total variation 1 - α: exactly one minus the acceptance rate at temperature 1. Its gradient
  is only the sign of p - q, weak when q and p barely overlap (a fresh drafter).
* `lk` — the hybrid "LK" loss of Samarin et al., "LK Losses: Direct Acceptance Rate
  Optimization for Speculative Decoding" (arXiv 2602.23881), as speculators 0.9 (`lk_hybrid`)
  defines it: λ·KL(p‖q) + (1 - λ)·(1 - α), λ = exp(-η·α) with α not differentiated, η = 3. KL
  leads while the overlap is small, TV takes over as it grows.
* `lk_alpha` — the paper's (and speculators' `nla`) -log α: TV's target with a 1/α larger
  gradient; equals cross-entropy when p is one-hot.
"""

from __future__ import annotations

from typing import Callable

import torch

LK_ETA = 3.0  # the paper's best hybrid setting, speculators' default
_ALPHA_FLOOR = 1e-5  # -log α stays finite when the distributions do not overlap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class SoftCrossEntropy(torch.autograd.Function):
    """-Σ_v p_v log softmax(logits)_v per row, without keeping fp32 log-probabilities for backward.

    d/dlogits = (softmax(logits) - p) · grad, recomputed from the saved (bf16) logits: saves a
    [rows, Vd] fp32 tensor per TTT step and several passes over it.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = torch.logsumexp(lf, dim=-1)  # [..]
        ce = lse - (p * lf).sum(-1)  # Σp = 1
        ctx.save_for_backward(logits, p, lse)
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, p, lse = ctx.saved_tensors
        g = logits.to(lse.dtype, copy=True).sub_(lse[..., None]).exp_().sub_(p).mul_(grad[..., None])
        return g.to(logits.dtype), None


def soft_ce(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return SoftCrossEntropy.apply(logits, p)


def overlap(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """α = Σ_v min(p_v, q_v) [...], q = softmax(logits) in fp32."""
    q = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return torch.minimum(p, q).sum(-1)


def tv(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return 1.0 - overlap(logits, p)


def kl(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) = soft CE - H(p); the entropy term has no gradient (p is the target)."""
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return soft_ce(logits, p) - entropy


def lk(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    alpha = overlap(logits, p)
    lam = torch.exp(-LK_ETA * alpha.detach())
    return lam * kl(logits, p) + (1.0 - lam) * (1.0 - alpha)


def lk_alpha(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return -torch.log(overlap(logits, p).clamp_min(_ALPHA_FLOOR))


LOSSES: dict[str, LossFn] = {"soft_ce": soft_ce, "tv": tv, "lk": lk, "lk_alpha": lk_alpha}
