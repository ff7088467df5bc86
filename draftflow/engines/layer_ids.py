"""Layer ids per engine, architecture and version: the one table that translates.

Our convention (DESIGN.md §3): aux id i = the output of decoder layer i, counted from 0;
the final state = the last layer's output after the final norm. Each engine names the
same tensors differently, and one of them changed its rule between versions. Everything
that names layers for an engine asks this module:

- capture engines: what the engine is asked to capture (`hf_hidden_state_indices`,
  `vllm_layer_ids`; the SGLang engine hooks layer modules by our ids directly);
- data_config.json: the engine's own ids and their meaning (`engine_layer_ids`);
- export / import: the ids a drafter config carries (`draft_config_ids`, `aux_from_draft_ids`).

| engine | id the engine takes for our aux id i | final state |
|---|---|---|
| HF transformers | `hidden_states[i + 1]` (0 = embeddings), hooked on layer i: for i = N-1 the raw output, not HF's post-norm `hidden_states[N]` | hook on the final norm |
| SGLang capture (`layers_to_capture`) | j = i + 1 (captures the *input* of layer j) | post-norm |
| SGLang draft config (`eagle_aux_hidden_state_layer_ids`) | see `sglang_captures` | (not used) |
| vLLM `extract_hidden_states` / draft config | i + 1 (0 = embeddings) | id N, *pre*-norm: we apply the norm |

SGLang. A drafter's `eagle_aux_hidden_state_layer_ids` go to the target model's
`set_eagle3_layers_to_capture(ids)`, which sets `layers_to_capture`; the forward appends
`hidden_states + residual` *before* layer j for j in `layers_to_capture` (the input of
layer j = output of layer j - 1; the loop never reaches j = N, so the last layer's output
cannot be an aux state). We need layers_to_capture = [i + 1].
- llama.py, qwen2.py, qwen3.py, qwen3_moe.py: `[val + 1 for val in layer_ids]` in every
  release (still so in 2026 copies next to DFlash/Gemma-4 code).
- deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2; Kimi-K2.5's `kimi_k25.py` delegates to it):
  +1 always (PR #12319, 2025-10) until PR #25454 "fix(eagle3): drop +1 offset on aux layer
  ids when first id != 1" (Qiaolin-Yu, opened and merged 2026-05-16): since then
  `[val + 1 ...] if layer_ids[0] == 1 else list(layer_ids)`. So our [2, 30, 58] must be
  written [3, 31, 59] for a new SGLang serving Kimi and [1, 29, 57] stays [1, 29, 57]; an
  aux id 0 cannot be expressed at all ([0, …] is taken as the embeddings, [1, …] gets +1).
  The user's run: ids [2, 30, 58] (+ final after layer 60) were captured as
  layers_to_capture [3, 31, 59].
  Release boundary (evidence, 2026 release records): v0.5.11 was released 2026-05-06,
  before the merge -> old rule. v0.5.12 was released from the branch `release/v0.5.12`
  by 2026-05-18 (AWS DLC image notes of that date); that branch existed by 2026-05-19
  and main-branch fixes merged before 2026-05-16 (e.g. #25396) reached it only by
  cherry-pick (#26154, 2026-05-23, for 0.5.12.postN). No cherry-pick of #25454 was
  found, so 0.5.12 most likely has the old rule, but a .postN may carry it: refused as
  unknown. v0.5.13 (released 2026-06-13, branched from main after the merge) is the
  first release assumed to have the new rule. Not verified against a real install.
- Other model files differ (gpt_oss.py reads ids as boundary indices since PR #32334,
  2026-07; glm4_moe_lite.py has the first-id rule too): architectures not in
  `ARCHITECTURES` are refused.

vLLM. `extract_hidden_states` (PR #33736) and EAGLE-3 serving both hand the ids to the
target's `set_aux_hidden_state_layers`: id 0 = embeddings, id j = output of layer j - 1 =
input of layer j (llama-style backbones through `EagleModelMixin._maybe_add_hidden_state`
since PR #36063; before it, and in deepseek_v2.py, by appending before layer j: the same
numbering). Id N (the last layer's output, *before* the final norm) exists for
DeepSeek-V2-family models only since PR #46973 (mgoin, merged 2026-06-28; vLLM 0.24.0 was
released 2026-07-01 from a branch cut before it, 0.25.0 on ~2026-07-11): extraction needs
>= 0.25.0. A drafter config's ids are read from a speculators config since PR #25961
(2025-10; before it vLLM silently used its default (2, N//2, N-3)): export needs >= 0.12.0.
Checked releases (`VLLM_EXTRACTION_CHECKED`): 0.32.0 and 0.33.0. Their llama.py, qwen2.py,
qwen3.py, qwen3_moe.py, deepseek_v2.py, kimi_k25.py, v1/spec_decode/extract_hidden_states.py
and the hidden-states connector are byte-identical between the two (interfaces.py differs
outside `EagleModelMixin._maybe_add_hidden_state`, models/extract_hidden_states.py in one
import): llama-style models append `hidden_states + residual` at id `start_layer` (0: the
embeddings, residual None) and at id `idx + 1` after layer idx; deepseek_v2.py appends before
layer idx (id idx) and at id `end_layer` (N) after the last layer, before `self.norm`. The
real 0.32.0 CPU build gave, for the builtin Llama target in float32 (ids [0, 1, 2, 8], two
prompts, against an HF forward): id 0 = HF `hidden_states[0]` exactly, id i = HF
`hidden_states[i]` within 6e-6 (HF index i + 1: off by 1.4 or more), id N + our final norm =
HF `hidden_states[N]` within 4e-6; through the workflow the vllm store equals the hf store
within 7.2e-6 per slot (tests/test_vllm_extract_real.py). Other releases >= 0.25.0
are accepted with a check at run time: the vllm engine also asks for id 0 and compares it with
the checkpoint's embedding rows of the sample's tokens (`vllm_extraction_checked`).

Where a release cannot be placed, the functions refuse and say what to check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from draftflow.errors import DraftflowError

ENGINES = ("hf", "sglang", "vllm")


class CaptureError(DraftflowError):
    """A capture that must not be stored (short, wrong shape, non-finite), or an unusable engine."""


@dataclass(frozen=True)
class EngineLayerIds:
    """How one engine names the requested layers."""

    engine: str
    aux_ids: list[int]  # the engine's own ids for the aux layers, in config order
    id_meaning: str  # what an engine id means, recorded in data_config.json
    final: str  # how the engine obtains the final post-norm state

    def as_json(self) -> dict:
        return {
            "engine": self.engine,
            "engine_layer_ids": self.aux_ids,
            "engine_layer_id_meaning": self.id_meaning,
            "engine_final": self.final,
        }

# ---------------------------------------------------------------- versions

# SGLang: first release assumed to have PR #25454 (deepseek_v2: +1 only when the first id is 1).
SGLANG_DEEPSEEK_FIRST_ID_RULE = (0, 5, 13)
# 0.5.12 (and its .postN): branched around the merge; most likely the old rule, not verified.
SGLANG_DEEPSEEK_AMBIGUOUS = (0, 5, 12)
# vLLM: first release where `extract_hidden_states` captures the last layer's output (id N) of
# every architecture below (PR #46973 for deepseek_v2; Llama/Qwen had it earlier).
VLLM_FINAL_LAYER_CAPTURE = (0, 25, 0)
# vLLM: first release assumed to read `eagle_aux_hidden_state_layer_ids` from a speculators
# drafter config (PR #25961, merged 2025-10).
VLLM_DRAFT_CONFIG_IDS = (0, 12, 0)
# vLLM: releases whose extract_hidden_states numbering was read in their released source
# (0.32.0 also run): (major, minor), any patch. Others run with the embeddings probe.
VLLM_EXTRACTION_CHECKED = ((0, 32), (0, 33))


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


def num_decoder_layers(config: Mapping[str, Any]) -> int:
    """Decoder layers of a HF config.json; multimodal wrappers (Kimi-K2.5) keep them in text_config."""
    for source in (config, config.get("text_config") or {}):
        if source.get("num_hidden_layers"):
            return int(source["num_hidden_layers"])
    raise CaptureError(f"the target config (model_type {config.get('model_type')!r}) has no num_hidden_layers")


def _check_range(aux: Sequence[int], num_layers: int) -> list[int]:
    aux = [int(i) for i in aux]
    bad = [i for i in aux if not 0 <= i < num_layers]
    if bad:
        raise CaptureError(
            f"extract.aux_layer_ids {bad} out of range: the target has {num_layers} decoder "
            f"layers (ids 0..{num_layers - 1}, DESIGN.md §3)"
        )
    return aux


# ---------------------------------------------------------------- capture ids (no version dependence)


def hf_hidden_state_indices(aux: Sequence[int], num_layers: int) -> list[int]:
    """HF `output_hidden_states` indices of our aux ids: i + 1 (index 0 is the embeddings)."""
    return [i + 1 for i in _check_range(aux, num_layers)]


def sglang_layers_to_capture(aux: Sequence[int], num_layers: int) -> list[int]:
    """SGLang `layers_to_capture` (input of layer j) of our aux ids: j = i + 1, every model.

    The last layer's output has no j (there is no layer N); it is the final state's job.
    """
    return [i + 1 for i in _check_range(aux, num_layers)]


def vllm_capture_ids(aux: Sequence[int], num_layers: int) -> list[int]:
    """vLLM ids of our aux ids: i + 1 (0 is the embeddings), in every version."""
    return [i + 1 for i in _check_range(aux, num_layers)]


# ---------------------------------------------------------------- SGLang draft config


def sglang_captures(ids: Sequence[int], arch: Architecture, version: str) -> list[int]:
    """SGLang `version`'s `set_eagle3_layers_to_capture`: a draft config's ids -> `layers_to_capture`."""
    ids = [int(i) for i in ids]
    if arch.family == "llama":
        return [i + 1 for i in ids]  # llama.py / qwen*.py: always +1
    v = parse_version(version)
    if v < SGLANG_DEEPSEEK_AMBIGUOUS:
        return [i + 1 for i in ids]  # deepseek_v2.py before PR #25454: always +1
    if v < SGLANG_DEEPSEEK_FIRST_ID_RULE:
        raise CaptureError(
            f"SGLang {version} ({arch.name}): it is not known whether this release has PR #25454 "
            "(deepseek_v2.py adds +1 to a draft's aux ids only when the first id is 1). 0.5.12 was "
            "branched around the merge and most likely adds +1 always, but a .postN may carry it. Read "
            "`set_eagle3_layers_to_capture` in sglang/srt/models/deepseek_v2.py of your install: if it "
            "adds 1 to every id, set the version to 0.5.11 here; if only when the first id is 1, to "
            f"{format_version(SGLANG_DEEPSEEK_FIRST_ID_RULE)}."
        )
    # PR #25454: first id == 1 -> every id gets +1; otherwise the ids are layers_to_capture as given.
    return [i + 1 for i in ids] if ids and ids[0] == 1 else ids


def _sglang_rule(arch: Architecture, version: str) -> str:
    if arch.family == "llama":
        return f"sglang {arch.name}: layers_to_capture = [id + 1 for id in ids] (every version)"
    if parse_version(version) < SGLANG_DEEPSEEK_AMBIGUOUS:
        return f"sglang {version} deepseek_v2.py ({arch.name}), before PR #25454: layers_to_capture = ids + 1"
    return (
        f"sglang {version} deepseek_v2.py ({arch.name}), PR #25454: layers_to_capture = ids + 1 "
        "if ids[0] == 1 else ids"
    )


def sglang_draft_ids(aux: Sequence[int], num_layers: int, arch: Architecture, version: str) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` that make SGLang `version` capture our aux ids.

    We need `sglang_captures(ids) == [i + 1 for i in aux]`; the candidates are aux (for a
    +1 rule) and aux + 1 (ids taken as given).
    """
    aux = _check_range(aux, num_layers)
    if aux and max(aux) == num_layers - 1:
        raise CaptureError(
            f"aux layer {num_layers - 1} is the output of the last decoder layer: SGLang captures layer "
            f"inputs (layers_to_capture < {num_layers}), so it cannot feed it to a drafter. Choose aux "
            f"layers below {num_layers - 1}."
        )
    wanted = [i + 1 for i in aux]
    for candidate in (aux, wanted):
        if sglang_captures(candidate, arch, version) == wanted:
            return candidate
    if aux and aux[0] == 0:
        raise CaptureError(
            f"aux layer id 0 cannot be expressed for {arch.name} in SGLang {version} (>= "
            f"{format_version(SGLANG_DEEPSEEK_FIRST_ID_RULE)}): its deepseek_v2.py reads [1, ...] as "
            "'add one' and [0, ...] as the embeddings. Choose aux ids starting at 1 or more."
        )
    raise CaptureError(f"aux layers {aux} cannot be requested from SGLang {version} for {arch.name}")


