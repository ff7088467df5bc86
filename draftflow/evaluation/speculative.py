"""Chain speculative decoding, greedy, against a Hugging Face target: the *real* acceptance length.

One verify step (batch size 1):

    tokens  x_0 .. x_{n-1} | t          t: the last emitted token, not yet in the target's KV cache
    draft   d_1 .. d_k                  the proposer, from the tokens (and the target's aux states)
    verify  target([t, d_1 .. d_k])     one forward; g_i = argmax after t, d_1 .. d_i
    accept  a = longest prefix with d_{i+1} == g_i;  emit d_1 .. d_a, g_a (the bonus token)
    rollback the KV cache to n + 1 + a entries (t and the accepted drafts)

Every emitted token is a target argmax given the emitted prefix, so the output equals plain
greedy decoding token for token (up to floating-point ties between a (k+1)-token forward and
single-token forwards). τ = tokens emitted by verify steps / verify steps, 1 ≤ τ ≤ k + 1
(DESIGN.md §3); the first token comes from the prompt's forward and is not counted.

Proposers: `Eagle3Proposer` (an EAGLE-3 drafter fed the target's aux states, captured in the
verify forward by hooks on the decoder layers: aux id i = output of decoder layer i),
`DFlashProposer` (a DFlash drafter: one forward drafts a block from the same kind of states)
and `NgramProposer` (prompt lookup, the model-free baseline). Any object with `propose` works.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import nn

from draftflow.errors import DraftflowError

# ---------------------------------------------------------------- the target


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a CausalLM (`.model.layers`) or of its decoder (`get_decoder()`),
    the same modules the hf capture engine hooks for extraction."""
    for body in (getattr(model, "model", None), model, getattr(model, "get_decoder", lambda: None)()):
        layers = getattr(body, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise DraftflowError(f"{type(model).__name__}: no decoder layers (`.model.layers`) to capture aux states from")


class Target:
    """A causal LM with a rollback-able KV cache and hooks that capture aux hidden states.

    `forward(ids)` appends ids to the cache and returns the greedy next token after each of
    them and, when capturing, their aux states [S, n_aux, H] (output of decoder layer i for
    each aux id i, in `aux_layer_ids` order).
    """

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int] = ()):
        from transformers import DynamicCache

        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        layers = _decoder_layers(model)
        bad = [i for i in self.aux_layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise DraftflowError(f"aux layer ids {bad} out of range: the target has {len(layers)} decoder layers")
        self._new_cache = lambda: DynamicCache(config=model.config)
        # transformers >= 5.24 names the argument `cache`, older versions `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None)
        self._captured: list[torch.Tensor | None] = [None] * len(self.aux_layer_ids)
        self._capture = False
        self._hooks = [layers[i].register_forward_hook(self._hook(slot)) for slot, i in enumerate(self.aux_layer_ids)]
        self.cache = self._new_cache()

    def _hook(self, slot: int):
        def hook(module, args, output):
            if self._capture:
                self._captured[slot] = (output[0] if isinstance(output, tuple) else output)[0]  # [S, H]

        return hook

    def reset(self) -> None:
        self.cache = self._new_cache()

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    def forward(
        self, ids: Sequence[int], capture: bool = False, last: int | None = None
    ) -> tuple[list[int], torch.Tensor | None]:
        """ids [S] -> (greedy next token after each of the last `last` ids (default all),
        aux [S, n_aux, H] or None). A prompt's forward needs only the last position's logits,
        which keeps a long prompt from materializing [S, vocab] logits."""
        logits, aux = self.logits(ids, capture, last)
        return logits.argmax(-1).tolist(), aux

    @torch.inference_mode()
    def logits(
        self, ids: Sequence[int], capture: bool = False, last: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `forward`, with the next-token logits [S or last, V] instead of their argmax."""
        self._capture = capture and bool(self.aux_layer_ids)
        kwargs = {self._cache_arg: self.cache}
        if last is not None and self._keep_arg:
            kwargs[self._keep_arg] = last
        try:
            x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # [1, S]
            logits = self.model(input_ids=x, use_cache=True, **kwargs).logits  # [1, S or last, V]
            logits = logits[:, -last:] if last is not None else logits
            aux = torch.stack(self._captured, dim=1) if self._capture else None  # [S, n_aux, H]
        finally:
            self._capture = False
            self._captured = [None] * len(self.aux_layer_ids)
        return logits[0], aux

    def crop(self, length: int) -> None:
        """Keep the first `length` cache entries (a negative crop works on every transformers version)."""
        extra = len(self) - length
        if extra > 0:
            self.cache.crop(-extra)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


# ---------------------------------------------------------------- proposers


class Proposer(Protocol):
    """Drafts up to k tokens continuing `tokens`.

    tokens: everything so far (prompt + emitted), ending with the token the target has not
    read yet; new_aux [S, n_aux, H]: the target's aux states for the S positions it read since
    the previous call (all of them accepted), None when the target captures none.
    """

    name: str
    needs_aux: bool

    def reset(self) -> None: ...

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, k: int) -> list[int]: ...


class Eagle3Proposer:
    """Chain drafting with an EAGLE-3 drafter (`draftflow.drafters.eagle3.Eagle3Drafter` API).

    Its KV cache holds one row per target position (target state i paired with token i+1) plus
    the rows of the last chain's drafts, which are cropped before the next call.
    """

    name = "eagle3"
    needs_aux = True

    def __init__(self, drafter):
        from draftflow.drafters.eagle3 import KVCache

        self.drafter = drafter.eval()
        self._new_cache = lambda: KVCache(drafter.num_layers)
        self.device = drafter.fc.weight.device
        self._target_ids: torch.Tensor | None = None  # sampling: each draft id's target id, read once
        self.reset()

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.rows = 0  # target-derived rows in the cache = target positions seen

    @torch.inference_mode()
    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, k: int) -> list[int]:
        return self._draft(tokens, new_aux, k)[0]

    @torch.inference_mode()
    def propose_sampled(
        self, tokens: list[int], new_aux: torch.Tensor | None, k: int, temperature: float, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]:
        """Drafts sampled from softmax(drafter logits / temperature), with that distribution over
        the target vocabulary for each draft: (drafts, q: k rows of [V] float64, `TargetVocabRows`)."""
        return self._draft(tokens, new_aux, k, (temperature, generator))

    def _draft(self, tokens, new_aux, k, sampling=None) -> tuple[list[int], torch.Tensor | None]:
        S = 0 if new_aux is None else new_aux.shape[0]
        n = self.rows
        if len(tokens) != n + S + 1:
            raise DraftflowError(f"eagle3 proposer: {len(tokens)} tokens but {n + S} target positions + 1 expected")
        self.cache.crop(n)  # drop the previous chain's draft rows
        if S == 0:
            raise DraftflowError("eagle3 proposer: no aux states for the new positions (target captures none)")
        ids = torch.tensor([tokens[n + 1 : n + 1 + S]], device=self.device)  # [1, S]: token after each state
        positions = torch.arange(n, n + S, device=self.device)[None]  # [1, S]
        hidden = self.drafter.fuse(new_aux[None].to(self.device))  # [1, S, H]
        last = torch.tensor([S - 1], device=self.device)  # the first draft comes from the last state
        logits, out, _ = self.drafter.step(ids, hidden, positions, self.cache, only_at=last)  # [1, 1, Vd]
        self.rows = n + S
        drafts: list[int] = []  # k = 0: the rows are fed, nothing is drafted
        qs: list[torch.Tensor] = []
        for i in range(k):
            if sampling is None:
                d = logits[0, -1].argmax(-1)  # draft id
            else:
                temperature, generator = sampling
                q = target_probs(logits[0, -1], temperature)  # [Vd], on the drafter's device
                d = sample_rows(q[None], torch.tensor([draw_uniform(generator)], dtype=torch.float64))[0]
                qs.append(q)
            draft = self.drafter.to_target_ids(d[None])  # [1] target id
            drafts.append(int(draft))
            if i + 1 < k:  # feed it back with the drafter's own (pre-norm) hidden state
                pos = torch.tensor([[n + S + i]], device=self.device)
                logits, out, _ = self.drafter.step(draft[:, None], out[:, -1:], pos, self.cache)
        if sampling is None:
            return drafts, None
        if self._target_ids is None:
            self._target_ids = draft_vocab_target_ids(self.drafter)
        return drafts, TargetVocabRows(qs, self._target_ids, self.drafter.config.vocab_size)


def draft_vocab_target_ids(drafter) -> torch.Tensor:
    """[Vd], on the drafter's device: the target id of each EAGLE-3 draft-vocabulary id."""
    return drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=drafter.fc.weight.device))


