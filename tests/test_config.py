"""Config schema: defaults are filled in, and errors name the offending key."""

import re
from pathlib import Path

import pytest
import yaml

from draftflow.config import (
    ConfigError,
    check_config_files,
    coerce_overrides,
    default_aux_layer_ids,
    enabled_datasets,
    load_config,
    load_schema,
    validate_config,
)
from draftflow.errors import DraftflowError
from draftflow.hidden_states.plan import resolve_aux_layer_ids

REPO = Path(__file__).resolve().parent.parent
CONFIGS = [REPO / "config" / "config.yaml", *sorted((REPO / "config" / "examples").glob("*.yaml"))]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    config = load_config(path)
    assert config["datasets"], "every config names datasets"
    assert config["merge"]["max_seq_len"] >= 8


def test_defaults_filled_in_nested_datasets():
    config = validate_config({"datasets": {"d": {"path": "x.jsonl"}}})
    assert config["datasets"]["d"]["shards"] == 1
    assert config["datasets"]["d"]["on_error"] == "fail"
    assert config["target"]["model"] == "builtin:tiny-llama"
    assert config["train"]["ttt_steps"] == 7
    assert config["extract"]["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "config, key, words",
    [
        ({"datasets": {"d": {"path": "x", "shards": 0}}}, "datasets.d.shards", "minimum"),
        ({"datasets": {"d": {"path": "x", "on_eror": "skip"}}}, "datasets.d", "on_eror"),
        ({"datasets": {"d": {}}}, "datasets.d", "'path' is a required property"),
        ({"datasets": {"d": {"path": "x"}}, "merge": {"seed": "one"}}, "merge.seed", "integer"),
        ({"datasets": {"d": {"path": "x"}}, "extract": {"dtype": "int8"}}, "extract.dtype", "int8"),
        ({"datasets": {"bad name": {"path": "x"}}}, "datasets", "bad name"),
        ({}, "<top level>", "'datasets' is a required property"),
        ({"datasets": {"d": {"path": "x"}}, "train": {"methods": ["eagle3", "dflash"]}, "evaluate": {"engine": "sglang"}},
         "train.methods", "through SGLang measures EAGLE-3 drafters only"),  # fmt: skip
        ({"datasets": {"d": {"path": "x"}}, "train": {"methods": ["dflash"]},
          "evaluate": {"temperatures": [0, 1], "engine": "vllm"}},
         "train.methods", "served DFlash was checked with greedy decoding only"),  # fmt: skip
    ],
)
def test_errors_name_the_key(config, key, words):
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    message = str(err.value)
    assert f"  {key}:" in message
    assert words in message


def test_dflash_is_evaluated_in_process_at_any_temperature():
    config = {"datasets": {"d": {"path": "x"}}, "train": {"methods": ["dflash"]}, "evaluate": {"temperatures": [0, 1]}}
    assert validate_config(config)["evaluate"]["temperatures"] == [0, 1]


