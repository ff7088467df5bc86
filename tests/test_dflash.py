"""DFlash: training blocks see exactly what inference drafting sees, block speculative decoding
equals greedy decoding, the objective's statistics are real decoding's acceptance, the chunked
cross-entropy is exact, anchors and mask tokens are chosen as documented, and a training run
from range folders that store more layers than the drafter reads.

The tiny target runs in float64 (no float ties between a block verify forward and single-token
forwards), so equality with greedy decoding is asserted exactly.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from draftflow.drafters.dflash import (
    AnchoredBlocks,
    ContextCache,
    DFlashConfig,
    DFlashDrafter,
    resolve_mask_token,
    spread_target_layer_ids,
)
from draftflow.drafters.dflash_loss import (
    DFlashObjective,
    FusedChunks,
    LinearCrossEntropy,
    block_label_counts,
    ce_chunk_grad,
    ce_chunk_stats,
    choose_anchors,
    dpace_weights,
    pad_anchors,
)
from draftflow.errors import DraftflowError
from draftflow.evaluation.speculative import (
    AcceptanceStats,
    DFlashProposer,
    NgramProposer,
    Target,
    greedy_decode,
    speculative_decode,
)
from test_speculative import random_prompts, tiny_target

IDS = [0, 1, 2]  # target layers the drafter reads (of 4: the last one's output is not servable)
BLOCK = 4
MASK = 63


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_drafter(model, layers: int = 2, std: float | None = 0.3, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target(model.config.to_dict(), num_hidden_layers=layers, target_layer_ids=IDS,
                                   block_size=BLOCK, mask_token_id=MASK)  # fmt: skip
    drafter = DFlashDrafter(cfg)
    if std is not None:
        drafter.reset_parameters(std=std)
    drafter.set_target(model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone())
    return drafter.to(torch.float64)


def target_data(model, prompts: list[list[int]], new: int = 24):
    """Greedy continuations of the prompts with the target's states: (ids, loss mask, aux
    [B, T, len(IDS)*H], greedy [B, T]: argmax z_t)."""
    target = Target(model, [])
    seqs = [p + greedy_decode(target, p, new, set()).tokens for p in prompts]
    target.close()
    B, T = len(seqs), max(map(len, seqs))
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, len(p) : len(s)] = True
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    aux = torch.stack([out.hidden_states[i + 1] for i in IDS], dim=2).flatten(-2)
    return ids, mask, aux, out.logits.argmax(-1)


@pytest.fixture(scope="module")
def trained():
    """A DFlash drafter fitted to the target's greedy continuations of 12 prompts (so that block
    decoding of those prompts accepts many drafts and exercises every verify path)."""
    model = tiny_target()
    prompts = random_prompts(12, model.config.vocab_size, seed=5)
    ids, mask, aux, greedy = target_data(model, prompts)
    drafter = make_drafter(model, layers=1, std=None, seed=0)
    objective = DFlashObjective(drafter, decay=float(np.exp(-1 / 7)))
    anchors = pad_anchors([choose_anchors(m.numpy(), 10**6, None) for m in mask])
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(80):
        loss, _ = objective(ids, mask, aux, None, greedy, None, anchors)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"model": model, "drafter": drafter.eval(), "prompts": prompts, "losses": losses,
            "data": (ids, mask, aux, greedy)}  # fmt: skip


# ---------------------------------------------------------------- model


def test_training_blocks_see_exactly_what_inference_drafting_sees():
    """One forward over many anchored blocks (any grouping) gives each block the hidden states
    that drafting it alone from a context cache of the rows before its anchor gives."""
    model = tiny_target()
    drafter = make_drafter(model)
    g = torch.Generator().manual_seed(0)
    T, H = 14, model.config.hidden_size
    aux = torch.randn(2, T, len(IDS), H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 60, (2, T), generator=g)
    anchors = torch.tensor([[0, 3, 7, 12], [2, 9, -1, -1]])  # -1: padding blocks
    start = anchors.clamp(min=0)
    block_pos = start[..., None] + torch.arange(BLOCK)
    block_ids = torch.full((2, 4, BLOCK), MASK)
    block_ids[..., 0] = torch.gather(ids, 1, start)
    with torch.no_grad():
        context_kv = drafter.context_kv(drafter.context(aux), torch.arange(T).expand(2, T))
        # groups of any size; context lengths as needed (bucket 1), rounded up within T (5) and past
        # T (256: zero rows appended); the lengths read from the anchors or given by the loader
        for group, bucket, column_max in ((1, 1, None), (3, 5, None), (64, 256, None), (3, 256, [2, 9, 7, 12])):
            attend = AnchoredBlocks(context_kv, anchors, BLOCK, group=group, context_bucket=bucket,
                                    anchor_column_max=column_max)  # fmt: skip
            hidden = drafter.forward_blocks(block_ids.view(2, -1), block_pos.view(2, -1), attend).view(2, 4, BLOCK, H)
            for b in range(2):
                for j, a in enumerate(anchors[b].tolist()):
                    if a < 0:
                        continue
                    cache = ContextCache(drafter.num_layers)
                    if a > 0:  # the target states of rows 0..a-1, appended in two parts as decoding does
                        for lo, hi in ((0, a // 2), (a // 2, a)):
                            if hi > lo:
                                c = drafter.context(aux[b : b + 1, lo:hi])
                                cache.append(drafter.context_kv(c, torch.arange(lo, hi)[None]))
                    alone = drafter.forward_blocks(block_ids[b : b + 1, j], block_pos[b : b + 1, j], cache)
                    torch.testing.assert_close(hidden[b, j], alone[0], rtol=1e-10, atol=1e-10)


def test_anchored_blocks_refuse_column_maxima_of_another_batch():
    anchors = torch.tensor([[0, 3], [2, 9]])
    context_kv = [(torch.zeros(2, 1, 12, 4), torch.zeros(2, 1, 12, 4))]
    with pytest.raises(ValueError, match="3 values for 2 anchor columns"):
        AnchoredBlocks(context_kv, anchors, BLOCK, anchor_column_max=[2, 9, 4])


def test_dflash_batches_carry_each_anchor_column_s_maximum_on_the_host():
    """The attention's context lengths come with the batch as host integers, in a DataLoader worker
    too, and stay on the host when the batch moves to the device (no read-back from the GPU)."""
    from functools import partial

    from draftflow.drafters.batching import AnchorPlan, collate
    from test_packing import fake_sample

    rng = np.random.default_rng(2)
    samples = [fake_sample(rng, n) for n in (9, 30, 17)]
    collate_fn = partial(collate, ttt_steps=BLOCK - 1, anchors=AnchorPlan(BLOCK, 5, seed=1, epoch=0))
    loader = torch.utils.data.DataLoader(samples, batch_size=3, collate_fn=collate_fn, num_workers=1)
    for batch in (next(iter(loader)), collate_fn(samples)):
        expected = tuple(batch.anchors.max(dim=0).values.tolist())
        assert batch.anchor_column_max == expected and all(isinstance(v, int) for v in expected)
        moved = batch.to(torch.device("cpu"))
        assert moved.extra()[1] == expected


def test_spread_layout_is_dflash_s_own():
    assert spread_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's reference drafter
    assert spread_target_layer_ids(32, 1) == [16]
    assert spread_target_layer_ids(8, 3) == [1, 3, 5]


def test_config_round_trip_and_engine_keys():
    model = tiny_target()
    cfg = make_drafter(model).config
    d = cfg.to_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"block_size": BLOCK, "target_layer_ids": IDS, "mask_token_id": MASK}
    assert d["layer_types"] == ["full_attention"] * cfg.num_hidden_layers
    assert "eagle_config" not in d and "eagle_aux_hidden_state_layer_ids" not in d  # vLLM would read those first
    assert DFlashConfig.from_dict(json.loads(json.dumps(d))) == cfg


# ---------------------------------------------------------------- objective


@pytest.mark.parametrize(
    "passes",
    ["eager", "fused", pytest.param("compiled", marks=[
        pytest.mark.slow, pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile on CPU needs a C compiler")])],
)  # fmt: skip
def test_linear_cross_entropy_equals_full_logits_cross_entropy(passes):
    """In chunks, each row's gradient taken in forward: eager in place, the out-of-place passes
    that `FusedChunks` compiles, and those compiled (dynamic shapes: the last chunk is shorter)."""
    fused = {"eager": None, "fused": FusedChunks(ce_chunk_stats, ce_chunk_grad)}.get(passes) or (
        FusedChunks.compiled() if passes == "compiled" else None
    )
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,), generator=g)
    scale = torch.rand(37, generator=g, dtype=torch.float64)
    ce, pred, label_ce = LinearCrossEntropy.apply(hidden, weight, labels, 8, fused)  # 5 chunks
    assert torch.equal(label_ce, ce.detach())  # hard labels: the label's CE is the CE
    with torch.no_grad():  # evaluation takes no row gradients: the same outputs
        again = LinearCrossEntropy.apply(hidden, weight, labels, 8, fused)
        for got, want in zip(again, (ce, pred, label_ce)):
            torch.testing.assert_close(got, want.detach())
    (ce * scale).sum().backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ weight.T
    reference = F.cross_entropy(logits, labels, reduction="none")
    (reference * scale).sum().backward()
    torch.testing.assert_close(ce, reference)
    torch.testing.assert_close(grad, hidden.grad)
    assert torch.equal(pred, logits.argmax(-1))


def test_soft_linear_cross_entropy_equals_full_logits_cross_entropy_against_the_target():
    """labels "soft": the CE against softmax(target_rows @ weight.T), in chunks, its row gradients
    taken in forward, equals -Σ p log softmax(z) from full logits with its gradient; the third
    output is the hard CE of the target's greedy token (D-PACE's confidence), and the argmax is
    the drafter's."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    target_rows = torch.randn(37, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64)
    target_logits = target_rows @ weight.T
    greedy = target_logits.argmax(-1)
    scale = torch.rand(37, generator=g, dtype=torch.float64)
    ce, pred, label_ce = LinearCrossEntropy.apply(hidden, weight, greedy, 8, None, target_rows)  # 5 chunks
    (ce * scale).sum().backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ weight.T
    reference = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    (reference * scale).sum().backward()
    torch.testing.assert_close(ce, reference)
    torch.testing.assert_close(grad, hidden.grad)
    torch.testing.assert_close(label_ce, F.cross_entropy(logits.detach(), greedy, reduction="none"))
    assert torch.equal(pred, logits.argmax(-1))
    assert not torch.allclose(ce, label_ce)  # the soft CE is not the argmax's
    with torch.no_grad():  # evaluation takes no row gradients: the same three outputs
        again = LinearCrossEntropy.apply(hidden, weight, greedy, 8, None, target_rows)
        for got, want in zip(again, (ce, pred, label_ce)):
            torch.testing.assert_close(got, want.detach())
    with pytest.raises(ValueError, match="soft labels run the eager chunk passes"):
        LinearCrossEntropy.apply(hidden, weight, greedy, 8, FusedChunks(ce_chunk_stats, ce_chunk_grad), target_rows)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_soft_label_objective_is_the_cross_entropy_against_the_target_s_distribution(trained, weighting):
    """The objective with labels "soft" on a target's real final states: its loss and gradients
    equal a full-logits reference, row k against softmax(z_{a+k-1}) through the shared head;
    D-PACE's weights from the drafter's confidence in the greedy token; statistics unchanged."""
    from draftflow.drafters.dflash_loss import ArgmaxHead, block_label_positions, label_weights

    model, drafter, (ids, mask, aux, greedy) = trained["model"], trained["drafter"], trained["data"]
    with torch.no_grad():
        final = model.model.norm(model(ids, output_hidden_states=True).hidden_states[-1])  # post-norm [B, T, H]
    head = ArgmaxHead(drafter.lm_head.weight, keep_final=True)
    target = head(final)
    assert target.probs is final and torch.equal(target.argmax, greedy)
    anchors = pad_anchors([choose_anchors(m.numpy(), 6, None) for m in mask])
    objective = DFlashObjective(drafter, decay=0.8, labels="soft", weighting=weighting, ce_chunk=7)
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, stats = objective(ids, mask, aux, target.probs, target.argmax, None, anchors)
    grads = torch.autograd.grad(loss, params)
    _, hard_stats = DFlashObjective(drafter, decay=0.8, weighting=weighting)(ids, mask, aux, None, greedy, None, anchors)
    torch.testing.assert_close(stats[1:], hard_stats[1:])  # tokens, hits and chains: against the greedy token

    labelled = label_weights(mask, anchors, BLOCK)  # [B, n, K]
    pos, _ = block_label_positions(anchors, BLOCK, ids.shape[1])
    n = anchors.shape[1]
    state = torch.gather(final[:, None].expand(-1, n, -1, -1), 2,
                         (pos - 1).clamp(min=0)[..., None].expand(-1, -1, -1, final.shape[-1]))  # [B, n, K, H]
    p = torch.softmax(state @ drafter.lm_head.weight.T, -1)
    log_q = torch.log_softmax(objective.block_hidden(ids, aux, anchors) @ drafter.lm_head.weight.T, -1)
    ce = -(p * log_q).sum(-1) * labelled  # [B, n, K]
    if weighting == "decay":
        per_row = ce.sum(dim=(0, 1)) / labelled.sum(dim=(0, 1)).clamp(min=1)
        reference = (0.8 ** torch.arange(BLOCK - 1, dtype=ce.dtype) * per_row).sum()
    else:
        labels = torch.gather(greedy[:, None, :].expand(-1, n, -1), 2, (pos - 1).clamp(min=0))
        reference = dpace_reference(ce, -log_q.gather(-1, labels[..., None])[..., 0], labelled)
    torch.testing.assert_close(loss, reference)
    for got, want in zip(grads, torch.autograd.grad(reference, params)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="soft labels need the target's final states"):
        objective(ids, mask, aux, None, greedy, None, anchors)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile on CPU needs a C compiler")
