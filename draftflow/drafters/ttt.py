"""Training-time test (TTT): the EAGLE-3 unroll, its loss, and simulated acceptance.

Notation: tokens x_0..x_{T-1}; a_t the target's aux states and z_t its logits after reading
x_0..x_t (z_t predicts x_{t+1}); m_t = 1 when x_t is a loss (assistant) token.

Row j at step k is the (k+1)-th draft of a chain anchored at row j, as at inference:
  * input token x_{j+1+k} (teacher forced), position j+k;
  * hidden state fc(a_j) at step 0, the drafter's own output of row j at step k-1 after;
  * attention: the step-0 keys of rows 0..j (target-derived) and row j's keys of steps
    1..k (its own drafts), see `drafter.TTTCache`;
  * target: softmax of z_{j+1+k} over the draft vocabulary; weight m_{j+2+k} (the token it
    predicts is a loss token) and step weight decay**k.
Rows whose target argmax is not in the draft vocabulary are left out of the loss (the
restricted softmax would teach a distribution without the right token in it) but still
count in the normalizer and as misses in accuracy and acceptance: the drafter can never
propose that token. Each step's loss is normalized by its number of loss tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.drafters.eagle3 import Eagle3Drafter, FlexTTTCache, TTTCache
from draftflow.drafters.losses import LOSSES, SoftCrossEntropy, soft_ce  # noqa: F401 (re-exported)

# rows of the per-step statistics tensor [len(STAT_ROWS), steps]
STAT_ROWS = ("loss_sum", "tokens", "correct", "chain_hits", "chain_trials")


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, j] = x[:, j+n], padded with `fill` at the end."""
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


TTT_ATTENTIONS = ("chunked", "chunked-gqa", "flex")


def check_attention(attention: str) -> None:
    if attention not in TTT_ATTENTIONS:
        raise ValueError(f"attention must be one of {TTT_ATTENTIONS}, got {attention!r}")


