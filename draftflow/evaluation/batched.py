"""Speculative decoding of many requests at once against a Hugging Face target (EAGLE-3, DFlash).

`speculative.speculative_decode` decodes one request per forward. A small target on a GPU is then
bound by kernel launches, not arithmetic (SmolLM2-135M: ~5 ms a forward at batch 1 on an H200), and an
evaluation of a real model takes hours. Here B requests share every forward; each keeps its own
acceptance, so each request's tokens, verify steps and accepted counts are those of decoding it alone.

Layout: every request has a row in one batched KV cache (the target's and the drafter's). A verify
step appends k+1 slots to every row; a row keeps the slots of its accepted tokens and marks the rest
invalid. Invalid slots (a shorter prompt's padding, rejected drafts, a finished row's filler) stay in
the cache but no query attends to them (a [B, L] mask); positions come from each row's own count of
valid slots, so rotary embeddings see exactly the positions of the unbatched decode.

    step  rows b:  [t_b, d_b1 .. d_bk]        one target forward for all rows
          keep     1 + a_b slots of row b      a_b = accepted drafts (≤ the row's k_eff)

Batched: the plain reference decode (`batched_reference`), EAGLE-3 chains, DFlash blocks and prompt
lookup, greedy and sampled (`batched_speculative_decode`; sampling, each row draws from its own
generator in the order a lone request draws). A row may verify fewer drafts than another (prompt
lookup finds none, or the budget is nearly spent): the step is as wide as its widest row and the
rest of a row is filler that `keep` drops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.drafters.dflash import ContextCache
from draftflow.drafters.eagle3 import KVCache
from draftflow.errors import DraftflowError
from draftflow.evaluation.speculative import (
    DecodeResult,
    DraftDistributions,
    NgramProposer,
    _decoder_layers,
    _stop_index,
    _sync,
    draft_vocab_target_ids,
    draw_uniform,
    sample_rows,
    target_probs,
    verify_sampled_rows,
)


@dataclass
class RowSampling:
    """Speculative sampling's per-row state: the temperature, each row's generator (drawn in the
    order `speculative_sample` draws for that request alone) and the drafts each row verifies."""

    temperature: float
    generators: list[torch.Generator]
    k_eff: list[int] = field(default_factory=list)

    def uniforms(self, rows: Sequence[bool]) -> torch.Tensor:
        """[B] float64 (CPU): a uniform from row b's generator where rows[b], else 0 (nothing drawn)."""
        return torch.tensor([draw_uniform(g) if r else 0.0 for g, r in zip(self.generators, rows)], dtype=torch.float64)

    def sample(self, logits: torch.Tensor, rows: Sequence[bool]) -> torch.Tensor:
        """logits [B, V] -> [B] ids (device): row b sampled at the temperature where rows[b] (its
        generator draws one uniform), an arbitrary id elsewhere."""
        return sample_rows(target_probs(logits, self.temperature), self.uniforms(rows))


def batching_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot decode batched here (None: it can): the [B, L] mask with holes and explicit
    positions suit plain full-attention decoders."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "its attention uses a sliding window"
    if getattr(cfg, "final_logit_softcapping", None):
        return "its logits are soft-capped"
    if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return f"its layers are not all full attention ({sorted(set(cfg.layer_types))})"
    if not isinstance(getattr(model, "model", None), nn.Module) or model.get_output_embeddings() is None:
        return "it has no `.model` decoder with an output embedding"
    return None


