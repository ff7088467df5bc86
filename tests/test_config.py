"""Config schema: defaults are filled in, and errors name the offending key."""

import re
from pathlib import Path

import pytest
import yaml

from draftflow.config import ConfigError, default_aux_layer_ids, enabled_datasets, load_config, validate_config
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
    ],
)
def test_errors_name_the_key(config, key, words):
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    message = str(err.value)
    assert f"  {key}:" in message
    assert words in message


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
