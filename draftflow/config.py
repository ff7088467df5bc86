"""Load and validate a workflow config against config/schema/config.schema.yaml.

Defaults from the schema are filled in (also inside each named dataset), and a
violation is reported with the dotted path of the offending key, so a user reads
"datasets.B1_glaive.shards: 0 is less than the minimum of 1" instead of a traceback.
"""

from __future__ import annotations

import copy
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


def validate_config(config: dict, schema: dict | None = None) -> dict:
    """Validate `config`, fill defaults, and return a new dict. Raises ConfigError."""
    schema = schema or load_schema()
    config = _fill_defaults(copy.deepcopy(config), schema)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {_path_of(e)}: {e.message}" for e in errors]
        raise ConfigError(
            "invalid draftflow config:\n" + "\n".join(lines) + "\n"
            "See config/schema/config.schema.yaml for every key and its meaning."
        )
    return config


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