class BatchedTarget:
    """A causal LM decoding B rows at once in one KV cache with per-row valid slots."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]):
        import inspect

        from transformers import DynamicCache

        why = batching_refusal(model)
        if why:
            raise DraftflowError(f"evaluate.batch_size > 1: {type(model).__name__} cannot decode batched here: {why}; "
                                 "set evaluate.batch_size to 1")  # fmt: skip
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self._new_cache = lambda: DynamicCache(config=model.config)
        # transformers >= 5.24 names the argument `cache`, older versions `past_key_values`
        params = inspect.signature(model.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._captured: list[torch.Tensor | None] = [None] * len(self.aux_layer_ids)
        layers = _decoder_layers(model)
        self._hooks = [layers[i].register_forward_hook(self._hook(slot)) for slot, i in enumerate(self.aux_layer_ids)]

    def _hook(self, slot: int):
        def hook(module, args, output):
            self._captured[slot] = output[0] if isinstance(output, tuple) else output  # [B, S, H]

        return hook

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [B, S] -> (hidden after the final norm [B, S, H], aux [B, S, n_aux, H]);
        appends S slots per row, valid until `keep` says otherwise."""
        self.valid = torch.cat([self.valid, torch.ones_like(ids, dtype=torch.bool)], dim=1)  # [B, L + S]
        out = self.model.model(input_ids=ids, attention_mask=self.valid.long(), position_ids=positions,
                               use_cache=True, **{self._cache_arg: self.cache})  # fmt: skip
        aux = torch.stack(self._captured, dim=2)  # [B, S, n_aux, H]
        self._captured = [None] * len(self.aux_layer_ids)
        return out.last_hidden_state, aux

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[torch.Tensor]]:
        """Right-padded prompts in one forward -> (each row's first greedy token, aux [len_b, n_aux, H])."""
        B, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, P, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.as_tensor(list(p), device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        positions = torch.arange(P, device=self.device).expand(B, P)
        self.cache = self._new_cache()
        self.valid = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        hidden, aux = self._forward(ids, positions)
        # padding after a prompt: its slots are never attended to (causal: the prompt's own queries come first)
        self.valid[:, :P] = torch.arange(P, device=self.device)[None] < lengths[:, None]
        self.lengths = lengths.clone()  # valid slots per row = the next position
        last = hidden[torch.arange(B, device=self.device), lengths - 1]  # [B, H]
        self.last_logits = self.model.get_output_embeddings()(last)  # [B, V]: sampling draws its first token here
        return self.last_logits.argmax(-1).tolist(), [aux[b, : len(p)] for b, p in enumerate(prompts)]

    @torch.inference_mode()
    def verify_logits(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows[b] = [t_b, d_b1 .. d_bS-1] (equal lengths) -> (next-token logits [B, S, V], aux [B, S, n_aux, H])."""
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)  # [B, S]
        S = ids.shape[1]
        positions = self.lengths[:, None] + torch.arange(S, device=self.device)[None]
        hidden, aux = self._forward(ids, positions)
        return self.model.get_output_embeddings()(hidden), aux

    @torch.inference_mode()
    def keep(self, kept: Sequence[int], appended: int) -> None:
        """Of the last `appended` slots, row b keeps its first kept[b] (0 for a finished row)."""
        L = self.valid.shape[1]
        slot = torch.arange(appended, device=self.device)[None]  # [1, S]
        kept_t = torch.as_tensor(list(kept), device=self.device)
        self.valid[:, L - appended :] = slot < kept_t[:, None]
        self.lengths += kept_t


class MaskedKVCache(KVCache):
    """The drafter's batched cache: entries appended for every row, a [B, L] mask of the valid ones;
    new queries see the valid entries and the new ones up to themselves."""

    def __init__(self, num_layers: int, batch: int, device):
        super().__init__(num_layers)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    def append(self, new_valid: torch.Tensor) -> None:
        """Before a drafter call: which of its S new entries per row are real ([B, S] bool)."""
        self.valid = torch.cat([self.valid, new_valid], dim=1)

    def attend(self, layer, q, k, v):
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        S, L = q.shape[2], k.shape[2]
        causal = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(L - S)  # [S, L]
        mask = causal[None] & self.valid[:, None, :]  # [B, S, L]
        # a query on an invalid (padding) entry still sees itself: no fully masked row (NaN-free)
        own = torch.zeros(S, L, dtype=torch.bool, device=q.device)
        own[torch.arange(S), torch.arange(L - S, L)] = True
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(mask | own[None])[:, None])

    def invalidate_from(self, length: int) -> None:
        """Entries from `length` on no longer count (the last chain's drafts)."""
        self.valid[:, length:] = False


class BatchedEagle3Proposer:
    """EAGLE-3 chains for B rows at once (the batched form of `speculative.Eagle3Proposer`); one per
    batch of requests, from its first verify step to its last."""

    def __init__(self, drafter, batch: int):
        self.drafter = drafter.eval()
        self.device = drafter.fc.weight.device
        self.cache = MaskedKVCache(drafter.num_layers, batch, self.device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)  # target positions fed per row
        self._fed = 0  # cache entries that are target-derived (the rest: the last chain's drafts)
        self._target_ids: torch.Tensor | None = None  # sampling: each draft id's target id, read once

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], next_tokens: list[list[int]], new_aux: list[torch.Tensor], k: int,
                sampling: "RowSampling | None" = None) -> tuple[list[list[int]], DraftDistributions | None]:  # fmt: skip
        """seqs: unused (the drafter reads states, not tokens);
        next_tokens[b]: the token after each of row b's new target states (aux [S_b, n_aux, H]);
        -> (k drafts per row, None) greedily; with `sampling`, row b's first k_eff[b] drafts are drawn
        from softmax(logits / T) with its own generator, as `Eagle3Proposer.propose_sampled` draws them,
        and the distributions they were drawn from (the remaining drafts are filler the caller
        ignores). Rows with no new states draft filler."""
        B = len(new_aux)
        S = max(1, max(a.shape[0] for a in new_aux))
        self.cache.invalidate_from(self._fed)  # the previous chain's drafts
        ids = torch.zeros(B, S, dtype=torch.long, device=self.device)
        aux = torch.zeros(B, S, *new_aux[0].shape[1:], dtype=new_aux[0].dtype, device=self.device)
        counts = torch.tensor([a.shape[0] for a in new_aux], device=self.device)
        for b, (toks, a) in enumerate(zip(next_tokens, new_aux)):
            n = a.shape[0]
            if n:
                ids[b, :n] = torch.as_tensor(toks[:n], device=self.device)
                aux[b, :n] = a.to(self.device)
        positions = self.positions[:, None] + torch.arange(S, device=self.device)[None]  # [B, S]
        self.cache.append(torch.arange(S, device=self.device)[None] < counts[:, None])
        last = (counts - 1).clamp(min=0)  # each row's last fed state gives its first draft
        logits, hidden, _ = self.drafter.step(ids, self.drafter.fuse(aux), positions, self.cache, only_at=last)
        self.positions += counts  # logits [B, 1, Vd], hidden [B, 1, H]
        self._fed = self.cache.valid.shape[1]
        drafts: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []  # sampling: per draft position, [B, Vd]
        choices: list[torch.Tensor] = []
        for i in range(k):
            choice = logits[:, -1].argmax(-1)  # [B] draft ids
            if sampling is not None:  # each row's own generator, only for the drafts it verifies
                drawing = [i < n for n in sampling.k_eff]
                qs.append(target_probs(logits[:, -1], sampling.temperature))
                sampled = sample_rows(qs[-1], sampling.uniforms(drawing))
                choice = torch.where(torch.tensor(drawing, device=self.device), sampled, choice)
                choices.append(choice)
            draft = self.drafter.to_target_ids(choice)  # [B] target ids
            drafts.append(draft)
            if i + 1 < k:  # fed back with the drafter's own hidden state, at the next position
                self.cache.append(torch.ones(B, 1, dtype=torch.bool, device=self.device))
                logits, hidden, _ = self.drafter.step(draft[:, None], hidden[:, -1:], (self.positions + i)[:, None],
                                                      self.cache)  # fmt: skip
        rows_out = torch.stack(drafts, dim=1).tolist() if drafts else [[] for _ in range(B)]
        if sampling is None or not qs:
            return rows_out, None
        if self._target_ids is None:
            self._target_ids = draft_vocab_target_ids(self.drafter)
        return rows_out, DraftDistributions(qs, torch.stack(choices, 1), self._target_ids)


class MaskedContextCache(ContextCache):
    """DFlash's batched context cache: the projected keys/values of every verified position, rows
    padded to one length with a [B, C] mask of the real ones; a block sees the valid context and
    all of itself (bidirectional within the block, as `dflash.ContextCache`)."""

    def __init__(self, num_layers: int, batch: int, device):
        super().__init__(num_layers)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], new_valid: torch.Tensor) -> None:
        super().append(kv)
        self.valid = torch.cat([self.valid, new_valid], dim=1)

    def attend(self, layer, q, k, v):
        sees = torch.cat([self.valid, torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)], dim=1)
        k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sees[:, None, None, :])  # [B, 1, 1, C + bs]