class DFlashProposer:
    """Block drafting with a DFlash drafter (`draftflow.drafters.dflash.DFlashDrafter` API): one
    forward drafts a whole block [last token, MASK × (B-1)] from the target states of every
    verified position, which its cache keeps as projected keys/values. Drafts are never cached,
    so nothing is rolled back; k < B-1 verifies only the block's first k drafts."""

    name = "dflash"
    needs_aux = True

    def __init__(self, drafter):
        from draftflow.drafters.dflash import ContextCache

        self.drafter = drafter.eval()
        self._new_cache = lambda: ContextCache(drafter.num_layers)
        self.device = drafter.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.rows = 0  # target positions whose states are in the cache

    @torch.inference_mode()
    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, k: int) -> list[int]:
        logits = self._block_logits(tokens, new_aux, k)
        return [] if logits is None else logits.argmax(-1).tolist()

    @torch.inference_mode()
    def propose_sampled(
        self, tokens: list[int], new_aux: torch.Tensor | None, k: int, temperature: float, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]:
        """Each draft of the block sampled from softmax(its logits / temperature): (drafts, q [k, V]
        float64, on the drafter's device). The block's positions are drafted in one forward, so draft
        i's distribution does not depend on drafts < i; verification needs only the q each draft was
        drawn from. The uniforms are drawn in the block's order."""
        logits = self._block_logits(tokens, new_aux, k)
        if logits is None:
            return [], torch.zeros(0, self.drafter.config.vocab_size, dtype=torch.float64, device=self.device)
        q = target_probs(logits, temperature)  # [k, V]
        uniforms = torch.tensor([draw_uniform(generator) for _ in range(q.shape[0])], dtype=torch.float64)
        return sample_rows(q, uniforms).tolist(), q

    def _block_logits(self, tokens: list[int], new_aux: torch.Tensor | None, k: int) -> torch.Tensor | None:
        """Feeds the new target states to the cache and drafts one block: logits [min(k, B-1), V]
        of the block's drafts, None for k = 0."""
        S = 0 if new_aux is None else new_aux.shape[0]
        n = self.rows
        if len(tokens) != n + S + 1:
            raise DraftflowError(f"dflash proposer: {len(tokens)} tokens but {n + S} target positions + 1 expected")
        if S == 0:
            raise DraftflowError("dflash proposer: no target states for the new positions (target captures none)")
        d = self.drafter
        positions = torch.arange(n, n + S, device=self.device)[None]  # [1, S]
        self.cache.append(d.context_kv(d.context(new_aux[None].to(self.device)), positions))
        self.rows = n + S
        if k == 0:
            return None
        B = d.block_size
        ids = torch.full((1, B), d.config.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = tokens[-1]  # the last emitted token, at position n + S
        block_positions = torch.arange(n + S, n + S + B, device=self.device)[None]
        logits = d.draft(ids, block_positions, self.cache)  # [1, B, V]
        return logits[0, 1 : 1 + min(k, B - 1)]


class NgramProposer:
    """Prompt lookup: find the longest suffix n-gram (n ≤ ngram_max) that occurred earlier in the
    sequence and propose the tokens that followed its most recent earlier occurrence."""

    name = "ngram"
    needs_aux = False

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise DraftflowError(f"ngram sizes must satisfy 1 <= min ({ngram_min}) <= max ({ngram_max})")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def reset(self) -> None:
        pass

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, k: int) -> list[int]:
        seq = np.asarray(tokens, dtype=np.int64)
        L = len(seq)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            # windows starting at 0 .. L-1-n: each has at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # [L-n, n]
            hits = np.flatnonzero((windows == seq[L - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []


# ---------------------------------------------------------------- decoding loops


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (the first from the prompt's forward), EOS included
    seconds: float
    proposed: list[int] = field(default_factory=list)  # drafts per verify step
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verify step

    @property
    def verify_steps(self) -> int:
        return len(self.accepted)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stop_index(new: list[int], budget: int, eos_ids: set[int]) -> int:
    """How many of `new` to keep: up to and including the first EOS, at most `budget`."""
    for i, tok in enumerate(new[:budget]):
        if tok in eos_ids:
            return i + 1
    return min(len(new), budget)


def greedy_decode(target: Target, prompt: Sequence[int], max_new_tokens: int, eos_ids: set[int]) -> DecodeResult:
    """Plain greedy decoding with the KV cache: the reference output and the speed baseline."""
    target.reset()
    _sync(target.device)
    start = time.perf_counter()
    nxt, _ = target.forward(prompt, last=1)
    tokens = [nxt[-1]]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        nxt, _ = target.forward(tokens[-1:])
        tokens.append(nxt[0])
    _sync(target.device)
    return DecodeResult(tokens, time.perf_counter() - start)


def speculative_decode(
    target: Target,
    proposer: Proposer,
    prompt: Sequence[int],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
) -> DecodeResult:
    """Greedy chain speculative decoding with at most k drafts per verify step.

    Near the end a step drafts only what the budget can still emit (k_eff = remaining - 1), so
    no verified token is thrown away for the budget; tokens after an EOS are dropped.
    """
    if k < 1:
        raise DraftflowError(f"draft tokens must be >= 1, got {k}")
    capture = proposer.needs_aux
    target.reset()
    proposer.reset()
    _sync(target.device)
    start = time.perf_counter()
    nxt, aux = target.forward(prompt, capture=capture, last=1)
    out = DecodeResult([nxt[-1]], 0.0)
    seq = list(prompt) + out.tokens  # ends with the token the target has not read yet
    while len(out.tokens) < max_new_tokens and out.tokens[-1] not in eos_ids:
        k_eff = min(k, max_new_tokens - len(out.tokens) - 1)
        drafts = proposer.propose(seq, aux, k_eff)[:k_eff]  # called at k_eff = 0 too: it consumes aux
        base = len(target)
        greedy, aux = target.forward([seq[-1], *drafts], capture=capture)  # g_i after t, d_1 .. d_i
        a = 0
        while a < len(drafts) and drafts[a] == greedy[a]:
            a += 1
        target.crop(base + 1 + a)  # keep t and the accepted drafts
        aux = aux[: a + 1] if aux is not None else None
        new = drafts[:a] + [greedy[a]]
        keep = _stop_index(new, max_new_tokens - len(out.tokens), eos_ids)
        out.tokens += new[:keep]
        seq += new[:keep]
        out.proposed.append(len(drafts))
        out.accepted.append(a)
    _sync(target.device)
    out.seconds = time.perf_counter() - start
    return out


# ---------------------------------------------------------------- sampling (temperature > 0)


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[.., V] logits -> softmax(logits / temperature) in float64, on the logits' device."""
    return torch.softmax(logits.double() / temperature, dim=-1)


def draw_uniform(generator: torch.Generator) -> float:
    """One uniform in [0, 1) from a request's own (CPU) generator: every random choice of a sampled
    decode is one of these, in the order a lone request makes them, so a request's draws do not
    depend on what it is batched with."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws, one per row: weights [R, V] >= 0 (any device; a row need not sum to 1 but
    must have mass), uniforms [R] in [0, 1) -> ids [R] on the weights' device, P(id) = weight / total.

    Row r's id is the first whose cumulative weight exceeds u_r * total: always an id of positive
    weight. Only the [R] uniforms go to the device and only the ids come back, so a batch of rows
    costs one transfer each way instead of a copy and a CPU draw per row."""
    cdf = weights.cumsum(-1)  # [R, V]
    # u < 1 keeps u * total below total after rounding (the gap is >= half an ulp of total), so the
    # search always lands inside the row
    target = uniforms.to(cdf) * cdf[:, -1]  # [R]
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V] with a uniform from `generator` (`sample_rows` of one row)."""
    u = torch.tensor([draw_uniform(generator)], dtype=torch.float64)
    return int(sample_rows(probs[None], u)[0])


def residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected draft is resampled from: max(0, p - q) [.., V], unnormalised (`sample_rows`
    normalises), or p itself where that is all zero (q = p: the draft was certain to be accepted)."""
    residual = (p - q).clamp_min_(0.0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p, out=residual)


class LazyProbs:
    """`target_probs` of a verify step's logits [n+1, V], one row at a time as `verify_sampled`
    reads it: it needs the rows up to the first rejection, not all n + 1."""

    def __init__(self, logits: torch.Tensor, temperature: float):
        self.logits, self.temperature = logits, temperature

    def __getitem__(self, i: int) -> torch.Tensor:
        return target_probs(self.logits[i], self.temperature)


class TargetVocabRows:
    """Draft distributions over the draft vocabulary ([Vd] float64 each), read as rows over the
    target vocabulary ([V], zero outside the draft vocabulary), each built when first read."""

    def __init__(self, draft_probs: list[torch.Tensor], target_ids: torch.Tensor, vocab_size: int):
        self.draft_probs, self.target_ids, self.vocab_size = draft_probs, target_ids, vocab_size  # target_ids [Vd]

    def __len__(self) -> int:
        return len(self.draft_probs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return TargetVocabRows(self.draft_probs[i], self.target_ids, self.vocab_size)
        return spread_over_target_vocab(self.draft_probs[i], self.target_ids, self.vocab_size)


def spread_over_target_vocab(probs: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """probs [.., Vd] over a draft vocabulary -> [.., V] over the target's, zero outside target_ids [Vd]."""
    out = torch.zeros(*probs.shape[:-1], vocab_size, dtype=probs.dtype, device=probs.device)
    out[..., target_ids.to(probs.device)] = probs
    return out


def verify_sampled(
    p: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling's verification of one chain (Leviathan et al. 2023, Chen et al. 2023).

    p [n+1, V]: the target's distribution after t, d_1 .. d_n (row i decides d_{i+1}, row n the
    bonus); q [n, V]: the distribution each draft was sampled from (None: deterministic drafts,
    q = one-hot). Draft i is accepted with probability min(1, p_i(d)/q_i(d)); the first rejected
    one is replaced by a sample of norm(max(0, p_i - q_i)), and if all are accepted a bonus token
    comes from p_n. Every emitted token is then distributed exactly as the target's own sampling.
    p and q are read row by row (p[i] -> [V]): tensors, or `LazyProbs` / `TargetVocabRows`.
    `verify_sampled_rows` is the same for a batch of chains, drawing the same tokens.
    Returns (accepted drafts a, the token emitted after them).
    """
    for i, d in enumerate(drafts):
        p_i = p[i]
        q_i = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p_i.shape[-1]).to(p_i)
        if draw_uniform(generator) * float(q_i[d]) < float(p_i[d]):
            continue  # u < p/q, written without dividing (q_i(d) > 0: d was drawn from q_i)
        return i, _sample(residual_weights(p_i, q_i), generator)
    return len(drafts), _sample(p[len(drafts)], generator)


@dataclass
class DraftDistributions:
    """What a batch of rows' sampled drafts were drawn from, on the drafter's device.

    probs[i] [B, Vq] float64: draft i of row b was drawn from probs[i][b], at index index[b, i] of Vq;
    target_ids [Vq]: the target id of each index (EAGLE-3's draft vocabulary), None when Vq is the
    target vocabulary (DFlash). One tensor a position, as drafted: nothing is stacked."""

    probs: Sequence[torch.Tensor]
    index: torch.Tensor
    target_ids: torch.Tensor | None = None

    def at_drafts(self, rows: torch.Tensor, position: int) -> torch.Tensor:
        """rows [R] -> [R]: q(d), the probability the draft at `position` of each row was drawn with."""
        rows = rows.to(self.index.device)  # the drafter's device, which may not be the target's
        return self.probs[position][rows].gather(-1, self.index[rows, position][:, None])[:, 0]

    def rows(self, rows: Sequence[int], positions: Sequence[int], vocab_size: int) -> torch.Tensor:
        """[R, V]: row rows[r]'s distribution at positions[r], over the target vocabulary."""
        picked = torch.stack([self.probs[i][b] for b, i in zip(rows, positions)])  # [R, Vq]
        return picked if self.target_ids is None else spread_over_target_vocab(picked, self.target_ids, vocab_size)


def verify_sampled_rows(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int] | None],
    q: DraftDistributions | None,
    temperature: float,
    generators: Sequence[torch.Generator],
) -> list[tuple[int, int] | None]:
    """`verify_sampled` for every row of one batched verify step, with the same draws per row.

    logits [B, 1 + W, V] (any device): the target after row b's t, d_1 .. d_W; drafts[b]: the n_b <= W
    drafts row b verifies (None: a finished row, which draws nothing); q: what they were drawn from
    (None: deterministic drafts). Position by position, the rows still accepting get their p(d) and
    q(d) computed together on the device and their acceptance tests drawn on the host: the rows of p
    that one row at a time would read, with one transfer a position instead of one a row. Then every
    row's residual or bonus token in one draw. Returns (a, the token emitted after the a accepted
    drafts) per row, None for a finished row."""
    device, V = logits.device, logits.shape[-1]
    live = [b for b, row in enumerate(drafts) if row is not None]
    accepted = {b: len(drafts[b]) for b in live}
    residual_p: dict[int, torch.Tensor] = {}  # row -> p at its rejected position [V]
    testing = [b for b in live if drafts[b]]
    position = 0
    while testing:
        rows = torch.tensor(testing, device=device)
        ids = torch.tensor([drafts[b][position] for b in testing], device=device)
        p = target_probs(logits[rows, position], temperature)  # [R, V]
        p_d = p.gather(-1, ids[:, None])[:, 0]
        q_d = q.at_drafts(rows, position).to(p_d) if q is not None else torch.ones_like(p_d)
        p_d, q_d = torch.stack([p_d, q_d]).tolist()
        still = []
        for j, b in enumerate(testing):
            if draw_uniform(generators[b]) * q_d[j] < p_d[j]:
                if position + 1 < len(drafts[b]):
                    still.append(b)
            else:
                accepted[b] = position
                residual_p[b] = p[j]
        testing, position = still, position + 1
    # the token after the accepted drafts: a residual where a draft was rejected, else the bonus (one
    # uniform a row, so the two groups are drawn apart)
    tokens: dict[int, int] = {}
    bonus = [b for b in live if b not in residual_p]
    if bonus:
        rows = torch.tensor(bonus, device=device)
        at = torch.tensor([accepted[b] for b in bonus], device=device)
        uniforms = torch.tensor([draw_uniform(generators[b]) for b in bonus], dtype=torch.float64)
        tokens.update(zip(bonus, sample_rows(target_probs(logits[rows, at], temperature), uniforms).tolist()))
    if residual_p:
        rejected = list(residual_p)
        p = torch.stack([residual_p[b] for b in rejected])  # [R, V]
        if q is not None:
            q_at = q.rows(rejected, [accepted[b] for b in rejected], V).to(p)
        else:
            ids = torch.tensor([drafts[b][accepted[b]] for b in rejected], device=device)
            q_at = torch.nn.functional.one_hot(ids, V).to(p)
        uniforms = torch.tensor([draw_uniform(generators[b]) for b in rejected], dtype=torch.float64)
        tokens.update(zip(rejected, sample_rows(residual_weights(p, q_at), uniforms).tolist()))
    return [None if row is None else (accepted[b], tokens[b]) for b, row in enumerate(drafts)]


def sample_decode(
    target: Target, prompt: Sequence[int], max_new_tokens: int, eos_ids: set[int], temperature: float,
    generator: torch.Generator,
) -> DecodeResult:  # fmt: skip
    """Plain sampling from the target at `temperature`: the reference speed at this temperature."""
    target.reset()
    _sync(target.device)
    start = time.perf_counter()
    logits, _ = target.logits(prompt, last=1)
    tokens = [_sample(target_probs(logits[-1], temperature), generator)]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        logits, _ = target.logits(tokens[-1:])
        tokens.append(_sample(target_probs(logits[-1], temperature), generator))
    _sync(target.device)
    return DecodeResult(tokens, time.perf_counter() - start)


def speculative_sample(
    target: Target,
    proposer: Proposer,
    prompt: Sequence[int],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: float,
    generator: torch.Generator,
) -> DecodeResult:
    """Chain speculative sampling at `temperature` > 0: the output is distributed as the target's
    own sampling at that temperature (`verify_sampled`). Proposers with `propose_sampled` draft
    by sampling and report their distribution; others (n-gram) draft deterministically."""
    if k < 1:
        raise DraftflowError(f"draft tokens must be >= 1, got {k}")
    if temperature <= 0:
        raise DraftflowError(f"speculative sampling needs a temperature > 0, got {temperature}")
    capture = proposer.needs_aux
    sampled = hasattr(proposer, "propose_sampled")
    target.reset()
    proposer.reset()
    _sync(target.device)
    start = time.perf_counter()
    logits, aux = target.logits(prompt, capture=capture, last=1)
    out = DecodeResult([_sample(target_probs(logits[-1], temperature), generator)], 0.0)
    seq = list(prompt) + out.tokens  # ends with the token the target has not read yet
    while len(out.tokens) < max_new_tokens and out.tokens[-1] not in eos_ids:
        k_eff = min(k, max_new_tokens - len(out.tokens) - 1)
        if sampled:
            drafts, q = proposer.propose_sampled(seq, aux, k_eff, temperature, generator)
        else:
            drafts, q = proposer.propose(seq, aux, k_eff), None
        drafts = drafts[:k_eff]
        q = q[: len(drafts)] if q is not None else None
        base = len(target)
        logits, aux = target.logits([seq[-1], *drafts], capture=capture)  # [n+1, V]
        a, nxt = verify_sampled(LazyProbs(logits, temperature), drafts, q, generator)
        target.crop(base + 1 + a)  # keep t and the accepted drafts
        aux = aux[: a + 1] if aux is not None else None
        new = drafts[:a] + [nxt]
        keep = _stop_index(new, max_new_tokens - len(out.tokens), eos_ids)
        out.tokens += new[:keep]
        seq += new[:keep]
        out.proposed.append(len(drafts))
        out.accepted.append(a)
    _sync(target.device)
    out.seconds = time.perf_counter() - start
    return out


# ---------------------------------------------------------------- statistics


@dataclass
class AcceptanceStats:
    """Per-position counts over verify steps: position i (1-based) is *reached* when drafts
    1..i-1 were accepted and a draft i was proposed; α_i = accepted_i / reached_i."""

    k: int
    steps: int = 0
    emitted: int = 0  # tokens emitted by verify steps
    generated: int = 0  # all generated tokens (with the prompt forward's first)
    seconds: float = 0.0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def add(self, result: DecodeResult) -> None:
        self.steps += result.verify_steps
        self.emitted += len(result.tokens) - 1
        self.generated += len(result.tokens)
        self.seconds += result.seconds
        for proposed, accepted in zip(result.proposed, result.accepted):
            for i in range(min(proposed, accepted + 1)):
                self.reached[i] += 1
                self.accepted[i] += i < accepted

    @property
    def tau(self) -> float:
        """Real acceptance length: tokens per verify step (1 when nothing was verified)."""
        return self.emitted / self.steps if self.steps else 1.0

    @property
    def alpha(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def as_json(self) -> dict:
        return {
            "draft_tokens": self.k,
            "acceptance_length": self.tau,
            "alpha": self.alpha,
            "accepted": self.accepted,
            "reached": self.reached,
            "verify_steps": self.steps,
            "generated_tokens": self.generated,
            "seconds": self.seconds,
            "tokens_per_second": self.generated / self.seconds if self.seconds else None,
        }
