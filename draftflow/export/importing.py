"""`draftflow import-drafter`: existing EAGLE-3 drafters into our drafter folder (the
`checkpoint.save_drafter` layout): SpecForge and SGLang-format checkpoints
(`LlamaForCausalLMEagle3`), and speculators (0.9) checkpoints, the format of our vLLM export.
Aux layer ids are read back with the rules of `eagle3.our_aux_ids`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from draftflow.drafters.checkpoint import load_target_tensors, save_drafter
from draftflow.drafters.eagle3 import ARCHITECTURE, VARIANT_FLAGS, Eagle3Config, Eagle3Drafter
from draftflow.errors import DraftflowError, where
from draftflow.export import common
from draftflow.export.common import DEFAULT_SGLANG_VERSION, DEFAULT_VLLM_VERSION
from draftflow.export.eagle3 import our_aux_ids
from draftflow.jsonl import read_json

log = logging.getLogger(__name__)


def _text_config(target_config: dict) -> dict:
    """Multimodal wrappers (Kimi-K2.5) keep the language model's config in text_config."""
    return target_config if "num_hidden_layers" in target_config else target_config.get("text_config") or target_config


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        return tensors
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:  # older SpecForge checkpoints
        tensors = {}
        for f in bins:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
        return tensors
    raise DraftflowError(f"{path}: no *.safetensors or pytorch_model*.bin weights")