def unroll(
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    steps: int,
    attn_chunk: int = 256,
    doc: torch.Tensor | None = None,
    attention: str = "chunked",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (logits [B, T, Vd], out hidden [B, T, H]) for TTT steps 0..steps-1.

    input_ids [B, T] (right-padded), aux [B, T, n_aux*H] or [B, T, n_aux, H].
    attn_chunk: query rows per attention call (speed only, see `drafter.TTTCache`).
    doc [B, T]: packed rows' sample ids (attention stays inside a sample), None: one sample a row.
    attention: "chunked" (`TTTCache`, SDPA over GQA heads expanded), "chunked-gqa" (the same with the kv
    heads as they come, SDPA's enable_gqa) or "flex" (`FlexTTTCache`; GPU training only): the same attention.
    Positions run along the row: RoPE attention depends only on position differences inside a sample.
    """
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    hidden = drafter.fuse(aux)
    check_attention(attention)
    if attention == "flex":
        cache = FlexTTTCache(drafter.num_layers, doc)
    else:
        cache = TTTCache(drafter.num_layers, attn_chunk, doc, grouped_kv=attention == "chunked-gqa")
    for k in range(steps):
        logits, hidden = drafter.forward_hidden(shift_left(input_ids, 1 + k), hidden, positions + k, cache)
        yield logits, hidden


@dataclass
class TargetInfo:
    probs: torch.Tensor  # [B, T, Vd] fp32: target softmax over the draft vocabulary at each t
    argmax: torch.Tensor  # [B, T] int64: draft id of the target's argmax, -1 if not in the draft vocab


class TargetHead(nn.Module):
    """The target's frozen LM head applied to stored final (post-norm) states.

    temperature (config `train.target_temperature`): the probabilities the loss matches are
    softmax(logits / temperature) over the draft vocabulary; 0 gives the target's argmax as a
    one-hot row (all zero where the argmax is outside the draft vocabulary: such rows carry no
    loss). The argmax, and so every acceptance statistic, does not depend on it.
    """

    def __init__(self, weight: torch.Tensor, t2d: torch.Tensor, temperature: float = 1.0):
        super().__init__()
        self.temperature = temperature
        self.register_buffer("weight", weight.detach().clone(), persistent=False)  # [V, H]
        draft_ids = torch.nonzero(t2d, as_tuple=True)[0]  # [Vd] target ids, ascending = draft order
        to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.int64)
        to_draft[draft_ids] = torch.arange(draft_ids.numel())
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        self.register_buffer("to_draft", to_draft, persistent=False)

    @torch.no_grad()
    def forward(self, final: torch.Tensor, chunk_tokens: int = 4096) -> TargetInfo:
        B, T, H = final.shape
        flat = final.reshape(B * T, H)
        probs, argmax = [], []
        for rows in flat.split(chunk_tokens):  # bounds the [n, V] logits buffer
            z = _logits_fp32(rows, self.weight)  # [n, V]
            draft_argmax = self.to_draft[z.argmax(-1)]  # [n], -1 outside the draft vocabulary
            argmax.append(draft_argmax)
            if self.temperature > 0:
                probs.append(torch.softmax(z[:, self.draft_ids].float() / self.temperature, dim=-1))
            else:
                one_hot = F.one_hot(draft_argmax.clamp(min=0), self.draft_ids.numel()).float()  # [n, Vd]
                probs.append(one_hot * (draft_argmax >= 0)[:, None])
        return TargetInfo(torch.cat(probs).view(B, T, -1), torch.cat(argmax).view(B, T))


def _logits_fp32(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows @ weight.T with fp32 output: bf16 logits would round soft targets by up to ~0.1 nats."""
    if weight.dtype in (torch.bfloat16, torch.float16) and rows.is_cuda:
        try:  # bf16 inputs, fp32 accumulate and output, at bf16 speed (CUDA, torch >= 2.8)
            return torch.mm(rows.to(weight.dtype), weight.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return rows.float() @ weight.float().T


def step_terms(
    logits: torch.Tensor, probs: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, loss=soft_ce
) -> tuple[torch.Tensor, torch.Tensor]:
    """One TTT step's loss sum and hits.

    logits [B, R, Vd] (drafter), probs [B, R, Vd] (target), target [B, R] draft ids (-1: not in
    the draft vocab), weight [B, R] bool, loss: a `losses.LOSSES` function -> (Σ loss over
    weighted in-vocab rows (scalar), hit [B, R] bool: drafter argmax == target argmax on a weighted row).
    """
    per_row = loss(logits, probs)  # [B, R]
    loss_sum = torch.where(weight & (target >= 0), per_row, 0.0).sum()
    hit = (logits.detach().argmax(-1) == target) & weight
    return loss_sum, hit


class TTTObjective(nn.Module):
    """The training forward as one module call (what DDP/FSDP wrap): TTT loss and statistics.

    compile: torch.compile the drafter's norms and MLPs and the per-step loss (`step_terms`),
    which fuses the elementwise passes eager mode makes over [tokens, Vd] logits each step.
    loss: a name of `losses.LOSSES` (config `train.loss`).
    attention: `unroll`'s; "flex" only where FlexAttention trains (CUDA); config `train.ttt_attention`.
    """

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, compile: bool = False, loss: str = "soft_ce",
                 attention: str = "chunked"):  # fmt: skip
        super().__init__()
        check_attention(attention)
        self.drafter, self.steps, self.decay, self.attention = drafter, steps, decay, attention
        self.step_terms = functools.partial(step_terms, loss=LOSSES[loss])
        if compile:
            drafter.compile_pointwise()
            self.step_terms = torch.compile(self.step_terms, dynamic=True)

    def forward(self, input_ids, loss_mask, aux, target_probs, target_argmax, normalizer=None, doc=None):
        result = ttt_loss(
            self.drafter, input_ids, loss_mask, aux, TargetInfo(target_probs, target_argmax),
            self.steps, self.decay, normalizer, self.step_terms, doc, self.attention,
        )  # fmt: skip
        return result.loss, result.stats


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, differentiable
    stats: torch.Tensor  # [len(STAT_ROWS), steps] float64, detached; sums, so they add across batches


def step_weights(mask: torch.Tensor, k: int, doc: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T-2-k] bool: row j's weight at TTT step k, m_{j+2+k}; in packed rows (`doc` [B, T])
    also j and j+2+k in the same sample (a chain never crosses into the next sample)."""
    T = mask.shape[1]
    w = mask[:, 2 + k :]
    if doc is not None:
        w = w & (doc[:, 2 + k :] == doc[:, : max(0, T - 2 - k)])
    return w


def step_token_counts(loss_mask: torch.Tensor, steps: int, doc: torch.Tensor | None = None) -> torch.Tensor:
    """[steps] int64: loss tokens of each TTT step (`step_weights` summed)."""
    mask = loss_mask.bool()
    return torch.stack([step_weights(mask, k, doc).sum() for k in range(steps)]).to(torch.int64)


def ttt_loss(
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    aux: torch.Tensor,
    target: TargetInfo,
    steps: int,
    decay: float = 0.8,
    normalizer: torch.Tensor | None = None,
    terms=step_terms,
    doc: torch.Tensor | None = None,
    attention: str = "chunked",
) -> TTTResult:
    """Unroll `steps` TTT steps and return the loss and per-step statistics.

    input_ids, loss_mask [B, T]; aux [B, T, n_aux*H]; target from `TargetHead`.
    normalizer [steps]: loss tokens per step to divide by (pass the global count under
    data parallelism); default: this batch's own counts. terms: `step_terms` or a compiled copy.
    doc [B, T]: packed rows' sample ids (-1 padding); None: one sample per row.
    """
    B, T = input_ids.shape
    mask = loss_mask.bool()
    if normalizer is None:
        normalizer = step_token_counts(mask, steps, doc)
    normalizer = normalizer.to(input_ids.device).clamp(min=1)
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # rows with no miss yet
    loss = torch.zeros((), device=input_ids.device)
    stats = []
    for k, (logits, _) in enumerate(unroll(drafter, input_ids, aux, steps, doc=doc, attention=attention)):
        R = T - 1 - k  # rows j with a target z_{j+1+k}
        if R <= 0:
            stats.append(torch.zeros(len(STAT_ROWS), dtype=torch.float64, device=input_ids.device))
            continue
        lg = logits[:, :R]  # [B, R, Vd]
        p = target.probs[:, 1 + k :]  # [B, R, Vd]
        tgt = target.argmax[:, 1 + k :]  # [B, R]
        w = F.pad(step_weights(mask, k, doc), (0, 1))  # [B, R]: m_{j+2+k}, inside row j's sample
        loss_sum, hit = terms(lg, p, tgt, w)
        loss = loss + decay**k * loss_sum / normalizer[k]
        with torch.no_grad():
            trials = chain_ok[:, :R] & w
            chain_ok = F.pad(chain_ok[:, :R] & hit, (0, T - R))
            stats.append(torch.stack([loss_sum.detach(), w.sum(), hit.sum(), chain_ok.sum(), trials.sum()]).double())
    return TTTResult(loss, torch.stack(stats, dim=1))


def acceptance_length(alphas: list[float]) -> float:
    """τ = 1 + Σ_k Π_{j≤k} α_j from per-step conditional acceptance rates (DESIGN.md §3)."""
    tau, prod = 1.0, 1.0
    for a in alphas:
        prod *= a
        tau += prod
    return tau


def summarize(stats: torch.Tensor, decay: float) -> dict:
    """Metrics from summed `TTTResult.stats`: loss (as trained), per-step loss, accuracy,
    conditional acceptance α_k and simulated (teacher-forced) acceptance length τ."""
    s = dict(zip(STAT_ROWS, stats.double().cpu().tolist()))
    steps = stats.shape[1]

    def ratio(a, b):
        return [x / y if y else 0.0 for x, y in zip(a, b)]

    step_loss = ratio(s["loss_sum"], s["tokens"])
    alpha = ratio(s["chain_hits"], s["chain_trials"])
    return {
        "loss": sum(decay**k * step_loss[k] for k in range(steps)),
        "step_loss": step_loss,
        "step_accuracy": ratio(s["correct"], s["tokens"]),
        "step_alpha": alpha,
        "tau": acceptance_length(alpha),
        "loss_tokens": int(s["tokens"][0]),
    }
