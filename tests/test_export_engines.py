"""Every drafter shape the trainer allows, exported and checked against the pinned engines'
released code (SGLang 0.5.14 / 0.5.23, vLLM 0.25.1 / 0.33.0; tests/helpers_engines.py runs
their config, model construction, load_weights and forward on CPU):

* loading maps every exported tensor to a parameter of its shape, skips none (but t2d, which
  both engines drop by design) and leaves no parameter unset (but the embedding, the target's);
* the engines' forward (layer stack, residual, fc over n aux states, final norm, vocab mapping)
  equals the drafter's own, prefill and drafted steps, to float tolerance;
* `import-drafter` gives back the exported drafter bit for bit.

The matrix: drafter layers 1 and 2 x aux layers 3 and 4, plus a draft vocabulary equal to the
target's. The engines' source comes from their release wheels on PyPI (a few hundred KB, cached).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import helpers_engines as engines
from draftflow.cli import main as cli_main
from draftflow.drafters.eagle3 import Eagle3Config, Eagle3Drafter, KVCache
from draftflow.drafters.checkpoint import load_drafter, save_drafter
from helpers_engine_source import PINNED, SourceUnavailable, engine_source

V, VD, TARGET_LAYERS, THETA = 64, 48, 6, 20000.0  # a non-default RoPE base: the engines must read ours
SGLANG, VLLM = ("0.5.14", "0.5.23"), ("0.25.1", "0.33.0")
SHAPES = [(1, 3), (2, 3), (1, 4), (2, 4)]  # (drafter layers, aux layers)
AUX = {3: [1, 2, 4], 4: [1, 2, 3, 4]}
EMBED = ("model.embed_tokens.weight",)  # both engines share the target's embedding


@pytest.fixture(scope="module", autouse=True)
def released_source():
    try:
        for project, version in PINNED:
            engine_source(project, version)
    except SourceUnavailable as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": THETA},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("engines") / "target"
    model.save_pretrained(path)
    return path, model


class Exports:
    """One drafter per shape, saved, and exported as float32 (forward checks) and bfloat16 (the default)."""

    def __init__(self, root, target):
        self.root, (self.target, self.model) = root, target
        self.made: dict = {}

    def __call__(self, layers: int, n_aux: int, draft_vocab: int = VD):
        key = (layers, n_aux, draft_vocab)
        if key not in self.made:
            folder = self.root / f"l{layers}-a{n_aux}-v{draft_vocab}"
            drafter = self.drafter(layers, n_aux, draft_vocab)
            save_drafter(drafter, folder / "drafter", dtype=torch.float32)
            for dtype in ("float32", "bfloat16"):
                settings = {"dtype": dtype, "aux_layer_ids": AUX[n_aux]}
                args = ["export", "--drafter", str(folder / "drafter"), "--target", str(self.target),
                        "--settings", json.dumps(settings), "--output-dir", str(folder / dtype)]  # fmt: skip
                assert cli_main(args) == 0
            self.made[key] = (folder, drafter)
        return self.made[key]

    def drafter(self, layers: int, n_aux: int, draft_vocab: int) -> Eagle3Drafter:
        torch.manual_seed(10 * layers + n_aux)
        cfg = Eagle3Config.from_target(self.model.config.to_dict(), draft_vocab_size=draft_vocab,
                                       aux_layer_ids=AUX[n_aux], num_hidden_layers=layers)  # fmt: skip
        assert cfg.rope_theta == THETA
        drafter = Eagle3Drafter(cfg)
        drafter.reset_parameters(std=0.3)  # large weights: every term of the forward matters
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)  # norms away from their ones init, so a swapped norm shows
        drafter.embed_tokens.weight = self.model.model.embed_tokens.weight.detach().clone()
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.randperm(V)[:draft_vocab]] = True
        drafter.set_vocab(torch.nonzero(t2d)[:, 0] - torch.arange(draft_vocab), t2d)
        return drafter.eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory, target):
    return Exports(tmp_path_factory.mktemp("exports"), target)


def tensors_of(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def sglang_loaded(version: str, folder):
    """SGLang's model for the export in `folder`, after its load_weights ran over the checkpoint."""
    model, loads = engines.sglang_model(version, folder)
    skipped = engines.sglang_load(model, loads, tensors_of(folder))
    return model, loads, skipped