def test_compiled_objective_gives_the_eager_loss_and_gradients():
    """train.compile on DFlash: the compiled norms, MLPs and attention projections (q-norm, RoPE,
    GQA expansion in one region) give the eager loss and every parameter's gradient."""
    model = tiny_target()
    ids, mask, aux, greedy = target_data(model, random_prompts(3, model.config.vocab_size, seed=4), new=10)
    anchors = pad_anchors([choose_anchors(m.numpy(), 6, None) for m in mask])
    results = []
    for compile in (False, True):
        drafter = make_drafter(model, layers=2, std=0.3, seed=2)
        loss, _ = DFlashObjective(drafter, decay=0.5, compile=compile)(ids, mask, aux, None, greedy, None, anchors)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert eager_grads.keys() == compiled_grads.keys() and len(eager_grads) > 10
    # float32's tolerance on a float64 drafter: RMSNorm computes in float32, which inductor rounds
    # differently (the same before the projections were compiled)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def dpace_reference(ce: torch.Tensor, confidence_ce: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """Σ W·CE / N over [B, n, K] rows, W_k = Σ_{j>=k labelled} Π_{i<=j} s_i with s = 0.5 exp(-CE) + 0.5
    from `confidence_ce` held constant (1 on rows without a label): D-PACE written out, alpha 0.5."""
    s = torch.where(labelled, 0.5 * torch.exp(-confidence_ce.detach()) + 0.5, torch.ones_like(ce))
    W = torch.stack([sum(labelled[..., j] * s[..., : j + 1].prod(-1) for j in range(k, BLOCK - 1))
                     for k in range(BLOCK - 1)], dim=-1) * labelled  # fmt: skip
    return (W * ce).sum() / labelled.sum()


def test_dpace_weight_is_each_row_s_share_of_the_block_s_expected_acceptance():
    """W_k = ∂E/∂log s_k for E = Σ_j m_j Π_{i<=j} s_i (the block's expected accepted rows when
    row i is accepted with probability s_i): a row weighs what improving it adds."""
    g = torch.Generator().manual_seed(3)
    labelled = torch.rand(3, 4, 5, generator=g) < 0.7  # [B, n, K]
    labelled[0, 0] = torch.tensor([True, False, True, True, False])  # a gap: s = 1 there
    rows = labelled.nonzero(as_tuple=True)
    ce = torch.rand(len(rows[0]), generator=g, dtype=torch.float64) * 3
    alpha = 0.3
    log_s = torch.zeros(labelled.shape, dtype=torch.float64)
    log_s[rows] = torch.log((1 - alpha) * torch.exp(-ce) + alpha)
    log_s.requires_grad_(True)
    expected = (log_s.cumsum(dim=2).exp() * labelled).sum()
    expected.backward()
    torch.testing.assert_close(dpace_weights(ce, rows, labelled, alpha), log_s.grad[rows])
    # by hand, the block with a gap: s = (s0, 1, s2, s3, 1), labels at rows 0, 2, 3
    s0, s2, s3 = ((1 - alpha) * torch.exp(-ce[:3]) + alpha).tolist()
    by_hand = [s0 + s0 * s2 + s0 * s2 * s3, s0 * s2 + s0 * s2 * s3, s0 * s2 * s3]
    torch.testing.assert_close(dpace_weights(ce, rows, labelled, alpha)[:3], torch.tensor(by_hand, dtype=torch.float64))
    # alpha 1: every s is 1, row k weighs the labelled rows from k on
    ones = dpace_weights(ce, rows, labelled, 1.0)
    from_k_on = labelled.flip(2).cumsum(2).flip(2)[rows].to(ones.dtype)
    torch.testing.assert_close(ones, from_k_on)


def test_dpace_loss_is_the_weighted_cross_entropy_with_weights_held_constant(trained):
    """The objective's D-PACE loss and its gradient equal Σ W·CE / N computed from full logits,
    W from the detached confidences; rows without a label count nowhere."""
    from draftflow.drafters.dflash_loss import block_label_positions, label_weights

    drafter, (ids, mask, aux, greedy) = trained["drafter"], trained["data"]
    anchors = pad_anchors([choose_anchors(m.numpy(), 6, None) for m in mask])
    objective = DFlashObjective(drafter, decay=1.0, weighting="dpace", dpace_alpha=0.5, ce_chunk=7)
    params = [p for p in drafter.parameters() if p.requires_grad]

    loss, _ = objective(ids, mask, aux, None, greedy, None, anchors)
    grads = torch.autograd.grad(loss, params)

    labelled = label_weights(mask, anchors, BLOCK)  # [B, n, K]
    pos, _ = block_label_positions(anchors, BLOCK, ids.shape[1])
    labels = torch.gather(greedy[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos - 1)  # g_{a+k}
    logits = objective.block_hidden(ids, aux, anchors) @ drafter.lm_head.weight.T
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape) * labelled
    reference = dpace_reference(ce, ce, labelled)
    torch.testing.assert_close(loss, reference)
    for got, want in zip(grads, torch.autograd.grad(reference, params)):
        torch.testing.assert_close(got, want)


def test_dpace_settings_are_checked():
    from draftflow.drafters.dflash import DFlashSettings

    assert DFlashSettings.from_dict({"loss_weighting": "dpace"}).dpace_alpha == 0.5
    with pytest.raises(DraftflowError, match=r"train.dflash.dpace_alpha must be in \(0, 1\], got 0.0"):
        DFlashSettings.from_dict({"loss_weighting": "dpace", "dpace_alpha": 0.0})
    with pytest.raises(DraftflowError, match="train.dflash.loss_weighting must be decay or dpace, got 'pace'"):
        DFlashSettings.from_dict({"loss_weighting": "pace"})
    assert DFlashSettings.from_dict({"labels": "soft"}).labels == "soft"
    with pytest.raises(DraftflowError, match="train.dflash.labels must be target, data or soft, got 'kl'"):
        DFlashSettings.from_dict({"labels": "kl"})


def test_anchors_are_loss_positions_with_a_label_after_them():
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1], dtype=np.uint8)
    assert choose_anchors(mask, 100, None).tolist() == [2, 3, 4, 6]  # 7 is last: nothing to draft
    assert choose_anchors(mask, 2, None).tolist() == [2, 6]  # evenly spaced, deterministic
    rng = np.random.default_rng(0)
    picked = choose_anchors(mask, 3, rng)
    assert len(picked) == 3 and set(picked) <= {2, 3, 4, 6} and list(picked) == sorted(picked)
    anchors = pad_anchors([np.array([2, 4]), np.array([], dtype=np.int64)])
    assert anchors.tolist() == [[2, 4], [-1, -1]]
    loss_mask = torch.from_numpy(np.stack([mask, mask]).astype(bool))
    # rows k = 1..3 of anchor 2 label positions 3, 4, 5 (m_5 = 0); of anchor 4: 5 (m_5 = 0), 6, 7
    assert block_label_counts(loss_mask, anchors, 4).tolist() == [1, 2, 1]


def test_training_fits_and_statistics_are_decoding_acceptance(trained):
    """Loss falls; the objective's chain counts over every anchor equal those of drafting each
    block alone at inference and comparing with the target's greedy continuation."""
    losses = trained["losses"]
    assert losses[-1] < 0.3 * losses[0], losses[::10]
    drafter, (ids, mask, aux, greedy) = trained["drafter"], trained["data"]
    anchors = pad_anchors([choose_anchors(m.numpy(), 10**6, None) for m in mask])
    objective = DFlashObjective(drafter, decay=1.0)
    with torch.no_grad():
        _, stats = objective(ids, mask, aux, None, greedy, None, anchors)
    trials, hits = np.zeros(BLOCK - 1), np.zeros(BLOCK - 1)
    for b in range(ids.shape[0]):
        T = int(mask[b].nonzero().max()) + 1
        for a in anchors[b].tolist():
            if a < 0:
                continue
            cache = ContextCache(drafter.num_layers)
            if a > 0:
                cache.append(drafter.context_kv(drafter.context(aux[b : b + 1, :a]), torch.arange(a)[None]))
            block = torch.tensor([[int(ids[b, a])] + [MASK] * (BLOCK - 1)])
            with torch.no_grad():
                drafts = drafter.draft(block, torch.arange(a, a + BLOCK)[None], cache)[0, 1:].argmax(-1)
            for k in range(1, BLOCK):
                if a + k >= T or not mask[b, a + k]:
                    break
                trials[k - 1] += 1
                if drafts[k - 1] != greedy[b, a + k - 1]:
                    break
                hits[k - 1] += 1
    assert stats[4].tolist() == trials.tolist()  # chain trials
    assert stats[3].tolist() == hits.tolist()  # chain hits
    assert hits[0] > 0.5 * trials[0]


