"""Speculative sampling (evaluate.temperatures > 0): the output is distributed as the target's.

Tolerance: with N draws, the empirical frequency of a token of probability p has standard
deviation σ = sqrt(p(1-p)/N). Each cell must lie within 4.5σ (+1e-9 for p = 0, where σ = 0 and
the count must be exactly 0). A correct sampler fails one cell with probability ≈ 6.8e-6, so
≤ 2.5e-4 over the ≤ 36 cells a test checks (Bonferroni); the seeds are fixed, so each run is
deterministic anyway. The same bound rejects the wrong rule "accept every draft" (its output is
distributed as the drafter's q), which shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from draftflow.evaluation.speculative import (
    DraftDistributions,
    Eagle3Proposer,
    Target,
    TargetVocabRows,
    sample_rows,
    speculative_sample,
    target_probs,
    verify_sampled,
    verify_sampled_rows,
)
from test_speculative import tiny_drafter, tiny_target


def within_bound(counts: torch.Tensor, p: torch.Tensor, n: int) -> bool:
    freq = counts.double() / n
    sigma = torch.sqrt(p * (1 - p) / n)
    return bool(((freq - p).abs() <= 4.5 * sigma + 1e-9).all())


def test_one_verify_step_emits_the_targets_distribution_on_a_toy_vocabulary():
    # p and q differ everywhere: q puts mass where p has none (token 4) and none where p has some (token 0)
    p = torch.tensor([[0.30, 0.25, 0.25, 0.20, 0.00], [0.10, 0.20, 0.30, 0.40, 0.00]], dtype=torch.float64)
    q = torch.tensor([[0.00, 0.10, 0.50, 0.10, 0.30]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(5, dtype=torch.int64)  # the first emitted token: the draft if accepted, else the resample
    drafted = torch.zeros(5, dtype=torch.int64)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g))
        a, nxt = verify_sampled(p, [d], q, g)
        first[d if a == 1 else nxt] += 1
        drafted[d] += 1
    assert within_bound(first, p[0], n), first.double() / n
    assert first[4] == 0  # never emits a token the target cannot
    assert not within_bound(drafted, p[0], n)  # "accept every draft" would emit q: the check has power


def test_deterministic_drafts_are_accepted_with_the_targets_probability():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    n = 20000
    first = torch.zeros(3, dtype=torch.int64)
    for _ in range(n):
        a, nxt = verify_sampled(p, [1], None, g)  # an n-gram draft: always token 1
        first[1 if a == 1 else nxt] += 1
    assert within_bound(first, p[0], n), first.double() / n


def test_inverse_cdf_draws_hit_each_id_in_proportion_to_its_weight_and_never_a_zero_one():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    n = 4000  # a grid of uniforms: the exact inverse CDF gives each id n * weight / total draws, +-1
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for row in weights:
        ids = sample_rows(row.expand(n, -1), grid)
        counts = torch.bincount(ids, minlength=row.numel()).double()
        assert ((counts - n * row / row.sum()).abs() <= 1).all(), counts
    # the ends of [0, 1): the first and the last id of positive weight, never a zero-weight one
    ends = torch.tensor([0.0, torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0)).item()],
                        dtype=torch.float64)  # fmt: skip
    assert sample_rows(weights[0].expand(2, -1), ends).tolist() == [1, 4]
    assert sample_rows(weights[1].expand(2, -1), ends).tolist() == [0, 5]


@pytest.mark.parametrize("drafter", ["eagle3", "deterministic"])
def test_batched_verification_draws_what_each_row_draws_alone(drafter):
    """`verify_sampled_rows` against `verify_sampled` row by row, on one random step: chains of
    different lengths (none too), a finished row, drafts that are accepted and rejected."""
    B, W, V, Vd = 6, 4, 40, 25
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, W + 1, V, generator=g) * 2
    target_ids = torch.randperm(V, generator=g)[:Vd].sort().values  # the draft vocabulary's target ids
    lengths = [4, 2, 0, 3, None, 1]  # None: a finished row
    results = {}
    for trial in range(30):
        q_logits = logits[:, :W, target_ids] + torch.randn(B, W, Vd, generator=g)
        qs = [target_probs(q_logits[:, i], 1.0) for i in range(W)]  # per position [B, Vd]
        index = torch.stack([torch.multinomial(q, 1, generator=g)[:, 0] for q in qs], 1)  # [B, W]
        if drafter == "eagle3":
            drafts = [None if n is None else target_ids[index[b, :n]].tolist() for b, n in enumerate(lengths)]
            q = DraftDistributions(qs, index, target_ids)
        else:  # prompt lookup: fixed drafts, often the target's likeliest
            drafts = [None if n is None else logits[b, :n].argmax(-1).tolist() for b, n in enumerate(lengths)]
            q = None
        alone = []
        for b, row in enumerate(drafts):
            gen = torch.Generator().manual_seed(100 * trial + b)
            rows_q = None if q is None else TargetVocabRows([qs[i][b] for i in range(W)], target_ids, V)
            alone.append(None if row is None else verify_sampled(target_probs(logits[b], 0.7), row, rows_q, gen))
        gens = [torch.Generator().manual_seed(100 * trial + b) for b in range(B)]
        batched = verify_sampled_rows(logits, drafts, q, 0.7, gens)
        assert batched == alone, (trial, batched, alone)
        results[trial] = batched
    outcomes = {a for r in results.values() for row in r if row for a in [row[0]]}
    assert len(outcomes) >= 3  # rejections at several positions and whole chains accepted were exercised


def exact_marginals(model, prompt: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P(x2, x3) of the target's own sampling after `prompt` (x1 summed out) [V, V], by enumeration."""
    def probs(ids):
        with torch.no_grad():
            return target_probs(model(torch.tensor([ids])).logits[0, -1], temperature)

    V = model.config.vocab_size
    joint = torch.zeros(V, V, dtype=torch.float64)
    p1 = probs(prompt)
    for x1 in range(V):
        p2 = probs(prompt + [x1])
        for x2 in range(V):
            joint[x2] += p1[x1] * p2[x2] * probs(prompt + [x1, x2])
    return joint


