"""The EAGLE-3 drafter and its training-time-test unroll: layout, RoPE, masking, loss, acceptance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftflow.drafters.eagle3 import Eagle3Config, Eagle3Drafter, rope_inv_freq
from draftflow.drafters.ttt import (
    STAT_ROWS,
    SoftCrossEntropy,
    TargetHead,
    TargetInfo,
    acceptance_length,
    soft_ce,
    summarize,
    ttt_loss,
    unroll,
)

H, HEADS, KV, V, VD = 32, 4, 2, 96, 40


def tiny_config(layers: int = 1, **kw) -> Eagle3Config:
    target = {
        "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV, "intermediate_size": 48,
        "vocab_size": V, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
    }  # fmt: skip
    target.update(kw)
    return Eagle3Config.from_target(target, draft_vocab_size=VD, aux_layer_ids=[1, 3, 4], num_hidden_layers=layers)


def tiny_drafter(layers: int = 1, seed: int = 0, dtype=torch.float64, **config) -> Eagle3Drafter:
    """config: target config keys tiny_config overrides (e.g. head_dim)."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(tiny_config(layers, **config))
    torch.nn.init.normal_(model.embed_tokens.weight)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:VD]] = True
    draft_ids = torch.nonzero(t2d)[:, 0]
    model.set_vocab(draft_ids - torch.arange(VD), t2d)
    return model.to(dtype).eval()


def test_parameter_names_follow_sglang_layout():
    model = tiny_drafter(layers=2)
    shapes = {k: tuple(v.shape) for k, v in model.export_state_dict().items()}
    q_out, kv_out = HEADS * (H // HEADS), KV * (H // HEADS)
    expected = {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q_out),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (48, H),
        "midlayer.mlp.up_proj.weight": (48, H),
        "midlayer.mlp.down_proj.weight": (H, 48),
        "layers.1.hidden_norm.weight": (H,),
        "layers.1.self_attn.q_proj.weight": (q_out, H),
        "layers.1.self_attn.k_proj.weight": (kv_out, H),
        "layers.1.self_attn.v_proj.weight": (kv_out, H),
        "layers.1.self_attn.o_proj.weight": (H, q_out),
        "layers.1.post_attention_layernorm.weight": (H,),
        "layers.1.mlp.gate_proj.weight": (48, H),
        "layers.1.mlp.up_proj.weight": (48, H),
        "layers.1.mlp.down_proj.weight": (H, 48),
        "norm.weight": (H,),
        "lm_head.weight": (VD, H),
        "d2t": (VD,),
        "t2d": (V,),
    }
    assert shapes == expected
    assert "embed_tokens.weight" not in model.state_dict()  # the target's, frozen, never exported
    assert not any(p is model.embed_tokens.weight for p in model.parameters())


def test_config_reads_both_transformers_rope_styles_and_round_trips():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = tiny_config(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    new = tiny_config(rope_theta=None, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling})
    assert old == new and old.rope_theta == 500000.0 and old.rope_scaling["rope_type"] == "llama3"
    assert Eagle3Config.from_dict(old.to_dict()) == old
    assert old.to_dict()["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    # an unsupported type falls back to plain RoPE, recorded as such
    assert tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}).rope_scaling is None


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}  # fmt: skip
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0, rope_scaling=scaling,
                     max_position_embeddings=4096)  # fmt: skip
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = Eagle3Config.from_target(hf.to_dict(), draft_vocab_size=8, aux_layer_ids=[0, 1, 2])
    ours = rope_inv_freq(cfg)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    unscaled = 1.0 / 500000.0 ** (torch.arange(0, 128, 2) / 128)
    assert ours[0] == pytest.approx(unscaled[0].item()) and ours[-1] == pytest.approx(unscaled[-1].item() / 8)


def batch(seed: int, B: int = 2, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * H, generator=g, dtype=torch.float64)
    return ids, aux


@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_unroll_equals_step_by_step_inference(layers):
    """Row p at step k equals drafting k+1 tokens with the `step` API after a prefix of p+1 rows."""
    model = tiny_drafter(layers)
    ids, aux = batch(1, B=1, T=10)
    steps = 4
    with torch.no_grad():
        ttt = list(unroll(model, ids, aux, steps))
        for p in (0, 3, 5):
            # draft extend: rows 0..p pair target state a_i with token x_{i+1}, positions 0..p
            logits, out, cache = model.step(ids[:, 1 : p + 2], model.fuse(aux[:, : p + 1]), torch.arange(p + 1)[None])
            torch.testing.assert_close(logits[:, -1], ttt[0][0][:, p])
            for k in range(1, steps):
                token = ids[:, p + 1 + k : p + 2 + k]  # teacher-forced draft token
                logits, out, cache = model.step(token, out[:, -1:], torch.tensor([[p + k]]), cache)
                torch.testing.assert_close(logits[:, -1], ttt[k][0][:, p], msg=f"step {k} row {p}")
                assert len(cache) == p + 1 + k