def test_sampled_simulation_is_each_block_s_expected_acceptance(trained):
    """`dflash_overlaps` gives each row of each anchored block Σ min(p, q): p the target's own
    softmax(logits / T) (its forward here, not the stored states) at the row's position, q the
    drafter's row drafted alone from a context cache. Near T = 0 it becomes the greedy hit, and
    chained it gives the objective's greedy counts."""
    from draftflow.evaluation.evaluate import SimulatedAcceptance, dflash_overlaps

    model, drafter, (ids, mask, aux, greedy) = trained["model"], trained["drafter"], trained["data"]
    b, T = 0, int(mask[0].nonzero().max()) + 1
    one = (ids[b : b + 1, :T], mask[b : b + 1, :T], aux[b : b + 1, :T])
    anchors = pad_anchors([choose_anchors(one[1][0].numpy(), 10**6, None)])
    objective = DFlashObjective(drafter, decay=1.0)
    with torch.no_grad():
        out = model(one[0], output_hidden_states=True)
    final, target_logits = out.hidden_states[-1], out.logits[0]  # [1, T, H] post-norm; [T, V]
    accept, counts = dflash_overlaps(objective, final, *one, anchors, temperature=1.0)  # [K, n]
    assert counts.any(dim=0).all()
    for j, a in enumerate(anchors[0].tolist()):
        cache = ContextCache(drafter.num_layers)
        if a > 0:
            cache.append(drafter.context_kv(drafter.context(one[2][:, :a]), torch.arange(a)[None]))
        block = torch.tensor([[int(one[0][0, a])] + [MASK] * (BLOCK - 1)])
        with torch.no_grad():
            q = torch.softmax(drafter.draft(block, torch.arange(a, a + BLOCK)[None], cache)[0, 1:], -1)  # [K, V]
        for k in range(1, BLOCK):
            if not counts[k - 1, j]:
                assert accept[k - 1, j] == 0 and (a + k >= T or not one[1][0, a + k])
                continue
            p = torch.softmax(target_logits[a + k - 1], -1)
            assert float(accept[k - 1, j]) == pytest.approx(float(torch.minimum(p, q[k - 1]).sum()), abs=1e-9)
    assert 0 < float(accept[counts].mean()) < 1

    cold, _ = dflash_overlaps(objective, final, *one, anchors, temperature=1e-9)  # one-hot p and q
    sim = SimulatedAcceptance(BLOCK - 1)
    sim.add_expected(cold, counts)
    with torch.no_grad():
        _, stats = objective(*one[:2], one[2], None, greedy[b : b + 1, :T], None, anchors)
    assert sim.trials == pytest.approx(stats[4].tolist(), abs=1e-6)
    assert sim.hits == pytest.approx(stats[3].tolist(), abs=1e-6)


