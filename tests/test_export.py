"""SGLang / vLLM export and import: names, shapes, dtypes and config keys as the engines' loaders
read them; aux layer id translation per engine and version; launch commands; round trips."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftflow.cli import main as cli_main
from draftflow.errors import DraftflowError
from draftflow.export.eagle3 import engine_aux_ids, our_aux_ids
from draftflow.drafters.checkpoint import load_drafter, save_drafter
from test_speculative import tiny_drafter, tiny_target

AUX = [1, 2, 4]  # of a 6-layer target: below the last layer, whose output engines cannot capture
V, VD, LAYERS = 64, 48, 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny target and a saved drafter with a draft vocabulary of 48 of its 64 tokens."""
    tmp = tmp_path_factory.mktemp("export")
    model = tiny_target(vocab=V, layers=LAYERS, dtype=torch.float32)
    model.save_pretrained(tmp / "target")
    drafter = tiny_drafter(model, aux=AUX, draft_vocab=VD, dtype=torch.float32)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(0))[:VD]] = True
    drafter.set_vocab(torch.nonzero(t2d)[:, 0] - torch.arange(VD), t2d)
    save_drafter(drafter, tmp / "drafter", dtype=torch.float32)
    return tmp


def export(tmp, out: str, **settings) -> dict:
    settings = {"sglang_version": "0.5.14", "vllm_version": "0.25.1", "tensor_parallel": 2, "aux_layer_ids": AUX,
                "engine_versions": {"hf": "test"}, **settings}  # fmt: skip
    args = ["export", "--drafter", str(tmp / "drafter"), "--target", str(tmp / "target"),
            "--settings", json.dumps(settings), "--output-dir", str(tmp / out)]  # fmt: skip
    assert cli_main(args) == 0
    return json.loads((tmp / out / "export.json").read_text())


def some_logits(drafter, seed: int = 0) -> torch.Tensor:
    """Logits of a prefill over random tokens and fused aux states, then two drafted steps."""
    from draftflow.drafters.eagle3 import KVCache

    g = torch.Generator().manual_seed(seed)
    H, dtype = drafter.config.hidden_size, drafter.fc.weight.dtype
    ids = torch.randint(0, V, (1, 9), generator=g)
    aux = torch.randn(1, 9, 3, H, generator=g).to(dtype)
    cache = KVCache(drafter.num_layers)
    with torch.no_grad():
        logits, out, _ = drafter.step(ids, drafter.fuse(aux), torch.arange(9)[None], cache)
        outs = [logits]
        for i in range(2):
            token = drafter.to_target_ids(logits[:, -1].argmax(-1))[:, None]
            logits, out, _ = drafter.step(token, out[:, -1:], torch.tensor([[9 + i]]), cache)
            outs.append(logits)
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------- SGLang

# Both loaders' stacked_params_mapping: (fused parameter, checkpoint name part, shard id)
STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]  # fmt: skip


def unstack(name: str) -> tuple[str, object]:
    for fused, part, shard in STACKED:
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def sglang_params(c: dict) -> dict[str, tuple]:
    """Parameters of SGLang's LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py):
    model.fc (3 × target hidden in), model.midlayer with qkv_proj over 2H inputs and fused
    gate_up_proj, its input_layernorm / hidden_norm / post_attention_layernorm, model.norm, and
    lm_head over draft_vocab_size (tie_word_embeddings false). model.embed_tokens is set from
    the target by the EAGLE worker, so a checkpoint need not carry it."""
    H, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    m = "model.midlayer."
    return {
        "model.fc.weight": (H, 3 * c.get("target_hidden_size", H)),
        m + "self_attn.qkv_proj.weight": (q + 2 * kv, 2 * H),
        m + "self_attn.o_proj.weight": (H, q),
        m + "mlp.gate_up_proj.weight": (2 * I, H),
        m + "mlp.down_proj.weight": (H, I),
        m + "input_layernorm.weight": (H,),
        m + "hidden_norm.weight": (H,),
        m + "post_attention_layernorm.weight": (H,),
        "model.norm.weight": (H,),
        "lm_head.weight": (c["draft_vocab_size"], H),
    }


