"""DFlash export: the names, shapes and config keys SGLang 0.5.14's `DFlashDraftModel` and vLLM
0.25.1's `DFlashQwen3ForCausalLM` read (their loaders' name handling written out below from the
released source, see draftflow/engines/export_dflash.py), the launch commands, and refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from draftflow.cli import main as cli_main
from draftflow.drafters.dflash import DFlashConfig, DFlashDrafter
from draftflow.drafters.train import load_drafter, save_drafter
from test_export import run_launch, unstack
from test_speculative import tiny_target

V, LAYERS, IDS, BLOCK, MASK = 64, 6, [1, 2, 4], 8, 60


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export-dflash")
    model = tiny_target(vocab=V, layers=LAYERS, dtype=torch.float32)
    model.save_pretrained(tmp / "target")
    cfg = DFlashConfig.from_target(model.config.to_dict(), num_hidden_layers=2, target_layer_ids=IDS,
                                   block_size=BLOCK, mask_token_id=MASK)  # fmt: skip
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), tmp / "drafter", dtype=torch.float32)
    return tmp


def export(tmp, out: str, check: bool = True, **settings) -> dict | int:
    settings = {"sglang_version": "0.5.14", "vllm_version": "0.25.1", "tensor_parallel": 2, "aux_layer_ids": IDS,
                **settings}  # fmt: skip
    args = ["export", "--drafter", str(tmp / "drafter"), "--target", str(tmp / "target"),
            "--settings", json.dumps(settings), "--output-dir", str(tmp / out)]  # fmt: skip
    rc = cli_main(args)
    if not check:
        return rc
    assert rc == 0
    return json.loads((tmp / out / "export.json").read_text())


def layer_params(c: dict, prefix: str) -> dict[str, tuple]:
    """One DFlash decoder layer as both engines build it: fused qkv_proj (q | k | v rows) and
    gate_up_proj, o_proj, down_proj, per-head q_norm / k_norm, the two layer norms."""
    H, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {}
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        out.update({
            p + "self_attn.qkv_proj.weight": (q + 2 * kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_up_proj.weight": (2 * I, H), p + "mlp.down_proj.weight": (H, I),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        })  # fmt: skip
    return out


# ---------------------------------------------------------------- SGLang


def sglang_params(c: dict) -> dict[str, tuple]:
    """DFlashDraftModel.named_parameters() (python/sglang/srt/models/dflash.py): layers.*, norm,
    fc [H, K·H] with K = len(dflash_config.target_layer_ids), hidden_norm; no embedding, no
    lm_head (the worker uses the target's)."""
    H, K = c["hidden_size"], len(c["dflash_config"]["target_layer_ids"])
    return {**layer_params(c, ""), "norm.weight": (H,), "fc.weight": (H, K * H), "hidden_norm.weight": (H,)}


def sglang_load(params: dict, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """DFlashDraftModel.load_weights: `.q/k/v_proj.` -> qkv_proj and `.gate/up_proj.` -> gate_up_proj
    (shards); a name is tried as given, then with / without `model.`; a name that resolves to no
    parameter is silently skipped, so every tensor must resolve."""
    loaded: dict[str, dict] = {}
    for name, w in tensors.items():
        name, shard = unstack(name)
        resolved = name if name in params else (name.removeprefix("model.") if name.startswith("model.") else f"model.{name}")
        assert resolved in params, f"SGLang would silently skip {name}"
        assert shard not in loaded.setdefault(resolved, {}), f"{resolved} loaded twice"
        loaded[resolved][shard] = tuple(w.shape)
    return loaded


def check_dflash_config(c: dict) -> None:
    """parse_dflash_draft_config (speculative/dflash_utils.py) and the model's own reads."""
    d = c["dflash_config"]
    assert c["architectures"] == ["DFlashDraftModel"]  # the EntryClass; vLLM's registry key too
    assert c["model_type"] == "qwen3"  # AutoConfig must build it (vLLM wraps it in EAGLEConfig)
    assert isinstance(c["num_hidden_layers"], int) and c["num_hidden_layers"] >= 1
    assert d["block_size"] == c["block_size"] == BLOCK
    assert d["target_layer_ids"] == IDS and all(0 <= i < c["num_target_layers"] for i in IDS)
    assert c["num_target_layers"] == LAYERS
    assert isinstance(d["mask_token_id"], int) and not isinstance(d["mask_token_id"], bool) and 0 <= d["mask_token_id"] < V
    assert c["layer_types"] == ["full_attention"] * c["num_hidden_layers"]  # SGLang ENCODER_ONLY, vLLM non-causal
    assert c["hidden_act"] == "silu" and c["intermediate_size"] > 0 and c["attention_bias"] is False
    assert c["vocab_size"] == V and "draft_vocab_size" not in c  # vLLM: no draft_id_to_target_id
    # vLLM's gpu_model_runner takes these before dflash_config.target_layer_ids + 1
    assert "eagle_aux_hidden_state_layer_ids" not in c and "eagle_config" not in c
    assert "causal" not in d and "use_swa" not in d


def test_sglang_export_has_the_names_shapes_and_keys_dflash_draft_model_reads(saved):
    manifest = export(saved, "out")
    folder = saved / "out" / "sglang"
    c = json.loads((folder / "config.json").read_text())
    check_dflash_config(c)
    tensors = load_file(str(folder / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in tensors), sorted(tensors)
    params = sglang_params(c)
    loaded = sglang_load(params, tensors)
    assert set(loaded) == set(params)
    H, hd = c["hidden_size"], c["head_dim"]
    kv = (c["num_key_value_heads"] * hd, H)
    assert loaded["layers.0.self_attn.qkv_proj.weight"] == {"q": (c["num_attention_heads"] * hd, H), "k": kv, "v": kv}
    assert loaded["layers.1.mlp.gate_up_proj.weight"] == {0: (c["intermediate_size"], H), 1: (c["intermediate_size"], H)}
    for name, shards in loaded.items():
        if None in shards:
            assert shards[None] == params[name], name
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert manifest["method"] == "dflash" and manifest["block_size"] == BLOCK
    assert manifest["sglang"]["captures_input_of_layers"] == [i + 1 for i in IDS]  # set_dflash_layers_to_capture


# ---------------------------------------------------------------- vLLM


def vllm_params(c: dict) -> dict[str, tuple]:
    """DFlashQwen3ForCausalLM (vllm/model_executor/models/qwen3_dflash.py): model.layers.*,
    model.fc [H, len(target_layer_ids) · (target_hidden_size or H)], model.hidden_norm,
    model.norm; embed_tokens / lm_head come from the target when the checkpoint lacks them."""
    H, K = c["hidden_size"], len(c["dflash_config"]["target_layer_ids"])
    fc_in = K * (c.get("target_hidden_size") or H)
    return {**layer_params(c, "model."), "model.fc.weight": (H, fc_in), "model.hidden_norm.weight": (H,),
            "model.norm.weight": (H,)}  # fmt: skip


def vllm_load(params: dict, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """load_weights: t2d skipped, d2t renamed, `model.` prepended unless lm_head; then the inner
    model: `midlayer.` -> `layers.0.`, stacked q/k/v and gate/up, params_dict[name] (KeyError if absent)."""
    loaded: dict[str, dict] = {}
    for name, w in tensors.items():
        assert "mask_hidden" not in name and "d2t" not in name and "t2d" not in name
        if "lm_head" not in name:
            name = "model." + name
        name, shard = unstack(name.replace("midlayer.", "layers.0."))
        assert name in params, f"vLLM has no parameter {name}"
        assert shard not in loaded.setdefault(name, {}), f"{name} loaded twice"
        loaded[name][shard] = tuple(w.shape)
    return loaded


def test_vllm_export_has_the_names_shapes_and_keys_qwen3_dflash_reads(saved):
    manifest = export(saved, "out-v")
    folder = saved / "out-v" / "vllm"
    c = json.loads((folder / "config.json").read_text())
    check_dflash_config(c)
    params = vllm_params(c)
    loaded = vllm_load(params, load_file(str(folder / "model.safetensors")))
    assert set(loaded) == set(params)
    for name, shards in loaded.items():
        if None in shards:
            assert shards[None] == params[name], name
    # gpu_model_runner: aux ids = dflash_config.target_layer_ids + 1 (vLLM id j = input of layer j)
    assert manifest["vllm"]["captures_input_of_layers"] == [i + 1 for i in c["dflash_config"]["target_layer_ids"]]
    assert (saved / "out-v" / "sglang" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_launch_scripts_run_the_exact_dflash_server_commands(saved, tmp_path):
    export(saved, "out-l")
    target = str((saved / "target").resolve())
    sg = (saved / "out-l" / "sglang").resolve()
    assert run_launch(sg / "launch.sh", tmp_path, "python") == [
        "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(sg), "--speculative-num-draft-tokens", str(BLOCK), "--tp", "2",
        "--port", "30000",
    ]  # fmt: skip
    vl = (saved / "out-l" / "vllm").resolve()
    argv = run_launch(vl / "launch.sh", tmp_path, "vllm")
    assert argv[:5] == ["serve", target, "--tensor-parallel-size", "2", "--speculative-config"]
    assert json.loads(argv[5]) == {"method": "dflash", "model": str(vl), "num_speculative_tokens": BLOCK - 1}


def test_exported_drafter_loads_back_unchanged(saved):
    export(saved, "out-r", dtype="float32")
    original, cfg = load_drafter(saved / "drafter", saved / "target")
    again, cfg2 = load_drafter(saved / "out-r" / "sglang", saved / "target")
    assert cfg2.target_layer_ids == cfg.target_layer_ids and cfg2.block_size == cfg.block_size
    for k, v in original.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"vllm_version": "0.18.0"}, "vllm serves DFlash drafters from 0.19.0"),
        ({"sglang_version": "0.5.10.post1"}, "sglang serves DFlash drafters from 0.5.11"),
        ({"aux_layer_ids": [1, 2, 3]}, r"reads target layers \[1, 2, 4\]"),
    ],
)
def test_export_refuses_what_the_engines_cannot_serve(saved, tmp_path, capsys, settings, message):
    assert export(saved, "bad", check=False, **settings) == 1
    assert re.search(message, capsys.readouterr().err)
    assert not (saved / "bad").exists()


def test_export_refuses_the_last_layer_and_unknown_targets(saved, tmp_path, capsys):
    model = tiny_target(vocab=V, layers=LAYERS, dtype=torch.float32)
    cfg = DFlashConfig.from_target(model.config.to_dict(), num_hidden_layers=1, target_layer_ids=[2, LAYERS - 1],
                                   block_size=4, mask_token_id=1)  # fmt: skip
    save_drafter(DFlashDrafter(cfg), tmp_path / "last", dtype=torch.float32)
    args = ["export", "--drafter", str(tmp_path / "last"), "--target", str(saved / "target"),
            "--settings", "{}", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 1
    assert "the last layer's output cannot be served" in capsys.readouterr().err
    qwen2 = tmp_path / "qwen2"
    qwen2.mkdir()
    config = json.loads((saved / "target" / "config.json").read_text())
    (qwen2 / "config.json").write_text(json.dumps(dict(config, model_type="qwen2")))
    args = ["export", "--drafter", str(saved / "drafter"), "--target", str(qwen2), "--settings", "{}",
            "--output-dir", str(tmp_path / "out2")]  # fmt: skip
    assert cli_main(args) == 1
    assert "no DFlash layer capture for model_type 'qwen2'" in capsys.readouterr().err
