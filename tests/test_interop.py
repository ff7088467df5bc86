"""SpecForge / speculators interop: documented shapes and bit-exact round trips."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftflow import cli
from draftflow.errors import DraftflowError
from draftflow.hidden_states.interop import ConvertOptions, FinalNorm, convert
from draftflow.hidden_states.storage import HiddenStateReader, find_range_dirs, read_range_index
from test_storage import bits, build_ranges, make_sample


def read_all(hidden_states_dir):
    reader = HiddenStateReader(find_range_dirs(hidden_states_dir))
    return reader, [reader[i] for i in range(len(reader))]


def assert_same_samples(a_dir, b_dir, final_too: bool = True):
    (ra, sa), (rb, sb) = read_all(a_dir), read_all(b_dir)
    assert ra.sample_ids == rb.sample_ids and ra.keys == rb.keys
    for x, y in zip(sa, sb, strict=True):
        assert x.hidden.dtype == y.hidden.dtype == torch.bfloat16
        assert torch.equal(x.hidden, y.hidden) and torch.equal(bits(x.hidden), bits(y.hidden))
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)


def test_specforge_export_layout_shapes_and_round_trip(tmp_path):
    hs, samples = build_ranges(tmp_path)  # 5 samples, L=4 (3 aux + final), H=64, bf16
    out = tmp_path / "specforge"
    convert("draftflow", "specforge", hs, out)

    files = sorted(out.glob("rows_*/data_*.ckpt"))
    assert [f.relative_to(out).as_posix() for f in files] == [f"rows_0-2000/data_{i}.ckpt" for i in range(5)]
    for i, (_, _, ids, mask, hidden) in enumerate(samples):
        raw = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        T, H = len(ids), 64
        assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert raw["input_ids"].shape == (T,) and raw["input_ids"].dtype == torch.int64
        assert raw["loss_mask"].shape == (T,) and raw["loss_mask"].dtype == torch.int64
        assert raw["aux_hidden_state"].shape == (1, T, 3 * H) and raw["aux_hidden_state"].dtype == torch.bfloat16
        assert raw["hidden_state"].shape == (1, T, H)
        # aux layers concatenated along the last dim, in layer order
        assert torch.equal(raw["aux_hidden_state"][0], torch.cat([hidden[:, k] for k in range(3)], dim=-1))
        assert torch.equal(raw["hidden_state"][0], hidden[:, -1])

    back = tmp_path / "back"
    convert("specforge", "draftflow", out, back, ConvertOptions(split="train"))
    assert_same_samples(hs, back)
    meta, _ = read_range_index(back / "train" / "rows_0-5")
    assert meta["layer_ids"] == [1, 2, 3] and meta["num_layers_captured"] == 4  # carried by the sidecar


def test_specforge_import_without_sidecar_accepts_gzip_and_batched_ids(tmp_path):
    src = tmp_path / "sf" / "rows_0-2000"
    src.mkdir(parents=True)
    ids, mask, hidden = make_sample(9)
    record = {
        "input_ids": torch.from_numpy(ids)[None],  # [1, T] as some SpecForge versions batch it
        "loss_mask": torch.from_numpy(mask.astype(np.int64)),
        "aux_hidden_state": hidden[:, :-1].reshape(1, 9, -1),
        "hidden_state": hidden[:, -1][None],
    }
    with gzip.open(src / "data_7.ckpt.gz", "wb") as f:
        torch.save(record, f)
    convert("specforge", "draftflow", tmp_path / "sf", tmp_path / "df", ConvertOptions(range_size=2))
    reader, (sample,) = read_all(tmp_path / "df")
    assert reader.sample_ids == ["specforge-7"]
    assert torch.equal(bits(sample.hidden), bits(hidden)) and np.array_equal(sample.input_ids, ids)


def test_speculators_export_layout_shapes_and_bit_exact_round_trip(tmp_path):
    from datasets import load_from_disk

    hs, samples = build_ranges(tmp_path)
    out = tmp_path / "speculators"
    convert("draftflow", "speculators", hs, out, ConvertOptions(copy_final=True))

    rows = load_from_disk(str(out))  # what speculators' ArrowDataset opens
    assert {"input_ids", "loss_mask", "seq_len"} <= set(rows.column_names)
    for i, (_, _, ids, mask, hidden) in enumerate(samples):
        row = rows[i]
        assert row["input_ids"].dtype == torch.int64 and row["input_ids"].tolist() == ids.tolist()
        assert row["loss_mask"].tolist() == mask.tolist() and int(row["seq_len"]) == len(ids)
        hs_file = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(hs_file) == {"token_ids", "hidden_states"}
        assert torch.equal(hs_file["token_ids"], row["input_ids"])  # the trainer's own consistency check
        assert hs_file["hidden_states"].shape == (len(ids), 4, 64) and hs_file["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(hs_file["hidden_states"], hidden)

    back = tmp_path / "back"
    convert("speculators", "draftflow", out, back, ConvertOptions(copy_final=True))
    assert_same_samples(hs, back)


def test_speculators_final_state_needs_an_explicit_choice(tmp_path):
    hs, _ = build_ranges(tmp_path)
    with pytest.raises(DraftflowError, match="before the final norm"):
        convert("draftflow", "speculators", hs, tmp_path / "out")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)  # a non-trivial norm weight
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return model, path


def test_speculators_pre_norm_state_imports_as_hf_post_norm_bitwise(tmp_path, tiny_llama):
    model, target_dir = tiny_llama
    ids = torch.randint(0, 300, (1, 21))
    captured = {}
    handle = model.model.norm.register_forward_hook(lambda m, inp, out: captured.update(pre=inp[0][0]))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    handle.remove()
    post = out.hidden_states[-1][0]  # HF: post-norm last_hidden_state, draftflow's final state
    aux = torch.stack([out.hidden_states[i + 1][0] for i in (0, 1, 2)], dim=1)  # [T, 3, H]

    # A speculators folder as vLLM + speculators produce it: last slot = pre-norm output of the last layer.
    from datasets import Dataset

    src = tmp_path / "spec"
    (src / "hidden_states").mkdir(parents=True)
    save_file({"token_ids": ids[0], "hidden_states": torch.cat([aux, captured["pre"][:, None]], dim=1)},
              str(src / "hidden_states" / "hs_0.safetensors"))  # fmt: skip
    Dataset.from_dict({"input_ids": [ids[0].tolist()], "loss_mask": [[1] * 21], "seq_len": [21]}).save_to_disk(str(src))

    assert cli.main(["convert", "--from", "speculators", "--to", "draftflow", "--input", str(src),
                     "--output", str(tmp_path / "df"), "--target", str(target_dir)]) == 0  # fmt: skip
    _, (sample,) = read_all(tmp_path / "df")
    assert torch.equal(bits(sample.final), bits(post))  # exactly what a draftflow HF capture stores
    assert torch.equal(sample.aux, aux)

    # Export back: speculators' trainer computes lm_head(verifier_norm(slot)); that must reproduce `post`.
    convert("draftflow", "speculators", tmp_path / "df", tmp_path / "spec2", ConvertOptions(target=target_dir))
    slot = load_file(str(tmp_path / "spec2" / "hidden_states" / "hs_0.safetensors"))["hidden_states"][:, -1]
    renormed = FinalNorm.from_target(target_dir).apply(slot)
    ulp = post.float().abs() * 2**-7
    assert ((renormed.float() - post.float()).abs() <= 2 * ulp + 1e-6).all()
    assert json.loads((tmp_path / "spec2" / "draftflow_export.json").read_text())["copy_final"] is False


def test_convert_cli_rejects_same_folder_and_missing_input(tmp_path):
    hs, _ = build_ranges(tmp_path)
    with pytest.raises(DraftflowError, match="different"):
        convert("draftflow", "specforge", hs, hs)
    with pytest.raises(DraftflowError, match="no SpecForge"):
        convert("specforge", "draftflow", tmp_path / "hs" / "store", tmp_path / "x")