# ---------------------------------------------------------------- decoding


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_block_decoding_equals_greedy_on_many_prompts(trained):
    model, drafter = trained["model"], trained["drafter"]
    target = Target(model, IDS)
    proposer = DFlashProposer(drafter)
    prompts = trained["prompts"] + random_prompts(12, model.config.vocab_size, seed=11)
    accepted = 0
    try:
        for prompt in prompts:
            reference = greedy_decode(target, prompt, 24, set())
            for k in (1, 2, BLOCK - 1, 7):  # 7 > B-1: the block drafts at most B-1
                out = speculative_decode(target, proposer, prompt, k, 24, set())
                assert out.tokens == reference.tokens, (prompt, k)
                assert max(out.proposed) <= min(k, BLOCK - 1)
                stats = AcceptanceStats(k)
                stats.add(out)
                assert 1.0 <= stats.tau <= min(k, BLOCK - 1) + 1
                accepted += sum(out.accepted)
    finally:
        target.close()
    assert accepted > 100  # the accept path ran, not only rejections


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_blocks_are_each_request_decoded_alone(trained, temperature):
    """evaluate.batch_size for DFlash: 24 prompts of different lengths in one batch, at K below,
    at and above the block's B-1 drafts: every request's tokens and acceptance equal decoding it
    alone, greedy or sampled (each row's generator drawn as a lone request draws)."""
    from draftflow.evaluation.batched import (
        BatchedDFlashProposer,
        BatchedTarget,
        RowSampling,
        batched_speculative_decode,
    )
    from draftflow.evaluation.speculative import speculative_sample

    model, drafter = trained["model"], trained["drafter"]
    prompts = trained["prompts"] + random_prompts(12, model.config.vocab_size, seed=11)
    generators = lambda: [torch.Generator().manual_seed(300 + i) for i in range(len(prompts))]  # noqa: E731
    target, batched = Target(model, IDS), BatchedTarget(model, IDS)
    accepted = 0
    try:
        for k in (1, BLOCK - 1, 7):
            if temperature == 0:
                alone = [speculative_decode(target, DFlashProposer(drafter), p, k, 24, set()) for p in prompts]
                rows = None
            else:
                alone = [speculative_sample(target, DFlashProposer(drafter), p, k, 24, set(), temperature, g)
                         for p, g in zip(prompts, generators())]  # fmt: skip
                rows = RowSampling(temperature, generators())
            together = batched_speculative_decode(batched, BatchedDFlashProposer(drafter, len(prompts)), prompts,
                                                  k, 24, set(), rows)  # fmt: skip
            assert [o.tokens for o in together] == [o.tokens for o in alone], k
            assert [(o.proposed, o.accepted) for o in together] == [(o.proposed, o.accepted) for o in alone], k
            accepted += sum(map(sum, (o.accepted for o in alone)))
    finally:
        target.close()
        batched.close()
    assert accepted > 50  # blocks were accepted, not only rejected


