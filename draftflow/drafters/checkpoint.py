"""A drafter's folder and its target's files: what training writes and evaluation, export and
import read, with no dependency on the trainer.

A drafter folder (`save_drafter`) holds config.json + model.safetensors (the SGLang names, no
embedding); `load_drafter` reads either method's folder back, taking the frozen embedding (and
DFlash's LM head) from the target (`load_target_tensors`). The trainer's own resume state
(optimizer, data position, RNG) is not this: it lives in `train.CheckpointDir`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.drafters.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from draftflow.drafters.dflash import DFlashConfig, DFlashDrafter
from draftflow.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftflow.errors import DraftflowError
from draftflow.jsonl import atomic_path, file_mode, read_json, write_json


def target_config(target_dir: Path) -> dict:
    try:
        return read_json(Path(target_dir) / "config.json")
    except FileNotFoundError:
        raise DraftflowError(f"{target_dir}: no config.json; --target must be the target model folder") from None


def load_target_tensors(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """{"embed": [V, H], "lm_head": [V, H]} from the target's safetensors, reading only those two."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)["weight_map"]
    else:
        files = sorted(target_dir.glob("*.safetensors"))
        if not files:
            raise DraftflowError(f"{target_dir}: no *.safetensors weights (other formats are not supported)")
        weight_map = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                weight_map.update({k: f.name for k in h.keys()})

    def find(suffix: str) -> str | None:
        names = sorted((n for n in weight_map if n == suffix or n.endswith("." + suffix)), key=len)
        return names[0] if names else None

    def read(name: str) -> torch.Tensor:
        with safe_open(str(target_dir / weight_map[name]), "pt") as h:
            return h.get_tensor(name)

    embed_name = find("embed_tokens.weight")
    if embed_name is None:
        raise DraftflowError(f"{target_dir}: no '*embed_tokens.weight' tensor in the weights")
    cfg = target_config(target_dir)
    head_name = find("lm_head.weight")
    tied = cfg.get("tie_word_embeddings", False) or head_name is None
    embed = read(embed_name)
    return {"embed": embed, "lm_head": embed if tied else read(head_name)}


def save_drafter(
    drafter: Eagle3Drafter | DFlashDrafter,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    extra_files: dict | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write out_dir/config.json + model.safetensors (SGLang names; floats as `dtype`).

    `state`: the tensors to write when the drafter's own are sharded (see `gather_state`).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = drafter.export_state_dict() if state is None else state
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()}
    with atomic_path(out_dir / "model.safetensors", mode=file_mode()) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    config = drafter.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_json(out_dir / "config.json", config)
    for name, obj in (extra_files or {}).items():
        write_json(out_dir / name, obj)


def drafter_method(config: dict) -> str:
    """eagle3 | dflash, from a drafter's config.json (its architecture)."""
    return "dflash" if DFLASH_ARCHITECTURE in (config.get("architectures") or []) else "eagle3"


def load_drafter(
    path: str | Path,
    target_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Eagle3Drafter | DFlashDrafter, Eagle3Config | DFlashConfig]:
    """(drafter in eval mode, config) from a `save_drafter` folder of either method; the frozen
    embedding (and DFlash's LM head) comes from `target_dir`, else the target path in config.json."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        raw = read_json(path / "config.json")
    except FileNotFoundError:
        raise DraftflowError(f"{path}: no config.json; not a drafter folder") from None
    method = drafter_method(raw)
    config_class, model_class = (DFlashConfig, DFlashDrafter) if method == "dflash" else (Eagle3Config, Eagle3Drafter)
    try:
        cfg = config_class.from_dict(raw)
    except (KeyError, ValueError) as e:
        name = "a DFlash" if method == "dflash" else "an EAGLE-3"
        raise DraftflowError(f"{path / 'config.json'}: not {name} drafter config: {e}") from None
    drafter = model_class(cfg)
    tensors = load_file(str(path / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise DraftflowError(f"{path / 'model.safetensors'}: missing tensors {missing}, unexpected {unexpected}")
    target_dir = Path(target_dir or cfg.target_path or "")
    if not (target_dir / "config.json").is_file():
        raise DraftflowError(
            f"{path}: the drafter needs its target's embedding; pass the target folder (recorded: {cfg.target_path!r})"
        )
    tensors = load_target_tensors(target_dir)
    if method == "dflash":
        drafter.set_target(tensors["embed"], tensors["lm_head"])
    else:
        drafter.embed_tokens.weight = tensors["embed"]
    return drafter.to(device=device, dtype=dtype).eval(), cfg
