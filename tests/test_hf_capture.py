"""The HF capture engine and the capture interface: layer-id convention, padding, guards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftflow.engines.capture import (
    CaptureEngine,
    CaptureError,
    capture_settings,
    check_capture,
    engine_layer_ids,
    layer_names,
    make_capture_engine,
    plan_batches,
)
from draftflow import cli
from draftflow.hidden_states.extract import Record, extract_range, run_extract, write_range
from draftflow.hidden_states.storage import SampleStore, decode_sample, read_range_index

NUM_LAYERS = 6
AUX = [1, 2, 4]


def build_target(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("target") / "tiny")


def make_records(lengths: list[int], seed: int = 1) -> list[Record]:
    rng = np.random.default_rng(seed)
    return [
        Record(f"s{i}", "d", rng.integers(1, 300, size=n).astype(np.int64), (np.arange(n) % 2).astype(np.uint8), i)
        for i, n in enumerate(lengths)
    ]


def settings(dtype: str, **extra) -> dict:
    return {"engine": "hf", "aux_layer_ids": AUX, "dtype": dtype, "target_identity": "tiny", **extra}


class Reference:
    """Independent captures from a separately loaded LlamaForCausalLM."""

    def __init__(self, target: Path, dtype: torch.dtype):
        self.model = LlamaForCausalLM.from_pretrained(target, dtype=dtype).eval()
        self.layer_out: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.model.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, output):
            self.layer_out[i] = (output[0] if isinstance(output, tuple) else output)[0].clone()  # [T, H]

        return hook

    @torch.inference_mode()
    def run(self, ids: np.ndarray):
        out = self.model(torch.from_numpy(ids)[None], output_hidden_states=True)
        return out, dict(self.layer_out)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_stored_layers_follow_the_convention(target, tmp_path, dtype_name):
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    records = make_records([7, 19, 12])
    s = settings(dtype_name, batch_tokens=1)  # one sample per forward: no padding at all
    engine = make_capture_engine(s, target, ["cpu"])
    assert isinstance(engine, CaptureEngine)
    assert engine.engine_layer_ids == [i + 1 for i in AUX]
    store = SampleStore(tmp_path / "store")
    outcome = extract_range(records, engine, store, s)
    write_range(tmp_path / "rows_0-3", outcome, {"settings_digest": outcome.settings_digest,
                "store_root": str(store.root), "num_layers_captured": 4, "hidden_size": 64})  # fmt: skip
    _, entries = read_range_index(tmp_path / "rows_0-3")

    # On the CPU the engine computes in float32 and stores each state rounded to `dtype`
    ref = Reference(target, torch.float32)
    for record, entry in zip(records, entries):
        sample = decode_sample(store.get(entry.key), check=True)
        assert sample.hidden.dtype == dtype and sample.hidden.shape == (len(record.input_ids), 4, 64)
        assert np.array_equal(sample.input_ids, record.input_ids)
        out, layer_out = ref.run(record.input_ids)
        for slot, i in enumerate(AUX):
            # aux id i == HF output_hidden_states[i + 1] == output of decoder layer i (hook)
            assert torch.equal(sample.hidden[:, slot], out.hidden_states[i + 1][0].to(dtype))
            assert torch.equal(sample.hidden[:, slot], layer_out[i].to(dtype))
            assert not torch.equal(sample.hidden[:, slot], out.hidden_states[i][0].to(dtype))  # not off by one
        final = sample.hidden[:, -1]
        # final == norm(last layer output), computed independently; == what lm_head reads
        assert torch.equal(final, ref.model.model.norm(layer_out[NUM_LAYERS - 1]).to(dtype))
        assert torch.equal(final, out.hidden_states[-1][0].to(dtype))
        with torch.inference_mode():  # out's tensors are inference tensors
            assert torch.equal(ref.model.lm_head(out.hidden_states[-1][0]), out.logits[0])
        assert not torch.equal(final, layer_out[NUM_LAYERS - 1].to(dtype))  # post-norm, not pre-norm
    engine.close()


def test_last_layer_aux_id_is_the_raw_output_and_data_config_says_so(target, tmp_path):
    """Aux id N-1: the store holds the last layer's raw output (a hook on it), which is NOT HF's
    output_hidden_states[N] (post-norm: the final slot); data_config.json says exactly that."""
    aux = [1, 3, NUM_LAYERS - 1]
    split = tmp_path / "train.jsonl"
    records = make_records([9, 14])
    split.write_text("".join(
        json.dumps({"id": r.sample_id, "dataset": "d", "input_ids": r.input_ids.tolist(),
                    "loss_mask": r.loss_mask.tolist()}) + "\n" for r in records
    ))  # fmt: skip
    hs = tmp_path / "hidden_states"
    s = settings("float32", aux_layer_ids=aux, batch_tokens=1)  # one sample per forward: bit-exact
    run_extract(split, "train", 0, 2, target, hs / "store", s, hs / "train" / "rows_0-2")
    _, entries = read_range_index(hs / "train" / "rows_0-2")
    ref = Reference(target, torch.float32)
    for record, entry in zip(records, entries):
        sample = decode_sample(SampleStore(hs / "store").get(entry.key), check=True)
        out, layer_out = ref.run(record.input_ids)
        last = sample.hidden[:, 2]
        assert torch.equal(last, layer_out[NUM_LAYERS - 1])  # forward hook on the last layer
        assert not torch.allclose(last, out.hidden_states[NUM_LAYERS][0], atol=1e-3)  # HF's index N is normed
        assert torch.equal(out.hidden_states[NUM_LAYERS][0], ref.model.model.norm(last))
        assert torch.equal(sample.hidden[:, -1], out.hidden_states[NUM_LAYERS][0])  # the final slot

    assert cli.main(["summarize-hidden-states", "--ranges", str(hs / "train" / "rows_0-2"),
                     "--output-dir", str(hs)]) == 0  # fmt: skip
    config = json.loads((hs / "data_config.json").read_text())
    meanings = config["layer_meanings"]
    assert len(meanings) == len(config["layer_ids"]) == 4
    assert meanings[0].startswith("aux 1: output of decoder layer 1") and "output_hidden_states[2]" in meanings[0]
    assert meanings[2].startswith(f"aux {NUM_LAYERS - 1}: raw output of decoder layer {NUM_LAYERS - 1}")
    assert f"not HF output_hidden_states[{NUM_LAYERS}]" in meanings[2] and "before the final norm" in meanings[2]
    assert meanings[3].startswith("final:") and "after the final norm" in meanings[3]
    assert f"output_hidden_states[{NUM_LAYERS}])" in meanings[3]
    assert f"not HF's hidden_states[{NUM_LAYERS}]" in config["engine_layer_id_meaning"]


def test_right_padding_leaves_real_positions_unchanged(target):
    engine = make_capture_engine(settings("float32", batch_tokens=10_000), target, ["cpu"])
    records = make_records([5, 31, 17, 31, 2])
    batched = engine.capture([r.input_ids for r in records])  # one padded forward
    for record, hidden in zip(records, batched):
        alone = engine.capture([record.input_ids])[0]
        assert hidden.shape == alone.shape == (len(record.input_ids), 4, 64)
        torch.testing.assert_close(hidden, alone, atol=1e-5, rtol=1e-5)
        check_capture(record.sample_id, record.input_ids, hidden, 4, 64)


def test_batch_budget_counts_padded_tokens():
    lengths = [10, 3, 7, 7, 2, 30]
    batches = plan_batches(lengths, batch_tokens=16)
    assert sorted(p for b in batches for p in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[p] for p in b) <= 16
    assert batches == [[4, 1], [2, 3], [0], [5]]  # sorted by length, packed in order
    assert plan_batches(lengths, 16) == batches  # deterministic


def test_short_capture_is_refused_naming_the_sample():
    ids = np.arange(10)
    hidden = torch.zeros(10, 4, 8)
    check_capture("ok", ids, hidden, 4, 8)
    with pytest.raises(CaptureError, match=r"sample B1-abc: 9 hidden-state rows for 10 input tokens.*prefix"):
        check_capture("B1-abc", ids, hidden[:-1], 4, 8)
    with pytest.raises(CaptureError, match="sample x: 3 captured layers, expected 4"):
        check_capture("x", ids, hidden[:, :3], 4, 8)
    with pytest.raises(CaptureError, match="sample x: hidden width 8, expected the target's 16"):
        check_capture("x", ids, hidden, 4, 16)


def test_non_finite_values_are_refused_naming_layer_and_count():
    hidden = torch.zeros(10, 4, 8)
    hidden[3, 1, :5] = float("nan")
    hidden[0, 3, 0] = float("inf")
    with pytest.raises(CaptureError) as err:
        check_capture("s7", np.arange(10), hidden, 4, 8, layer_names([2, 30, 58]))
    message = str(err.value)
    assert "sample s7: non-finite" in message
    assert "aux layer 30: 5 of 80" in message and "final (post-norm): 1 of 80" in message
    assert "aux layer 2" not in message


def test_engine_layer_id_table():
    assert engine_layer_ids("hf", [2, 30, 58], 61).aux_ids == [3, 31, 59]
    assert engine_layer_ids("vllm", [2, 30, 58], 61).aux_ids == [3, 31, 59]
    with pytest.raises(CaptureError, match=r"\[61\] out of range.*61 decoder layers"):
        engine_layer_ids("hf", [2, 61], 61)
    with pytest.raises(CaptureError, match="unknown capture engine"):
        engine_layer_ids("tgi", [1], 4)


def test_capture_settings_exclude_throughput_knobs():
    base = settings("bfloat16")
    digest_input = capture_settings(dict(base, batch_tokens=1, writer_threads=9, compression_level=5,
                                         on_error="skip", device="cuda:3", gpus_per_job=2))  # fmt: skip
    assert digest_input == capture_settings(base)
    assert capture_settings(dict(base, dtype="float32")) != capture_settings(base)
    assert capture_settings(dict(base, aux_layer_ids=[1, 2, 3])) != capture_settings(base)
    sglang = dict(base, engine="sglang", tensor_parallel=8, sglang={"version": "0.5.5", "endpoint": "http://x"})
    assert capture_settings(sglang)["sglang.version"] == "0.5.5" and "endpoint" not in str(capture_settings(sglang))


def test_unknown_or_unavailable_engine(target):
    with pytest.raises(CaptureError, match="unknown capture engine 'tgi'"):
        make_capture_engine(settings("float32", engine="tgi"), target)