def test_fitted_drafter_beats_prompt_lookup_on_its_prompts(trained):
    model, drafter = trained["model"], trained["drafter"]
    target = Target(model, IDS)
    taus = {}
    try:
        for proposer in (DFlashProposer(drafter), NgramProposer()):
            stats = AcceptanceStats(BLOCK - 1)
            for prompt in trained["prompts"]:
                stats.add(speculative_decode(target, proposer, prompt, BLOCK - 1, 24, set()))
            taus[proposer.name] = stats.tau
    finally:
        target.close()
    assert taus["dflash"] > taus["ngram"] + 0.5, taus


# ---------------------------------------------------------------- mask token


def test_mask_token_is_chosen_inside_the_embedding_with_a_non_zero_row():
    from helpers_tokenizers import build_fast_tokenizer

    tok = build_fast_tokenizer("llama3", vocab_size=300)
    n = len(tok)
    embed = torch.randn(n + 8, 4)
    assert resolve_mask_token(tok, n + 8, embedding=embed) == (n, None)  # the first spare row
    embed[n : n + 3] = 0  # untrained spare rows: skipped
    assert resolve_mask_token(tok, n + 8, embedding=embed) == (n + 3, None)
    assert resolve_mask_token(tok, n, configured=5)[0] == 5
    with pytest.raises(DraftflowError, match="outside the target vocabulary"):
        resolve_mask_token(tok, n, configured=n)
    with pytest.raises(DraftflowError, match="all zeros"):
        resolve_mask_token(tok, n + 8, configured=n, embedding=embed)
    bos = tok.bos_token_id  # no spare row, no mask / reserved token: BOS starts no block
    assert resolve_mask_token(tok, n) == (bos, tok.bos_token)
    tok.add_special_tokens({"pad_token": "<|pad|>"})
    zero_bos = torch.randn(len(tok), 4)
    zero_bos[bos] = 0
    assert resolve_mask_token(tok, len(tok), embedding=zero_bos) == (tok.pad_token_id, "<|pad|>")
    zero_bos[tok.pad_token_id] = 0  # a zero pad row (padding_idx), as the builtin target has
    with pytest.raises(DraftflowError, match="set train.dflash.mask_token_id"):
        resolve_mask_token(tok, len(tok), embedding=zero_bos)
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_0|>"]})
    reserved = tok.convert_tokens_to_ids("<|reserved_special_token_0|>")
    assert resolve_mask_token(tok, len(tok)) == (reserved, "<|reserved_special_token_0|>")
    tok.add_special_tokens({"mask_token": "<|MASK|>"})
    assert resolve_mask_token(tok, len(tok)) == (tok.mask_token_id, "<|MASK|>")


