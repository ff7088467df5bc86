"""`draftflow export` / `draftflow import-drafter`: servable drafters for SGLang and vLLM, and
existing SpecForge / SGLang-format EAGLE-3 drafters into ours. A DFlash drafter (config.json
architecture DFlashDraftModel) is exported by `export_dflash.py` into the same folders.

Export writes, under --output-dir:

* `sglang/`: config.json for `LlamaForCausalLMEagle3` and model.safetensors with the names its
  loader reads (sgl-project/sglang python/sglang/srt/models/llama_eagle3.py, 0.5.14 / 0.5.23:
  `fc`, `midlayer.*` → `model.layers.0.*`, `layers.{i}.*` → `model.layers.{i}.*`, `norm`,
  `lm_head`, `d2t` → hot_token_id = d2t + arange, `t2d` skipped; q/k/v and gate/up are stacked
  by its `load_weights`, which skips unknown names silently; no embedding: SGLang shares the
  target's), plus launch.sh (`python3 -m sglang.launch_server … --speculative-algorithm EAGLE3`);
* `vllm/`: the speculators format (vllm-project/speculators src/speculators/models/eagle3/
  config.py `Eagle3SpeculatorConfig`, read by vLLM's
  vllm/transformers_utils/configs/speculators/{base,algos}.py) with tensors named as the
  speculators model names them (`layers.{i}.*`; vLLM's llama_eagle3.py `load_weights` also maps
  `midlayer.` to `layers.0.`), plus launch.sh (`vllm serve … --speculative-config`);
* export.json: what was written, and the aux layer ids translated for each engine.

Aux layer ids: ours are "output of decoder layer i, counted from 0" (DESIGN.md §3); every
engine captures the *input* of decoder layer j (= output of layer j-1) and derives j from the
config ids by its own rule, per engine, architecture and version. That rule lives in one table,
`draftflow/engines/layer_ids.py`, shared with extraction; export refuses a release the table
cannot place (e.g. SGLang 0.5.12 for DeepSeek/Kimi targets).

Every drafter shape the trainer allows serves in both engines (checked against the pinned
releases' own code: tests/test_export_engines.py): extra layers (both engines' layers i >= 1
carry the residual on, as ours do; SGLang normalizes their input with `hidden_norm`, vLLM with
`input_layernorm`, so the vLLM export renames it) and any aux-layer count (SGLang sizes `fc`
from `eagle_config`; vLLM's speculators path only from `num_aux_hidden_states`, else 3).
Parameters an engine allocates but never reads (layer i >= 1's other norm) are written as ones,
so that loading leaves no parameter unset.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from draftflow.drafters.eagle3 import ARCHITECTURE, VARIANT_FLAGS, Eagle3Config, Eagle3Drafter
from draftflow.engines.layer_ids import DraftIds, aux_from_draft_ids, draft_config_ids
from draftflow.errors import DraftflowError, reject_unknown_keys, where
from draftflow.jsonl import atomic_path, file_mode, read_json, write_json

log = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.9.0"  # the Eagle3SpeculatorConfig layout written below
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------- aux layer ids per engine

# The serving releases an export targets when the config names none (config schema defaults).
DEFAULT_SGLANG_VERSION = "0.5.14"
DEFAULT_VLLM_VERSION = "0.25.1"


# The speculators-recipe norms each SGLang release's LlamaForCausalLMEagle3 applies (read from its
# released source: 0.5.14 knows norm_output only; 0.5.23 adds norm_before_fc; neither has
# norm_before_residual, its first layer's residual is the un-normed hidden state).
SGLANG_VARIANTS = {"0.5.14": {"norm_output"}, "0.5.23": {"norm_before_fc", "norm_output"}}


def sglang_ignored_variants(cfg: Eagle3Config, sglang_version: str) -> list[str]:
    """The drafter's recipe norms that this SGLang version would not apply (all of them for a
    version not read here)."""
    applied = SGLANG_VARIANTS.get(sglang_version, set())
    return [k for k in VARIANT_FLAGS if getattr(cfg, k) and k not in applied]


def engine_aux_ids(engine: str, version: str, target_config: dict, aux_ids: list[int]) -> DraftIds:
    """Our aux ids -> the `eagle_aux_hidden_state_layer_ids` with which `engine` `version` serving
    this target captures exactly them (the inputs of layers ours + 1); the table and its evidence
    are `draftflow/engines/layer_ids.py`. Refuses (DraftflowError) what the table cannot answer."""
    return draft_config_ids(engine, aux_ids, target_config, version)


def our_aux_ids(engine: str, version: str, target_config: dict, engine_ids: list[int]) -> list[int]:
    """The ids, in our convention, of the layers an engine config's ids make it capture."""
    return aux_from_draft_ids(engine, engine_ids, target_config, version)