def vllm_loaded(version: str, folder):
    model, loads = engines.vllm_model(version, folder, TARGET_LAYERS, V)
    model.load_weights(tensors_of(folder).items())  # raises on a name it has no parameter for
    return model, loads


def vllm_unloaded(model, loads, folder) -> dict:
    missing = engines.unloaded(model, loads, EMBED)
    if "d2t" not in tensors_of(folder) and "draft_id_to_target_id" in missing:
        # 0.25.1 keeps the parameter for a full draft vocab and skips it by design when the
        # checkpoint has no d2t: its zeros are the identity mapping
        assert not model.draft_id_to_target_id.any()
        del missing["draft_id_to_target_id"]
    return missing


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("version", SGLANG)
@pytest.mark.parametrize("layers, n_aux", SHAPES)
def test_sglang_loads_every_exported_tensor_into_a_parameter_of_its_shape(exports, version, layers, n_aux):
    folder, drafter = exports(layers, n_aux)
    model, loads, skipped = sglang_loaded(version, folder / "bfloat16" / "sglang")
    assert skipped == ["t2d"]  # SGLang drops t2d by design; nothing else
    assert engines.unloaded(model, loads, EMBED) == {}
    assert len(model.model.layers) == layers
    assert model.model.fc.weight.shape == (32, n_aux * 32)
    assert torch.equal(model.hot_token_id, drafter.to_target_ids(torch.arange(VD)))


@pytest.mark.parametrize("version", VLLM)
@pytest.mark.parametrize("layers, n_aux", SHAPES)
def test_vllm_loads_every_exported_tensor_into_a_parameter_of_its_shape(exports, version, layers, n_aux):
    folder, drafter = exports(layers, n_aux)
    model, loads = vllm_loaded(version, folder / "bfloat16" / "vllm")
    assert vllm_unloaded(model, loads, folder / "bfloat16" / "vllm") == {}
    config = model.config
    assert config.rope_parameters["rope_theta"] == THETA and config.norm_before_residual is False
    assert len(model.model.layers) == layers and model.model.num_aux_hidden_states == n_aux
    assert model.model.fc.weight.shape == (32, n_aux * 32)
    assert list(config.eagle_aux_hidden_state_layer_ids) == [i + 1 for i in AUX[n_aux]]  # vLLM: input of layer j
    assert torch.equal(model.draft_id_to_target_id + torch.arange(VD), drafter.to_target_ids(torch.arange(VD)))


@pytest.mark.parametrize("version", SGLANG + VLLM)
def test_a_draft_vocab_equal_to_the_targets_loads_too(exports, version):
    """vLLM 0.33 has no draft_id_to_target_id then: the export leaves d2t (all zeros) out."""
    folder, _ = exports(2, 4, draft_vocab=V)
    if version in SGLANG:
        model, loads, skipped = sglang_loaded(version, folder / "bfloat16" / "sglang")
        assert skipped == ["t2d"] and engines.unloaded(model, loads, EMBED) == {}
    else:
        model, loads = vllm_loaded(version, folder / "bfloat16" / "vllm")
        assert vllm_unloaded(model, loads, folder / "bfloat16" / "vllm") == {}
        if version == "0.33.0":  # the default run's case (tiny target, vocab 1024 < 32000): d2t would not load
            model, _ = engines.vllm_model(version, folder / "bfloat16" / "vllm", TARGET_LAYERS, V)
            with pytest.raises(ValueError, match="no module or parameter named 'draft_id_to_target_id'"):
                model.load_weights([("d2t", torch.zeros(V, dtype=torch.int64))])