def test_a_zero_mask_row_would_freeze_the_first_layer_s_attention():
    """Why the mask row must not be zero: the masked rows' queries are then exactly zero and no
    gradient reaches q_proj / k_proj of a one-layer drafter (its attention stays uniform)."""
    model = tiny_target()
    drafter = make_drafter(model, layers=1, std=0.3)
    ids, mask, aux, greedy = target_data(model, random_prompts(2, model.config.vocab_size, seed=3), new=8)
    anchors = pad_anchors([choose_anchors(m.numpy(), 4, None) for m in mask])
    original = drafter.embed_tokens.weight.clone()
    for zero in (True, False):
        embed = original.clone()
        if zero:
            embed[MASK] = 0
        drafter.set_target(embed, drafter.lm_head.weight)
        drafter.zero_grad()
        loss, _ = DFlashObjective(drafter, decay=0.5)(ids, mask, aux, None, greedy, None, anchors)
        loss.backward()
        q_grad = drafter.layers[0].self_attn.q_proj.weight.grad.abs().max().item()
        assert (q_grad == 0.0) == zero, (zero, q_grad)


# ---------------------------------------------------------------- training from range folders


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A 4-layer target and range folders storing its layers [0, 1, 2] + final (test_train's)."""
    from test_train import make_ranges, make_target

    root = tmp_path_factory.mktemp("dflash-train")
    target = make_target(root / "target")
    return {
        "root": root, "target": target, "vocab": None,
        "train": make_ranges(root / "hs" / "train", target, n=24, seed=1),
        "eval": make_ranges(root / "hs" / "eval", target, n=6, seed=2, ranges=1),
    }  # fmt: skip


def dflash_settings(**kw) -> dict:
    from test_train import settings

    base = settings(aux_layer_ids=[1, 2], method="dflash", learning_rate=1e-2)
    base["dflash"] = {"num_hidden_layers": 1, "block_size": 4, "mask_token_id": 127, "anchors_per_sample": 16}
    base.update(kw)
    return base


@pytest.mark.parametrize("weighting, labels", [("decay", "target"), ("dpace", "target"), ("dpace", "soft")])
def test_dflash_trains_from_ranges_storing_more_layers(world, tmp_path, weighting, labels):
    from draftflow.drafters.checkpoint import load_drafter
    from draftflow.drafters.train import TrainInputs, TrainSettings, run_training

    settings = dflash_settings(epochs=2)
    settings["dflash"].update(loss_weighting=weighting, labels=labels)
    s = TrainSettings.from_dict(settings)
    assert s.dflash_settings.loss_weighting == weighting
    inputs = TrainInputs(world["train"], world["eval"], world["target"], None, tmp_path / "state", tmp_path / "out")
    summary = run_training(inputs, s)
    assert 1.0 <= summary["simulated_acceptance_length"] <= 4.0
    assert len(summary["step_alpha"]) == 3  # block rows 1..3
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"block_size": 4, "target_layer_ids": [1, 2], "mask_token_id": 127}
    assert config["draftflow"]["loss_weighting"] == weighting  # how it was trained, in its record
    assert config["draftflow"]["labels"] == labels
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    drafter, cfg = load_drafter(tmp_path / "out", world["target"])
    assert isinstance(drafter, DFlashDrafter) and cfg.target_layer_ids == [1, 2]
    assert drafter.lm_head.weight.abs().sum() > 0  # the target's head, from the target folder