def _normalize_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SGLang accepts names with or without the `model.` prefix, and `layers.0.` for `midlayer.`;
    ours have no prefix and `midlayer.`. The input_layernorm of layers i >= 1, which SGLang
    allocates but never applies (our export writes ones there), is dropped."""
    out = {}
    for k, v in tensors.items():
        k = k.removeprefix("model.")
        if k.startswith("layers.0."):
            k = "midlayer." + k.removeprefix("layers.0.")
        if k.startswith("layers.") and k.endswith(".input_layernorm.weight"):
            continue
        out[k] = v
    return out


def _vocab_mapping(tensors: dict, vocab: int, draft_vocab: int, path: Path) -> None:
    """Fill in d2t / t2d where a checkpoint lacks them (SGLang only needs d2t)."""
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise DraftflowError(f"{path}: draft vocab {draft_vocab} < target vocab {vocab} but no d2t mapping")
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    if "t2d" not in tensors:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[tensors["d2t"] + torch.arange(draft_vocab)] = True
        tensors["t2d"] = t2d
    tensors["t2d"] = tensors["t2d"].to(torch.bool)


def import_drafter(
    source: str, input_dir: Path, target: Path, output: Path, sglang_version: str = DEFAULT_SGLANG_VERSION
) -> Eagle3Config:
    """A SpecForge or SGLang-format EAGLE-3 drafter (LlamaForCausalLMEagle3) -> our drafter folder.

    Aux ids: our own record (`draftflow.aux_layer_ids`, present in our exports) when there is
    one; else `eagle_config.eagle_aux_hidden_state_layer_ids`, which SpecForge writes in our
    convention and an SGLang-format config in the server's (inverted with the rule of
    `sglang_version`); else SGLang's default for the target, [1, N//2 - 1, N - 4] in ours.
    The embedding is always the target's (frozen); a checkpoint's own copy is only compared.
    """
    from draftflow.target import target_identity

    if source == "speculators":
        return import_speculators(input_dir, target, output)
    if source not in ("sglang", "specforge"):
        raise DraftflowError(f"import-drafter --from must be sglang, specforge or speculators, got {source!r}")
    try:
        raw = read_json(input_dir / "config.json")
    except FileNotFoundError:
        raise DraftflowError(f"{input_dir}: no config.json; not a drafter checkpoint") from None
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise DraftflowError(
            f"{input_dir / 'config.json'}: architectures {raw.get('architectures')} lack {ARCHITECTURE}"
        )
    target_config = common.target_config(target)
    tensors = _normalize_names(_checkpoint_tensors(input_dir))
    ckpt_embed = tensors.pop("embed_tokens.weight", None)

    ours = (raw.get("draftflow") or {}).get("aux_layer_ids")
    engine_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ours is None and engine_ids:
        ours = engine_ids if source == "specforge" else our_aux_ids("sglang", sglang_version, target_config, engine_ids)
    if ours is None:
        # SGLang's own fallback (layers_to_capture [2, N//2, N-3]), not our small-target default
        n = int(_text_config(target_config)["num_hidden_layers"])
        ours = [1, n // 2 - 1, n - 4]

    vocab = int(raw.get("vocab_size") or target_config.get("vocab_size"))
    draft_vocab = int(raw.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0])
    _vocab_mapping(tensors, vocab, draft_vocab, input_dir)
    record = dict(raw, vocab_size=vocab, draft_vocab_size=draft_vocab)
    record["draftflow"] = {
        **(raw.get("draftflow") or {}), "aux_layer_ids": list(ours), "target": target_identity(target),
        "target_path": str(target.resolve()), "imported_from": {"format": source, "path": str(input_dir)},
    }  # fmt: skip
    cfg = Eagle3Config.from_dict(record)

    drafter = Eagle3Drafter(cfg)
    try:
        missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise DraftflowError(f"{input_dir}: weights do not fit {ARCHITECTURE} with this config: {e}") from None
    missing = sorted(set(missing) - {"embed_tokens.weight"})  # the embedding is the target's
    if missing or unexpected:
        raise DraftflowError(
            f"{input_dir}: weights do not fit {ARCHITECTURE} with this config: missing {missing}, "
            f"unexpected {sorted(unexpected)}"
        )
    if ckpt_embed is not None and not torch.equal(
        ckpt_embed, load_target_tensors(target)["embed"].to(ckpt_embed.dtype)
    ):
        log.warning("%s: the checkpoint's embedding differs from the target's; the target's is used", input_dir)
    dtype = next(v.dtype for k, v in tensors.items() if v.is_floating_point())
    save_drafter(drafter, output, dtype=dtype, extra_files=None)
    log.info(
        "imported %s drafter %s -> %s (aux layers %s, draft vocab %d)", source, input_dir, output, ours, draft_vocab
    )
    return cfg


# ---------------------------------------------------------------- import from speculators

SPECULATORS_LAYER_TYPES = ("llama",)  # its qwen3 drafter layer has q/k norms that ours lacks
_SPECULATORS_DROPPED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def speculators_checkpoint(path: Path) -> Path:
    """The epoch folder to import: `path` itself when it holds config.json, else, for a
    `speculators train --save-path` folder, `checkpoint_best` or the highest numbered epoch."""
    if (path / "config.json").is_file():
        return path
    if not path.is_dir():
        raise DraftflowError(f"{path}: no such folder")
    best = path / "checkpoint_best"
    if (best / "config.json").is_file():
        return best
    epochs = sorted((int(p.name), p) for p in path.iterdir() if p.name.isdigit() and (p / "config.json").is_file())
    if not epochs:
        raise DraftflowError(
            f"{path}: neither a speculators checkpoint (config.json + model.safetensors) nor a --save-path "
            "folder with epoch checkpoints (0/, 1/, …) or checkpoint_best/"
        )
    return epochs[-1][1]


def _speculators_config(path: Path, raw: dict, target_config: dict) -> tuple[dict, list[int]]:
    """(our config record without draftflow's block, aux ids in ours) from speculators' config.json
    (`Eagle3SpeculatorConfig`: transformer_layer_config, draft_vocab_size, the norm flags,
    eagle_aux_hidden_state_layer_ids in vLLM numbering: i = output of decoder layer i - 1)."""
    cfg_path = path / "config.json"
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise DraftflowError(
            f"{where(cfg_path, field='speculators_model_type')}: {kind!r}; only speculators' eagle3 drafters "
            "can be imported (is this a speculators checkpoint?)"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftflowError(f"{where(cfg_path, field='transformer_layer_config')}: missing")
    if layer.get("model_type", "llama") not in SPECULATORS_LAYER_TYPES:
        raise DraftflowError(
            f"{where(cfg_path, field='transformer_layer_config.model_type')}: {layer.get('model_type')!r}; "
            f"draftflow's EAGLE-3 layer is {SPECULATORS_LAYER_TYPES[0]}-style"
        )
    if raw.get("fc_norm"):
        raise DraftflowError(
            f"{where(cfg_path, field='fc_norm')}: true (a norm per aux state); draftflow's drafter has "
            "norm_before_fc (one norm over the concatenation) but not fc_norm"
        )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise DraftflowError(
            f"{where(cfg_path, field='transformer_layer_config.num_hidden_layers')}: "
            f"{layer.get('num_hidden_layers')}; speculators' extra layers are plain decoder layers that continue "
            "the residual, which draftflow's (SGLang's) do not: only 1-layer drafters import"
        )
    window = layer.get("sliding_window")
    if "sliding_attention" in (layer.get("layer_types") or []) and window:
        log.warning(
            "%s: trained with a %s-token sliding attention window; draftflow's drafter attends to the whole "
            "context (the same for contexts up to %s tokens)", cfg_path, window, window,
        )  # fmt: skip
    ours = (raw.get("draftflow") or {}).get("aux_layer_ids")  # our own vLLM export: exact
    engine_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ours is None and engine_ids:
        ours = our_aux_ids("vllm", DEFAULT_VLLM_VERSION, target_config, engine_ids)
    if ours is None:  # speculators' default [2, N//2, N-3] in its numbering = ours [1, N//2-1, N-4]
        from draftflow.config import default_aux_layer_ids

        ours = default_aux_layer_ids(int(_text_config(target_config)["num_hidden_layers"]))
    # to_diff_dict() left out every value equal to LlamaConfig's default: fill them back in
    from transformers import LlamaConfig

    record = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("model_type", "architectures")}).to_dict()
    record.update(
        architectures=[ARCHITECTURE],
        vocab_size=int(layer.get("vocab_size") or target_config.get("vocab_size")),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
        num_hidden_layers=1,
        **{k: bool(raw.get(k, False)) for k in VARIANT_FLAGS},
    )
    return record, [int(i) for i in ours]


def import_speculators(input_dir: Path, target: Path, output: Path) -> Eagle3Config:
    """A speculators (0.9) EAGLE-3 checkpoint -> our drafter folder.

    Its tensors: `fc`, `layers.0.*` (= our `midlayer.*`), `norm`, `lm_head`, `d2t`, `t2d`, and
    `input_norm` when norm_before_fc; `embed_tokens` (the target's copy) is compared and dropped.
    Our vLLM export is this format, so an export imports back to the same tensors and config.
    """
    from draftflow.target import target_identity

    path = speculators_checkpoint(Path(input_dir))
    try:
        raw = read_json(path / "config.json")
    except ValueError as e:
        raise DraftflowError(f"{path / 'config.json'}: not JSON: {e}") from None
    target_config = common.target_config(target)
    record, ours = _speculators_config(path, raw, target_config)
    if not list(path.glob("*.safetensors")):
        raise DraftflowError(f"{path}: no model.safetensors (an interrupted save?); pick another epoch folder")
    tensors = _checkpoint_tensors(path)
    renamed = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        renamed[name] = t
    ckpt_embed = renamed.get("embed_tokens.weight")
    for name in _SPECULATORS_DROPPED:
        renamed.pop(name, None)
    if "lm_head.weight" not in renamed:
        raise DraftflowError(f"{path}: no lm_head.weight in the weights; a partial checkpoint?")
    _vocab_mapping(renamed, record["vocab_size"], record["draft_vocab_size"], path)
    record["draftflow"] = {
        **(raw.get("draftflow") or {}), "aux_layer_ids": ours, "target": target_identity(target),
        "target_path": str(target.resolve()), "imported_from": {"format": "speculators", "path": str(path)},
    }  # fmt: skip
    try:
        cfg = Eagle3Config.from_dict(record)
    except (KeyError, TypeError, ValueError) as e:
        raise DraftflowError(f"{path / 'config.json'}: transformer_layer_config lacks {e}") from None
    drafter = Eagle3Drafter(cfg)
    try:
        missing, unexpected = drafter.load_state_dict(renamed, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise DraftflowError(f"{path}: weights do not fit its config.json: {e}") from None
    missing = sorted(set(missing) - {"embed_tokens.weight"})
    if missing or unexpected:
        raise DraftflowError(
            f"{path}: weights do not fit its config.json: missing {missing}, unexpected {sorted(unexpected)}"
        )
    if ckpt_embed is not None:
        embed = load_target_tensors(target)["embed"]
        if tuple(ckpt_embed.shape) != tuple(embed.shape) or not torch.equal(ckpt_embed, embed.to(ckpt_embed.dtype)):
            log.warning("%s: the checkpoint's embedding differs from the target's; the target's is used", path)
    dtype = next(v.dtype for v in renamed.values() if v.is_floating_point())
    save_drafter(drafter, output, dtype=dtype)
    log.info("imported speculators drafter %s -> %s (aux layers %s, draft vocab %d, flags %s)", path, output, ours,
             cfg.draft_vocab_size, {k: getattr(cfg, k) for k in VARIANT_FLAGS})  # fmt: skip
    return cfg