class BatchedDFlashProposer:
    """DFlash blocks for B rows at once (the batched form of `speculative.DFlashProposer`): one
    forward drafts every row's block from its verified positions' context; one per batch of requests."""

    def __init__(self, drafter, batch: int):
        self.drafter = drafter.eval()
        self.device = drafter.fc.weight.device
        self.cache = MaskedContextCache(drafter.num_layers, batch, self.device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)  # target positions fed per row

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], next_tokens: list[list[int]], new_aux: list[torch.Tensor], k: int,
                sampling: RowSampling | None = None) -> tuple[list[list[int]], DraftDistributions | None]:  # fmt: skip
        """As `BatchedEagle3Proposer.propose`; next_tokens[b][-1] is row b's last emitted token, the
        block's first. Drafts per row: min(k, block_size - 1); sampling draws row b's first k_eff[b]
        with its generator in the block's order, as `DFlashProposer.propose_sampled` does alone."""
        d = self.drafter
        B = len(new_aux)
        S = max(1, max(a.shape[0] for a in new_aux))
        aux = torch.zeros(B, S, *new_aux[0].shape[1:], dtype=new_aux[0].dtype, device=self.device)
        counts = torch.tensor([a.shape[0] for a in new_aux], device=self.device)
        for b, a in enumerate(new_aux):
            aux[b, : a.shape[0]] = a.to(self.device)
        positions = self.positions[:, None] + torch.arange(S, device=self.device)[None]  # [B, S]
        self.cache.append(d.context_kv(d.context(aux), positions), torch.arange(S, device=self.device)[None] < counts[:, None])
        self.positions += counts
        bs = d.block_size
        ids = torch.full((B, bs), d.config.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = torch.tensor([t[-1] if t else 0 for t in next_tokens], device=self.device)
        block_positions = self.positions[:, None] + torch.arange(bs, device=self.device)[None]
        n = min(k, bs - 1)
        logits = d.draft(ids, block_positions, self.cache)[:, 1 : 1 + n]  # [B, n, V]
        drafts = logits.argmax(-1)  # [B, n]
        if sampling is None or n == 0:
            return drafts.tolist(), None
        drawing = [[i < min(m, n) for i in range(n)] for m in sampling.k_eff]  # row by row, in block order
        uniforms = torch.stack([sampling.uniforms([row[i] for row in drawing]) for i in range(n)], 1)  # [B, n]
        q = target_probs(logits, sampling.temperature)  # [B, n, V]
        sampled = sample_rows(q.flatten(0, 1), uniforms.flatten()).view(B, n)
        drafts = torch.where(torch.tensor(drawing, device=self.device), sampled, drafts)
        return drafts.tolist(), DraftDistributions(q.unbind(1), drafts)


class BatchedNgramProposer:
    """Prompt lookup for B rows: each row's own n-gram search (`NgramProposer`) over its sequence."""

    def __init__(self, lookup: NgramProposer):
        self.lookup = lookup

    def propose(self, seqs: list[list[int]], next_tokens: list[list[int]], new_aux: list[torch.Tensor], k: int,
                sampling: RowSampling | None = None) -> tuple[list[list[int]], None]:  # fmt: skip
        """seqs[b]: row b's tokens so far -> (row b's drafts, at most k or its k_eff when sampling, None:
        deterministic drafts, verified as one-hot proposals); the states are not read."""
        caps = sampling.k_eff if sampling is not None else [k] * len(seqs)
        return [self.lookup.propose(seq, None, cap) for seq, cap in zip(seqs, caps)], None


def batched_reference(
    target: BatchedTarget,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: RowSampling | None = None,
) -> list[DecodeResult]:
    """Plain decoding of every prompt at once: greedy (each row's tokens those of `greedy_decode`)
    or, with `sampling`, each row drawing from its own generator as `sample_decode` draws alone."""
    B = len(prompts)
    _sync(target.device)
    start = time.perf_counter()
    target.prefill(prompts)
    logits = target.last_logits  # [B, V]
    outs = [DecodeResult([], 0.0) for _ in range(B)]
    done = [False] * B
    while True:
        live = [not d for d in done]
        tokens = (logits.argmax(-1) if sampling is None else sampling.sample(logits, live)).tolist()  # [B]
        for b in range(B):
            if done[b]:
                continue
            token = tokens[b]
            outs[b].tokens.append(token)
            done[b] = token in eos_ids or len(outs[b].tokens) >= max_new_tokens
        if all(done):
            break
        step, _ = target.verify_logits([[o.tokens[-1]] for o in outs])  # [B, 1, V]; finished rows feed filler
        target.keep([0 if d else 1 for d in done], 1)
        logits = step[:, 0]
    _sync(target.device)
    seconds = time.perf_counter() - start
    for o in outs:
        o.seconds = seconds / B
    return outs


def batched_speculative_decode(
    target: BatchedTarget,
    proposer: "BatchedEagle3Proposer | BatchedDFlashProposer | BatchedNgramProposer",
    prompts: Sequence[Sequence[int]],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: RowSampling | None = None,
) -> list[DecodeResult]:
    """Chain speculative decoding of every prompt at once; per prompt the DecodeResult that
    `speculative_decode` (greedy) gives it alone, or with `sampling` `speculative_sample`: row b
    draws from its own generator in the order a lone request draws (first token, then per step its
    k_eff drafts, the acceptance tests and the residual or bonus token). seconds: the batch's wall
    time shared equally (a throughput figure, not one request's latency)."""
    if sampling is not None and sampling.temperature <= 0:
        raise DraftflowError(f"speculative sampling needs a temperature > 0, got {sampling.temperature}")
    if k < 1:
        raise DraftflowError(f"draft tokens must be >= 1, got {k}")
    B = len(prompts)
    _sync(target.device)
    start = time.perf_counter()
    first, aux = target.prefill(prompts)
    if sampling is not None:
        first = sampling.sample(target.last_logits, [True] * B).tolist()
    outs = [DecodeResult([t], 0.0) for t in first]
    seqs = [list(p) + [t] for p, t in zip(prompts, first)]  # each ends with the token the target has not read
    fed = [len(p) for p in prompts]  # target positions each row has verified (and its drafter has seen)
    done = [o.tokens[-1] in eos_ids or len(o.tokens) >= max_new_tokens for o in outs]
    while not all(done):
        k_eff = [0 if d else min(k, max_new_tokens - len(o.tokens) - 1) for d, o in zip(done, outs)]
        next_tokens = [s[f - len(a) + 1 : f + 1] for s, f, a in zip(seqs, fed, aux)]
        if sampling is not None:
            sampling.k_eff = k_eff
        drafts, qs = proposer.propose(seqs, next_tokens, aux, k, sampling)  # [B][<= k]
        mine = [d[:n] for d, n in zip(drafts, k_eff)]  # what each row verifies (none for a finished row)
        width = max(len(m) for m in mine)
        rows = [[s[-1], *m] + [s[-1]] * (width - len(m)) for s, m in zip(seqs, mine)]  # filler: dropped by keep
        logits, new_aux = target.verify_logits(rows)  # [B, 1 + width, V]
        if sampling is None:
            greedy = logits.argmax(-1).tolist()
        else:  # every row's acceptance tests and next token, the probabilities computed on the device
            verdicts = verify_sampled_rows(logits, [None if d else m for d, m in zip(done, mine)], qs,
                                           sampling.temperature, sampling.generators)  # fmt: skip
        kept, aux = [], []
        for b in range(B):
            if done[b]:
                kept.append(0)
                aux.append(new_aux[b, :0])
                continue
            verified = mine[b]
            if sampling is None:
                a = 0
                while a < len(verified) and verified[a] == greedy[b][a]:
                    a += 1
                nxt = greedy[b][a]
            else:
                a, nxt = verdicts[b]
            kept.append(1 + a)
            new = verified[:a] + [nxt]
            keep = _stop_index(new, max_new_tokens - len(outs[b].tokens), eos_ids)
            outs[b].tokens += new[:keep]
            seqs[b] += new[:keep]
            fed[b] += 1 + a
            outs[b].proposed.append(len(verified))
            outs[b].accepted.append(a)
            done[b] = outs[b].tokens[-1] in eos_ids or len(outs[b].tokens) >= max_new_tokens
            # a row that ended drafts no more: no states for the proposer (an accepted EOS draft cuts
            # `new`, so its a + 1 states would outnumber the tokens kept after it)
            aux.append(new_aux[b, : 0 if done[b] else a + 1])
        target.keep(kept, 1 + width)
    _sync(target.device)
    seconds = time.perf_counter() - start
    for o in outs:
        o.seconds = seconds / B
    return outs
