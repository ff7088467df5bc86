"""What the EAGLE-3 (`eagle3`) and DFlash (`dflash`) exports share: the settings, the checked
read of a drafter folder, tensor casting and saving, the target's config.json, and the launch
script every export writes. Neither export imports the other; the stage (`stage`) picks one.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from draftflow.errors import DraftflowError, reject_unknown_keys
from draftflow.jsonl import atomic_path, file_mode, read_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The serving releases an export targets when the config names none (config schema defaults).
DEFAULT_SGLANG_VERSION = "0.5.14"
DEFAULT_VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class ExportSettings:
    """config `export` plus aux_layer_ids (what the drafter was trained on) and engine_versions."""

    sglang_version: str = DEFAULT_SGLANG_VERSION
    vllm_version: str = DEFAULT_VLLM_VERSION
    tensor_parallel: int = 1
    num_speculative_tokens: int = 3
    dtype: str = "bfloat16"
    aux_layer_ids: tuple[int, ...] | None = None
    engine_versions: dict | None = None  # recorded (e.g. the capture engine's), not interpreted

    @classmethod
    def from_dict(cls, settings: dict) -> "ExportSettings":
        known = {f.name for f in fields(cls)}
        reject_unknown_keys(settings, known, "export --settings")
        values = dict(settings)
        if values.get("aux_layer_ids") is not None:
            values["aux_layer_ids"] = tuple(int(i) for i in values["aux_layer_ids"])
        s = cls(**values)
        if s.dtype not in DTYPES:
            raise DraftflowError(f"export dtype must be one of {sorted(DTYPES)}, got {s.dtype!r}")
        if s.num_speculative_tokens < 1:
            raise DraftflowError("export num_speculative_tokens must be >= 1")
        return s


def target_config(target: Path) -> dict:
    try:
        return read_json(target / "config.json")
    except FileNotFoundError:
        raise DraftflowError(f"{target}: no config.json; --target must be the target model folder") from None


def read_checked_drafter(path: Path, config_cls, model_cls, kind: str):
    """(config, tensors) of a `kind` drafter folder: config.json parsed by `config_cls`,
    model.safetensors' names and shapes equal to `model_cls(config).export_state_dict()`."""
    from safetensors.torch import load_file

    try:
        cfg = config_cls.from_dict(read_json(path / "config.json"))
    except FileNotFoundError:
        raise DraftflowError(f"{path}: no config.json; not a drafter folder") from None
    except (KeyError, ValueError) as e:
        article = "an" if kind[0] in "AEIOU" else "a"
        raise DraftflowError(f"{path / 'config.json'}: not {article} {kind} drafter config: {e}") from None
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except FileNotFoundError:
        raise DraftflowError(f"{path}: no model.safetensors") from None
    with torch.device("meta"):
        expected = model_cls(cfg).export_state_dict()
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    want = {k: tuple(v.shape) for k, v in expected.items()}
    if shapes != want:
        diff = sorted(set(shapes.items()) ^ set(want.items()))
        raise DraftflowError(f"{path / 'model.safetensors'}: tensors do not match config.json: {diff[:6]}")
    return cfg, tensors


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    with atomic_path(path, mode=file_mode()) as tmp:  # safetensors alone writes 0600
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def launch_script(header: str, command: list[str], target_path: Path, extra: str = "") -> str:
    """A bash script that runs anywhere: `launch.sh [TARGET_DIR] [server args…]`.

    The target: the first argument (when it is not an option), else $TARGET, else the path
    recorded at export. The drafter: $DRAFTER, else the script's own folder.
    """
    lines = [shlex.quote(a) if not a.startswith('"$') else a for a in command]
    return (
        "#!/usr/bin/env bash\n"
        f"# {header}\n"
        "# Usage: launch.sh [TARGET_DIR] [server arguments...]\n"
        "#   TARGET_DIR (or $TARGET): the target model; default: the path recorded at export.\n"
        "#   $DRAFTER: this drafter's folder (default: the script's own); $PYTHON (default: python3).\n"
        "set -euo pipefail\n"
        'DRAFTER="${DRAFTER:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"\n'
        f'TARGET="${{TARGET:-{shlex.quote(str(target_path))}}}"\n'
        'if [[ $# -gt 0 && $1 != -* ]]; then TARGET=$1; shift; fi\n'
        f"{extra}"
        "exec " + " \\\n  ".join(lines) + ' \\\n  "$@"\n'
    )


def write_launch(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o755)
