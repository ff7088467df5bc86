"""Layer ids per engine, architecture and version: the one table that translates.

Our convention (DESIGN.md §3): aux id i = the output of decoder layer i, counted from 0;
the final state = the last layer's output after the final norm. Each engine names the
same tensors differently, and one of them changed its rule between versions:

| engine | id the engine takes | final state |
|---|---|---|
| HF transformers | `hidden_states[i + 1]` (0 = embeddings) | hook on the final norm |
| SGLang capture (`layers_to_capture`) | j = i + 1 (captures the *input* of layer j) | post-norm |
| SGLang draft config (`eagle_aux_hidden_state_layer_ids`) | see `sglang_draft_ids` | post-norm |
| vLLM `extract_hidden_states` | i + 1 (0 = embeddings) | id N, *pre*-norm: we apply the norm |

SGLang's `set_eagle3_layers_to_capture(ids)` turns the ids a draft config carries into
`layers_to_capture`. Llama/Qwen add 1 to every id (python/sglang/srt/models/llama.py,
qwen3.py). DeepSeek-V2/V3 and Kimi-K2.5 (python/sglang/srt/models/deepseek_v2.py, which
Kimi-K2.5's text model reuses) added 1 unconditionally until PR #25454 (merged
2026-05-16); since then they add 1 only when the first id is 1 and take the ids as
`layers_to_capture` otherwise. So our aux ids [2, 30, 58] must be written as [3, 31, 59]
for a new SGLang serving Kimi, and [1, 29, 57] stay [1, 29, 57]; an aux id 0 cannot be
expressed at all there. This is the user's "[2, 30, 58] was captured as [3, 31, 59]".

vLLM's `extract_hidden_states` (PR #33736) numbers hidden states like HF; the last
layer's output is id N and comes *before* the final norm (docs/features/speculative_decoding/
extract_hidden_states.md). DeepSeek-V2-family models captured only layer *inputs* (ids
0..N-1) until PR #46973 (merged 2026-06-28) added the final layer's output.

Version boundaries are release numbers we believe contain those PRs, by merge date and
release date; where a release is ambiguous the function refuses and says what to check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from draftflow.engines.capture import CaptureError, EngineLayerIds

# ---------------------------------------------------------------- versions

# SGLang: the first release with PR #25454 (deepseek_v2 "+1 only when the first id is 1").
# 0.5.12 shipped around the merge date, so it is not known which rule it has.
SGLANG_DEEPSEEK_FIRST_ID_RULE = (0, 5, 13)
SGLANG_DEEPSEEK_AMBIGUOUS = (0, 5, 12)
# vLLM: the first release where `extract_hidden_states` can capture the last layer's output
# of every architecture below (PR #46973 for deepseek_v2; Llama/Qwen had it earlier).
VLLM_FINAL_LAYER_CAPTURE = (0, 25, 0)


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.5.14.post1' -> (0, 5, 14); 'v0.25.1rc2' -> (0, 25, 1)."""
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text).strip())
    if not match:
        raise CaptureError(f"cannot read the version {text!r}; expected a release number like 0.5.14")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def format_version(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


# ---------------------------------------------------------------- architectures


@dataclass(frozen=True)
class Architecture:
    name: str  # e.g. "llama", "deepseek_v3"
    family: str  # "llama" (Llama, Qwen: +1 always) or "deepseek_v2" (the SGLang file that changed)
    # module paths inside the SGLang / vLLM model object (Kimi-K2.5 wraps a DeepSeek-V3 text model)
    module_prefixes: tuple[str, ...] = ("model.",)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "llama"),
    "qwen2": Architecture("qwen2", "llama"),
    "qwen3": Architecture("qwen3", "llama"),
    "qwen3_moe": Architecture("qwen3_moe", "llama"),
    "deepseek_v3": Architecture("deepseek_v3", "deepseek_v2"),
    "deepseek_v2": Architecture("deepseek_v2", "deepseek_v2"),
    "kimi_k2": Architecture("kimi_k2", "deepseek_v2"),
    "kimi_k25": Architecture("kimi_k25", "deepseek_v2", ("language_model.model.", "model.")),
}


def architecture_of(config: Mapping[str, Any]) -> Architecture:
    """The Architecture of a HF config.json (its `model_type`)."""
    model_type = str(config.get("model_type", ""))
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    raise CaptureError(
        f"no layer-id rules for model_type {model_type!r} (architectures {config.get('architectures')}); "
        f"known: {sorted(ARCHITECTURES)}. Add it to draftflow/engines/layer_ids.py after checking how "
        "that model's SGLang / vLLM code numbers captured layers."
    )


def _check_range(aux: Sequence[int], num_layers: int) -> list[int]:
    aux = [int(i) for i in aux]
    bad = [i for i in aux if not 0 <= i < num_layers]
    if bad:
        raise CaptureError(
            f"extract.aux_layer_ids {bad} out of range: the target has {num_layers} decoder "
            f"layers (ids 0..{num_layers - 1}, DESIGN.md §3)"
        )
    return aux


