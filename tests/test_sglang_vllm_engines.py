"""SGLang and vLLM capture engines without SGLang or vLLM: layer-id tables, the arguments the
engines start their runtime with, and the capture path on real tensors laid out as those
runtimes hand them over (SGLang: flattened batches through forward hooks; vLLM: the hidden-
states connector's safetensors files), compared with the HF engine on a tiny Llama."""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftflow.engines import layer_ids as L
from draftflow.engines import sglang_capture as S
from draftflow.engines import vllm_capture as V
from draftflow.engines.capture import CaptureError, check_capture, make_capture_engine

NUM_LAYERS, HIDDEN = 6, 32
AUX = [1, 2, 4]
LLAMA = L.ARCHITECTURES["llama"]
KIMI = L.architecture_of({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"]})


# ---------------------------------------------------------------- layer-id tables


def test_llama_ids_per_engine():
    aux, n = [1, 15, 28], 32  # Llama-3.1-8B default
    assert L.hf_hidden_state_indices(aux, n) == [2, 16, 29]
    assert L.sglang_layers_to_capture(aux, n) == [2, 16, 29]
    for version in ("0.5.5", "0.5.12", "0.5.14"):  # llama.py adds +1 in every version
        assert L.sglang_draft_ids(aux, n, LLAMA, version) == [1, 15, 28]
    assert L.vllm_layer_ids(aux, n, LLAMA, "0.25.1") == [2, 16, 29, 32]  # + final (pre-norm) id N
    assert L.sglang_draft_ids(aux, n, L.ARCHITECTURES["qwen3"], "0.5.14") == [1, 15, 28]


@pytest.mark.parametrize("arch", ["kimi_k25", "deepseek_v3"])
def test_deepseek_v2_rule_for_kimi_and_deepseek(arch):
    a, n = L.ARCHITECTURES[arch], 61
    # The user's run: ids [2, 30, 58] are the inputs of layers [3, 31, 59] in SGLang.
    assert L.sglang_layers_to_capture([2, 30, 58], n) == [3, 31, 59]
    # Since PR #25454 deepseek_v2.py adds +1 only when the first id is 1:
    assert L.sglang_draft_ids([2, 30, 58], n, a, "0.5.14") == [3, 31, 59]
    assert L.sglang_draft_ids([1, 29, 57], n, a, "0.5.14") == [1, 29, 57]  # default ids: +1 by SGLang
    with pytest.raises(CaptureError, match="aux layer id 0 cannot be expressed"):
        L.sglang_draft_ids([0, 29, 57], n, a, "0.5.14")
    assert L.sglang_draft_ids([2, 30, 58], n, a, "0.5.13") == [3, 31, 59]  # first release assumed
    # Before it, +1 always:
    assert L.sglang_draft_ids([2, 30, 58], n, a, "0.5.5") == [2, 30, 58]
    assert L.sglang_draft_ids([0, 29, 57], n, a, "0.5.11") == [0, 29, 57]
    for version in ("0.5.12", "0.5.12.post1"):  # branched around the merge: unknown, refused
        with pytest.raises(CaptureError, match="not known whether this release has PR #25454"):
            L.sglang_draft_ids([2, 30, 58], n, a, version)
    # SGLang's own function, forward: what the server captures from a draft config's ids
    assert L.sglang_captures([3, 31, 59], a, "0.5.14") == [3, 31, 59]
    assert L.sglang_captures([1, 29, 57], a, "0.5.14") == [2, 30, 58]
    assert L.sglang_captures([2, 30, 58], a, "0.5.11") == [3, 31, 59]
    with pytest.raises(CaptureError, match="last decoder layer"):
        L.sglang_draft_ids([2, 30, 60], n, a, "0.5.14")  # layers_to_capture 61 does not exist
    # vLLM: output of layer i = id i + 1, final = id N before the norm; needs PR #46973
    assert L.vllm_layer_ids([2, 30, 58], n, a, "0.25.1") == [3, 31, 59, 61]
    with pytest.raises(CaptureError, match="#46973"):
        L.vllm_layer_ids([2, 30, 58], n, a, "0.12.0")


def test_architecture_lookup_and_range_checks():
    assert KIMI.module_prefixes[0] == "language_model.model."
    assert L.architecture_of({"model_type": "llama"}) is LLAMA
    with pytest.raises(CaptureError, match="no layer-id rules for model_type 'gpt_oss'"):
        L.architecture_of({"model_type": "gpt_oss"})
    with pytest.raises(CaptureError, match=r"\[61\] out of range.*61 decoder layers"):
        L.sglang_layers_to_capture([2, 61], 61)
    assert L.parse_version("v0.5.14.post1") == (0, 5, 14) and L.parse_version("0.25") == (0, 25, 0)
    ids = L.sglang_engine_layer_ids([2, 30, 58], 61, KIMI, "0.5.14")
    assert ids.aux_ids == [3, 31, 59] and "eagle_aux_hidden_state_layer_ids=[3, 31, 59]" in ids.id_meaning
    ids = L.vllm_engine_layer_ids([2, 30, 58], 61, KIMI, "0.25.1")
    assert ids.aux_ids == [3, 31, 59] and "id 61" in ids.final


def test_one_table_serves_capture_data_config_and_export():
    """capture.py's engine_layer_ids, the engines' records and export's drafter-config ids all
    come from layer_ids.py, and agree: the ids a data_config.json names for SGLang are the ids
    the export writes for the same release."""
    from draftflow.engines import capture
    from draftflow.export.eagle3 import engine_aux_ids

    assert not hasattr(capture, "ENGINE_LAYER_CONVENTIONS")
    kimi = {"model_type": "kimi_k25", "text_config": {"num_hidden_layers": 61}}
    for engine, version in (("hf", None), ("sglang", "0.5.14"), ("vllm", "0.25.1")):
        ours = capture.engine_layer_ids(engine, [2, 30, 58], 61, KIMI, version)
        assert ours == L.engine_layer_ids(engine, [2, 30, 58], 61, KIMI, version)
        assert ours.aux_ids == [3, 31, 59]  # every engine's own id of "output of layer i": i + 1
    record = L.engine_layer_ids("sglang", [2, 30, 58], 61, KIMI, "0.5.14").id_meaning
    written = engine_aux_ids("sglang", "0.5.14", kimi, [2, 30, 58]).ids
    assert f"eagle_aux_hidden_state_layer_ids={written}" in record and written == [3, 31, 59]
    # a release the table cannot place: extraction records why, export refuses
    unknown = L.engine_layer_ids("sglang", [2, 30, 58], 61, KIMI, "0.5.12")
    assert "no draft config for SGLang 0.5.12" in unknown.id_meaning
    with pytest.raises(CaptureError, match="not known whether"):
        engine_aux_ids("sglang", "0.5.12", kimi, [2, 30, 58])
    # the vLLM extraction ids (+ final N) and the vLLM drafter-config ids share the aux part
    vllm_draft = engine_aux_ids("vllm", "0.25.1", kimi, [2, 30, 58]).ids
    assert L.vllm_layer_ids([2, 30, 58], 61, KIMI, "0.25.1")[:-1] == vllm_draft
    assert L.aux_from_draft_ids("sglang", [3, 31, 59], kimi, "0.5.14") == [2, 30, 58]
    assert L.aux_from_draft_ids("vllm", [3, 31, 59], kimi, "0.25.1") == [2, 30, 58]


# ---------------------------------------------------------------- runtime arguments


def test_sglang_engine_arguments_turn_off_prefix_reuse_and_hook_the_right_modules(tmp_path):
    kwargs = S.engine_kwargs("/models/kimi", KIMI, [2, 30, 58], tmp_path, tensor_parallel=8, batch_tokens=32768)
    assert kwargs["disable_radix_cache"] is True and kwargs["chunked_prefill_size"] == -1
    assert kwargs["tp_size"] == 8 and kwargs["max_prefill_tokens"] == 32768 and kwargs["skip_tokenizer_init"]
    hooks = kwargs["forward_hooks"]
    assert [h["config"]["slot"] for h in hooks] == [0, 1, 2, 3]
    assert hooks[0]["target_modules"] == ["language_model.model.layers.2", "model.layers.2"]
    assert hooks[-1]["target_modules"] == ["language_model.model.norm", "model.norm"]
    assert hooks[-1]["config"]["kind"] == "norm" and all(h["hook_factory"] == S.HOOK_FACTORY for h in hooks)
    # importable by the name SGLang resolves
    module, _, name = S.HOOK_FACTORY.partition(":")
    assert getattr(importlib.import_module(module), name) is S.capture_hook_factory

    fields = set(kwargs) - {"enable_flashinfer_allreduce_fusion"}
    assert "enable_flashinfer_allreduce_fusion" not in S.fit_to_server_args(kwargs, fields, "0.5.14")
    with pytest.raises(CaptureError, match=r"lacks the server argument\(s\) \['forward_hooks'\]"):
        S.fit_to_server_args(kwargs, fields - {"forward_hooks"}, "0.5.5")


def test_vllm_engine_arguments():
    ids = L.vllm_layer_ids([1, 15, 28], 32, LLAMA, "0.25.1")
    kwargs = V.llm_kwargs("/models/llama", ids, "/dev/shm/x", tensor_parallel=2)
    assert kwargs["enable_prefix_caching"] is False and kwargs["enable_chunked_prefill"] is False
    assert kwargs["tensor_parallel_size"] == 2
    spec = kwargs["speculative_config"]
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29, 32]
    assert kwargs["kv_transfer_config"]["kv_connector"] == "DraftflowHiddenStatesConnector"
    assert kwargs["kv_transfer_config"]["kv_connector_module_path"] == "draftflow.engines.vllm_connector"
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] == "/dev/shm/x"
    assert V.requests_for([np.array([5, 6, 7])]) == [{"prompt_token_ids": [5, 6, 7]}]