def sglang_load(c: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, list], torch.Tensor]:
    """SGLang's `load_weights` name resolution: d2t -> hot_token_id = d2t + arange; t2d skipped;
    .q/.k/.v_proj into .qkv_proj and .gate/.up_proj into .gate_up_proj (shards); a name is
    tried as given, then with a `model.` prefix. Returns {param: {shard: shape}} and hot ids."""
    params = sglang_params(c)
    loaded: dict[str, dict] = {}
    hot = None
    for name, w in tensors.items():
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        name, shard = unstack(name)
        param = name if name in params else f"model.{name}"
        assert param in params, f"SGLang has no parameter for {name}"
        assert shard not in loaded.setdefault(param, {}), f"{param} loaded twice"
        loaded[param][shard] = tuple(w.shape)
    return loaded, hot


def test_sglang_export_has_the_names_shapes_dtypes_and_keys_its_loader_reads(saved):
    manifest = export(saved, "out")
    folder = saved / "out" / "sglang"
    c = json.loads((folder / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "rope_theta", "max_position_embeddings", "num_hidden_layers", "draft_vocab_size"):  # fmt: skip
        assert key in c, key
    assert c["vocab_size"] == V and c["draft_vocab_size"] == VD and c["tie_word_embeddings"] is False
    assert c["torch_dtype"] == "bfloat16"
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX  # llama.py adds the 1 itself
    assert manifest["sglang"]["captures_input_of_layers"] == [2, 3, 5]

    tensors = load_file(str(folder / "model.safetensors"))
    assert not any("embed_tokens" in k for k in tensors)
    loaded, hot = sglang_load(c, tensors)
    params = sglang_params(c)
    assert set(loaded) == set(params)
    H, hd = c["hidden_size"], c["head_dim"]
    kv = (c["num_key_value_heads"] * hd, 2 * H)
    assert loaded["model.midlayer.self_attn.qkv_proj.weight"] == {
        "q": (c["num_attention_heads"] * hd, 2 * H),
        "k": kv,
        "v": kv,
    }
    assert loaded["model.midlayer.mlp.gate_up_proj.weight"] == {
        0: (c["intermediate_size"], H),
        1: (c["intermediate_size"], H),
    }
    for name, shards in loaded.items():
        if None in shards:
            assert shards == {None: params[name]}, name
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["t2d"].shape == (V,) and hot.shape == (VD,)
    assert torch.equal(hot, torch.nonzero(tensors["t2d"])[:, 0])  # draft id i -> its target id


# ---------------------------------------------------------------- vLLM


def vllm_params(layer: dict, draft_vocab: int, target_hidden: int | None) -> dict[str, tuple]:
    """Parameters of vLLM's Eagle3LlamaForCausalLM (vllm/model_executor/models/llama_eagle3.py):
    model.layers.0 with a 2H-input qkv_proj, hidden_norm, model.fc over 3 × (target_hidden_size
    or hidden_size), model.norm, lm_head [draft_vocab_size, H], draft_id_to_target_id [Vd]."""
    H, I, hd = layer["hidden_size"], layer["intermediate_size"], layer["head_dim"]
    q, kv = layer["num_attention_heads"] * hd, layer["num_key_value_heads"] * hd
    m = "model.layers.0."
    return {
        m + "self_attn.qkv_proj.weight": (q + 2 * kv, 2 * H),
        m + "self_attn.o_proj.weight": (H, q),
        m + "mlp.gate_up_proj.weight": (2 * I, H),
        m + "mlp.down_proj.weight": (H, I),
        m + "input_layernorm.weight": (H,),
        m + "hidden_norm.weight": (H,),
        m + "post_attention_layernorm.weight": (H,),
        "model.fc.weight": (H, 3 * (target_hidden or H)),
        "model.norm.weight": (H,),
        "lm_head.weight": (draft_vocab, H),
        "draft_id_to_target_id": (draft_vocab,),
    }


def vllm_load(tensors: dict[str, torch.Tensor], params: dict) -> dict[str, list]:
    """vLLM's Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights name handling:
    t2d skipped; d2t -> draft_id_to_target_id; names without lm_head get `model.`; `midlayer.` ->
    `layers.0.`; q/k/v and gate/up stacked into qkv_proj / gate_up_proj."""
    loaded: dict[str, dict] = {}
    for name, w in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name, shard = unstack(name.replace("midlayer.", "layers.0."))
        assert name in params, f"vLLM has no parameter for {name}"
        assert shard not in loaded.setdefault(name, {}), f"{name} loaded twice"
        loaded[name][shard] = (tuple(w.shape), w.dtype)
    return loaded


def test_vllm_export_is_the_speculators_format_vllm_reads(saved):
    manifest = export(saved, "out")
    folder = saved / "out" / "vllm"
    c = json.loads((folder / "config.json").read_text())
    # vllm/transformers_utils/configs/speculators/base.py: validate_speculators_config and
    # extract_transformers_pre_trained_config; algos.py update_eagle3
    assert c["speculators_model_type"] == "eagle3"
    spec = c["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 3,
                                           "verifier_accept_k": 1, "accept_tolerance": 0.0}  # fmt: skip
    assert spec["verifier"] == {
        "name_or_path": str((saved / "target").resolve()),
        "architectures": ["LlamaForCausalLM"],
    }
    layer = c["transformer_layer_config"]
    assert isinstance(layer, dict) and layer["model_type"] == "llama" and layer["vocab_size"] == V
    assert layer["num_hidden_layers"] == 1
    assert c["draft_vocab_size"] == VD
    assert c["norm_before_residual"] is False  # update_eagle3 defaults a missing key to True
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5] == manifest["vllm"]["eagle_aux_hidden_state_layer_ids"]

    tensors = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("layers.0.") for k in tensors) and not any("midlayer" in k for k in tensors)
    params = vllm_params(layer, c["draft_vocab_size"], c["target_hidden_size"])
    loaded = vllm_load(tensors, params)
    assert set(loaded) == set(params)  # embed_tokens absent: vLLM then skips it (shares the target's)
    H, hd = layer["hidden_size"], layer["head_dim"]
    kv = (layer["num_key_value_heads"] * hd, 2 * H)
    qkv = {k: shape for k, (shape, _) in loaded["model.layers.0.self_attn.qkv_proj.weight"].items()}
    assert qkv == {"q": (layer["num_attention_heads"] * hd, 2 * H), "k": kv, "v": kv}
    for name, shards in loaded.items():
        if None in shards:
            assert shards[None][0] == params[name], name
    assert loaded["draft_id_to_target_id"][None][1] == torch.int64
    assert loaded["model.fc.weight"][None][1] == torch.bfloat16


