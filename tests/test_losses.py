"""Training losses (`train.loss`): values, gradients, and that each one trains the drafter."""

from __future__ import annotations

import pytest
import torch

from draftflow.drafters.losses import LK_ETA, LOSSES, kl, lk, overlap, soft_ce, tv
from draftflow.drafters.ttt import TargetInfo, TTTObjective
from test_drafter import H, V, VD, tiny_drafter


def _dist(*shape, seed=0, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(*shape, generator=g, dtype=torch.float64), -1)


def test_tv_of_identical_distributions_is_zero_and_of_disjoint_ones_is_one():
    p = _dist(4, 7, 33)
    assert torch.allclose(tv(torch.log(p), p), torch.zeros(4, 7, dtype=torch.float64), atol=1e-12)
    q_logits = torch.full((1, 4), -1e4, dtype=torch.float64)
    q_logits[0, 0] = 0.0  # q = one-hot on token 0
    p2 = torch.tensor([[0.0, 0.5, 0.5, 0.0]], dtype=torch.float64)
    assert tv(q_logits, p2).item() == pytest.approx(1.0)


def test_each_loss_is_its_definition():
    logits = torch.randn(5, 19, dtype=torch.float64)
    p = _dist(5, 19, seed=1)
    q = torch.softmax(logits, -1)
    alpha = torch.minimum(p, q).sum(-1)
    kl_ref = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(overlap(logits, p), alpha)
    torch.testing.assert_close(soft_ce(logits, p), -(p * q.log()).sum(-1))
    torch.testing.assert_close(kl(logits, p), kl_ref)
    torch.testing.assert_close(tv(logits, p), 1 - alpha)
    lam = torch.exp(-LK_ETA * alpha)
    torch.testing.assert_close(lk(logits, p), lam * kl_ref + (1 - lam) * (1 - alpha))
    torch.testing.assert_close(LOSSES["lk_alpha"](logits, p), -alpha.log())
    # LK and soft CE vanish / are minimal where q = p
    assert lk(torch.log(p), p).abs().max() < 1e-12


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradients_are_finite_even_for_disjoint_or_extreme_logits(name):
    logits = torch.randn(3, 6, 23, dtype=torch.float32) * 30  # near one-hot q
    logits[0, 0] = -1e4
    logits[0, 0, 5] = 1e4
    p = _dist(3, 6, 23, seed=2, sharp=20).float()
    p[0, 0] = 0
    p[0, 0, 7] = 1.0  # disjoint from q on this row
    logits.requires_grad_(True)
    loss = LOSSES[name](logits, p)
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all()


def _fixed_batch(T: int = 24, B: int = 2):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * H, generator=g)
    probs = torch.softmax(3 * torch.randn(B, T, VD, generator=g), -1)
    argmax = probs.argmax(-1)
    mask = torch.ones(B, T, dtype=torch.bool)
    return ids, mask, aux, TargetInfo(probs, argmax)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_each_loss_falls_when_training_on_a_fixed_batch(name):
    drafter = tiny_drafter(dtype=torch.float32).train()
    objective = TTTObjective(drafter, steps=3, decay=0.8, loss=name)
    ids, mask, aux, target = _fixed_batch()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = objective(ids, mask, aux, target.probs, target.argmax)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda x: x == x, losses))  # no NaN
    assert losses[-1] < 0.8 * losses[0], losses[::8]


def test_unknown_loss_names_are_refused():
    from draftflow.drafters.train import TrainSettings
    from draftflow.errors import DraftflowError

    with pytest.raises(DraftflowError, match="'loss' must be one of soft_ce, tv, lk, lk_alpha"):
        TrainSettings.from_dict({"aux_layer_ids": [1, 2, 3], "loss": "kl"})