def test_engines_import_lazily_and_say_what_is_missing(tmp_path):
    assert "sglang" not in sys.modules and "vllm" not in sys.modules  # importing ours pulled neither
    for engine, package in (("sglang", "sglang"), ("vllm", "vllm")):
        if importlib.util.find_spec(package) is not None:
            continue  # installed here: nothing to show
        with pytest.raises(CaptureError, match=f"'{engine}' but .* not installed"):
            make_capture_engine({"engine": engine, "aux_layer_ids": AUX}, tmp_path, ["cuda:0"])


# ---------------------------------------------------------------- a tiny target and its HF reference


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target") / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=200, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


class Reference:
    """Per-layer outputs of the tiny target and the HF engine's post-norm final, per sample."""

    def __init__(self, target: Path):
        self.model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.out: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.model.layers):
            layer.register_forward_hook(lambda m, a, o, i=i: self.out.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0]))

    @torch.inference_mode()
    def layers(self, ids: np.ndarray) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """({layer: output [T, H]}, post-norm final [T, H])."""
        out = self.model(torch.from_numpy(ids)[None], output_hidden_states=True)
        return dict(self.out), out.hidden_states[-1][0]

    def expected(self, ids: np.ndarray) -> torch.Tensor:
        layers, final = self.layers(ids)
        return torch.stack([layers[i] for i in AUX] + [final], dim=1)  # [T, L, H]