# ---------------------------------------------------------------- aux layer ids

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32}
KIMI = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61}}  # fmt: skip
DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61}


@pytest.mark.parametrize(
    "engine, version, target, ours, written",
    [
        ("sglang", "0.5.5", LLAMA, [1, 15, 28], [1, 15, 28]),
        ("sglang", "0.5.13", LLAMA, [1, 15, 28], [1, 15, 28]),
        ("sglang", "0.5.12", LLAMA, [1, 15, 28], [1, 15, 28]),  # llama.py: +1 in every release
        ("sglang", "0.5.5", KIMI, [2, 30, 58], [2, 30, 58]),  # the user's run: captured as [3, 31, 59]
        ("sglang", "0.5.11", DEEPSEEK, [2, 30, 58], [2, 30, 58]),
        ("sglang", "0.5.13", KIMI, [2, 30, 58], [3, 31, 59]),  # PR #25454: no +1 unless the first id is 1
        ("sglang", "0.5.14", KIMI, [2, 30, 58], [3, 31, 59]),
        ("sglang", "0.5.19", DEEPSEEK, [2, 30, 58], [3, 31, 59]),
        ("sglang", "0.5.14.post1", KIMI, [1, 29, 57], [1, 29, 57]),  # first id 1: the server adds 1
        ("vllm", "0.12.0", LLAMA, [1, 15, 28], [2, 16, 29]),  # vLLM's own default (2, N//2, N-3)
        ("vllm", "0.25.1", KIMI, [2, 30, 58], [3, 31, 59]),
        ("vllm", "0.25.1", LLAMA, [1, 15, 31], [2, 16, 32]),  # the last layer's output: id N, since 0.25
    ],
)
def test_aux_ids_are_translated_per_engine_family_and_version(engine, version, target, ours, written):
    from draftflow.engines.layer_ids import architecture_of, sglang_captures

    ids = engine_aux_ids(engine, version, target, ours)
    assert ids.ids == written and ids.captures_input_of_layers == [i + 1 for i in ours]
    if engine == "sglang":  # what the server then does with them: the input of layer i+1 = output of layer i
        assert sglang_captures(written, architecture_of(target), version) == [i + 1 for i in ours]
    assert our_aux_ids(engine, version, target, written) == ours


