"""Packed EAGLE-3 micro-batches: the plan, the rows the collate function rebuilds, and a TTT loss
on packed rows that equals the loss on the same samples one per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftflow.drafters.packing import best_fit_decreasing, plan_packed
from draftflow.drafters.batching import collate
from draftflow.drafters.train import TrainSettings, plan_micro_batches
from draftflow.drafters.ttt import TTTObjective, TargetInfo, step_token_counts, ttt_loss, unroll
from draftflow.hidden_states.storage import Sample
from test_drafter import VD, tiny_drafter


def test_best_fit_decreasing_fills_the_fullest_row_that_has_room():
    lengths = np.array([3, 4, 2, 5, 1, 7])
    rows = best_fit_decreasing([0, 1, 2, 3, 4, 5], lengths, 7)
    assert rows == [[5], [3, 2], [1, 0], [4]]
    assert best_fit_decreasing([], lengths, 7) == []


def test_plan_packed_is_a_deterministic_partition_into_full_rows_of_mixed_samples():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 200, size=3000)
    width = int(lengths.max())
    plan = plan_packed(lengths, 1000, seed=3, epoch=1)
    assert plan == plan_packed(lengths, 1000, seed=3, epoch=1)
    assert plan != plan_packed(lengths, 1000, seed=3, epoch=2)
    assert sorted(i for batch in plan for row in batch for i in row) == list(range(3000))  # every sample once
    assert all(len(batch) <= 1000 // width for batch in plan)
    assert all(lengths[row].sum() <= width for batch in plan for row in batch)
    # full rows: little padding (one sample a row pads to the longest: about half)
    assert lengths.sum() / sum(len(batch) * width for batch in plan) > 0.97
    # mixed: a micro-batch is not one length band (length-sorted padded batches were, and trained worse)
    spreads = [np.ptp(lengths[[i for row in batch for i in row]]) for batch in plan]
    assert np.median(spreads) > 150
    # evaluation keeps one deterministic plan
    assert plan_packed(lengths, 1000, 0, 0, shuffle=False) == plan_packed(lengths, 1000, 5, 3, shuffle=False)


def test_a_sample_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    plan = plan_packed(np.array([10, 500, 20]), 100, seed=0, epoch=0)
    assert sorted(plan) == [[[1]], [[2, 0]]]
    # rows are at most batch_tokens wide: one long sample does not widen every micro-batch
    plan = plan_packed(np.array([10, 500, 20, 30, 40]), 100, seed=0, epoch=0)
    assert sorted(plan) == [[[1]], [[4, 3, 2, 0]]]


def test_eagle3_packs_and_dflash_pads_one_sample_a_row():
    lengths = np.array([10, 20, 30, 40, 50])
    eagle = TrainSettings(aux_layer_ids=(0,), batch_tokens=100)
    dflash = TrainSettings(aux_layer_ids=(0,), batch_tokens=100, method="dflash", dflash={})
    assert plan_micro_batches(lengths, eagle, 0) == plan_packed(lengths, 100, 0, 0)
    assert all(len(row) == 1 for batch in plan_micro_batches(lengths, dflash, 0) for row in batch)


def fake_sample(rng: np.random.Generator, n: int, layers: int = 4, hidden: int = 32) -> Sample:
    ids = rng.integers(0, 96, size=n).astype(np.int64)
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    return Sample(ids, mask, torch.from_numpy(rng.standard_normal((n, layers, hidden)).astype(np.float32)))


def test_collate_packs_rows_with_sample_ids_and_counts_no_chain_across_samples():
    rng = np.random.default_rng(1)
    samples = [fake_sample(rng, n) for n in (5, 3, 6, 1)]
    batch = collate(samples, ttt_steps=3, rows=[[0, 1], [2, 3]])
    assert batch.input_ids.shape == (2, 8)
    assert batch.doc.tolist() == [[0] * 5 + [1] * 3, [0] * 6 + [1] + [-1]]
    assert torch.equal(batch.input_ids[0, 5:], torch.from_numpy(samples[1].input_ids))
    assert torch.equal(batch.aux[0, 5:], samples[1].aux.reshape(3, -1))
    assert batch.tokens == 15
    # loss tokens per step, counted sample by sample: what one-sample rows count
    single = collate(samples, ttt_steps=3)
    assert single.doc is None and single.input_ids.shape == (4, 6)
    assert torch.equal(batch.step_tokens, single.step_tokens)
    assert torch.equal(step_token_counts(batch.loss_mask, 3, batch.doc), batch.step_tokens)


def expected_rows(samples, rows, width, layers):
    """(aux, final) of `rows` built sample by sample, padding zero: what collate must return."""
    aux = torch.zeros(len(rows), width, len(layers) * samples[0].hidden.shape[2])
    final = torch.zeros(len(rows), width, samples[0].hidden.shape[2])
    for b, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(samples[i].input_ids)
            aux[b, start : start + n] = samples[i].aux[:, layers].reshape(n, -1)
            final[b, start : start + n] = samples[i].final
            start += n
    return aux, final


@pytest.mark.parametrize("layers", [None, [2, 0]], ids=["every stored layer", "a subset, reordered"])
def test_collate_in_a_worker_process_writes_what_it_writes_in_process(layers):
    """The batch tensors are allocated uninitialised (in shared memory in a DataLoader worker) and
    written once: every token and layer in place, padding and added rows zero, in both places."""
    from functools import partial

    rng = np.random.default_rng(5)
    samples = [fake_sample(rng, n) for n in (5, 3, 6, 1)]
    rows, pad_to = [[0, 1], [2, 3]], (3, 9)  # a third, empty row and a token of padding: packing's shape
    collate_fn = partial(collate, ttt_steps=3, rows=rows, layers=layers, pad_to=pad_to)
    loader = torch.utils.data.DataLoader(samples, batch_size=4, collate_fn=collate_fn, num_workers=1)
    in_worker = next(iter(loader))
    in_process = collate_fn(samples)
    aux, final = expected_rows(samples, rows + [[]], 9, layers or [0, 1, 2])
    for batch in (in_worker, in_process):
        assert torch.equal(batch.aux, aux) and torch.equal(batch.final, final)
        assert batch.doc.tolist()[2] == [-1] * 9 and batch.tokens == 15


def test_a_bad_read_leaves_its_row_and_an_empty_row_goes():
    from draftflow.hidden_states.storage import BadRead

    rng = np.random.default_rng(4)
    bad = BadRead("r", "s1", "k", "p", "store file missing")
    samples = [fake_sample(rng, 4), bad, fake_sample(rng, 2)]
    batch = collate(samples + [fake_sample(rng, 1)], ttt_steps=2, rows=[[0, 1], [2, 3]])
    assert batch.bad == (bad,) and batch.doc.tolist() == [[0] * 4, [0, 0, 1, -1]]
    batch = collate([bad, samples[2]], ttt_steps=2, rows=[[0], [1]])
    assert batch.input_ids.shape == (1, 2)
    assert batch.doc is None  # one sample a row: plain causal attention, no sample masks


@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_loss_on_packed_rows_equals_the_loss_on_one_sample_a_row(layers):
    """Packing changes only the layout: loss, statistics and gradients are the same (RoPE
    depends on position differences only, and attention stays inside each sample)."""
    rng = np.random.default_rng(2)
    samples = [fake_sample(rng, n) for n in (9, 4, 12, 7, 3)]
    model = tiny_drafter(layers=layers)
    head = torch.randn(96, 32, dtype=torch.float64)

    def run(batch):
        model.zero_grad()
        final = batch.final.double()
        z = final @ head.T  # [B, T, V]
        t2d = model.t2d
        probs = torch.softmax(z[..., t2d], dim=-1)
        to_draft = torch.full((96,), -1, dtype=torch.int64)
        to_draft[t2d] = torch.arange(VD)
        info = TargetInfo(probs, to_draft[z.argmax(-1)])
        result = ttt_loss(model, batch.input_ids, batch.loss_mask, batch.aux.double(), info, 4, 0.8,
                          batch.step_tokens, doc=batch.doc)  # fmt: skip
        result.loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return result, grads

    packed, packed_grads = run(collate(samples, ttt_steps=4, rows=[[0, 1], [2], [3, 4]]))
    single, single_grads = run(collate(samples, ttt_steps=4))
    torch.testing.assert_close(packed.loss, single.loss, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(packed.stats[0], single.stats[0], rtol=1e-9, atol=1e-9)  # loss sums
    assert torch.equal(packed.stats[1:], single.stats[1:])  # token, hit and chain counts
    for k in single_grads:
        torch.testing.assert_close(packed_grads[k], single_grads[k], rtol=1e-7, atol=1e-9)


def test_attention_does_not_leak_from_the_sample_before_in_a_packed_row():
    """The second sample's logits do not change when the first sample in its row changes."""
    rng = np.random.default_rng(3)
    a, b, other = fake_sample(rng, 6), fake_sample(rng, 5), fake_sample(rng, 6)
    model = tiny_drafter()
    from draftflow.drafters.ttt import unroll

    def logits_of_b(first):
        batch = collate([first, b], ttt_steps=3, rows=[[0, 1]])
        return [lg[0, 6:].detach() for lg, _ in unroll(model, batch.input_ids, batch.aux.double(), 3, doc=batch.doc)]

    for x, y in zip(logits_of_b(a), logits_of_b(other)):
        torch.testing.assert_close(x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_rows_on_cuda_match_one_sample_a_row_fp32_and_bf16_autocast():
    """The masked SDPA path on the GPU (step 0 with sample masks instead of is_causal)."""
    rng = np.random.default_rng(5)
    samples = [fake_sample(rng, n) for n in (90, 40, 130, 70, 30)]
    model = tiny_drafter(dtype=torch.float32).cuda()
    head = torch.randn(96, 32, device="cuda")
    to_draft = torch.full((96,), -1, dtype=torch.int64, device="cuda")
    to_draft[model.t2d] = torch.arange(VD, device="cuda")

    def loss_of(batch, autocast: bool):
        batch = batch.to("cuda")
        z = batch.final.float() @ head.T
        info = TargetInfo(torch.softmax(z[..., model.t2d], dim=-1), to_draft[z.argmax(-1)])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return ttt_loss(model, batch.input_ids, batch.loss_mask, batch.aux, info, 7, 0.8, batch.step_tokens,
                            doc=batch.doc)  # fmt: skip

    packed, single = collate(samples, 7, rows=[[0, 1], [2], [3, 4]]), collate(samples, 7)
    for autocast, tol in ((False, 1e-4), (True, 2e-2)):
        a, b = loss_of(packed, autocast), loss_of(single, autocast)
        torch.testing.assert_close(a.loss, b.loss, rtol=tol, atol=tol)
        assert torch.equal(a.stats[1], b.stats[1])  # loss tokens per step


def _unrolled(model, batch, attention: str, attn_chunk: int = 256) -> list[torch.Tensor]:
    return [torch.cat([lg, h], dim=-1) for lg, h in unroll(model, batch.input_ids, batch.aux, 5, attn_chunk, batch.doc,
                                                          attention)]  # fmt: skip


@pytest.mark.parametrize("attention", ["chunked-gqa", "flex"])
@pytest.mark.parametrize("packed", [False, True])
def test_other_ttt_attentions_give_the_chunked_attention_s_outputs(attention, packed):
    """The training-time test's other attentions (kv heads not expanded: SDPA's enable_gqa, or one
    FlexAttention call a step over every step's keys) see what the chunked SDPA path sees: every
    step's logits and hidden states agree, with and without packed samples, over several query
    chunks (flex forward only: FlexAttention has no CPU backward; the CUDA test checks gradients)."""
    rng = np.random.default_rng(9)
    samples = [fake_sample(rng, n) for n in (90, 40, 130, 70, 30)]
    batch = collate(samples, 5, rows=[[0, 1], [2], [3, 4]] if packed else None)
    model = tiny_drafter(layers=2)  # float64, 4 heads over 2 kv heads
    with torch.no_grad():
        chunked, other = _unrolled(model, batch, "chunked", attn_chunk=32), _unrolled(model, batch, attention, 32)
    assert len(other) == 5
    for step, (a, b) in enumerate(zip(chunked, other)):
        torch.testing.assert_close(b, a, msg=f"step {step}")


def test_grouped_kv_heads_give_the_chunked_gradients():
    """chunked-gqa trains as chunked does: the same loss and every parameter's gradient (packed rows)."""
    rng = np.random.default_rng(4)
    samples = [fake_sample(rng, n) for n in (90, 40, 130, 70, 30)]
    batch = collate(samples, 5, rows=[[0, 1], [2], [3, 4]])
    head = torch.randn(96, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = []
    for attention in ("chunked", "chunked-gqa"):
        model = tiny_drafter(layers=2).train()
        to_draft = torch.full((96,), -1, dtype=torch.int64)
        to_draft[model.t2d] = torch.arange(VD)
        z = batch.final.double() @ head.T
        info = TargetInfo(torch.softmax(z[..., model.t2d], dim=-1), to_draft[z.argmax(-1)])
        result = ttt_loss(model, batch.input_ids, batch.loss_mask, batch.aux.double(), info, 5, 0.8,
                          batch.step_tokens, doc=batch.doc, attention=attention)  # fmt: skip
        result.loss.backward()
        results.append((result.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, msg=name)


def test_an_unknown_ttt_attention_is_refused():
    with pytest.raises(ValueError, match="attention must be one of"):
        TTTObjective(tiny_drafter(), 3, 0.8, attention="paged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["chunked-gqa", "flex"])
def test_other_ttt_attentions_on_cuda_give_the_chunked_loss_and_gradients(attention):
    """SDPA with grouped kv heads (cuDNN's GQA) and the compiled FlexAttention path train as the
    chunked SDPA path does (packed rows; float32, and bf16 autocast, where SDPA takes cuDNN's kernels)."""
    rng = np.random.default_rng(6)
    samples = [fake_sample(rng, n) for n in (90, 40, 130, 70, 30)]
    batch = collate(samples, 7, rows=[[0, 1], [2], [3, 4]]).to("cuda")
    head = torch.randn(96, 32, device="cuda")
    for autocast, tol in ((False, 1e-4), (True, 2e-2)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _assert_same_training(batch, head, "chunked", attention, tol)


def _assert_same_training(batch, head, attention_a: str, attention_b: str, tol: float) -> None:
    results = []
    for name in (attention_a, attention_b):
        # head_dim 16: FlexAttention's CUDA kernels refuse fewer (tiny_drafter's default is 8)
        model = tiny_drafter(layers=2, dtype=torch.float32, head_dim=16).cuda()
        to_draft = torch.full((96,), -1, dtype=torch.int64, device="cuda")
        to_draft[model.t2d] = torch.arange(VD, device="cuda")
        z = batch.final.float() @ head.T
        info = TargetInfo(torch.softmax(z[..., model.t2d], dim=-1), to_draft[z.argmax(-1)])
        result = ttt_loss(model, batch.input_ids, batch.loss_mask, batch.aux, info, 7, 0.8, batch.step_tokens,
                          doc=batch.doc, attention=name)  # fmt: skip
        result.loss.backward()
        results.append((result.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=tol, atol=tol / 10)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=10 * tol, atol=tol / 10, msg=name)
