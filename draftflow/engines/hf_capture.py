"""Capture engine on Hugging Face transformers: the target in-process, CPU or GPU.

Forward hooks on the requested decoder layers and on the final norm copy their outputs
into one buffer [B, T, L, H] while the model body runs; `output_hidden_states` would keep
every layer's output alive, and the LM head (large for 128k vocabularies) never runs.
Batches are right-padded with an attention mask: under causal attention a real position
only sees earlier positions, so padding never changes real rows.

Layer ids: aux id i = output of decoder layer i = HF `output_hidden_states[i + 1]` for
i < N-1. For the last layer (i = N-1) the hook gives its raw output, while HF's
`output_hidden_states[N]` is already normed: that is the final, the output of `model.norm`,
what the LM head reads.

Dtype: on a GPU the target computes in `extract.dtype`, as an engine serving it would. On a CPU
it computes in float32 and the hooks round each captured state to `extract.dtype`: CPU
half-precision matmuls are several times slower (SmolLM2-135M on 2 cores: 70 tokens/s in bf16,
484 in float32), and on a CPU the drafter is evaluated and served against the float32 target.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from draftflow.engines.capture import CaptureError, EngineLayerIds, engine_layer_ids, plan_batches

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _locate(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(body, decoder layers, final norm) of a CausalLM or of its base model."""
    body = model
    if not hasattr(body, "layers"):
        body = getattr(model, "model", None) or model.get_decoder()
    layers = getattr(body, "layers", None)
    norm = getattr(body, "norm", None)
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise CaptureError(
            f"{type(model).__name__}: the hf capture engine needs a decoder body with `.layers` "
            "and a final `.norm` (Llama, Qwen, Mistral, DeepSeek style models)"
        )
    return body, layers, norm


def _load_body(target_dir: Path, kwargs: dict) -> nn.Module:
    """The base model without the LM head. Its weights in the checkpoint are reported as
    unexpected (expected: silenced); a missing weight would mean random values: an error."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModel.from_pretrained(target_dir, output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise CaptureError(f"{target_dir}: weights missing from the checkpoint: {missing[:5]} (of {len(missing)})")
    log.debug("not loaded (LM head etc.): %s", sorted(info.get("unexpected_keys", [])))
    return model


def _first_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class HfCaptureEngine:
    """CaptureEngine over a transformers model (a CausalLM or its base model)."""

    name = "hf"

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int], batch_tokens: int = 16384,
                 dtype: torch.dtype | None = None):  # fmt: skip
        """`dtype`: of the captured states (default: the model's); the hooks round to it."""
        self.model = model.eval()
        self.body, layers, norm = _locate(model)
        self.num_layers = len(layers)
        self.hidden_size = int(model.config.hidden_size)
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.layer_ids: EngineLayerIds = engine_layer_ids("hf", self.aux_layer_ids, self.num_layers)
        self.batch_tokens = batch_tokens
        self.dtype = dtype or next(model.parameters()).dtype
        self.device = _first_device(self.body)
        self.pad_token_id = 0  # any valid id: padded positions are masked and never returned
        self._buffer: torch.Tensor | None = None  # [B, T, L, H] of the running forward
        slots = [layers[i] for i in self.aux_layer_ids] + [norm]
        self._hooks = [module.register_forward_hook(self._hook(k)) for k, module in enumerate(slots)]

    @classmethod
    def from_settings(cls, settings: dict, target_dir: Path, devices: list[str]) -> "HfCaptureEngine":
        from transformers import AutoConfig

        dtype = DTYPES[settings.get("dtype", "bfloat16")]
        on_gpu = bool(devices) and devices[0] != "cpu"
        compute_dtype = dtype if on_gpu else torch.float32  # see the module's docstring
        trust = bool(settings.get("trust_remote_code", False))
        config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust)
        config.use_cache = False
        # The base model only: the LM head is not needed for hidden states.
        kwargs: dict = {"dtype": compute_dtype, "trust_remote_code": trust, "config": config}
        if on_gpu:
            kwargs["device_map"] = devices[0] if len(devices) == 1 else "auto"
        model = _load_body(target_dir, kwargs)
        aux = settings.get("aux_layer_ids")
        if not aux:
            from draftflow.config import default_aux_layer_ids

            aux = default_aux_layer_ids(config.num_hidden_layers)
        log.info(
            "hf engine: %s (%d layers, hidden %d, computed in %s, stored as %s) on %s, aux layers %s",
            target_dir, config.num_hidden_layers, config.hidden_size, str(compute_dtype).removeprefix("torch."),
            settings.get("dtype", "bfloat16"), ",".join(devices), aux,
        )
        return cls(model, aux, batch_tokens=int(settings.get("batch_tokens", 16384)), dtype=dtype)

    @property
    def engine_layer_ids(self) -> list[int]:
        return self.layer_ids.aux_ids

    def versions(self) -> dict[str, str]:
        import transformers

        return {"engine": f"transformers {transformers.__version__}"}

    def _hook(self, slot: int):
        def hook(module: nn.Module, args, output) -> None:
            if self._buffer is None:  # the model ran outside capture(): nothing to record
                return
            out = output[0] if isinstance(output, tuple) else output  # [B, T, H]
            self._buffer[:, :, slot].copy_(out)

        return hook

    def capture(self, batch: list[np.ndarray]) -> list[torch.Tensor]:
        """Per sample [T_i, L, H] on the model's device (views into one batch buffer)."""
        out: list[torch.Tensor | None] = [None] * len(batch)
        for group in plan_batches([len(x) for x in batch], self.batch_tokens):
            for i, hidden in zip(group, self._forward([batch[i] for i in group])):
                out[i] = hidden
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _forward(self, seqs: list[np.ndarray]) -> list[torch.Tensor]:
        lengths = [len(s) for s in seqs]
        B, T, L = len(seqs), max(lengths), len(self.aux_layer_ids) + 1
        ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)  # [B, T], right-padded
        mask = torch.zeros((B, T), dtype=torch.long)  # [B, T], 1 on real tokens
        for b, seq in enumerate(seqs):
            ids[b, : lengths[b]] = torch.from_numpy(np.asarray(seq, dtype=np.int64))
            mask[b, : lengths[b]] = 1
        padded = min(lengths) != T
        if self.device.type == "cuda":
            # Pinned, so the copies below are truly asynchronous: a copy from pageable memory
            # would first wait for the previous batch's forward to finish.
            ids, mask = ids.pin_memory(), mask.pin_memory()
        self._buffer = torch.empty((B, T, L, self.hidden_size), dtype=self.dtype, device=self.device)
        try:
            self.body(
                input_ids=ids.to(self.device, non_blocking=True),
                # Without padding, no mask: lets attention take its plain causal path.
                attention_mask=mask.to(self.device, non_blocking=True) if padded else None,
                use_cache=False,
            )
            buffer = self._buffer
        finally:
            self._buffer = None
        return [buffer[b, :n] for b, n in enumerate(lengths)]  # each [T_b, L, H], contiguous

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