def test_aux_ids_or_releases_the_table_cannot_answer_are_refused():
    with pytest.raises(DraftflowError, match="aux layer id 0 cannot be expressed"):
        engine_aux_ids("sglang", "0.5.14", KIMI, [0, 30, 58])  # would need config [1, …], which gets +1
    assert engine_aux_ids("sglang", "0.5.11", KIMI, [0, 30, 58]).ids == [0, 30, 58]
    for version in ("0.5.12", "0.5.12.post1"):  # branched around PR #25454: unknown rule
        with pytest.raises(DraftflowError, match="not known whether this release has PR #25454"):
            engine_aux_ids("sglang", version, KIMI, [2, 30, 58])
        with pytest.raises(DraftflowError, match="not known whether"):
            our_aux_ids("sglang", version, DEEPSEEK, [3, 31, 59])
    with pytest.raises(DraftflowError, match="last decoder layer.*SGLang captures layer inputs"):
        engine_aux_ids("sglang", "0.5.14", LLAMA, [1, 15, 31])
    with pytest.raises(DraftflowError, match="#46973"):
        engine_aux_ids("vllm", "0.24.0", LLAMA, [1, 15, 31])
    with pytest.raises(DraftflowError, match="speculators drafter config"):
        engine_aux_ids("vllm", "0.11.0", LLAMA, [1, 15, 28])
    with pytest.raises(DraftflowError, match="no layer-id rules for model_type 'gpt_oss'"):
        engine_aux_ids("sglang", "0.5.14", {"model_type": "gpt_oss", "num_hidden_layers": 36}, [1, 17, 32])
    with pytest.raises(DraftflowError, match="increasing"):
        engine_aux_ids("sglang", "0.5.5", LLAMA, [15, 1, 28])
    with pytest.raises(DraftflowError, match="cannot read the version"):
        engine_aux_ids("sglang", "latest", LLAMA, [1, 15, 28])


def kimi_like(saved, tmp_path, aux):
    """A drafter trained on `aux` of the tiny target, whose config.json says it is a Kimi-K2.5."""
    model = tiny_target(vocab=V, layers=LAYERS, dtype=torch.float32)
    drafter = tiny_drafter(model, aux=aux, draft_vocab=VD, dtype=torch.float32)
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    target = tmp_path / "kimi"
    target.mkdir()
    config = dict(KIMI, text_config=dict(KIMI["text_config"], num_hidden_layers=LAYERS))
    (target / "config.json").write_text(json.dumps(config))
    return tmp_path / "drafter", target