def test_load_config_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"datasets": {"d": {"path": "x", "weight": 0}}}))
    with pytest.raises(ConfigError, match=r"(?s)c\.yaml.*datasets\.d\.weight"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_kimi_example_is_the_users_setup():
    config = load_config(REPO / "config" / "examples" / "kimi-k2.5.yaml")
    datasets = config["datasets"]
    assert "A1_deepswekimi" in datasets and not datasets["A1_deepswekimi"]["enabled"]
    enabled = enabled_datasets(config)
    assert enabled[0] == "A2_kimik25"
    assert {f"B{i}" for i in range(1, 9)} == {name.split("_")[0] for name in enabled if name.startswith("B")}
    assert "B1_glaive" in enabled and "B8_sweagent" in enabled
    assert config["merge"]["max_seq_len"] == 8192
    assert config["merge"]["samples_per_range"] == 2000
    assert config["extract"]["aux_layer_ids"] == [2, 30, 58]
    assert config["extract"]["engine"] == "sglang"
    assert config["extract"]["tensor_parallel"] == 8
    assert config["train"]["gpus"] == 8


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B
    assert default_aux_layer_ids(61) == [1, 29, 57]  # Kimi-K2.5
    assert default_aux_layer_ids(8) == [1, 3, 4]  # the builtin target's default depth


def test_default_aux_layer_ids_are_distinct_ascending_and_below_the_last_layer():
    # [1, N//2 - 1, N - 4] repeated ids below 7 layers: [1, 1, 0] for 4, [1, 2, 2] for 6
    assert default_aux_layer_ids(4) == [0, 1, 2]
    assert default_aux_layer_ids(5) == [1, 2, 3]
    assert default_aux_layer_ids(6) == [1, 2, 3]
    for n in range(4, 300):
        ids = default_aux_layer_ids(n)
        assert len(ids) == 3 and ids == sorted(set(ids)), (n, ids)
        assert 0 <= ids[0] and ids[-1] <= n - 2, (n, ids)  # N - 1 cannot be served by SGLang
        assert resolve_aux_layer_ids(None, n) == ids
        if n >= 7:
            assert ids == [1, n // 2 - 1, n - 4]  # DESIGN.md §3 where it is distinct
    for n in (1, 2, 3):
        with pytest.raises(DraftflowError, match="set extract.aux_layer_ids"):
            default_aux_layer_ids(n)


@pytest.mark.parametrize(
    "ids, words",
    [([1, 3, 3], "more than once"), ([3, 1, 2], "ascending order ([1, 2, 3])"), ([1, 8], "does not exist")],
)
def test_configured_aux_layer_ids_must_be_distinct_ascending_and_in_range(ids, words):
    with pytest.raises(DraftflowError, match=re.escape(words)):
        resolve_aux_layer_ids(ids, 8)


def _schema_keys(schema: dict, path: str = ""):
    children = dict(schema.get("properties", {}))
    if isinstance(schema.get("additionalProperties"), dict):
        children["<name>"] = schema["additionalProperties"]
    for key, sub in children.items():
        dotted = f"{path}.{key}" if path else key
        if key != "<name>":
            yield dotted, sub
        yield from _schema_keys(sub, dotted)


def test_every_schema_key_is_described():
    keys = dict(_schema_keys(load_schema()))
    assert len(keys) > 100
    undescribed = [k for k, sub in keys.items() if not str(sub.get("description", "")).strip()]
    assert undescribed == [], f"{len(undescribed)} schema keys lack a description: {undescribed}"


def minimal(**sections) -> dict:
    return {"datasets": {"chat": {"path": "data/samples/chat_openai.jsonl"}}, **sections}


def test_command_line_values_are_coerced_by_the_schema_types():
    """Snakemake's --config train='{learning_rate: 0.001}' gives nested values as strings."""
    overrides = {
        "train": {"learning_rate": "0.001", "epochs": "2", "fsdp": "true", "compile": "false"},
        "evaluate": {"draft_tokens": ["2", "5"], "prompts_file": "null"},
        "extract": {"aux_layer_ids": "[1, 3, 5]", "compression_level": "-3"},
        "target": {"tokenizer": "null", "model": "123"},
        "datasets": {"chat": {"shards": "3", "path": "007.jsonl"}},
        "regenerate": {"openai": {"timeout_s": "30", "extra_body": {"top_k": "20"}}},
    }
    config = minimal()
    for section, values in overrides.items():  # what Snakemake's own merge of --config leaves
        config.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match="'0.001' is not of type 'number'"):
        validate_config(config)
    config = validate_config(coerce_overrides(config, overrides))
    assert config["train"]["learning_rate"] == 0.001 and config["train"]["epochs"] == 2
    assert config["train"]["fsdp"] is True and config["train"]["compile"] is False
    assert config["evaluate"]["draft_tokens"] == [2, 5] and config["evaluate"]["prompts_file"] is None
    assert config["extract"]["aux_layer_ids"] == [1, 3, 5] and config["extract"]["compression_level"] == -3
    assert config["target"]["tokenizer"] is None and config["target"]["model"] == "123"  # strings stay strings
    assert config["datasets"]["chat"] == {**config["datasets"]["chat"], "shards": 3, "path": "007.jsonl"}
    assert config["regenerate"]["openai"]["timeout_s"] == 30
    assert config["regenerate"]["openai"]["extra_body"] == {"top_k": "20"}  # free-form: as given
    # a value that does not parse to the schema's type is left for validation to name
    bad = {"train": {"learning_rate": "fast"}}
    with pytest.raises(ConfigError, match="train.learning_rate: 'fast' is not of type 'number'"):
        validate_config(coerce_overrides(minimal(**bad), bad))


@pytest.mark.parametrize(
    "config, words",
    [
        (minimal(train={"learning_rat": 0.1}), "train: unknown key 'learning_rat'; did you mean 'learning_rate'?"),
        (minimal(learning_rate=0.1), "unknown key 'learning_rate'; did you mean 'target.builtin.learning_rate' or "
                                     "'train.learning_rate'? (not at the top level)"),
        ({"datasets": {"chat": {"path": "x.jsonl", "shard": 2}}},
         "datasets.chat: unknown key 'shard'; did you mean 'shards'?"),
        (minimal(merge={"max_seq_len": 64, "aux_layer_ids": [1]}),
         "merge: unknown key 'aux_layer_ids'; did you mean 'extract.aux_layer_ids'? (not under merge)"),
    ],
)  # fmt: skip
def test_unknown_keys_get_a_did_you_mean(config, words):
    with pytest.raises(ConfigError) as e:
        validate_config(config)
    assert words in str(e.value)


def test_a_config_file_that_is_not_a_config_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "merged").mkdir(parents=True)
    plan = tmp_path / "results" / "merged" / "storage_plan.json"
    plan.write_text('{"aux_layer_ids": [1, 2, 3], "ranges": {}, "total": {}}')
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(minimal()))
    check_config_files([tmp_path / "my.yaml"])  # a config passes
    with pytest.raises(ConfigError) as e:
        check_config_files([tmp_path / "my.yaml", plan])
    message = str(e.value)
    assert "--configfile results/merged/storage_plan.json is not a draftflow config" in message
    assert "`snakemake results/merged/storage_plan.json --configfile my.yaml`" in message
