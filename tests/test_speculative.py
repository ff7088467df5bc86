"""Chain speculative decoding: output equals greedy, τ bounds, per-position statistics, proposers.

The tiny target runs in float64, where a (k+1)-token verify forward and single-token forwards
give the same argmax (no float ties), so equality with greedy decoding is asserted exactly.
The builders here are reused by test_evaluate.py and test_export.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftflow.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftflow.evaluation.speculative import (
    AcceptanceStats,
    DecodeResult,
    Eagle3Proposer,
    NgramProposer,
    Target,
    greedy_decode,
    speculative_decode,
)

AUX = [0, 1, 3]  # aux layer ids of the 4-layer target (the last one included: easier drafting)


# ---------------------------------------------------------------- builders (shared)


def tiny_target(vocab: int = 64, layers: int = 4, attn_scale: float = 1.0, seed: int = 0, dtype=torch.float64):
    """A random Llama. initializer_range 0.3 gives clear argmax gaps; attn_scale < 1 shrinks the
    attention output, so the next token depends mostly on the current one (easier to draft)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attn_scale)
    return model


def tiny_drafter(
    target, aux=AUX, seed: int = 1, draft_vocab: int | None = None, std: float = 0.3, dtype=torch.float64
) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for `target`: its embedding, a draft vocab of the lowest ids.
    std 0.3 (not the training init's 0.02) makes every input, cached rows included, matter."""
    torch.manual_seed(seed)
    V = target.config.vocab_size
    Vd = draft_vocab or V
    cfg = Eagle3Config.from_target(target.config.to_dict(), draft_vocab_size=Vd, aux_layer_ids=list(aux))
    drafter = Eagle3Drafter(cfg)
    drafter.reset_parameters(std=std)
    drafter.embed_tokens.weight = target.model.embed_tokens.weight.detach().clone()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True
    drafter.set_vocab(torch.zeros(Vd, dtype=torch.int64), t2d)
    return drafter.to(dtype).eval()


def random_prompts(n: int, vocab: int, seed: int = 2, min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (n,), generator=g)
    return [torch.randint(0, vocab, (int(L),), generator=g).tolist() for L in lengths]


class ScriptedProposer:
    """Knows the greedy continuation and drafts it, wrong at draft index `wrong_at` (if any):
    a drafter whose acceptance is known exactly."""

    name = "scripted"
    needs_aux = False

    def __init__(self, full: list[int], vocab: int, wrong_at: int | None = None):
        self.full, self.vocab, self.wrong_at = full, vocab, wrong_at

    def reset(self) -> None:
        pass

    def propose(self, tokens, new_aux, k):
        assert tokens == self.full[: len(tokens)], "the decoded prefix left the greedy path"
        drafts = self.full[len(tokens) : len(tokens) + k]
        if self.wrong_at is not None and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab
        return drafts


# ---------------------------------------------------------------- fixtures

NEW = 24  # generated tokens per prompt


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The machine's cores are shared: one intra-op thread is faster for these tiny models."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    model = tiny_target()
    target = Target(model, AUX)
    prompts = random_prompts(10, model.config.vocab_size)
    references = [greedy_decode(target, p, NEW, set()) for p in prompts]
    yield model, target, prompts, references
    target.close()


def check_tau(result: DecodeResult, k: int) -> None:
    stats = AcceptanceStats(k)
    stats.add(result)
    assert result.verify_steps >= 1
    assert 1.0 <= stats.tau <= k + 1
    assert all(0 <= a <= p <= k for a, p in zip(result.accepted, result.proposed))
    # every verify step emits its accepted drafts plus one token (the last may stop early at EOS)
    assert len(result.tokens) - 1 <= sum(a + 1 for a in result.accepted)


# ---------------------------------------------------------------- the target


def test_target_captures_the_output_of_decoder_layer_i(setup):
    model, target, prompts, _ = setup
    ids = prompts[0] + [5, 6, 7]
    target.reset()
    _, aux = target.forward(ids, capture=True)  # [T, 3, H]
    with torch.no_grad():
        hf = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states  # [0] = embeddings
    # HF: hidden_states[i + 1] = output of layer i, except the last, replaced by the post-norm state
    for slot, i in enumerate(AUX[:-1]):
        torch.testing.assert_close(aux[:, slot], hf[i + 1][0], rtol=0, atol=1e-12)
    assert AUX[-1] == model.config.num_hidden_layers - 1
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(aux[:, -1]), hf[-1][0], rtol=0, atol=1e-12)


def test_greedy_decode_is_hf_greedy_generation(setup):
    model, _, prompts, references = setup
    for prompt, ref in zip(prompts[:3], references[:3]):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        assert ref.tokens == out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------- output equals greedy