@pytest.mark.parametrize("version, written", [("0.5.14", [3, 4, 5]), ("0.5.11", [2, 3, 4])])
def test_export_writes_the_ids_the_configured_sglang_expects_for_a_deepseek_family_target(
    saved, tmp_path, version, written
):
    """The user's case in small: a drafter trained on layers [2, 3, 4] of a deepseek_v2-family
    target must make SGLang capture the inputs of layers [3, 4, 5] in the configured release."""
    drafter, target = kimi_like(saved, tmp_path, [2, 3, 4])
    settings = {"sglang_version": version, "vllm_version": "0.25.1", "aux_layer_ids": [2, 3, 4]}
    args = ["export", "--drafter", str(drafter), "--target", str(target), "--settings", json.dumps(settings),
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 0
    config = json.loads((tmp_path / "out" / "sglang" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    manifest = json.loads((tmp_path / "out" / "export.json").read_text())
    assert manifest["sglang"]["captures_input_of_layers"] == [3, 4, 5]
    assert "PR #25454" in manifest["sglang"]["rule"]
    vllm = json.loads((tmp_path / "out" / "vllm" / "config.json").read_text())
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5]  # vLLM: id j = input of layer j


def test_export_refuses_a_release_the_table_cannot_place_before_writing(saved, tmp_path, capsys):
    drafter, target = kimi_like(saved, tmp_path, [2, 3, 4])
    settings = {"sglang_version": "0.5.12.post1", "vllm_version": "0.25.1"}
    args = ["export", "--drafter", str(drafter), "--target", str(target), "--settings", json.dumps(settings),
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert "SGLang 0.5.12.post1" in err and "set_eagle3_layers_to_capture" in err
    assert not (tmp_path / "out").exists()


def test_the_default_export_targets_the_schema_default_releases():
    import yaml

    from draftflow.export.common import ExportSettings

    schema = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "config/schema/config.schema.yaml")))
    export_props = schema["properties"]["export"]["properties"]
    extract_props = schema["properties"]["extract"]["properties"]
    assert ExportSettings().sglang_version == export_props["sglang_version"]["default"]
    assert ExportSettings().vllm_version == export_props["vllm_version"]["default"]
    from draftflow.export.common import DTYPES

    assert ExportSettings().dtype == export_props["dtype"]["default"] == "bfloat16"  # export.dtype (issue 33)
    assert sorted(export_props["dtype"]["enum"]) == sorted(DTYPES)
    assert export_props["sglang_version"]["default"] == extract_props["sglang"]["properties"]["version"]["default"]
    assert export_props["vllm_version"]["default"] == extract_props["vllm"]["properties"]["version"]["default"]


# ---------------------------------------------------------------- launch commands