def sampled_pairs(model, aux_ids, proposer, seed: int, n: int = 1500, temperature: float = 1.0):
    """n speculative samplings of 3 tokens after [1, 2, 0] at K = 2: counts of (x2, x3) [V, V],
    their exact probabilities, n, and the drafts accepted in all."""
    prompt = [1, 2, 0]
    target, g = Target(model, aux_ids), torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    pairs, accepted = torch.zeros(V, V, dtype=torch.int64), 0
    try:
        for _ in range(n):
            out = speculative_sample(target, proposer, prompt, 2, 3, set(), temperature, g)
            pairs[out.tokens[1], out.tokens[2]] += 1
            accepted += sum(out.accepted)
    finally:
        target.close()
    return pairs, exact_marginals(model, prompt, temperature), n, accepted


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_speculative_sampling_through_the_hf_target_keeps_its_distribution():
    torch.set_num_threads(1)
    model = tiny_target(vocab=5, layers=4, seed=3)
    drafter = tiny_drafter(model, draft_vocab=3, seed=4)  # restricted draft vocab: q = 0 on tokens 3, 4
    pairs, joint, n, accepted = sampled_pairs(model, drafter.config.aux_layer_ids, Eagle3Proposer(drafter), seed=5)
    assert within_bound(pairs.flatten(), joint.flatten(), n), (pairs.double() / n - joint).abs().max()
    assert within_bound(pairs.sum(1), joint.sum(1), n) and within_bound(pairs.sum(0), joint.sum(0), n)
    assert accepted > 0  # drafts were accepted, so the acceptance path was exercised


def test_expected_simulated_acceptance_equals_chain_counts_on_certain_outcomes():
    from draftflow.evaluation.evaluate import SimulatedAcceptance

    hits = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)  # [steps, T]
    counts = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    chain = (hits & counts).int().cumprod(dim=0).sum(dim=0)
    exact, expected = SimulatedAcceptance(3), SimulatedAcceptance(3)
    exact.add(chain, counts)
    expected.add_expected(hits.double(), counts)
    assert expected.trials == exact.trials and expected.hits == exact.hits
    half = SimulatedAcceptance(2)
    half.add_expected(torch.full((2, 1), 0.5, dtype=torch.float64), torch.ones(2, 1, dtype=torch.bool))
    assert half.alpha == [0.5, 0.5] and half.tau == 1.75


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_dflash_block_sampling_through_the_hf_target_keeps_its_distribution():
    from draftflow.drafters.dflash import DFlashConfig, DFlashDrafter
    from draftflow.evaluation.speculative import DFlashProposer

    torch.set_num_threads(1)
    model = tiny_target(vocab=5, layers=4, seed=3)
    torch.manual_seed(6)
    cfg = DFlashConfig.from_target(model.config.to_dict(), num_hidden_layers=1, target_layer_ids=[0, 1, 2],
                                   block_size=3, mask_token_id=4)  # fmt: skip
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.3)
    drafter.set_target(model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone())
    drafter = drafter.to(torch.float64)
    pairs, joint, n, accepted = sampled_pairs(model, cfg.target_layer_ids, DFlashProposer(drafter), seed=7)
    assert within_bound(pairs.flatten(), joint.flatten(), n), (pairs.double() / n - joint).abs().max()
    assert accepted > 0  # block drafts were accepted: the acceptance path ran