def test_the_checks_catch_the_layouts_the_engines_cannot_serve(exports, tmp_path):
    """The export before this fix: extra layers as `additional_layers.*` (SGLang skips all 9 of
    them without a word and leaves layer 1 unset), and a 4-aux speculators config without
    num_aux_hidden_states (vLLM sizes fc for 3)."""
    folder, _ = exports(2, 4)
    old = {k.replace("layers.1.", "additional_layers.0."): v for k, v in tensors_of(folder / "bfloat16" / "sglang").items()
           if not k.startswith("layers.1.input_layernorm")}  # fmt: skip
    model, loads = engines.sglang_model("0.5.14", folder / "bfloat16" / "sglang")
    skipped = engines.sglang_load(model, loads, old)
    assert len([k for k in skipped if k.startswith("additional_layers.")]) == 9
    assert {k.split(".")[3] for k in engines.unloaded(model, loads, EMBED)} == {
        "hidden_norm", "input_layernorm", "self_attn", "post_attention_layernorm", "mlp"
    }  # fmt: skip

    three = tmp_path / "vllm"
    shutil.copytree(folder / "bfloat16" / "vllm", three)
    config = json.loads((three / "config.json").read_text())
    del config["transformer_layer_config"]["num_aux_hidden_states"]
    (three / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError, match=r"Attempted to load weight \(\(32, 128\)\) into parameter \(\(32, 96\)\)"):
        vllm_loaded("0.25.1", three)


# ---------------------------------------------------------------- forward


def ours(drafter: Eagle3Drafter, ids, aux, steps: int = 2):
    """Prefill over target rows, then `steps` drafted tokens: [(draft logits [T, Vd], out [T, H])]."""
    T = ids.shape[0]
    cache = KVCache(drafter.num_layers)
    with torch.no_grad():
        logits, out, _ = drafter.step(ids[None], drafter.fuse(aux[None]), torch.arange(T)[None], cache)
        result = [(logits[0], out[0])]
        for i in range(steps):
            token = drafter.to_target_ids(logits[:, -1].argmax(-1))[:, None]
            logits, out, _ = drafter.step(token, out[:, -1:], torch.tensor([[T + i]]), cache)
            result.append((logits[0], out[0]))
    return result


def engine_run(engine: str, model, ids, aux, steps: int = 2):
    """The same calls through the engine's model: target rows fused by fc, then its own aux
    output fed back, each drafted token the argmax mapped to a target id by the engine."""
    T = ids.shape[0]
    engines.reset_caches(model)

    def step(ids, positions, hidden):
        if engine == "sglang":
            return engines.sglang_step(model, ids, positions, hidden)
        return engines.vllm_step(model, ids, positions, hidden, fuse=hidden.shape[-1] != model.config.hidden_size)

    with torch.no_grad():
        logits, out = step(ids, torch.arange(T), aux.flatten(-2))
        result = [(logits, out)]
        for i in range(steps):
            best = logits[-1:].argmax(-1)
            token = model.hot_token_id[best] if engine == "sglang" else best  # vLLM's logits: target vocab
            logits, out = step(token, torch.tensor([T + i]), out[-1:])
            result.append((logits, out))
    return result