def test_a_method_refuses_layers_the_ranges_do_not_store(world, tmp_path):
    from draftflow.drafters.train import TrainInputs, TrainSettings, run_training

    s = TrainSettings.from_dict(dflash_settings(aux_layer_ids=[1, 3]))
    inputs = TrainInputs(world["train"], world["eval"], world["target"], None, tmp_path / "state", tmp_path / "out")
    with pytest.raises(DraftflowError, match=r"index.json.*store aux layers \[0, 1, 2\].*reads aux layers \[1, 3\]"):
        run_training(inputs, s)


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_dflash_ddp_two_processes_match_one(world, tmp_path):
    """Anchors are drawn per batch content (not per process) and the loss is normalized by the
    global label counts: two gloo processes train exactly what one process does."""
    from test_train import final_state, run_cli, run_inprocess

    extra = {k: v for k, v in dflash_settings().items() if k in ("aux_layer_ids", "method", "dflash", "learning_rate")}
    world = dict(world, vocab=world["root"] / "unused-vocab")  # run_cli passes --vocab; DFlash ignores it
    run_inprocess(dict(world, vocab=None), tmp_path / "single", tmp_path / "s1", {**extra, "grad_accum": 2})
    run_cli(world, tmp_path / "ddp", tmp_path / "s2", extra, torchrun=2)
    single, latest1 = final_state(tmp_path / "s1")
    ddp, latest2 = final_state(tmp_path / "s2")
    assert latest1["step"] == latest2["step"] >= 3
    diff = max((single[k].float() - ddp[k].float()).abs().max().item() for k in single)
    assert diff < 1e-5, diff


@pytest.mark.parametrize("key, value", [("loss", "tv"), ("norm_before_fc", True)])
def test_eagle3_only_train_options_are_refused_for_dflash(key, value):
    """train.loss and speculators' norms shape EAGLE-3's objective and model; DFlash has neither."""
    from draftflow.drafters.train import TrainSettings

    with pytest.raises(DraftflowError, match=f"{key} apply to EAGLE-3 only"):
        TrainSettings.from_dict(dflash_settings(**{key: value}))