# ---------------------------------------------------------------- vLLM


def vllm_layer_ids(aux: Sequence[int], num_layers: int, arch: Architecture, version: str) -> list[int]:
    """vLLM `extract_hidden_states` ids for our aux ids + the final: [i + 1 ...] + [N].

    Id N is the last layer's output *before* the final norm; the vLLM engine applies the norm.
    """
    ids = vllm_capture_ids(aux, num_layers)
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
    return ids + [num_layers]


def vllm_extraction_checked(version: str) -> bool:
    """Whether vLLM `version`'s extract_hidden_states numbering was checked against its source;
    the vllm engine verifies any other release at run time (id 0 = the embeddings)."""
    return parse_version(version)[:2] in VLLM_EXTRACTION_CHECKED


def vllm_draft_ids(aux: Sequence[int], num_layers: int, arch: Architecture, version: str) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` of a speculators drafter config for vLLM `version`: i + 1."""
    ids = vllm_capture_ids(aux, num_layers)
    v = parse_version(version)
    if v < VLLM_DRAFT_CONFIG_IDS:
        raise CaptureError(
            f"vLLM {version}: releases before {format_version(VLLM_DRAFT_CONFIG_IDS)} are not known to read "
            "eagle_aux_hidden_state_layer_ids from a speculators drafter config (PR #25961) and would serve "
            "the drafter with their default layers (2, N//2, N-3). Set export.vllm_version to the release "
            f"you serve with, >= {format_version(VLLM_DRAFT_CONFIG_IDS)}."
        )
    if num_layers in ids and v < VLLM_FINAL_LAYER_CAPTURE:
        raise CaptureError(
            f"aux layer {num_layers - 1} is the output of the last decoder layer (vLLM id {num_layers}); vLLM "
            f"{version} cannot capture it for {arch.name} (PR #46973). Use vLLM >= "
            f"{format_version(VLLM_FINAL_LAYER_CAPTURE)} or aux layers below {num_layers - 1}."
        )
    return ids


# ---------------------------------------------------------------- what a drafter config carries


@dataclass(frozen=True)
class DraftIds:
    """The aux ids a drafter config carries for one engine release, and what they make it capture."""

    engine: str
    version: str
    arch: str
    ids: list[int]  # eagle_aux_hidden_state_layer_ids to write
    captures_input_of_layers: list[int]  # = our aux ids + 1
    rule: str  # the rule applied and where it comes from

    def as_json(self) -> dict:
        return {
            "version": self.version,
            "eagle_aux_hidden_state_layer_ids": self.ids,
            "captures_input_of_layers": self.captures_input_of_layers,
            "rule": self.rule,
        }


def draft_config_ids(engine: str, aux: Sequence[int], target_config: Mapping[str, Any], version: str) -> DraftIds:
    """Our aux ids -> the ids a drafter config must carry so that `engine` `version` serving this
    target captures exactly the layers the drafter was trained on."""
    aux = [int(i) for i in aux]
    if aux != sorted(set(aux)):
        # Engines append captured states in layer order; fc's input order must match.
        raise CaptureError(f"aux layer ids must be strictly increasing for serving, got {aux}")
    parse_version(version)  # every release string must be one, whether or not the rule depends on it
    arch, num_layers = architecture_of(target_config), num_decoder_layers(target_config)
    if engine == "sglang":
        ids = sglang_draft_ids(aux, num_layers, arch, version)
        rule = _sglang_rule(arch, version)
    elif engine == "vllm":
        ids = vllm_draft_ids(aux, num_layers, arch, version)
        rule = f"vllm {version} {arch.name}: id j = input of layer j (0 = embeddings, N = last output pre-norm)"
    else:
        raise CaptureError(f"no drafter config ids for engine {engine!r}; known: sglang, vllm")
    return DraftIds(engine, str(version), arch.name, ids, [i + 1 for i in aux], rule)


def aux_from_draft_ids(engine: str, ids: Sequence[int], target_config: Mapping[str, Any], version: str) -> list[int]:
    """The inverse: our aux ids of the layers a drafter config's ids make `engine` `version` capture."""
    parse_version(version)
    arch, num_layers = architecture_of(target_config), num_decoder_layers(target_config)
    if engine == "sglang":
        captured = sglang_captures(ids, arch, version)
    elif engine == "vllm":
        captured = [int(i) for i in ids]
    else:
        raise CaptureError(f"no drafter config ids for engine {engine!r}; known: sglang, vllm")
    ours = [j - 1 for j in captured]
    if any(not 0 <= i < num_layers for i in ours):
        raise CaptureError(
            f"{engine} {version} ids {list(ids)} capture the inputs of layers {captured}, which are not "
            f"outputs of decoder layers 0..{num_layers - 1} of this target"
        )
    return ours


# ---------------------------------------------------------------- what data_config.json records


def hf_engine_layer_ids(aux: Sequence[int], num_layers: int) -> EngineLayerIds:
    # output_hidden_states[0] = embeddings, [i + 1] = output of decoder layer i, except [N]:
    # transformers puts the post-norm state there. The engine hooks the layers themselves, so
    # aux N-1 is the raw last-layer output; the final comes from a hook on the final norm.
    return EngineLayerIds(
        "hf", hf_hidden_state_indices(aux, num_layers),
        f"hf_hidden_states_index (0 = embeddings, i + 1 = output of layer i, captured by a forward hook "
        f"on model.layers[i]; index {num_layers} is the raw output of the last layer, not HF's "
        f"hidden_states[{num_layers}], which is after the final norm)",
        "output of model.norm (forward hook)",
    )  # fmt: skip


def sglang_engine_layer_ids(
    aux: Sequence[int], num_layers: int, arch: Architecture | None = None, version: str | None = None
) -> EngineLayerIds:
    capture = sglang_layers_to_capture(aux, num_layers)
    where = f", {arch.name}" if arch else ""
    draft_text = ""
    if arch is not None and version:
        try:
            draft = sglang_draft_ids(aux, num_layers, arch, version)
            draft_text = f"; a draft config for SGLang {version} must say eagle_aux_hidden_state_layer_ids={draft}"
        except CaptureError as e:  # extraction does not need it; the export will refuse with this message
            draft_text = f"; no draft config for SGLang {version} can express these ids: {e}"
    return EngineLayerIds(
        "sglang",
        capture,
        f"sglang layers_to_capture (j = input of layer j = output of layer j - 1){where}{draft_text}",
        "output of the final norm (forward hook on the norm module)",
    )


def vllm_engine_layer_ids(
    aux: Sequence[int], num_layers: int, arch: Architecture | None = None, version: str | None = None
) -> EngineLayerIds:
    if arch is not None and version:
        ids = vllm_layer_ids(aux, num_layers, arch, version)[:-1]
        where = f", {arch.name}, vllm {version}"
    else:
        ids, where = vllm_capture_ids(aux, num_layers), ""
    return EngineLayerIds(
        "vllm",
        ids,
        f"vllm extract_hidden_states id (0 = embeddings, i + 1 = output of layer i){where}",
        f"id {num_layers} (last layer output, pre-norm) with the target's final RMSNorm applied",
    )


def engine_layer_ids(
    engine: str,
    aux: Sequence[int],
    num_layers: int,
    arch: Architecture | None = None,
    version: str | None = None,
) -> EngineLayerIds:
    """Our aux ids in `engine`'s own numbering, for data_config.json. With `arch` and `version`
    the record also says what a drafter config needs (SGLang) and checks the release (vLLM)."""
    if engine == "hf":
        return hf_engine_layer_ids(aux, num_layers)
    if engine == "sglang":
        return sglang_engine_layer_ids(aux, num_layers, arch, version)
    if engine == "vllm":
        return vllm_engine_layer_ids(aux, num_layers, arch, version)
    raise CaptureError(f"unknown capture engine {engine!r}; known: {sorted(ENGINES)}")
