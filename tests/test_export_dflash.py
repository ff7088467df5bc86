"""DFlash export, checked against the released code of the pinned engines (SGLang 0.5.14's
`DFlashDraftModel`, vLLM 0.25.1's `DFlashQwen3ForCausalLM`, run on CPU by
tests/helpers_dflash_engines.py from their wheels' source, fetched from PyPI once): their config
parsing, constructors and load_weights take every exported tensor and leave nothing unset, their
target-capture ids are ours + 1, and their block draft equals ours; plus the launch commands and
refusals."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from draftflow.cli import main as cli_main
from draftflow.drafters.dflash import ContextCache, DFlashConfig, DFlashDrafter
from draftflow.drafters.checkpoint import load_drafter, save_drafter
from test_export import run_launch
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


def check_dflash_config(c: dict) -> None:
    """The keys both engines read, with the values they must have for this drafter."""
    d = c["dflash_config"]
    assert c["architectures"] == ["DFlashDraftModel"]  # SGLang's EntryClass; vLLM's registry key
    assert c["model_type"] == "qwen3"  # AutoConfig must build it (vLLM then wraps it in EAGLEConfig)
    assert d["block_size"] == c["block_size"] == BLOCK
    assert d["target_layer_ids"] == IDS and c["num_target_layers"] == LAYERS
    assert isinstance(d["mask_token_id"], int) and 0 <= d["mask_token_id"] < V
    assert c["layer_types"] == ["full_attention"] * c["num_hidden_layers"]  # SGLang ENCODER_ONLY, vLLM non-causal
    assert c["vocab_size"] == V and "draft_vocab_size" not in c  # vLLM: no draft_id_to_target_id
    # vLLM's gpu_model_runner takes these before dflash_config.target_layer_ids + 1
    assert "eagle_aux_hidden_state_layer_ids" not in c and "eagle_config" not in c
    assert "causal" not in d and "use_swa" not in d


# ---------------------------------------------------------------- the released engines

SHAPES = [(1, [1, 2, 4]), (2, [1, 2, 4]), (2, [2, 3])]  # (draft layers, target layers)


@pytest.fixture(scope="module")
def engines_target(tmp_path_factory):
    """A target with a non-default RoPE base (the engines must read the drafter's own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers_engine_source import SourceUnavailable, engine_source

    try:
        engine_source("sglang", "0.5.14"), engine_source("vllm", "0.25.1")
    except SourceUnavailable as e:
        pytest.fail(str(e))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("dflash-engines")
    model.save_pretrained(path / "target")
    return path, model


def exported(root, model, layers: int, ids: list[int], dtype: str = "float32"):
    """A random DFlash drafter of this shape, saved and exported; returns (drafter, export folder)."""
    folder = root / f"l{layers}-{'-'.join(map(str, ids))}-{dtype}"
    cfg = DFlashConfig.from_target(model.config.to_dict(), num_hidden_layers=layers, target_layer_ids=ids,
                                   block_size=5, mask_token_id=MASK)  # fmt: skip
    torch.manual_seed(layers)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.3)
    drafter.set_target(model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone())
    save_drafter(drafter, folder / "drafter", dtype=torch.float32)
    args = ["export", "--drafter", str(folder / "drafter"), "--target", str(root / "target"),
            "--settings", json.dumps({"dtype": dtype, "aux_layer_ids": ids}), "--output-dir", str(folder / "out")]  # fmt: skip
    assert cli_main(args) == 0
    return drafter.eval(), folder / "out"


def our_block(drafter, aux, n: int):
    """Our drafter's logits [B, V] for the block [token 5, masks] after n context rows."""
    cache = ContextCache(drafter.num_layers)
    block = torch.tensor([5] + [MASK] * (drafter.block_size - 1))
    with torch.no_grad():
        cache.append(drafter.context_kv(drafter.context(aux[None]), torch.arange(n)[None]))
        return drafter.draft(block[None], torch.arange(n, n + drafter.block_size)[None], cache)[0], block