def run_launch(script, tmp_path, program: str, *args: str, **env_vars: str) -> list[str]:
    """Run launch.sh with a stub `program` on PATH that records its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / f"{program}.argv.json"
    stub = bin_dir / program
    stub.write_text(f'#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open("{record}", "w"))\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TARGET", "DRAFTER", "PYTHON")}
    env.update(env_vars, PATH=f"{bin_dir}:{os.environ['PATH']}")
    subprocess.run(["bash", str(script), *args, "--port", "30000"], check=True, env=env, timeout=60)
    return json.loads(record.read_text())


def test_launch_scripts_run_the_exact_server_commands(saved, tmp_path):
    export(saved, "out", num_speculative_tokens=4)
    target = str((saved / "target").resolve())
    sg = (saved / "out" / "sglang").resolve()
    argv = run_launch(sg / "launch.sh", tmp_path, "python3")
    assert argv == [
        "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(sg), "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "5", "--tp-size", "2", "--dtype", "bfloat16", "--port", "30000",
    ]  # fmt: skip
    vl = (saved / "out" / "vllm").resolve()
    argv = run_launch(vl / "launch.sh", tmp_path, "python3")  # the `vllm` command fails on the CPU build
    assert argv[:8] == ["-m", "vllm.entrypoints.openai.api_server", "--model", target, "--tensor-parallel-size", "2",
                        "--dtype", "bfloat16"]  # fmt: skip
    assert argv[8] == "--speculative-config" and argv[10:] == ["--port", "30000"]
    assert json.loads(argv[9]) == {"method": "eagle3", "model": str(vl), "num_speculative_tokens": 4}


def test_launch_scripts_serve_the_target_in_the_drafters_dtype(saved, tmp_path):
    """Issue 33: launch.sh passed no --dtype, SGLang's `auto` ran the float32 target in float16
    against the bfloat16 drafter, and its first forward failed (Half != BFloat16 in fc). Both
    engines now run the target in the dtype the drafter was written in (export.dtype)."""
    for dtype in ("bfloat16", "float32"):
        manifest = export(saved, f"out-{dtype}", dtype=dtype)
        assert manifest["settings"]["dtype"] == dtype
        for engine in ("sglang", "vllm"):
            folder = saved / f"out-{dtype}" / engine
            argv = run_launch(folder / "launch.sh", tmp_path, "python3")
            assert argv[argv.index("--dtype") + 1] == dtype == json.loads((folder / "config.json").read_text())["torch_dtype"]
            assert load_file(str(folder / "model.safetensors"))["fc.weight"].dtype == getattr(torch, dtype)


def test_moved_export_serves_a_target_given_by_argument_or_environment(saved, tmp_path):
    """launch.sh hard-codes nothing of the machine that built it: copied elsewhere it serves its
    own folder, and the target comes from its first argument or $TARGET (default: recorded)."""
    export(saved, "out-moved", num_speculative_tokens=3)
    moved = tmp_path / "elsewhere"
    shutil.copytree(saved / "out-moved", moved)
    shutil.rmtree(saved / "out-moved")
    other = tmp_path / "other-target"
    argv = run_launch(moved / "sglang" / "launch.sh", tmp_path, "python3", str(other))
    assert argv[argv.index("--model-path") + 1] == str(other)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(moved / "sglang")
    assert argv[-2:] == ["--port", "30000"]
    argv = run_launch(moved / "vllm" / "launch.sh", tmp_path, "python3", TARGET=str(other), DRAFTER="/srv/drafter")
    assert argv[argv.index("--model") + 1] == str(other)
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == "/srv/drafter"
    argv = run_launch(moved / "sglang" / "launch.sh", tmp_path, "python3")  # the recorded target
    assert argv[argv.index("--model-path") + 1] == str((saved / "target").resolve())


def test_exported_files_get_the_umask_modes(saved):
    """safetensors alone writes 0600; exports are for others to serve (0644 under umask 022)."""
    old = os.umask(0o022)
    try:
        export(saved, "out-modes")
    finally:
        os.umask(old)
    for engine in ("sglang", "vllm"):
        folder = saved / "out-modes" / engine
        assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o644
        assert (folder / "config.json").stat().st_mode & 0o777 == 0o644
        assert (folder / "launch.sh").stat().st_mode & 0o777 == 0o755
    assert (saved / "drafter" / "model.safetensors").stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_then_import_reproduces_the_drafter(saved, dtype):
    export(saved, f"out-{dtype}", dtype=dtype)
    args = ["import-drafter", "--from", "sglang", "--input", str(saved / f"out-{dtype}" / "sglang"),
            "--target", str(saved / "target"), "--output", str(saved / f"imported-{dtype}")]  # fmt: skip
    assert cli_main(args) == 0
    original, cfg = load_drafter(saved / "drafter", saved / "target")
    imported, cfg2 = load_drafter(saved / f"imported-{dtype}", saved / "target")
    assert cfg2.aux_layer_ids == AUX and cfg2.draft_vocab_size == VD
    if dtype == "bfloat16":  # the export rounds weights to bf16: compare with the rounded original
        with torch.no_grad():
            for p in original.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    assert torch.equal(some_logits(imported), some_logits(original))
    assert torch.equal(imported.d2t, original.d2t) and torch.equal(imported.t2d, original.t2d)


def test_import_of_a_specforge_checkpoint(saved, tmp_path):
    """SpecForge layout: names with a `model.` prefix are accepted too, the embedding is stored,
    t2d may be missing (derived from d2t), eagle_config ids are in our convention."""
    original, cfg = load_drafter(saved / "drafter", saved / "target")
    ckpt = tmp_path / "specforge"
    ckpt.mkdir()
    tensors = {("model." + k if k.startswith("midlayer.") else k): v.clone() for k, v in original.state_dict().items()}
    del tensors["t2d"]
    tensors["embed_tokens.weight"] = original.embed_tokens.weight.clone()
    save_file(tensors, str(ckpt / "model.safetensors"))
    config = {k: v for k, v in original.config.to_dict().items() if k != "draftflow"}
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX}
    (ckpt / "config.json").write_text(json.dumps(config))
    args = ["import-drafter", "--from", "specforge", "--input", str(ckpt), "--target", str(saved / "target"),
            "--output", str(tmp_path / "ours")]  # fmt: skip
    assert cli_main(args) == 0
    imported, cfg2 = load_drafter(tmp_path / "ours", saved / "target")
    assert cfg2.aux_layer_ids == AUX and cfg2.extra["imported_from"]["format"] == "specforge"
    assert torch.equal(imported.t2d, original.t2d)
    assert torch.equal(some_logits(imported), some_logits(original))


def test_import_rejects_weights_that_do_not_fit(saved, tmp_path, capsys):
    ckpt = tmp_path / "bad"
    ckpt.mkdir()
    tensors = load_file(str(saved / "drafter" / "model.safetensors"))
    tensors["midlayer.self_attn.q_proj.weight"] = tensors["midlayer.self_attn.q_proj.weight"][:, :10].contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text((saved / "drafter" / "config.json").read_text())
    args = ["import-drafter", "--from", "sglang", "--input", str(ckpt), "--target", str(saved / "target"),
            "--output", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 1
    assert "do not fit LlamaForCausalLMEagle3" in capsys.readouterr().err


# ---------------------------------------------------------------- speculators checkpoints


def speculators_checkpoint(drafter, folder, target_dir, epoch: int = 1) -> None:
    """A `speculators train --save-path` folder as speculators 0.9 writes it (layout copied from a
    real run: epoch folders, checkpoint_best -> N, config.json with transformer_layer_config as
    a diff dict, its (vLLM) aux ids = ours + 1, tensors `layers.0.*`, the embedding, input_norm)."""
    cfg = drafter.config
    ckpt = folder / str(epoch)
    ckpt.mkdir(parents=True)
    tensors = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v.clone()
               for k, v in drafter.state_dict().items()}  # fmt: skip
    tensors["embed_tokens.weight"] = drafter.embed_tokens.weight.clone().float()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(ckpt / "model.safetensors"))
    config = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": cfg.draft_vocab_size, "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids], "embed_requires_grad": False,
        "fc_norm": False, "norm_before_fc": cfg.norm_before_fc, "norm_before_residual": cfg.norm_before_residual,
        "norm_output": cfg.norm_output,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(target_dir)}},
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
        "transformer_layer_config": {
            "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "layer_types": ["sliding_attention"], "max_position_embeddings": cfg.max_position_embeddings,
            "model_type": "llama", "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": 1,
            "num_key_value_heads": cfg.num_key_value_heads, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "sliding_window": 2048,
            "vocab_size": cfg.vocab_size,
        },
    }  # fmt: skip
    (ckpt / "config.json").write_text(json.dumps(config))
    (folder / "0").mkdir()  # an older epoch, without weights
    (folder / "checkpoint_best").symlink_to(str(epoch))


@pytest.fixture(scope="module")
def recipe_drafter(saved):
    """The tiny drafter with speculators' three EAGLE-3 recipe norms on, weights perturbed."""
    from draftflow.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    original, cfg = load_drafter(saved / "drafter", saved / "target")
    flagged = Eagle3Config.from_dict({**cfg.to_dict(), "norm_before_fc": True, "norm_before_residual": True,
                                      "norm_output": True})  # fmt: skip
    drafter = Eagle3Drafter(flagged)
    drafter.load_state_dict(original.state_dict(), strict=False)
    drafter.embed_tokens.weight = original.embed_tokens.weight
    with torch.no_grad():
        drafter.input_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return drafter.eval()