def test_chunked_ttt_attention_equals_one_call():
    model = tiny_drafter(2)
    ids, aux = batch(6, B=2, T=13)
    with torch.no_grad():
        whole = list(unroll(model, ids, aux, 4, attn_chunk=1000))
        for chunk in (1, 4, 5):
            for (a, ha), (b, hb) in zip(whole, unroll(model, ids, aux, 4, attn_chunk=chunk)):
                torch.testing.assert_close(b, a)
                torch.testing.assert_close(hb, ha)


def test_ttt_has_no_future_leakage():
    """Step-k output at row p depends on tokens x_0..x_{p+1+k} and aux states a_0..a_p only."""
    model = tiny_drafter(2)
    ids, aux = batch(2, B=1, T=14)
    steps, p = 4, 5
    with torch.no_grad():
        ref = [lg[:, p] for lg, _ in unroll(model, ids, aux, steps)]
        for k in range(steps):
            ids2, aux2 = ids.clone(), aux.clone()
            ids2[:, p + 2 + k :] = (ids2[:, p + 2 + k :] + 7) % V
            aux2[:, p + 1 :] += torch.randn_like(aux2[:, p + 1 :])
            out = list(unroll(model, ids2, aux2, steps))[k][0][:, p]
            torch.testing.assert_close(out, ref[k], msg=f"step {k} saw the future")
            # ...and the last token it may read does matter (the test can fail)
            ids3 = ids.clone()
            ids3[:, p + 1 + k] = (ids3[:, p + 1 + k] + 7) % V
            assert not torch.allclose(list(unroll(model, ids3, aux, steps))[k][0][:, p], ref[k])


def test_kv_cache_crop_allows_redrafting():
    model = tiny_drafter()
    ids, aux = batch(3, B=1, T=8)
    with torch.no_grad():
        full, _, _ = model.step(ids[:, 1:7], model.fuse(aux[:, :6]), torch.arange(6)[None])
        _, _, cache = model.step(ids[:, 1:5], model.fuse(aux[:, :4]), torch.arange(4)[None])
        model.step(
            ids[:, :1], torch.randn(1, 1, H, dtype=torch.float64), torch.tensor([[4]]), cache
        )  # a rejected draft
        cache.crop(4)
        again, _, _ = model.step(ids[:, 5:7], model.fuse(aux[:, 4:6]), torch.tensor([[4, 5]]), cache)
    torch.testing.assert_close(again, full[:, 4:6])


def test_step_only_at_gives_each_rows_chosen_position_and_the_same_cache():
    """only_at (what drafting uses: each row's last fed state) equals the full step's rows at those
    positions, and the cache it leaves drafts the next token as the full step's does."""
    model = tiny_drafter(layers=2)
    ids, aux = batch(5, B=3, T=8)
    positions = torch.arange(6)[None].expand(3, 6)
    at = torch.tensor([5, 2, 0])
    with torch.no_grad():
        full, full_out, full_cache = model.step(ids[:, 1:7], model.fuse(aux[:, :6]), positions)
        some, some_out, some_cache = model.step(ids[:, 1:7], model.fuse(aux[:, :6]), positions, only_at=at)
        rows = torch.arange(3)
        assert some.shape == (3, 1, VD) and some_out.shape == (3, 1, H)
        torch.testing.assert_close(some[:, 0], full[rows, at])
        torch.testing.assert_close(some_out[:, 0], full_out[rows, at])
        draft = full[rows, at].argmax(-1)[:, None]
        nxt = [model.step(draft, out, torch.full((3, 1), 6), cache)[0] for out, cache in
               ((full_out[rows, at][:, None], full_cache), (some_out, some_cache))]  # fmt: skip
    torch.testing.assert_close(nxt[1], nxt[0])


def make_target(model: Eagle3Drafter, final: torch.Tensor, seed: int = 0) -> TargetInfo:
    torch.manual_seed(seed)
    head = TargetHead(torch.randn(V, H, dtype=torch.float64), model.t2d)
    return head(final)


def test_target_head_restricts_softmax_and_maps_argmax():
    model = tiny_drafter()
    final = torch.randn(2, 5, H, dtype=torch.float64)
    head = TargetHead(torch.randn(V, H, dtype=torch.float64), model.t2d)
    info = head(final, chunk_tokens=3)
    z = final @ head.weight.T
    draft_ids = model.d2t + torch.arange(VD)
    torch.testing.assert_close(info.probs, torch.softmax(z[..., draft_ids], -1).float())
    arg = z.argmax(-1)
    in_vocab = model.t2d[arg]
    assert (info.argmax[~in_vocab] == -1).all()
    assert (model.to_target_ids(info.argmax[in_vocab]) == arg[in_vocab]).all()


