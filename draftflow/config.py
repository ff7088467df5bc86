"""Load and validate a workflow config against config/schema/config.schema.yaml.

Defaults from the schema are filled in (also inside each named dataset), and a
violation is reported with the dotted path of the offending key, so a user reads
"datasets.B1_glaive.shards: 0 is less than the minimum of 1" instead of a traceback;
an unknown key gets a "did you mean". Values from Snakemake's `--config` are coerced
to the schema's types first (`coerce_overrides`), and a `--configfile` that is not a
config (a target written after the option) is named (`check_config_files`).
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from draftflow.errors import DraftflowError

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "config" / "schema" / "config.schema.yaml"


class ConfigError(DraftflowError):
    """A config that does not match the schema; the message names the key."""


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _fill_defaults(value: Any, schema: dict) -> Any:
    """Return `value` with every missing key that has a schema default filled in."""
    if isinstance(value, dict) and schema.get("type") in ("object", None):
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in value.items():
            if key in props:
                value[key] = _fill_defaults(item, props[key])
            elif isinstance(schema.get("additionalProperties"), dict):
                value[key] = _fill_defaults(item, schema["additionalProperties"])
    return value


def _path_of(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<top level>"


def schema_paths(schema: dict, prefix: str = "") -> dict[str, list[str]]:
    """{key name: [dotted paths where the schema has it]} (a dataset's keys under datasets.<name>)."""
    found: dict[str, list[str]] = {}
    children = dict(schema.get("properties", {}))
    if isinstance(schema.get("additionalProperties"), dict):
        children["<name>"] = schema["additionalProperties"]
    for key, sub in children.items():
        path = f"{prefix}.{key}" if prefix else key
        found.setdefault(key, []).append(path)
        for name, paths in schema_paths(sub, path).items():
            found.setdefault(name, []).extend(paths)
    return found


def _did_you_mean(key: str, here: list[str], everywhere: dict[str, list[str]], at: str) -> str:
    """A hint for an unknown key: a close name at the same place, or the same name elsewhere."""
    close = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    elsewhere = [p for p in everywhere.get(key, []) if p.rsplit(".", 1)[0] != at]
    if elsewhere:
        place = "not at the top level" if at == "<top level>" else f"not under {at}"
        return f"; did you mean {' or '.join(repr(p) for p in elsewhere[:3])}? ({place})"
    return f"; known keys here: {', '.join(here)}" if here else ""


def _messages(error: jsonschema.ValidationError, everywhere: dict[str, list[str]]) -> list[str]:
    path = _path_of(error)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = list(error.schema.get("properties", {}))
        unknown = [k for k in error.instance if k not in known]
        return [f"  {path}: unknown key '{k}'{_did_you_mean(str(k), known, everywhere, path)}" for k in unknown]
    return [f"  {path}: {error.message}"]


# ---- values from the command line ------------------------------------------------------------

NULL_WORDS = ("null", "Null", "NULL", "~")


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if kind else set()


def _fits(value: Any, types: set[str]) -> bool:
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return any(checks[t](value) for t in types if t in checks)


def coerce_to_schema(value: Any, schema: dict) -> Any:
    """`value` with strings turned into the number, boolean, null, list or enum member the schema
    expects at that place: Snakemake's `--config key='{a: 0.001}'` reads nested values as strings.

    A string stays a string where the schema allows one (except a null word where null is
    allowed too); a string that does not parse to an allowed value is left for validation to report.
    """
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return {
            k: coerce_to_schema(v, props[k] if k in props else extra if isinstance(extra, dict) else {})
            for k, v in value.items()
        }
    if isinstance(value, list):
        items = schema.get("items")
        return [coerce_to_schema(v, items) for v in value] if isinstance(items, dict) else value
    if not isinstance(value, str):
        return value
    types, enum = _types(schema), schema.get("enum")
    if enum is not None:
        if value in enum:
            return value
        parsed = _parse_scalar(value)
        return parsed if parsed in enum and type(parsed) in {type(e) for e in enum} else value
    if "null" in types and value in NULL_WORDS:
        return None
    if not types or "string" in types:
        return value
    parsed = _parse_scalar(value)
    if _fits(parsed, types):
        return coerce_to_schema(parsed, schema)  # a list or object parsed from text: its items too
    return value


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def coerce_overrides(config: dict, overrides: dict, schema: dict | None = None) -> dict:
    """`config` with the values Snakemake took from `--config` (`overrides`) coerced by the schema."""
    schema = schema or load_schema()
    return _deep_update(copy.deepcopy(config), coerce_to_schema(copy.deepcopy(dict(overrides)), schema))


def _deep_update(base: dict, new: dict) -> dict:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


# ---- config files --------------------------------------------------------------------------


def check_config_files(paths: list, schema: dict | None = None) -> None:
    """Refuse a `--configfile` that is not a draftflow config, e.g. a target written after the
    option (`--configfile my.yaml results/merged/storage_plan.json`: Snakemake reads every word
    after --configfile as a config file)."""
    schema = schema or load_schema()
    known = set(schema.get("properties", {}))
    for path in paths:
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue  # Snakemake has read it already; nothing to add
        keys = set(data) if isinstance(data, dict) else set()
        if not keys & known:
            relative = os.path.relpath(path)
            path = path if relative.startswith("..") else relative  # as the user typed it, usually
            found = ", ".join(sorted(map(str, keys))[:6]) or "none"
            raise ConfigError(
                f"--configfile {path} is not a draftflow config (top-level keys: {found}; a config has "
                f"{', '.join(sorted(known))}). --configfile reads every file named after it, so a target "
                f"written after it is taken for a config: name targets first, e.g. "
                f"`snakemake {path} --configfile my.yaml`, or end the file list with `--`."
            )


def validate_config(config: dict, schema: dict | None = None) -> dict:
    """Validate `config`, fill defaults, and return a new dict. Raises ConfigError."""
    schema = schema or load_schema()
    config = _fill_defaults(copy.deepcopy(config), schema)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        everywhere = schema_paths(schema)
        lines = [line for e in errors for line in _messages(e, everywhere)]
        raise ConfigError(
            "invalid draftflow config:\n" + "\n".join(lines) + "\n"
            "See config/schema/config.schema.yaml for every key and its meaning."
        )
    _check_methods(config)
    return config


def _check_methods(config: dict) -> None:
    """What the schema cannot say: DFlash is evaluated in process (hf) at any temperature, or served
    by vLLM greedily."""
    methods = (config.get("train") or {}).get("methods") or []
    engine = (config.get("evaluate") or {}).get("engine", "hf")
    temperatures = (config.get("evaluate") or {}).get("temperatures") or [0.0]
    if "dflash" in methods and engine == "vllm" and any(t != 0 for t in temperatures):
        raise ConfigError(
            f"invalid draftflow config:\n  train.methods: includes dflash, but evaluate.temperatures is {temperatures} "
            "with evaluate.engine vllm: served DFlash was checked with greedy decoding only (tests/test_vllm_served.py). "
            "Set evaluate.temperatures: [0], or evaluate.engine: hf (speculative sampling in process)."
        )
    if "dflash" in methods and engine == "sglang":
        raise ConfigError(
            "invalid draftflow config:\n  train.methods: includes dflash, but evaluate.engine is sglang: served "
            "evaluation through SGLang measures EAGLE-3 drafters only (its DFLASH counters were not checked). Set "
            "evaluate.engine: hf or vllm (its export still writes the SGLang launch command), or "
            "train.methods: [eagle3]."
        )


def load_config(path: str | Path) -> dict:
    """Read a YAML config file and validate it."""
    path = Path(path)
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return validate_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def enabled_datasets(config: dict) -> list[str]:
    """Names of the enabled datasets, in config order."""
    return [name for name, ds in config["datasets"].items() if ds["enabled"]]


# The rule, also in the schema (extract.aux_layer_ids) and README ("Layer ids").
DEFAULT_AUX_RULE = (
    "[1, max(2, N//2 - 1), max(3, N - 4)] for N >= 5 decoder layers (= [1, N//2 - 1, N - 4] "
    "from N = 7 on), [0, 1, 2] for N = 4, none below 4"
)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Three distinct, ascending layers below the last one (DEFAULT_AUX_RULE).

    DESIGN.md §3's [1, N//2 - 1, N - 4] (Llama-3.1-8B: [1, 15, 28]; Kimi-K2.5: [1, 29, 57])
    repeats ids below 7 layers ([1, 2, 2] for 6, [1, 1, 0] for 4); there the ids are raised
    to the smallest distinct ones. All stay below N - 1, whose output SGLang cannot capture.
    """
    n = int(num_layers)
    if n >= 5:
        return [1, max(2, n // 2 - 1), max(3, n - 4)]
    if n == 4:
        return [0, 1, 2]
    raise DraftflowError(
        f"a target with {n} decoder layer(s) has no default aux layers (three distinct layers "
        "below the last need at least 4); set extract.aux_layer_ids to distinct ascending ids "
        f"in 0..{max(n - 1, 0)}"
    )


# ---- what a setting changes: stored bytes and models, or only how a stage runs ----------------
# docs/ARCHITECTURE.md ("What reruns") lists, per config key, the rules a change reruns; a test
# pins that table to Snakemake's own rerun decisions.

# Per engine, the extract settings besides target, layers, engine and dtype that change captured
# values (the store digest's input, draftflow.engines.capture.capture_settings).
ENGINE_NUMERICS_KEYS: dict[str, tuple[str, ...]] = {
    "hf": (),
    "sglang": ("tensor_parallel", "sglang.version"),
    "vllm": ("tensor_parallel", "vllm.version"),
}

# Keys (dotted below the section) that change how a stage runs, never what it writes: rules pass
# them to the job without letting a change rerun it, and resume keys leave them out. Any key
# not listed is content: a new key reruns its stage until someone decides otherwise.
OPERATIONAL_KEYS: dict[str, frozenset[str]] = {
    "regenerate": frozenset({
        "device", "openai.endpoints", "openai.api_key_env", "openai.concurrency", "openai.timeout_s",
        "openai.max_retries", "openai.backoff_s", "openai.max_consecutive_failures",
    }),
    "extract": frozenset({
        # samples are keyed by capture settings only, so none of these changes a stored byte
        # that a rerun would rewrite (compression_level applies to files written from now on)
        "device", "gpus_per_job", "batch_tokens", "on_error", "compression_level", "writer_threads",
        "free_disk_margin", "expected_compression_ratio", "sglang.endpoint",
    }),
    "train": frozenset({
        "num_workers", "log_every_steps", "save_every_steps", "eval_every_steps", "compile", "on_bad_sample",
        "ttt_attention",
    }),
    "evaluate": frozenset({
        "device", "on_bad_sample", "server.endpoint", "server.baseline_endpoint", "server.host", "server.port",
        "server.startup_timeout_s", "server.request_timeout_s", "server.check_gpus",
    }),
}  # fmt: skip

# EAGLE-3 train keys added after runs existed, with their defaults: at the default a key is left
# out of the train rule's params and of the resume fingerprint, so earlier runs neither rerun nor
# refuse to resume.
TRAIN_KEYS_ADDED_LATER: dict[str, object] = {"target_temperature": 1.0, "freeze_lm_head": False, "lm_head_lr_scale": 1.0}

# Sub-sections a section's split descends into (every other value is a leaf).
_NESTED = {"extract": ("sglang", "vllm"), "regenerate": ("openai",), "evaluate": ("server",)}


def _operational(section: str, path: str, values: dict) -> bool:
    if path in OPERATIONAL_KEYS.get(section, ()):
        return True
    top = path.split(".")[0]
    if section == "extract" and top in ("tensor_parallel", "sglang", "vllm"):
        # engine-specific: content only where the engine in use computes with it
        return path not in ENGINE_NUMERICS_KEYS.get(values.get("engine", "hf"), ())
    if section == "regenerate" and top == "openai":
        return values.get("engine", "hf") != "openai"
    return False


def split_settings(section: str, values: dict) -> tuple[dict, dict]:
    """(content, operational) parts of a config section: `deep_merge(content, operational)` is
    `values` again. Content changes what a stage writes; operational parts only how it runs."""
    content: dict = {}
    operational: dict = {}
    nested = _NESTED.get(section, ())

    def walk(src: dict, prefix: str, c: dict, o: dict) -> None:
        for key, value in src.items():
            path = f"{prefix}{key}"
            if not prefix and key in nested and isinstance(value, dict):
                c_sub, o_sub = {}, {}
                walk(value, f"{path}.", c_sub, o_sub)
                if c_sub:
                    c[key] = c_sub
                if o_sub:
                    o[key] = o_sub
            elif _operational(section, path, values):
                o[key] = value
            else:
                c[key] = value

    walk(values, "", content, operational)
    return content, operational


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override`'s values, merging nested dicts key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
