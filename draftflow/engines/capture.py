"""The capture-engine interface: run the target's prefill and return per-token hidden states.

An engine returns, per sample, a tensor [T, L, H]: the L-1 auxiliary layers in config
order, then the final state (the last layer's output after the final norm, what the LM
head reads). Config layer ids follow DESIGN.md §3: aux id i = output of decoder layer i,
counted from 0. Every engine numbers layers its own way; `draftflow/engines/layer_ids.py`
is the one place that translates (for capture, data_config.json and export alike), and
`data_config.json` records both.

Every capture must pass `check_capture` before it is stored: a server with prefix
(radix) caching returns rows only for the uncached suffix, and a broken kernel can
return NaNs. Both must stop the pipeline, not end up in training data.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from draftflow.config import ENGINE_NUMERICS_KEYS
# CaptureError, EngineLayerIds and the translation table live in layer_ids (which imports
# nothing from here); the capture engines import them through this interface.
from draftflow.engines.layer_ids import CaptureError, EngineLayerIds, engine_layer_ids  # noqa: F401

CONVENTION = (
    "aux id i = output of decoder layer i (0-based); final = last layer output after the final norm"
)
FINAL = "post_norm"


def layer_meanings(aux_layer_ids: Sequence[int], num_layers: int) -> list[str]:
    """What each captured slot holds, aux ids in config order then the final, for data_config.json.

    Exact for every id, also the last layer's: aux id N-1 is that layer's raw output (a
    forward hook on it), while HF `output_hidden_states[N]` is the final-normed state, which
    is what the final slot holds.
    """
    n = int(num_layers)
    out = []
    for i in map(int, aux_layer_ids):
        if i == n - 1:
            out.append(
                f"aux {i}: raw output of decoder layer {i}, the last, before the final norm "
                f"(not HF output_hidden_states[{n}], which is after the final norm)"
            )
        else:
            out.append(f"aux {i}: output of decoder layer {i} = input of layer {i + 1} (HF output_hidden_states[{i + 1}])")
    out.append(
        f"final: output of decoder layer {n - 1} after the final norm, what the LM head reads "
        f"(HF output_hidden_states[{n}])"
    )
    return out


def layer_names(aux_layer_ids: Sequence[int]) -> list[str]:
    """Names of the L captured slots, for messages: 'aux layer 2', …, 'final (post-norm)'."""
    return [f"aux layer {i}" for i in aux_layer_ids] + ["final (post-norm)"]


# ---------------------------------------------------------------- settings that change the numbers

# Per engine, the settings besides target, layers, engine and dtype that change captured
# values. Batching, writer threads, compression, on_error and device ids do not enter
# the digest: changing them must not invalidate the store. ENGINE_NUMERICS_KEYS lives in
# draftflow.config (no torch there), so that rules/common.smk splits the extract params by it.


def capture_settings(settings: dict) -> dict:
    """The subset of extract settings that determines stored values (the store digest's input)."""
    engine = settings.get("engine", "hf")
    if engine not in ENGINE_NUMERICS_KEYS:
        raise CaptureError(f"unknown capture engine {engine!r}; known: {sorted(ENGINE_NUMERICS_KEYS)}")
    if not settings.get("target_identity"):
        raise CaptureError("extract settings lack 'target_identity' (computed by the rule from the target)")
    if not settings.get("aux_layer_ids"):
        raise CaptureError("extract settings lack resolved 'aux_layer_ids'")
    out = {
        "target_identity": settings["target_identity"],
        "aux_layer_ids": [int(i) for i in settings["aux_layer_ids"]],
        "engine": engine,
        "dtype": settings.get("dtype", "bfloat16"),
    }
    for dotted in ENGINE_NUMERICS_KEYS[engine]:
        value = settings
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[dotted] = value
    # fp8 files hold other values than lossless ones: they get their own keys. Lossless keys
    # stay what they were before storage modes existed, so existing stores remain valid.
    storage = settings.get("storage", "lossless")
    if storage not in ("lossless", "fp8", "fp8_aux"):
        raise CaptureError(f"extract.storage is {storage!r}; use lossless, fp8 or fp8_aux")
    if storage != "lossless":
        out["storage"] = storage
    return out


# ---------------------------------------------------------------- the engine interface


@runtime_checkable
class CaptureEngine(Protocol):
    """What the extraction driver needs from an engine."""

    name: str
    num_layers: int  # decoder layers of the target
    hidden_size: int  # H
    aux_layer_ids: list[int]  # config convention
    layer_ids: EngineLayerIds  # the engine's own ids, recorded in data_config.json
    dtype: torch.dtype

    @property
    def engine_layer_ids(self) -> list[int]: ...

    def capture(self, batch: list[np.ndarray]) -> list[torch.Tensor]:
        """Per sample [T_i, L, H] (aux in config order + final post-norm), on the engine's device."""
        ...

    def versions(self) -> dict[str, str]:
        """Versions that produced the numbers (engine package, torch …)."""
        ...

    def close(self) -> None: ...


# engine name -> "module:Class"; each class has from_settings(settings, target_dir, devices).
ENGINES: dict[str, str] = {
    "hf": "draftflow.engines.hf_capture:HfCaptureEngine",
    "sglang": "draftflow.engines.sglang_capture:SglangCaptureEngine",
    "vllm": "draftflow.engines.vllm_capture:VllmCaptureEngine",
}


def make_capture_engine(
    settings: dict, target_dir: str | Path, devices: Sequence[str] = ("cpu",)
) -> CaptureEngine:
    """Build the engine settings["engine"] names for the target in `target_dir`.

    `devices`: torch devices the engine may use ("cpu", or "cuda:0", "cuda:1", … after a GPU claim).
    """
    name = settings.get("engine", "hf")
    if name not in ENGINES:
        raise CaptureError(f"unknown capture engine {name!r}; known: {sorted(ENGINES)}")
    module_name, _, class_name = ENGINES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise CaptureError(f"capture engine {name!r} is not available in this draftflow version") from None
        raise CaptureError(f"capture engine {name!r} needs the package {e.name!r}: install it") from None
    return getattr(module, class_name).from_settings(settings, Path(target_dir), list(devices))


# ---------------------------------------------------------------- batching


def require_gpus(tensor_parallel: int, gpus: Sequence[str], devices: Sequence[str]) -> None:
    """A GPU job of a served engine (SGLang, vLLM) must hold a GPU for each tensor-parallel rank."""
    if len(gpus) < tensor_parallel:
        raise CaptureError(
            f"extract.tensor_parallel is {tensor_parallel} but this job holds {len(gpus)} GPU(s) ({list(devices)}); "
            f"set extract.gpus_per_job to {tensor_parallel}"
        )


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Partition sample positions into batches of similar length.

    Sort by length (ties by position), then pack consecutively while the padded size
    (batch size × longest length) stays within batch_tokens; a longer sample runs alone.
    Deterministic in its inputs, so a resumed run recomputes exactly the same batches.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Sorted ascending: the new member is the longest, so padded size = (n + 1) × lengths[i].
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# ---------------------------------------------------------------- the guard


def check_shape(
    sample_id: str, input_ids: np.ndarray, hidden: torch.Tensor, num_layers_expected: int, hidden_size: int
) -> None:
    """Raise CaptureError unless `hidden` is a floating [len(input_ids), L, H] tensor (no device sync)."""
    tokens = len(input_ids)
    if hidden.dim() != 3:
        raise CaptureError(f"sample {sample_id}: capture has shape {tuple(hidden.shape)}, expected [T, L, H]")
    rows, num_layers, width = hidden.shape
    if rows != tokens:
        hint = (
            "a server with prefix (radix) caching or chunked prefill skipped part of the "
            "forward pass: disable prefix caching for extraction"
            if rows < tokens
            else "the engine returned rows that are not this sample's tokens"
        )
        raise CaptureError(f"sample {sample_id}: {rows} hidden-state rows for {tokens} input tokens; {hint}")
    if num_layers != num_layers_expected:
        raise CaptureError(
            f"sample {sample_id}: {num_layers} captured layers, expected {num_layers_expected} "
            "(aux layers + final)"
        )
    if width != hidden_size:
        raise CaptureError(f"sample {sample_id}: hidden width {width}, expected the target's {hidden_size}")
    if not hidden.is_floating_point():
        raise CaptureError(f"sample {sample_id}: capture has dtype {hidden.dtype}, expected floating point")


def nonfinite_per_layer(hidden: torch.Tensor) -> torch.Tensor:
    """[L] int64 count of NaN/inf values per captured layer of a [T, L, H] capture, on its device."""
    return (~torch.isfinite(hidden)).sum(dim=(0, 2))


def check_finite(sample_id: str, nonfinite: Sequence[int], rows: int, width: int, names: Sequence[str] | None = None) -> None:
    """Raise CaptureError if any layer has non-finite values; `nonfinite` from `nonfinite_per_layer`."""
    if any(nonfinite):
        names = list(names) if names is not None else [f"layer slot {k}" for k in range(len(nonfinite))]
        where = ", ".join(f"{names[k]}: {n} of {rows * width}" for k, n in enumerate(nonfinite) if n)
        raise CaptureError(f"sample {sample_id}: non-finite hidden states ({where})")


def check_capture(
    sample_id: str,
    input_ids: np.ndarray,
    hidden: torch.Tensor,
    num_layers_expected: int,
    hidden_size: int,
    names: Sequence[str] | None = None,
) -> None:
    """Raise CaptureError unless `hidden` is [len(input_ids), L, H] and finite.

    `names` labels the L slots in messages (see `layer_names`). The driver runs the two
    halves separately (`check_shape` at once, `check_finite` once the counts reached the host)
    so that checking never stalls the GPU.
    """
    check_shape(sample_id, input_ids, hidden, num_layers_expected, hidden_size)
    rows, _, width = hidden.shape
    check_finite(sample_id, nonfinite_per_layer(hidden).tolist(), rows, width, names)