def test_target_head_temperature_sharpens_the_probabilities_and_keeps_the_argmax():
    model = tiny_drafter()
    final = torch.randn(3, 7, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64)
    plain = TargetHead(weight, model.t2d)(final)
    draft_ids = model.d2t + torch.arange(VD)
    z = final @ weight.T
    half = TargetHead(weight, model.t2d, temperature=0.5)(final, chunk_tokens=4)
    torch.testing.assert_close(half.probs, torch.softmax(z[..., draft_ids] / 0.5, -1).float())
    greedy = TargetHead(weight, model.t2d, temperature=0.0)(final, chunk_tokens=4)
    assert torch.equal(half.argmax, plain.argmax) and torch.equal(greedy.argmax, plain.argmax)
    in_vocab = plain.argmax >= 0
    assert in_vocab.any() and (~in_vocab).any()  # both kinds of rows are checked
    # temperature 0: the draft argmax as a one-hot row; no mass where the argmax is outside the draft vocab
    expected = F.one_hot(plain.argmax.clamp(min=0), VD).float() * in_vocab[..., None]
    assert torch.equal(greedy.probs, expected)
    # soft CE against it is the cross-entropy on the target's greedy token
    logits = torch.randn(3, 7, VD, dtype=torch.float64)
    ce = soft_ce(logits, greedy.probs.double())[in_vocab]
    torch.testing.assert_close(ce, F.cross_entropy(logits[in_vocab], plain.argmax[in_vocab], reduction="none"))


def test_loss_is_masked_and_skips_tokens_outside_the_draft_vocab():
    model = tiny_drafter()
    ids, aux = batch(4, B=2, T=10)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 3:7] = True
    target = make_target(model, torch.randn(2, 10, H, dtype=torch.float64))
    target.argmax[:] = 0
    base = ttt_loss(model, ids, mask, aux, target, steps=3)
    counts = dict(zip(STAT_ROWS, base.stats))
    assert counts["tokens"].tolist() == [8.0, 8.0, 6.0]  # m_{j+2+k} summed over rows j < T-1-k

    # target z_t is weighted by m_{t+1}: changing it where m_{t+1} = 0 changes nothing
    free = target.probs.clone()
    free[:, :2] = torch.rand_like(free[:, :2])
    free[:, 6:] = torch.rand_like(free[:, 6:])
    same = ttt_loss(model, ids, mask, aux, TargetInfo(free, target.argmax), steps=3)
    torch.testing.assert_close(same.loss, base.loss)
    used = target.probs.clone()
    used[:, 4] = torch.rand_like(used[:, 4])
    assert not torch.allclose(ttt_loss(model, ids, mask, aux, TargetInfo(used, target.argmax), steps=3).loss, base.loss)

    # a target argmax outside the draft vocab removes the row from the loss but not from the count
    out = target.argmax.clone()
    out[:, 4] = -1
    skipped = ttt_loss(model, ids, mask, aux, TargetInfo(used, out), steps=3)
    assert skipped.stats[1].tolist() == base.stats[1].tolist()
    ref = ttt_loss(model, ids, mask, aux, TargetInfo(target.probs, out), steps=3)
    torch.testing.assert_close(skipped.loss, ref.loss)  # the changed (now skipped) rows do not count
    assert skipped.loss < base.loss


def test_step_accuracy_and_chain_acceptance_match_a_brute_force_count():
    model = tiny_drafter()
    B, T, steps = 3, 12, 4
    ids, aux = batch(5, B=B, T=T)
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, T, generator=g) > 0.15
    mask[0, 7] = True
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits tie: the drafter always proposes draft id 0
        preds = [lg.argmax(-1) for lg, _ in unroll(model, ids, aux, steps)]
    assert all((p == 0).all() for p in preds)
    argmax = torch.where(torch.rand(B, T, generator=g) < 0.8, 0, 1)  # the target agrees 80% of the time
    argmax[0, 6] = -1  # a target token outside the draft vocab (a miss), weighted by m_7
    probs = torch.full((B, T, VD), 1.0 / VD)
    stats = summarize(ttt_loss(model, ids, mask, aux, TargetInfo(probs, argmax), steps).stats, 0.8)

    hits, trials, correct, tokens = [0] * steps, [0] * steps, [0] * steps, [0] * steps
    for b in range(B):
        for j in range(T):
            alive = True
            for k in range(steps):
                t = j + 1 + k
                if t + 1 >= T or not mask[b, t + 1]:
                    alive = False  # a chain ends at its first unmasked token
                    continue
                ok = argmax[b, t] >= 0 and preds[k][b, j] == argmax[b, t]
                tokens[k] += 1
                correct[k] += int(ok)
                trials[k] += int(alive)
                alive = alive and ok
                hits[k] += int(alive)
    assert stats["step_accuracy"] == pytest.approx([c / n for c, n in zip(correct, tokens)])
    alpha = [h / n for h, n in zip(hits, trials)]
    assert stats["step_alpha"] == pytest.approx(alpha)
    assert 0.0 < alpha[-1] and alpha[0] < 1.0 and hits[-1] > 0  # long chains exist, the -1 row misses
    assert stats["tau"] == pytest.approx(acceptance_length(alpha))


def test_acceptance_length_formula():
    assert acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert acceptance_length([0.0, 1.0]) == 1.0


def test_soft_cross_entropy_matches_autograd_reference():
    logits = torch.randn(3, 5, 17, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(3, 5, 17, dtype=torch.float64), -1)
    g = torch.randn(3, 5, dtype=torch.float64)
    ours = SoftCrossEntropy.apply(logits, p)
    (ours * g).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref = -(p * torch.log_softmax(logits, -1)).sum(-1)
    (ref * g).sum().backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad, logits.grad)