def test_the_recipe_norms_change_what_the_drafter_computes(saved, recipe_drafter):
    original, _ = load_drafter(saved / "drafter", saved / "target")
    assert not torch.allclose(some_logits(recipe_drafter), some_logits(original))
    assert "input_norm.weight" in recipe_drafter.export_state_dict()


def test_import_of_a_speculators_checkpoint(saved, recipe_drafter, tmp_path, caplog):
    speculators_checkpoint(recipe_drafter, tmp_path / "run", saved / "target")
    args = ["import-drafter", "--from", "speculators", "--input", str(tmp_path / "run"),
            "--target", str(saved / "target"), "--output", str(tmp_path / "ours")]  # fmt: skip
    assert cli_main(args) == 0
    imported, cfg = load_drafter(tmp_path / "ours", saved / "target")
    assert cfg.aux_layer_ids == AUX and cfg.extra["imported_from"]["path"].endswith("checkpoint_best")
    assert (cfg.norm_before_fc, cfg.norm_before_residual, cfg.norm_output) == (True, True, True)
    assert torch.equal(some_logits(imported), some_logits(recipe_drafter))
    assert "sliding attention window" in caplog.text
    # an epoch folder works as well
    args[4], args[-1] = str(tmp_path / "run" / "1"), str(tmp_path / "ours-epoch")
    assert cli_main(args) == 0


