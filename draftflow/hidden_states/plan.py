"""Stage `plan-storage`: how many bytes hidden-state extraction will write, before it starts.

Per token the extraction stores every aux layer plus the final state (DESIGN.md §4):
`bytes = tokens × (len(aux_layer_ids) + 1) × hidden_size × dtype bytes` raw, and about
`expected_compression_ratio` of that on disk (by default 0.72 for `extract.storage:
lossless`, 0.42 for `fp8`: BENCHMARKS.md measured 0.699 and ~0.39 on an 8B-shaped model;
0.53 for `fp8_aux`, whose final state stays lossless: 0.498 measured on SmolLM2).
The plan gives these figures per split, per range of the merge's range plan, and in total;
`preflight` checks them against the free disk. Kimi-K2.5 (H = 7168, 4 captured layers, bf16): 57,344 bytes per token, so
21,033,536 tokens -> 1.206 TB raw.

The model's depth and width come from the target's config.json (or its nested
`text_config` for multimodal models) unless the config overrides them, so a run can be
planned before a 1 TB model is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftflow.config import DEFAULT_AUX_RULE, default_aux_layer_ids
from draftflow.errors import DraftflowError, reject_unknown_keys
from draftflow.jsonl import read_json, write_json

log = logging.getLogger(__name__)

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
# stored / raw bytes assumed per storage mode when the config leaves it null (measured, plus margin)
# fp8_aux (aux states fp8, the final state lossless): 0.498 measured on SmolLM2 with three aux layers
DEFAULT_COMPRESSION_RATIO: dict[str, float] = {"lossless": 0.72, "fp8": 0.42, "fp8_aux": 0.53}
# where multimodal configs keep the language model's dimensions (Kimi-K2.5, Llama-4: text_config)
NESTED_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def storage_bytes(tokens: int, num_layers_captured: int, hidden_size: int, dtype: str) -> int:
    """Raw bytes of `tokens` tokens × `num_layers_captured` states × `hidden_size` in `dtype`."""
    if dtype not in DTYPE_BYTES:
        raise DraftflowError(f"extract.dtype: unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    return tokens * num_layers_captured * hidden_size * DTYPE_BYTES[dtype]


def format_bytes(n: float) -> str:
    """Decimal units, as disks are sold: 1_206_147_088_384 -> '1.21 TB'."""
    value, unit = float(n), _UNITS[0]
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            break
        value /= 1000
    return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"


# ---------------------------------------------------------------- model dimensions


def _read_target_config(target_dir: Path) -> dict[str, Any] | None:
    path = Path(target_dir) / "config.json"
    if not path.exists():
        return None
    try:
        return read_json(path)
    except json.JSONDecodeError as e:
        raise DraftflowError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_value(config: Mapping[str, Any], key: str) -> int | None:
    """`key` at the top level of a HF config, else in its nested language-model config."""
    if _is_int(config.get(key)):
        return config[key]
    for nested in NESTED_CONFIG_KEYS:
        sub = config.get(nested)
        if isinstance(sub, Mapping) and _is_int(sub.get(key)):
            return sub[key]
    return None


def resolve_model_dims(target_dir: str | Path, overrides: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """(num_hidden_layers, hidden_size) of the target.

    `overrides` is the `target` config section (only `num_hidden_layers` and `hidden_size`
    are read; null = read it from `target_dir/config.json`).
    """
    overrides = overrides or {}
    dims = {key: overrides.get(key) for key in ("num_hidden_layers", "hidden_size")}
    missing = [key for key, value in dims.items() if value is None]
    if missing:
        config = _read_target_config(Path(target_dir))
        for key in missing:
            dims[key] = _config_value(config, key) if config is not None else None
    unresolved = [key for key, value in dims.items() if value is None]
    if unresolved:
        source = (
            f"{Path(target_dir) / 'config.json'} has no integer {' / '.join(unresolved)} "
            f"(looked at the top level and in {', '.join(NESTED_CONFIG_KEYS)})"
            if (Path(target_dir) / "config.json").exists()
            else f"the target config {Path(target_dir) / 'config.json'} does not exist (yet)"
        )
        keys = " and ".join(f"`target.{key}`" for key in unresolved)
        raise DraftflowError(f"cannot tell the target's dimensions: {source}; set {keys} in the config")
    for key, value in dims.items():
        if not _is_int(value) or value < 1:
            raise DraftflowError(f"target.{key} must be a positive integer (got {value!r})")
    return dims["num_hidden_layers"], dims["hidden_size"]


def resolve_aux_layer_ids(aux: Sequence[int] | None, num_layers: int) -> list[int]:
    """The aux layer ids to capture (DESIGN.md §3 convention), defaulted and validated:
    distinct, ascending (engines return captured layers in layer order) and in range."""
    ids = default_aux_layer_ids(num_layers) if aux is None else list(aux)
    origin = f"the default ({DEFAULT_AUX_RULE})" if aux is None else "extract.aux_layer_ids"
    if not ids:
        raise DraftflowError("extract.aux_layer_ids is empty; list at least one layer, or null for the default")
    for i in ids:
        if not _is_int(i) or not 0 <= i < num_layers:
            raise DraftflowError(
                f"{origin} {ids}: layer {i!r} does not exist; the target has {num_layers} decoder layers "
                f"(ids 0..{num_layers - 1}, id i = the output of decoder layer i)"
            )
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise DraftflowError(
            f"{origin} {ids} for a {num_layers}-layer target lists layer(s) {duplicates} more than once; "
            "each aux layer must be distinct, or the drafter gets the same state twice"
        )
    if ids != sorted(ids):
        raise DraftflowError(
            f"{origin} {ids}: list the layers in ascending order ({sorted(ids)}); serving engines hand "
            "the drafter the captured layers in layer order, so fc's input order must be the same"
        )
    return ids


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanSettings:
    aux_layer_ids: list[int] | None = None
    dtype: str = "bfloat16"
    expected_compression_ratio: float | None = None  # None: DEFAULT_COMPRESSION_RATIO[storage]
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    storage: str = "lossless"  # extract.storage

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> PlanSettings:
        reject_unknown_keys(settings, cls.__dataclass_fields__, "plan-storage settings")
        result = cls(**settings)
        if result.storage not in DEFAULT_COMPRESSION_RATIO:
            modes = ", ".join(DEFAULT_COMPRESSION_RATIO)
            raise DraftflowError(f"extract.storage: unknown mode {result.storage!r}; use one of {modes}")
        if result.expected_compression_ratio is None:
            result = dataclasses.replace(result, expected_compression_ratio=DEFAULT_COMPRESSION_RATIO[result.storage])
        if result.dtype not in DTYPE_BYTES:
            raise DraftflowError(f"extract.dtype: unknown dtype {result.dtype!r}; use one of {sorted(DTYPE_BYTES)}")
        if not 0 < result.expected_compression_ratio <= 1:
            raise DraftflowError(
                f"extract.expected_compression_ratio must be in (0, 1] (got {result.expected_compression_ratio})"
            )
        return result


def _figures(tokens: int, bytes_per_token: int, ratio: float) -> dict[str, int]:
    raw = tokens * bytes_per_token
    return {"tokens": tokens, "bytes_raw": raw, "bytes_expected": math.ceil(raw * ratio)}


def plan_storage(manifest: Mapping[str, Any], target_dir: str | Path, settings: PlanSettings) -> dict[str, Any]:
    """The storage plan for a merge manifest (see the module docstring)."""
    num_layers, hidden = resolve_model_dims(
        target_dir, {"num_hidden_layers": settings.num_hidden_layers, "hidden_size": settings.hidden_size}
    )
    aux = resolve_aux_layer_ids(settings.aux_layer_ids, num_layers)
    captured = len(aux) + 1  # + the final (post-norm) state
    per_token = storage_bytes(1, captured, hidden, settings.dtype)
    ratio = settings.expected_compression_ratio
    if ratio is None:  # constructed directly rather than by from_dict
        ratio = DEFAULT_COMPRESSION_RATIO[settings.storage]

    splits = {}
    for split, ranges in manifest["ranges"].items():
        planned = [
            {"name": r["name"], "start": r["start"], "end": r["end"], "samples": r["end"] - r["start"],
             **_figures(r["tokens"], per_token, ratio)}
            for r in ranges
        ]  # fmt: skip
        tokens = sum(r["tokens"] for r in ranges)
        samples = sum(r["samples"] for r in planned)
        splits[split] = {"samples": samples, **_figures(tokens, per_token, ratio), "ranges": planned}
    total_tokens = sum(s["tokens"] for s in splits.values())
    return {
        "aux_layer_ids": aux,
        "num_layers_captured": captured,
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "dtype": settings.dtype,
        "dtype_bytes": DTYPE_BYTES[settings.dtype],
        "storage": settings.storage,
        "bytes_per_token": per_token,
        "expected_compression_ratio": ratio,
        "splits": splits,
        "total": {"samples": sum(s["samples"] for s in splits.values()), **_figures(total_tokens, per_token, ratio)},
    }


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument("--manifest", type=Path, required=True, help="merge manifest.json")
    parser.add_argument("--target", type=Path, required=True, help="target model folder (its config.json)")
    parser.add_argument("--settings", type=settings_arg, required=True, help="plan settings as a JSON object")
    parser.add_argument("--output", type=Path, required=True, help="storage_plan.json to write")


def main(args: argparse.Namespace) -> int:
    try:
        manifest = read_json(args.manifest)
    except FileNotFoundError:
        raise DraftflowError(f"merge manifest {args.manifest} does not exist; run `merge` first") from None
    plan = plan_storage(manifest, args.target, PlanSettings.from_dict(args.settings))
    write_json(args.output, plan)
    total = plan["total"]
    log.info(
        "storage plan: %d tokens x %d layers %s x %d x %d bytes = %s raw, ~%s on disk at ratio %.2f (%s)",
        total["tokens"], plan["num_layers_captured"], plan["aux_layer_ids"] + ["final"], plan["hidden_size"],
        plan["dtype_bytes"], format_bytes(total["bytes_raw"]), format_bytes(total["bytes_expected"]),
        plan["expected_compression_ratio"], plan["storage"],
    )  # fmt: skip
    return 0