def _text_config(target_config: dict) -> dict:
    """Multimodal wrappers (Kimi-K2.5) keep the language model's config in text_config."""
    return target_config if "num_hidden_layers" in target_config else target_config.get("text_config") or target_config


# ---------------------------------------------------------------- the drafter folder


def read_drafter(path: Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """(config, tensors) of a drafter folder (`train.save_drafter` layout), checked against the
    model's own parameter names and shapes (built on the meta device: no memory)."""
    return read_checked_drafter(path, Eagle3Config, Eagle3Drafter, "EAGLE-3")


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


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    with atomic_path(path, mode=file_mode()) as tmp:  # safetensors alone writes 0600
        save_file(tensors, str(tmp), metadata={"format": "pt"})


# ---------------------------------------------------------------- SGLang


def sglang_config(cfg: Eagle3Config, engine_ids: list[int], dtype: str) -> dict:
    """config.json for LlamaForCausalLMEagle3: the LlamaConfig keys its model reads (hidden_size,
    intermediate_size, heads, rms_norm_eps, rope, vocab_size = target vocab, draft_vocab_size,
    num_hidden_layers, tie_word_embeddings false) and `eagle_config`, which its EAGLE worker
    reads for the aux ids; our own ids stay in `draftflow` for a lossless re-import."""
    config = cfg.to_dict()
    config["torch_dtype"] = dtype
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": engine_ids, "use_aux_hidden_state": True}
    return config


def _unused_norms(cfg: Eagle3Config, name: str, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """`layers.{i}.{name}` = ones for the extra layers: a norm the engine's layer i >= 1 allocates
    (its Llama decoder layer base class) but never applies."""
    return {f"layers.{i}.{name}.weight": torch.ones_like(like) for i in range(1, cfg.num_hidden_layers)}


def sglang_tensors(tensors: dict[str, torch.Tensor], cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """Ours are SGLang's names; its layers i >= 1 also hold an input_layernorm they never apply."""
    return {**tensors, **_unused_norms(cfg, "input_layernorm", tensors["norm.weight"])}


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


def sglang_launch(target_path: Path, steps: int, tp: int, trust_remote_code: bool, version: str) -> str:
    command = [
        '"${PYTHON:-python3}"', "-m", "sglang.launch_server",
        "--model-path", '"$TARGET"',
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", '"$DRAFTER"',
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",  # chain drafting: what `draftflow evaluate` measures
        "--speculative-num-draft-tokens", str(steps + 1),
        "--tp", str(tp),
    ]  # fmt: skip
    if trust_remote_code:
        command.append("--trust-remote-code")
    return launch_script(f"SGLang {version}: serve the target with this EAGLE-3 drafter.", command, target_path)


# ---------------------------------------------------------------- vLLM (speculators format)


def vllm_tensors(tensors: dict[str, torch.Tensor], cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """vLLM's names: `layers.0.` for `midlayer.`; its layers i >= 1 normalize their input with
    `input_layernorm` where SGLang (and ours) use `hidden_norm` (same computation: the carried
    residual stream, normed, feeds attention). A draft vocabulary equal to the target's needs no
    d2t: vLLM 0.33 then has no `draft_id_to_target_id` to load it into (0.25.1 keeps its zeros)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        elif name.startswith("layers.") and ".hidden_norm." in name:
            name = name.replace(".hidden_norm.", ".input_layernorm.")
        out[name] = t
    out.update(_unused_norms(cfg, "hidden_norm", tensors["norm.weight"]))
    if cfg.draft_vocab_size == cfg.vocab_size:
        if torch.any(out["d2t"] != 0):
            raise DraftflowError(
                "the draft vocabulary is the whole target vocabulary, reordered (d2t not all zeros): vLLM 0.33 "
                "keeps no draft-to-target map for a full draft vocabulary and would read the drafts in the "
                "target's order; train with draftflow's vocab stage, which keeps target order"
            )
        del out["d2t"], out["t2d"]
    return out


def tensors_from_vllm(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `vllm_tensors` (for a speculators-format checkpoint: vLLM's layers i >= 1
    compute with `input_layernorm` and never apply `hidden_norm`); d2t / t2d stay as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        extra = parts[0] == "layers" and parts[1] != "0"
        if extra and parts[2] == "hidden_norm":
            continue
        if extra and parts[2] == "input_layernorm":
            name = name.replace(".input_layernorm.", ".hidden_norm.", 1)
        elif name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        out[name] = t
    return out


def vllm_config(
    cfg: Eagle3Config, engine_ids: list[int], target_config: dict, target_path: Path, steps: int, dtype: str
) -> dict:
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,  # the target's: the embedding is shared with it
        # vLLM sizes fc from this (else eagle_config's ids, which speculators configs lack, else 3)
        "num_aux_hidden_states": len(cfg.aux_layer_ids),
        "torch_dtype": dtype,
    }
    return {
        "architectures": ["Eagle3DraftModel"],  # vLLM replaces it by Eagle3LlamaForCausalLM (algos.py)
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": steps,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(target_path),
                "architectures": list(target_config.get("architectures") or []),
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        # vLLM defaults a missing norm_before_residual to True: always written
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        **({"norm_output": True} if cfg.norm_output else {}),
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": engine_ids,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "draftflow": cfg.to_dict()["draftflow"],
    }


def vllm_launch(target_path: Path, steps: int, tp: int, trust_remote_code: bool, version: str) -> str:
    command = ["vllm", "serve", '"$TARGET"', "--tensor-parallel-size", str(tp), "--speculative-config", '"$SPEC"']
    if trust_remote_code:
        command.append("--trust-remote-code")
    extra = f'SPEC=$(printf \'{{"method": "eagle3", "model": "%s", "num_speculative_tokens": {steps}}}\' "$DRAFTER")\n'
    return launch_script(
        f"vLLM {version}: serve the target with this EAGLE-3 drafter (speculators format).", command, target_path, extra
    )


# ---------------------------------------------------------------- export


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


def _target_config(target: Path) -> dict:
    try:
        return read_json(target / "config.json")
    except FileNotFoundError:
        raise DraftflowError(f"{target}: no config.json; --target must be the target model folder") from None


def _is_dflash(drafter_dir: Path) -> bool:
    from draftflow.drafters.train import drafter_method

    try:
        return drafter_method(read_json(drafter_dir / "config.json")) == "dflash"
    except FileNotFoundError:
        raise DraftflowError(f"{drafter_dir}: no config.json; not a drafter folder") from None


def _write_launch(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o755)


def export_drafter(drafter_dir: Path, target: Path, settings: ExportSettings, output_dir: Path) -> dict:
    if _is_dflash(drafter_dir):  # the other drafter method: its own layout (export_dflash.py)
        from draftflow.engines.export_dflash import export_dflash

        return export_dflash(drafter_dir, target, settings, output_dir)
    cfg, tensors = read_drafter(drafter_dir)
    if settings.aux_layer_ids is not None and list(settings.aux_layer_ids) != list(cfg.aux_layer_ids):
        raise DraftflowError(
            f"{drafter_dir}: the drafter reads aux layers {cfg.aux_layer_ids}, "
            f"the config says {list(settings.aux_layer_ids)}"
        )
    target_config = _target_config(target)
    target_path = target.resolve()
    trust = "auto_map" in target_config or "auto_map" in (target_config.get("text_config") or {})
    tensors = _cast(tensors, DTYPES[settings.dtype])
    steps, tp = settings.num_speculative_tokens, settings.tensor_parallel
    manifest = {"drafter": str(drafter_dir), "target": str(target_path), "aux_layer_ids": list(cfg.aux_layer_ids),
                "settings": asdict(settings)}  # fmt: skip

    # Translations and renames first: what an engine cannot serve refuses before anything is written.
    sg_ids = engine_aux_ids("sglang", settings.sglang_version, target_config, cfg.aux_layer_ids)
    vl_ids = engine_aux_ids("vllm", settings.vllm_version, target_config, cfg.aux_layer_ids)
    vl_tensors = vllm_tensors(tensors, cfg)
    ignored = sglang_ignored_variants(cfg, settings.sglang_version)
    if ignored:
        log.warning("%s: SGLang %s's LlamaForCausalLMEagle3 does not apply %s (its released source): the "
                    "sglang/ export would run this drafter without them and accept far fewer drafts; serve "
                    "it with the vllm/ export (vLLM applies all three) or train with train.norm_* off",
                    drafter_dir, settings.sglang_version, ", ".join(ignored))  # fmt: skip
    sg = output_dir / "sglang"
    sg.mkdir(parents=True, exist_ok=True)
    _save(sglang_tensors(tensors, cfg), sg / "model.safetensors")
    write_json(sg / "config.json", sglang_config(cfg, sg_ids.ids, settings.dtype))
    _write_launch(sg / "launch.sh", sglang_launch(target_path, steps, tp, trust, settings.sglang_version))
    manifest["sglang"] = sg_ids.as_json()

    vl = output_dir / "vllm"
    vl.mkdir(parents=True, exist_ok=True)
    _save(vl_tensors, vl / "model.safetensors")
    write_json(vl / "config.json", vllm_config(cfg, vl_ids.ids, target_config, target_path, steps, settings.dtype))
    _write_launch(vl / "launch.sh", vllm_launch(target_path, steps, tp, trust, settings.vllm_version))
    manifest["vllm"] = vl_ids.as_json()

    write_json(output_dir / "export.json", manifest)
    return manifest


# ---------------------------------------------------------------- import


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
    from draftflow.drafters.train import load_target_tensors, save_drafter

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
    target_config = _target_config(target)
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
    from draftflow.drafters.train import load_target_tensors, save_drafter

    path = speculators_checkpoint(Path(input_dir))
    try:
        raw = read_json(path / "config.json")
    except ValueError as e:
        raise DraftflowError(f"{path / 'config.json'}: not JSON: {e}") from None
    target_config = _target_config(target)
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


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    if stage == "export":
        parser.add_argument(
            "--drafter", type=Path, required=True, help="drafter folder (config.json + model.safetensors)"
        )
        parser.add_argument("--target", type=Path, required=True, help="target model folder")
        parser.add_argument(
            "--settings", type=settings_arg, default={},
            help="config `export` + aux_layer_ids (+ engine_versions, num_speculative_tokens, dtype), as JSON",
        )  # fmt: skip
        parser.add_argument("--output-dir", type=Path, required=True, help="writes sglang/, vllm/ and export.json")
    else:
        parser.add_argument("--from", dest="source", choices=["sglang", "specforge", "speculators"], required=True)
        parser.add_argument(
            "--input", type=Path, required=True,
            help="checkpoint folder (config.json + weights); speculators: an epoch folder or its --save-path "
            "(checkpoint_best, else the latest epoch)",
        )  # fmt: skip
        parser.add_argument("--target", type=Path, required=True, help="target model folder (embedding, layer count)")
        parser.add_argument("--output", type=Path, required=True, help="drafter folder to write")
        parser.add_argument("--sglang-version", default=DEFAULT_SGLANG_VERSION,
                            help="SGLang version an SGLang-format config's aux layer ids were written for")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.stage == "export":
        manifest = export_drafter(args.drafter, args.target, ExportSettings.from_dict(args.settings), args.output_dir)
        if manifest.get("method") != "dflash":
            log.info("exported: sglang ids %s, vllm ids %s -> %s", manifest["sglang"]["eagle_aux_hidden_state_layer_ids"],
                     manifest["vllm"]["eagle_aux_hidden_state_layer_ids"], args.output_dir)  # fmt: skip
    else:
        import_drafter(args.source, args.input, args.target, args.output, args.sglang_version)
    return 0