@pytest.fixture(scope="module")
def reference(target) -> Reference:
    return Reference(target)


def samples(*lengths: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 200, size=n).astype(np.int64) for n in lengths]


# ---------------------------------------------------------------- SGLang: the hooks on SGLang-shaped tensors


class Extend:
    def is_extend(self) -> bool:
        return True


class Decode:
    def is_extend(self) -> bool:
        return False


def forward_batch(batch: list[np.ndarray], mode=None, prefixes=None) -> SimpleNamespace:
    """The ForwardBatch fields the hooks read, as SGLang fills them for one extend forward."""
    return SimpleNamespace(
        forward_mode=mode or Extend(),
        input_ids=torch.from_numpy(np.concatenate(batch)),
        extend_seq_lens_cpu=[len(ids) for ids in batch],
        extend_prefix_lens_cpu=prefixes or [0] * len(batch),
    )


def run_sglang_forward(capture_dir: Path, reference: Reference, batch: list[np.ndarray], **fb_kwargs) -> None:
    """Call our hooks as SGLang would during one flattened prefill of `batch`.

    SGLang decoder layers return (hidden_states, residual) whose sum is the layer output;
    the final norm returns (normed, residual). Rows of all requests are concatenated.
    """
    fb = forward_batch(batch, **fb_kwargs)
    per_sample = [reference.layers(ids) for ids in batch]
    hooks = [S.capture_hook_factory(spec["config"]) for spec in S.hook_specs(LLAMA, AUX, capture_dir)]
    generator = torch.Generator().manual_seed(0)
    for slot, i in enumerate(AUX):
        out = torch.cat([layers[i] for layers, _ in per_sample])  # [sum T, H]
        residual = torch.randn(out.shape, generator=generator)
        positions = torch.cat([torch.arange(len(ids)) for ids in batch])
        hooks[slot](None, (positions, out, fb, residual), (out - residual, residual))
    final = torch.cat([f for _, f in per_sample])
    hooks[-1](None, (final, final), (final, final))