@pytest.mark.parametrize("engine, version", [("sglang", v) for v in SGLANG] + [("vllm", v) for v in VLLM])
@pytest.mark.parametrize("layers, n_aux", SHAPES)
def test_the_engines_forward_equals_the_drafters(exports, target, engine, version, layers, n_aux):
    folder, _ = exports(layers, n_aux)
    drafter, _ = load_drafter(folder / "drafter", target[0])  # fp32
    if engine == "sglang":
        model, loads, _ = sglang_loaded(version, folder / "float32" / "sglang")
    else:
        model, loads = vllm_loaded(version, folder / "float32" / "vllm")
    model.model.embed_tokens.weight.data.copy_(drafter.embed_tokens.weight)  # the engines share the target's
    g = torch.Generator().manual_seed(layers * 10 + n_aux)
    ids, aux = torch.randint(0, V, (9,), generator=g), torch.randn(9, n_aux, 32, generator=g)

    expected, got = ours(drafter, ids, aux), engine_run(engine, model, ids, aux)
    tol = {"rtol": 1e-4, "atol": 1e-4}  # float32 sums in another order (the pre-fix layout is off by ~10)
    for (logits, out), (e_logits, e_out) in zip(expected, got):
        torch.testing.assert_close(e_out, out, **tol)  # the hidden state fed back (pre-norm)
        if engine == "vllm":  # over the target vocabulary, -inf off the draft vocabulary
            assert torch.isinf(e_logits[:, ~drafter.t2d]).all()
            e_logits = e_logits[:, drafter.to_target_ids(torch.arange(VD))]
        torch.testing.assert_close(e_logits, logits, **tol)
        assert torch.equal(e_logits.argmax(-1), logits.argmax(-1))


# ---------------------------------------------------------------- refusals and round trips


def test_a_reordered_full_draft_vocab_is_refused_for_vllm(target, tmp_path, capsys):
    drafter = Exports(tmp_path, target).drafter(1, 3, V)
    drafter.set_vocab(torch.roll(torch.arange(V), 1) - torch.arange(V), torch.ones(V, dtype=torch.bool))
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    args = ["export", "--drafter", str(tmp_path / "drafter"), "--target", str(target[0]), "--settings", "{}",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 1
    assert "reordered" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_format_1_multi_layer_drafter_is_refused_with_the_reason(exports, target, tmp_path, capsys):
    folder, _ = exports(2, 3)
    old = tmp_path / "old"
    shutil.copytree(folder / "drafter", old)
    config = json.loads((old / "config.json").read_text())
    config["draftflow"]["format_version"] = 1
    (old / "config.json").write_text(json.dumps(config))
    tensors = {k.replace("layers.1.", "additional_layers.0."): v for k, v in tensors_of(old).items()}
    save_file(tensors, str(old / "model.safetensors"))
    args = ["export", "--drafter", str(old), "--target", str(target[0]), "--settings", "{}",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    assert cli_main(args) == 1
    assert "restart the residual stream" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layers, n_aux", SHAPES)
def test_import_drafter_round_trips_every_exported_shape_bit_exactly(exports, target, tmp_path, dtype, layers, n_aux):
    folder, _ = exports(layers, n_aux)
    args = ["import-drafter", "--from", "sglang", "--input", str(folder / dtype / "sglang"),
            "--target", str(target[0]), "--output", str(tmp_path / "imported")]  # fmt: skip
    assert cli_main(args) == 0
    original, imported = tensors_of(folder / "drafter"), tensors_of(tmp_path / "imported")
    assert set(imported) == set(original)
    for name, t in original.items():
        want = t.to(getattr(torch, dtype)) if t.is_floating_point() else t
        assert imported[name].dtype == want.dtype and torch.equal(imported[name], want), name
    a = json.loads((folder / "drafter" / "config.json").read_text())
    b = json.loads((tmp_path / "imported" / "config.json").read_text())
    for key in ("num_hidden_layers", "hidden_size", "draft_vocab_size", "vocab_size", "rope_theta"):
        assert a[key] == b[key], key
    assert b["draftflow"]["aux_layer_ids"] == AUX[n_aux]


@pytest.mark.parametrize("layers, n_aux", SHAPES)
def test_the_vllm_names_map_back_to_the_drafters_bit_exactly(exports, layers, n_aux):
    from draftflow.export.eagle3 import tensors_from_vllm

    folder, _ = exports(layers, n_aux)
    back, original = tensors_from_vllm(tensors_of(folder / "float32" / "vllm")), tensors_of(folder / "drafter")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
