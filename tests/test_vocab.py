"""Draft vocabulary: selection rules, d2t/t2d round trip, padding, ties, coverage, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from draftflow import cli
from draftflow.errors import DraftflowError
from draftflow.jsonl import write_jsonl
from draftflow.drafters.vocab import build_vocab, load_vocab, select_draft_vocab


def test_d2t_t2d_round_trip():
    counts = np.random.default_rng(0).integers(0, 50, 300)
    vocab = select_draft_vocab(counts, 40)
    draft = np.arange(40)
    target = draft + vocab.d2t  # draft id -> target id
    assert vocab.t2d.sum() == 40 and vocab.t2d[target].all()
    assert (np.diff(target) > 0).all()  # draft ids follow target-id order
    assert (vocab.target_to_draft()[target] == draft).all()  # ... and back
    assert (vocab.target_to_draft()[~vocab.t2d] == -1).all()
    # the chosen ids are the most frequent ones
    assert counts[target].min() >= counts[~vocab.t2d].max()


def test_ties_go_to_the_lower_target_id():
    counts = np.array([5, 3, 3, 9, 3, 0])
    assert select_draft_vocab(counts, 3).target_ids.tolist() == [0, 1, 3]
    assert select_draft_vocab(counts, 4).target_ids.tolist() == [0, 1, 2, 3]


def test_padding_uses_the_lowest_unused_ids():
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 4]] = [2, 1]
    assert select_draft_vocab(counts, 5).target_ids.tolist() == [0, 1, 2, 4, 7]


@pytest.fixture
def merged(tmp_path):
    records = [
        {"input_ids": [1, 2, 3, 3, 9], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [4, 4, 4, 2, 5], "loss_mask": [1, 1, 1, 1, 0]},  # 4 x3, 2 x1 (5 unmasked)
    ]
    write_jsonl(tmp_path / "train.jsonl", records)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"vocab_size": 12}))
    return tmp_path


def test_cli_writes_vocab_and_coverage(merged):
    out = merged / "vocab" / "draft_vocab.safetensors"
    rc = cli.main(["vocab", "--input", str(merged / "train.jsonl"), "--target", str(merged / "target"),
                   "--settings", '{"draft_vocab_size": 2}', "--output", str(out)])  # fmt: skip
    assert rc == 0
    vocab = load_vocab(out)
    assert vocab.target_ids.tolist() == [3, 4]  # 4: 3 times, 3: twice; 2 and 9 once
    stats = json.loads(out.with_suffix(".json").read_text())
    assert stats["loss_tokens"] == 7 and stats["covered_loss_tokens"] == 5
    assert stats["coverage"] == pytest.approx(5 / 7)
    assert stats["counts"] == [2, 3] and stats["padded"] == 0


def test_size_is_capped_at_the_target_vocab_and_padded(merged, caplog):
    caplog.set_level("INFO")
    stats = build_vocab(merged / "train.jsonl", merged / "target", 100, merged / "v.safetensors")
    assert stats["draft_vocab_size"] == 12 and stats["padded"] == 12 - 4 and stats["coverage"] == 1.0
    assert "exceeds the target vocabulary" in caplog.text
    assert load_vocab(merged / "v.safetensors").t2d.all()


def test_token_outside_the_target_vocab_names_file_and_line(merged):
    write_jsonl(
        merged / "bad.jsonl", [{"input_ids": [1], "loss_mask": [1]}, {"input_ids": [1, 12], "loss_mask": [1, 1]}]
    )
    with pytest.raises(DraftflowError, match=r"bad.jsonl:2: field 'input_ids'.*12"):
        build_vocab(merged / "bad.jsonl", merged / "target", 4, merged / "v.safetensors")