def test_vllm_export_round_trips_through_the_speculators_import(saved, recipe_drafter, tmp_path):
    save_drafter(recipe_drafter, tmp_path / "drafter", dtype=torch.float32)
    (tmp_path / "target").symlink_to(saved / "target")
    export(tmp_path, "out", dtype="float32")
    vllm_config = json.loads((tmp_path / "out" / "vllm" / "config.json").read_text())
    assert vllm_config["norm_before_fc"] and vllm_config["norm_before_residual"] and vllm_config["norm_output"]
    args = ["import-drafter", "--from", "speculators", "--input", str(tmp_path / "out" / "vllm"),
            "--target", str(saved / "target"), "--output", str(tmp_path / "back")]  # fmt: skip
    assert cli_main(args) == 0
    back, cfg = load_drafter(tmp_path / "back", saved / "target")
    assert cfg.aux_layer_ids == AUX and cfg.norm_output
    assert set(load_file(str(tmp_path / "back" / "model.safetensors"))) == set(recipe_drafter.export_state_dict())
    assert torch.equal(some_logits(back), some_logits(recipe_drafter))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no_weights", "no model.safetensors"),
        ("missing_tensor", "missing ['midlayer.mlp.down_proj.weight']"),
        ("wrong_type", "field 'speculators_model_type': 'mlp_speculator'"),
        ("fc_norm", "field 'fc_norm': true"),
        ("two_layers", "only 1-layer drafters import"),
        ("empty", "neither a speculators checkpoint"),
    ],
)
def test_speculators_import_names_what_is_wrong(saved, recipe_drafter, tmp_path, capsys, damage, message):
    run = tmp_path / "run"
    speculators_checkpoint(recipe_drafter, run, saved / "target")
    ckpt = run / "1"
    config = json.loads((ckpt / "config.json").read_text())
    if damage == "no_weights":
        (ckpt / "model.safetensors").unlink()
    elif damage == "missing_tensor":
        tensors = load_file(str(ckpt / "model.safetensors"))
        del tensors["layers.0.mlp.down_proj.weight"]
        save_file(tensors, str(ckpt / "model.safetensors"))
    elif damage == "wrong_type":
        config["speculators_model_type"] = "mlp_speculator"
    elif damage == "fc_norm":
        config["fc_norm"] = True
    elif damage == "two_layers":
        config["transformer_layer_config"]["num_hidden_layers"] = 2
    elif damage == "empty":
        run = tmp_path / "empty"
        run.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    args = ["import-drafter", "--from", "speculators", "--input", str(run), "--target", str(saved / "target"),
            "--output", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_exporting_recipe_norms_names_those_the_sglang_release_would_not_apply(saved, recipe_drafter, tmp_path, caplog):
    from draftflow.export.eagle3 import sglang_ignored_variants

    cfg = recipe_drafter.config
    assert sglang_ignored_variants(cfg, "0.5.14") == ["norm_before_fc", "norm_before_residual"]
    assert sglang_ignored_variants(cfg, "0.5.23") == ["norm_before_residual"]
    # ranges, not points (issue 33: 0.5.18 applies norm_output and was said not to)
    assert sglang_ignored_variants(cfg, "0.5.18") == ["norm_before_residual"]
    assert sglang_ignored_variants(cfg, "0.5.16") == ["norm_before_fc", "norm_before_residual"]
    assert sglang_ignored_variants(cfg, "0.5.11") == ["norm_before_fc", "norm_before_residual", "norm_output"]
    assert sglang_ignored_variants(cfg, "0.9.9") == ["norm_before_residual"]  # later: as the newest read
    original, _ = load_drafter(saved / "drafter", saved / "target")
    assert sglang_ignored_variants(original.config, "0.5.14") == []  # the default layout: nothing to say
    save_drafter(recipe_drafter, tmp_path / "drafter", dtype=torch.float32)
    (tmp_path / "target").symlink_to(saved / "target")
    with caplog.at_level("WARNING"):
        export(tmp_path, "out", dtype="float32")
    assert "SGLang 0.5.14's LlamaForCausalLMEagle3 does not apply norm_before_fc, norm_before_residual" in caplog.text