def test_sglang_hooks_split_a_flattened_batch_into_per_sample_captures(tmp_path, reference):
    batch = samples(7, 12, 5)
    run_sglang_forward(tmp_path, reference, batch)
    for k, ids in enumerate(batch):
        hidden = S.read_capture(tmp_path, f"s{k}", ids, len(AUX) + 1, HIDDEN, wait_s=0)
        torch.testing.assert_close(hidden, reference.expected(ids), atol=1e-5, rtol=1e-5)
        check_capture(f"s{k}", ids, hidden, len(AUX) + 1, HIDDEN)
        S.remove_capture(tmp_path, ids, len(AUX) + 1)
    assert not list(tmp_path.iterdir())


def test_sglang_hooks_ignore_decode_steps_and_refuse_prefix_reuse(tmp_path, reference):
    batch = samples(6)
    run_sglang_forward(tmp_path, reference, batch, mode=Decode())
    assert not list(tmp_path.iterdir())  # decode forwards write nothing
    run_sglang_forward(tmp_path, reference, batch, prefixes=[4])  # 4 tokens came from the radix cache
    with pytest.raises(CaptureError, match="SGLang capture hook failed: .*4 cached .*--disable-radix-cache"):
        S.read_capture(tmp_path, "s0", batch[0], len(AUX) + 1, HIDDEN, wait_s=0)


def test_sglang_hook_without_forward_batch_reports_instead_of_crashing(tmp_path):
    hook = S.capture_hook_factory({"dir": str(tmp_path), "slot": 0, "kind": "layer"})
    hook(None, (torch.zeros(3), torch.zeros(3, 4)), (torch.zeros(3, 4), torch.zeros(3, 4)))
    with pytest.raises(CaptureError, match="no ForwardBatch among a decoder layer's positional arguments"):
        S.raise_worker_error(tmp_path)


def test_sglang_short_or_cached_captures_are_refused_naming_the_sample(tmp_path):
    ids = samples(10)[0]
    key = S.token_key(ids)
    for slot in range(len(AUX) + 1):  # a server that computed only the last 8 rows
        save_file({"hidden": torch.zeros(8, HIDDEN)}, str(S.slot_path(tmp_path, key, slot)))
    with pytest.raises(CaptureError, match=r"sample B1-7f3a: slot 0 has shape \(8, 32\), expected \[10, 32\]; a short capture"):
        S.read_capture(tmp_path, "B1-7f3a", ids, len(AUX) + 1, HIDDEN, wait_s=0)
    with pytest.raises(CaptureError, match="sample B1-7f3a: SGLang served 6 of 10 prompt tokens from its prefix cache"):
        S.check_not_cached("B1-7f3a", {"prompt_tokens": 10, "cached_tokens": 6}, 10)
    S.check_not_cached("ok", {"prompt_tokens": 10, "cached_tokens": 0}, 10)
    with pytest.raises(CaptureError, match=r"sample gone: no hidden states arrived for slot\(s\) \[0, 1, 2, 3\]"):
        S.read_capture(tmp_path, "gone", samples(4)[0], len(AUX) + 1, HIDDEN, wait_s=0)