@pytest.mark.parametrize("layers, ids", SHAPES, ids=[f"l{a}-t{len(b)}" for a, b in SHAPES])
def test_sglang_0_5_14_loads_the_export_and_drafts_what_we_draft(engines_target, layers, ids):
    """SGLang's released DFlashDraftModel: every exported tensor loads (none skipped, no parameter
    left unset), its parsed config gives our layers / block / mask token, the target capture is
    the input of layer i + 1, and its block draft equals ours."""
    import helpers_dflash_engines as engines
    from helpers_engine_source import engine_source, load_method
    from helpers_engines import unloaded

    root, model = engines_target
    drafter, out = exported(root, model, layers, ids)
    sg, loads = engines.sglang_dflash("0.5.14", out / "sglang")
    assert engines.sglang_load(sg, loads, load_file(str(out / "sglang" / "model.safetensors"))) == []
    assert unloaded(sg, loads, ()) == {}
    assert sg.block_size == 5 and sg.num_context_features == len(ids)
    parse = sg.__init__.__globals__["parse_dflash_draft_config"]
    parsed = parse(draft_hf_config=sg.config)
    assert parsed.resolve_target_layer_ids(target_num_layers=LAYERS) == ids and parsed.mask_token_id == MASK
    capture = load_method(engine_source("sglang", "0.5.14") / "sglang/srt/models/llama.py", "LlamaForCausalLM",
                          "set_dflash_layers_to_capture", {})  # fmt: skip
    target = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
    capture(target, ids)
    assert target.model.layers_to_capture == [i + 1 for i in ids]  # = our aux ids (DESIGN.md §3)

    aux = torch.randn(7, len(ids) * 32, generator=torch.Generator().manual_seed(1))
    ours, block = our_block(drafter, aux, 7)
    theirs = engines.sglang_draft(sg, aux, torch.arange(7), block, torch.arange(7, 12),
                                  model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())  # fmt: skip
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers, ids", SHAPES, ids=[f"l{a}-t{len(b)}" for a, b in SHAPES])
def test_vllm_0_25_1_loads_the_export_and_drafts_what_we_draft(engines_target, layers, ids):
    """vLLM's released DFlashQwen3ForCausalLM (config through its EAGLEConfig): every tensor
    loads, only the target-shared embedding / LM head (and the optional mask embedding) stay
    unset, its runner captures aux ids target_layer_ids + 1, and its block draft equals ours."""
    import helpers_dflash_engines as engines
    from helpers_engine_source import engine_source, load_method
    from helpers_engines import unloaded

    root, model = engines_target
    drafter, out = exported(root, model, layers, ids)
    vl, loads = engines.vllm_dflash("0.25.1", out / "vllm", LAYERS, V)
    vl.load_weights(load_file(str(out / "vllm" / "model.safetensors")).items())
    assert not getattr(vl, "has_own_lm_head", False) and not getattr(vl, "has_own_embed_tokens", False)
    assert unloaded(vl, loads, ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")) == {}
    assert vl.model.fc.weight.shape == (32, len(ids) * 32)
    runner = load_method(engine_source("vllm", "0.25.1") / "vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner",
                         "_get_eagle3_aux_layers_from_config", {})  # fmt: skip
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=vl.config))
    assert runner(SimpleNamespace(speculative_config=spec)) == tuple(i + 1 for i in ids)  # vLLM id j = input of layer j

    aux = torch.randn(7, len(ids) * 32, generator=torch.Generator().manual_seed(1))
    ours, block = our_block(drafter, aux, 7)
    theirs = engines.vllm_draft(vl, aux, torch.arange(7), block, torch.arange(7, 12),
                                model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())  # fmt: skip
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_default_bfloat16_export_has_the_keys_and_dtypes(saved):
    manifest = export(saved, "out")
    for engine in ("sglang", "vllm"):
        folder = saved / "out" / engine
        check_dflash_config(json.loads((folder / "config.json").read_text()))
        tensors = load_file(str(folder / "model.safetensors"))
        assert not any("embed" in k or "lm_head" in k for k in tensors), sorted(tensors)
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert manifest[engine]["captures_input_of_layers"] == [i + 1 for i in IDS]
    assert manifest["method"] == "dflash" and manifest["block_size"] == BLOCK
    assert (saved / "out" / "sglang" / "model.safetensors").read_bytes() == (
        saved / "out" / "vllm" / "model.safetensors"
    ).read_bytes()


def test_launch_scripts_run_the_exact_dflash_server_commands(saved, tmp_path):
    export(saved, "out-l")
    target = str((saved / "target").resolve())
    sg = (saved / "out-l" / "sglang").resolve()
    assert run_launch(sg / "launch.sh", tmp_path, "python3") == [
        "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(sg), "--speculative-num-draft-tokens", str(BLOCK), "--tp-size", "2",
        "--dtype", "bfloat16", "--port", "30000",
    ]  # fmt: skip
    vl = (saved / "out-l" / "vllm").resolve()
    argv = run_launch(vl / "launch.sh", tmp_path, "python3")
    assert argv[:9] == ["-m", "vllm.entrypoints.openai.api_server", "--model", target, "--tensor-parallel-size", "2",
                        "--dtype", "bfloat16", "--speculative-config"]  # fmt: skip
    assert json.loads(argv[9]) == {"method": "dflash", "model": str(vl), "num_speculative_tokens": BLOCK - 1}


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