# ---------------------------------------------------------------- per engine


def hf_hidden_state_indices(aux: Sequence[int], num_layers: int) -> list[int]:
    """HF `output_hidden_states` indices of our aux ids: i + 1 (index 0 is the embeddings)."""
    return [i + 1 for i in _check_range(aux, num_layers)]


def sglang_layers_to_capture(aux: Sequence[int], num_layers: int) -> list[int]:
    """SGLang `layers_to_capture` (input of layer j) of our aux ids: j = i + 1, every model.

    The last layer's output has no j (there is no layer N); it is the final state's job.
    """
    return [i + 1 for i in _check_range(aux, num_layers)]


def sglang_draft_ids(aux: Sequence[int], num_layers: int, arch: Architecture, version: str) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` that make SGLang `version` capture our aux ids.

    SGLang passes a draft config's ids to the target's `set_eagle3_layers_to_capture`, which
    maps them to `layers_to_capture`; we need layers_to_capture = [i + 1].
    """
    aux = _check_range(aux, num_layers)
    if arch.family == "llama":
        return list(aux)  # llama.py / qwen*.py: layers_to_capture = [id + 1 for id in ids]
    v = parse_version(version)
    if v < SGLANG_DEEPSEEK_AMBIGUOUS:
        return list(aux)  # deepseek_v2.py before PR #25454: +1 always
    if v < SGLANG_DEEPSEEK_FIRST_ID_RULE:
        raise CaptureError(
            f"SGLang {version}: it is not known whether this release has PR #25454 (deepseek_v2 adds "
            "+1 to the draft's aux ids only when the first id is 1). Check "
            "`set_eagle3_layers_to_capture` in sglang/srt/models/deepseek_v2.py of your install, or "
            f"use SGLang <= 0.5.11 or >= {format_version(SGLANG_DEEPSEEK_FIRST_ID_RULE)}."
        )
    # PR #25454: first id == 1 -> every id gets +1; otherwise ids are layers_to_capture as given.
    if aux[0] == 1:
        return list(aux)
    if aux[0] == 0:
        raise CaptureError(
            f"aux layer id 0 cannot be expressed for {arch.name} in SGLang >= "
            f"{format_version(SGLANG_DEEPSEEK_FIRST_ID_RULE)}: its deepseek_v2.py would read "
            "[1, ...] as 'add one' and [0, ...] as the embeddings. Choose aux ids starting at 1 or more."
        )
    return [i + 1 for i in aux]


def vllm_layer_ids(aux: Sequence[int], num_layers: int, arch: Architecture, version: str) -> list[int]:
    """vLLM `eagle_aux_hidden_state_layer_ids` for our aux ids + the final: [i + 1 ...] + [N].

    Id N is the last layer's output *before* the final norm; the vLLM engine applies the norm.
    """
    aux = _check_range(aux, num_layers)
    v = parse_version(version)
    if v < VLLM_FINAL_LAYER_CAPTURE:
        why = (
            "deepseek_v2.py captures only layer inputs (ids 0..N-1) before PR #46973"
            if arch.family == "deepseek_v2"
            else "the final-layer id N is not reliably supported"
        )
        raise CaptureError(
            f"vLLM {version} is too old for extraction of {arch.name}: {why}. Use vLLM >= "
            f"{format_version(VLLM_FINAL_LAYER_CAPTURE)} (set extract.vllm.version to the installed release)."
        )
    return [i + 1 for i in aux] + [num_layers]


# ---------------------------------------------------------------- what data_config.json records


def sglang_engine_layer_ids(aux: Sequence[int], num_layers: int, arch: Architecture, version: str) -> EngineLayerIds:
    capture = sglang_layers_to_capture(aux, num_layers)
    try:
        draft = sglang_draft_ids(aux, num_layers, arch, version)
        draft_text = f"; a draft config for SGLang {version} must say eagle_aux_hidden_state_layer_ids={draft}"
    except CaptureError as e:  # extraction does not need it; the export will refuse with this message
        draft_text = f"; no draft config for SGLang {version} can express these ids: {e}"
    return EngineLayerIds(
        "sglang",
        capture,
        f"sglang layers_to_capture (j = input of layer j = output of layer j - 1), {arch.name}{draft_text}",
        "output of the final norm (forward hook on the norm module)",
    )


def vllm_engine_layer_ids(aux: Sequence[int], num_layers: int, arch: Architecture, version: str) -> EngineLayerIds:
    ids = vllm_layer_ids(aux, num_layers, arch, version)
    return EngineLayerIds(
        "vllm",
        ids[:-1],
        f"vllm extract_hidden_states id (0 = embeddings, i + 1 = output of layer i), {arch.name}, vllm {version}",
        f"id {num_layers} (last layer output, pre-norm) with the target's final RMSNorm applied",
    )