class RecordedSglang:
    """Stands in for `sglang.Engine.generate`: runs our hooks on the reference tensors (as the
    scheduler process would) and answers with SGLang's response shape."""

    def __init__(self, capture_dir: Path, reference: Reference, cached_tokens: int = 0):
        self.capture_dir, self.reference, self.cached = capture_dir, reference, cached_tokens
        self.requests: list[dict] = []

    def generate(self, input_ids, sampling_params):
        self.requests.append({"input_ids": input_ids, "sampling_params": sampling_params})
        batch = [np.asarray(ids, dtype=np.int64) for ids in input_ids]
        run_sglang_forward(self.capture_dir, self.reference, batch)
        return [
            {"output_ids": [0], "meta_info": {"prompt_tokens": len(ids), "cached_tokens": self.cached, "completion_tokens": 1}}
            for ids in input_ids
        ]


def test_sglang_engine_capture_matches_the_hf_engine(tmp_path, reference):
    runtime = RecordedSglang(tmp_path, reference)
    engine = S.SglangCaptureEngine(runtime, LLAMA, NUM_LAYERS, HIDDEN, AUX, torch.float32, tmp_path, "0.5.14")
    assert engine.engine_layer_ids == [2, 3, 5] and engine.layer_ids.engine == "sglang"
    batch = samples(9, 4, 9, seed=5)
    batch[2] = batch[0].copy()  # duplicates in one batch share files
    hiddens = engine.capture(batch)
    assert runtime.requests[0]["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert runtime.requests[0]["input_ids"][1] == batch[1].tolist()
    for ids, hidden in zip(batch, hiddens):
        torch.testing.assert_close(hidden, reference.expected(ids), atol=1e-5, rtol=1e-5)
    assert not list(tmp_path.iterdir())  # files removed after reading

    cached = S.SglangCaptureEngine(RecordedSglang(tmp_path, reference, cached_tokens=3), LLAMA, NUM_LAYERS,
                                   HIDDEN, AUX, torch.float32, tmp_path, "0.5.14")  # fmt: skip
    with pytest.raises(CaptureError, match=r"sample at batch position 0 \(9 tokens.*served 3 of 9"):
        cached.capture(batch[:1])


# ---------------------------------------------------------------- vLLM: connector files and the final norm


def write_connector_file(path: Path, ids: np.ndarray, hidden: torch.Tensor, hold_lock_s: float = 0.0) -> threading.Thread | None:
    """Write a file as ExampleHiddenStatesConnector does: an exclusive flock on <file>.lock held
    until the safetensors file {"hidden_states": [T, L, H], "token_ids": [T]} is complete."""
    lock = Path(f"{path}.lock")
    fd = os.open(lock, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def finish():
        time.sleep(hold_lock_s)
        save_file({"hidden_states": hidden.contiguous(), "token_ids": torch.from_numpy(ids)}, str(path))
        os.close(fd)

    if not hold_lock_s:
        finish()
        return None
    thread = threading.Thread(target=finish)
    thread.start()
    return thread


def vllm_tensors(reference: Reference, ids: np.ndarray) -> torch.Tensor:
    """What vLLM returns for our ids: aux layer outputs + the last layer's *pre*-norm output."""
    layers, _ = reference.layers(ids)
    return torch.stack([layers[i] for i in AUX] + [layers[NUM_LAYERS - 1]], dim=1)


def test_checkpoint_tensors_are_read_alone_from_one_file_or_shards(tmp_path):
    """The final norm and embedding rows the vllm engine needs, found by name in model.safetensors
    or through the shard index; a checkpoint without them is refused with the names it sought."""
    norm, embed = torch.arange(4.0), torch.arange(24.0).view(6, 4)
    one = tmp_path / "one"
    one.mkdir()
    save_file({"model.norm.weight": norm, "model.embed_tokens.weight": embed}, one / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"model.norm.weight": norm}, sharded / "b.safetensors")
    save_file({"model.embed_tokens.weight": embed}, sharded / "a.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "b.safetensors", "model.embed_tokens.weight": "a.safetensors"}}))  # fmt: skip
    for folder in (one, sharded):
        assert torch.equal(V.final_norm_weight(folder, LLAMA), norm)
        assert torch.equal(V.embedding_rows(folder, LLAMA, [5, 0, 5]), embed[[5, 0, 5]])
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({"lm_head.weight": embed}, empty / "model.safetensors")
    with pytest.raises(CaptureError, match=r"no final norm weight \(model\.norm\.weight"):
        V.final_norm_weight(empty, LLAMA)
    with pytest.raises(CaptureError, match="no input embedding"):
        V.embedding_rows(empty, LLAMA, [0])


def test_vllm_file_plus_final_norm_equals_the_hf_engine(tmp_path, target, reference):
    ids = samples(11)[0]
    path = tmp_path / "req-1.safetensors"
    thread = write_connector_file(path, ids, vllm_tensors(reference, ids), hold_lock_s=0.3)
    hidden = V.parse_capture("s0", V.load_connector_file(path, wait_s=10), ids, len(AUX) + 1, HIDDEN)  # waits for the lock
    thread.join()
    weight = V.final_norm_weight(target, LLAMA)
    assert weight.shape == (HIDDEN,)
    eps = V.rms_norm_eps({"rms_norm_eps": reference.model.config.rms_norm_eps})
    normed = V.apply_final_norm(hidden, weight, eps)
    expected = reference.expected(ids)
    assert torch.equal(normed[:, :-1], expected[:, :-1])
    torch.testing.assert_close(normed[:, -1], expected[:, -1], atol=1e-6, rtol=1e-6)  # post-norm, like HF
    assert not torch.allclose(hidden[:, -1], expected[:, -1])  # vLLM's own last slot is pre-norm


def test_vllm_short_or_foreign_files_are_refused_naming_the_sample(tmp_path, reference):
    ids = samples(10)[0]
    full = vllm_tensors(reference, ids)
    data = {"hidden_states": full[2:], "token_ids": torch.from_numpy(ids[2:])}
    with pytest.raises(CaptureError, match="sample B1-7f3a: vLLM captured 8 tokens of 10; a short capture"):
        V.parse_capture("B1-7f3a", data, ids, len(AUX) + 1, HIDDEN)
    data = {"hidden_states": full[:, :-1], "token_ids": torch.from_numpy(ids)}
    with pytest.raises(CaptureError, match="sample x: vLLM returned 3 layers, 4 requested.*#46973"):
        V.parse_capture("x", data, ids, len(AUX) + 1, HIDDEN)
    data = {"hidden_states": full, "token_ids": torch.from_numpy(ids[::-1].copy())}
    with pytest.raises(CaptureError, match="sample x: the hidden-states file holds other token ids"):
        V.parse_capture("x", data, ids, len(AUX) + 1, HIDDEN)
    out = SimpleNamespace(prompt_token_ids=ids.tolist(), num_cached_tokens=4, kv_transfer_params={"hidden_states_path": "p"})
    with pytest.raises(CaptureError, match="sample x: vLLM served 4 of 10 prompt tokens.*--no-enable-prefix-caching"):
        V.check_output("x", out, ids)
    with pytest.raises(CaptureError, match="no kv_transfer_params"):
        V.hidden_states_path("x", SimpleNamespace(kv_transfer_params=None))


class RecordedVllm:
    """Stands in for `vllm.LLM.generate`: writes connector files from the reference tensors and
    answers with RequestOutput-shaped objects."""

    def __init__(self, capture_dir: Path, reference: Reference):
        self.capture_dir, self.reference, self.calls = capture_dir, reference, []

    def generate(self, prompts, sampling_params, use_tqdm=False):
        self.calls.append((prompts, sampling_params))
        outputs = []
        for n, prompt in enumerate(prompts):
            ids = np.asarray(prompt["prompt_token_ids"], dtype=np.int64)
            path = self.capture_dir / f"req-{len(self.calls)}-{n}.safetensors"
            write_connector_file(path, ids, vllm_tensors(self.reference, ids))
            outputs.append(SimpleNamespace(
                prompt_token_ids=ids.tolist(), num_cached_tokens=0, kv_transfer_params={"hidden_states_path": str(path)}
            ))  # fmt: skip
        return outputs


def test_vllm_engine_capture_matches_the_hf_engine(tmp_path, target, reference):
    llm = RecordedVllm(tmp_path, reference)
    weight = V.final_norm_weight(target, LLAMA)
    engine = V.VllmCaptureEngine(llm, "params", LLAMA, NUM_LAYERS, HIDDEN, AUX, torch.float32, weight,
                                 reference.model.config.rms_norm_eps, tmp_path, "0.25.1")  # fmt: skip
    assert engine.engine_layer_ids == [2, 3, 5] and "id 6" in engine.layer_ids.final
    batch = samples(8, 3, 13, seed=9)
    for ids, hidden in zip(batch, engine.capture(batch)):
        torch.testing.assert_close(hidden, reference.expected(ids), atol=1e-6, rtol=1e-6)
    assert llm.calls[0][1] == "params" and llm.calls[0][0][1] == {"prompt_token_ids": batch[1].tolist()}
    assert not list(tmp_path.iterdir())  # files and locks removed


def test_vllm_engine_close_removes_its_capture_folder_and_socket_setting(tmp_path, target, monkeypatch):
    """from_settings points vLLM's socket files into the capture folder; close removes both, so that
    a later engine in the same process does not inherit a folder that is gone. A user's own setting stays."""
    weight = V.final_norm_weight(target, LLAMA)

    def engine(capture_dir):
        return V.VllmCaptureEngine(None, "params", LLAMA, NUM_LAYERS, HIDDEN, AUX, torch.float32, weight, 1e-6,
                                   capture_dir, "0.25.1", owns_capture_dir=True)  # fmt: skip

    ours = tmp_path / "capture"
    (ours / "rpc").mkdir(parents=True)
    monkeypatch.setenv(V.VLLM_RPC_PATH_ENV, str(ours / "rpc"))
    engine(ours).close()
    assert not ours.exists() and V.VLLM_RPC_PATH_ENV not in os.environ
    monkeypatch.setenv(V.VLLM_RPC_PATH_ENV, str(tmp_path / "users"))
    engine(tmp_path / "capture2").close()
    assert os.environ[V.VLLM_RPC_PATH_ENV] == str(tmp_path / "users")


def test_sglang_server_mode_checks_the_running_server(tmp_path):
    """`/server_info` of a server started by scripts/launch_sglang.sh extract (recorded fields)."""
    info = {
        "version": "0.5.14", "disable_radix_cache": True, "chunked_prefill_size": -1,
        "forward_hooks": S.hook_specs(KIMI, [2, 30, 58], tmp_path), "tp_size": 8,
    }  # fmt: skip
    assert S.capture_dir_from_server(info, KIMI, [2, 30, 58], "0.5.14") == tmp_path
    with pytest.raises(CaptureError, match="radix .* cache on"):
        S.capture_dir_from_server({**info, "disable_radix_cache": False}, KIMI, [2, 30, 58], "0.5.14")
    with pytest.raises(CaptureError, match="chunked prefill \\(chunked_prefill_size=8192\\)"):
        S.capture_dir_from_server({**info, "chunked_prefill_size": 8192}, KIMI, [2, 30, 58], "0.5.14")
    with pytest.raises(CaptureError, match=r"not the configured aux layers \[1, 29, 57\]"):
        S.capture_dir_from_server(info, KIMI, [1, 29, 57], "0.5.14")
    with pytest.raises(CaptureError, match=r"\['enable_dp_attention'\].*plain tensor parallelism only"):
        S.capture_dir_from_server({**info, "enable_dp_attention": True}, KIMI, [2, 30, 58], "0.5.14")
    with pytest.raises(CaptureError, match="runs 0.5.14 but extract.sglang.version is 0.5.13"):
        S.capture_dir_from_server(info, KIMI, [2, 30, 58], "0.5.13")


def test_sglang_server_mode_asks_server_info_then_the_older_name():
    """The capture client's /server_info with /get_server_info as the fallback for releases
    before 0.5.6 (it asked the deprecated name first); the served evaluation shares the logic."""
    from fake_engines import FakeSGLang

    with FakeSGLang(k=0, lifetime_s=60) as server:
        assert S.SglangHttpRuntime(server.url, 10).server_info()["version"] == server.version
        assert server.gets == ["/server_info"]
    with FakeSGLang(k=0, info_paths=("/get_server_info",), lifetime_s=60) as old:
        assert S.SglangHttpRuntime(old.url, 10).server_info()["version"] == old.version
        assert old.gets == ["/server_info", "/get_server_info"]
    port = old.port  # stopped: nothing answers there now
    with pytest.raises(CaptureError, match="not reachable .*scripts/launch_sglang.sh extract"):
        S.SglangHttpRuntime(f"http://127.0.0.1:{port}", 5).server_info()