@pytest.mark.parametrize("k", [1, 3, 7])
def test_eagle3_drafting_reproduces_greedy_output(setup, k):
    model, target, prompts, references = setup
    proposer = Eagle3Proposer(tiny_drafter(model))
    for prompt, ref in zip(prompts, references):
        out = speculative_decode(target, proposer, prompt, k, NEW, set())
        assert out.tokens == ref.tokens
        check_tau(out, k)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_ngram_drafting_reproduces_greedy_output_and_accepts_repeats(setup, k):
    model, target, prompts, references = setup
    stats = AcceptanceStats(k)
    for prompt, ref in zip(prompts, references):
        out = speculative_decode(target, NgramProposer(3), prompt, k, NEW, set())
        assert out.tokens == ref.tokens
        check_tau(out, k)
        stats.add(out)
    assert sum(stats.accepted) > 0  # greedy output of a random model repeats itself: lookup hits


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_scripted_drafts_give_the_exact_acceptance(setup, k, wrong_at):
    model, target, prompts, references = setup
    stats = AcceptanceStats(k)
    for prompt, ref in zip(prompts, references):
        proposer = ScriptedProposer(prompt + ref.tokens, model.config.vocab_size, wrong_at)
        out = speculative_decode(target, proposer, prompt, k, NEW, set())
        assert out.tokens == ref.tokens
        check_tau(out, k)
        stats.add(out)
        # each step accepts exactly the drafts before the wrong one
        assert out.accepted == [min(p, wrong_at) if wrong_at is not None else p for p in out.proposed]
    expected_accept = k if wrong_at is None else min(k, wrong_at)
    assert stats.alpha[:expected_accept] == [1.0] * expected_accept
    if wrong_at is not None and wrong_at < k:
        assert stats.alpha[wrong_at] == 0.0
        assert stats.reached[wrong_at + 1 :] == [0] * (k - wrong_at - 1)


def test_perfect_drafts_reach_k_plus_one(setup):
    model, target, prompts, references = setup
    k, new = 3, 1 + 4 * 5  # five full steps of 3 drafts + 1 bonus after the prompt's token
    prompt = prompts[0]
    ref = greedy_decode(target, prompt, new, set())
    out = speculative_decode(target, ScriptedProposer(prompt + ref.tokens, 64), prompt, k, new, set())
    assert out.tokens == ref.tokens and out.accepted == [3] * 5
    stats = AcceptanceStats(k)
    stats.add(out)
    assert stats.tau == k + 1 and stats.alpha == [1.0, 1.0, 1.0]


def test_eos_in_an_accepted_run_stops_like_greedy(setup):
    model, target, prompts, references = setup
    prompt, ref = prompts[1], references[1]
    eos = ref.tokens[6]  # a token greedy emits: decoding must stop right after its first occurrence
    expected = greedy_decode(target, prompt, NEW, {eos})
    assert expected.tokens[-1] == eos and len(expected.tokens) <= 7
    for k in (1, 3, 7):
        out = speculative_decode(target, ScriptedProposer(prompt + ref.tokens, 64), prompt, k, NEW, {eos})
        assert out.tokens == expected.tokens


# ---------------------------------------------------------------- proposers


def test_ngram_proposer_continues_the_most_recent_longest_match():
    p = NgramProposer(ngram_max=3)
    assert p.propose([1, 2, 3, 9, 1, 2], None, 3) == [3, 9, 1]  # suffix [1, 2] seen at 0
    assert p.propose([4, 5, 6, 7, 5, 6, 8, 4, 5, 6], None, 2) == [7, 5]  # [4, 5, 6] beats [5, 6]
    assert p.propose([7, 1, 7, 2, 7], None, 1) == [2]  # most recent earlier [7]
    assert p.propose([1, 2, 3], None, 4) == []  # no earlier occurrence
    assert p.propose([5, 5], None, 4) == [5]  # only what exists after the match
    assert NgramProposer(ngram_max=1).propose([3, 4, 9, 3, 4], None, 2) == [9, 3]


def test_eagle3_proposer_cache_rollback_matches_a_fresh_prefill(setup):
    """Drafting after two incremental updates (with a chain's draft rows cropped in between)
    equals drafting from one prefill of the same prefix."""
    model, target, prompts, references = setup
    drafter = tiny_drafter(model, seed=3)
    seq = prompts[2] + references[2].tokens
    m = len(prompts[2])
    target.reset()
    _, aux = target.forward(seq, capture=True)  # [T, 3, H]: states of the whole sequence
    incremental = Eagle3Proposer(drafter)
    incremental.propose(seq[: m + 1], aux[:m], 5)
    incremental.propose(seq[: m + 3], aux[m : m + 2], 5)
    drafts = incremental.propose(seq[: m + 7], aux[m + 2 : m + 6], 5)
    assert drafts == Eagle3Proposer(drafter).propose(seq[: m + 7], aux[: m + 6], 5)


def test_draft_vocabulary_ids_are_mapped_to_target_ids(setup):
    """With a draft vocab of target ids 32..63 (d2t = 32), every draft is a target id >= 32."""
    model, target, prompts, _ = setup
    drafter = tiny_drafter(model, seed=4, draft_vocab=32)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[32:] = True
    drafter.set_vocab(torch.full((32,), 32, dtype=torch.int64), t2d)
    target.reset()
    _, aux = target.forward(prompts[0], capture=True)
    drafts = Eagle3Proposer(drafter).propose(prompts[0] + [1], aux, 6)
    assert len(drafts) == 6 and all(32 <= d < 64 for d in drafts)
