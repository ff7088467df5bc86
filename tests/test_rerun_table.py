"""docs/ARCHITECTURE.md "What reruns": for every config key, the rules a change reruns, as
Snakemake itself decides it on a finished run.

One tiny workflow runs to the end once; then, for each key of the schema, the key alone is
changed and Snakemake plans the work (a dry-run, in this process: a Snakemake start-up per key
would cost ~10 s here). Where it plans one of the checkpoints preflight / preflight_servers,
whose dependents it re-plans only after they ran (in the planning pass where an upstream job
reruns, Snakemake 9.27 does not check a downstream job's own params), a copy of the workflow
runs those checkpoints with `--touch` and is dry-run again: the union is what a real run does.
After a re-merge Snakemake re-plans too (extraction of the ranges whose samples changed), which
no dry-run can show; the table says so for the rows that rerun merge.

The table must list exactly what Snakemake reruns; a schema key without a row fails with the
list of what to add.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, copy_workflow, load_default_config, snakemake, write_config
from draftflow.config import load_schema, validate_config

pytestmark = pytest.mark.slow  # real Snakemake runs of every rerun case (minutes): not in make test-fast

TABLE_DOC = REPO / "docs" / "ARCHITECTURE.md"
TABLE_HEADING = "## What reruns when a config key changes"
# checkpoints whose dependents Snakemake re-plans after they ran -> their output under `results`
RE_PLANNING = {"preflight": "hidden_states/preflight.json", "preflight_servers": "regenerated/preflight.json"}


# ---- the table and the schema ---------------------------------------------------------------


def schema_keys(schema: dict | None = None) -> list[str]:
    """Every leaf key of the schema, dotted; a named dataset's keys as `datasets.*.<key>`."""
    keys: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        if node.get("properties"):
            for name, sub in node["properties"].items():
                walk(sub, f"{prefix}{name}.")
        elif isinstance(node.get("additionalProperties"), dict) and node["additionalProperties"].get("properties"):
            walk(node["additionalProperties"], f"{prefix}*.")
        else:
            keys.append(prefix[:-1])

    walk(schema or load_schema(), "")
    return keys


def read_table(path: Path = TABLE_DOC) -> dict[str, set[str]]:
    """key -> rules, from the table under TABLE_HEADING: `| `k1`, `k2` | rule, rule |` ("—": none)."""
    text = path.read_text()
    assert TABLE_HEADING in text, f"{path} has no section {TABLE_HEADING!r}"
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        rules = set() if cells[1] in ("—", "-", "nothing") else {r.strip() for r in cells[1].split(",")}
        for key in re.findall(r"`([^`]+)`", cells[0]):
            assert key not in table, f"{path}: key {key} appears in two rows"
            table[key] = rules
    return table


def test_every_schema_key_has_a_row():
    keys, table = schema_keys(), read_table()
    missing = [k for k in keys if k not in table]
    unknown = sorted(set(table) - set(keys))
    assert not missing, (
        f"{TABLE_DOC} ({TABLE_HEADING!r}) has no row for these config keys: {missing}. Add each to the row "
        "listing the rules that a change of it reruns (run tests/test_rerun_table.py::"
        "test_the_table_is_what_snakemake_reruns to see what Snakemake does)."
    )
    assert not unknown, f"{TABLE_DOC} lists keys the schema does not have: {unknown}"


# ---- a changed value for every key ----------------------------------------------------------

# The named entry whose keys a `*` key changes, per named collection.
NAMED = {"datasets.*": "chat", "evaluate.prompt_sets.*": "eval"}


def _concrete(key: str) -> str:
    for pattern, name in NAMED.items():
        if key.startswith(pattern + "."):
            return name.join(pattern.rsplit("*", 1)) + key[len(pattern) :]
    return key


def _schema_node(schema: dict, key: str) -> dict:
    node = schema
    for part in key.split("."):
        node = node["additionalProperties"] if part == "*" else node["properties"][part]
    return node


def _get(config: dict, key: str):
    value = config
    for part in _concrete(key).split("."):
        value = value[part]
    return value


def _set(config: dict, key: str, value) -> None:
    parts = _concrete(key).split(".")
    node = config
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


# Keys whose new value needs the workflow's files (a copy of the built target …) or a valid shape.
SPECIAL = {
    "results": "results-moved",
    "target.model": "models/tiny",  # a copy of the built builtin target (fixture)
    "target.tokenizer": "models/tiny",
    "datasets.*.path": "data/samples/chat_copy.jsonl",  # the same content elsewhere (fixture)
    "datasets.*.split": "train",
    "tokenize.chat_template": "config/chat_template.jinja",  # (fixture)
    "evaluate.prompts_file": "config/prompts.txt",  # (fixture)
    "extract.aux_layer_ids": [0, 1, 3],
    "evaluate.draft_tokens": [3],
    "regenerate.openai.endpoints": ["http://127.0.0.1:9/v1"],
    "regenerate.openai.model": "tiny",
    "regenerate.openai.api_key_env": "TINY_KEY",
    "regenerate.openai.extra_body": {"top_k": 1},
    "extract.sglang.endpoint": "http://127.0.0.1:9",
    "target.num_hidden_layers": 4,
    "target.hidden_size": 32,
    "datasets.*.max_merged": 5,
    "evaluate.temperatures": [0.0, 1.0],
    "evaluate.prompt_sets.*.path": "config/prompts.txt",
    "evaluate.server.launcher": ["python3", "-m", "sglang.launch_server"],
    "extract.vllm.python": ".venv-vllm/bin/python",
    "evaluate.server.extra_args": ["--mem-fraction-static", "0.8"],
    "export.serve_check.python": ".venv-vllm/bin/python",
    "export.serve_check.extra_args": ["--max-model-len", "256"],
    "evaluate.server.endpoint": "http://127.0.0.1:9",
    "evaluate.server.baseline_endpoint": "http://127.0.0.1:10",
    "train.methods": ["eagle3", "dflash"],
    "train.dflash.target_layer_ids": [0, 3],  # a layer extraction does not store yet
    "train.batching": "padded",  # no default: unset means packed
}


def changed_value(schema: dict, config: dict, key: str):
    """A valid value for `key` other than the one `config` holds."""
    if key in SPECIAL:
        return SPECIAL[key]
    node, current = _schema_node(schema, key), _get(config, key)
    if "enum" in node:
        return next(v for v in node["enum"] if v != current)
    kinds = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
    if "boolean" in kinds:
        return not current
    if "integer" in kinds:
        new = (current if current is not None else node.get("minimum", 1)) + 1
        return new if new <= node.get("maximum", new) else current - 1
    if "number" in kinds:
        new = round(current * 0.5, 6) if current else 0.5
        return new if new > node.get("exclusiveMinimum", -1e18) else current + 0.1
    if "string" in kinds:
        return current + ".1" if re.fullmatch(r"[\d.]+", current) else current + "-x"
    raise AssertionError(f"no changed value for {key} ({node}): add it to SPECIAL")


# ---- Snakemake's own plan, in this process --------------------------------------------------


def tiny_config() -> dict:
    """The default, shrunk to seconds per job; every key filled in (a key changes from its value)."""
    config = load_default_config()
    config["target"]["builtin"] = {
        "train_steps": 0, "num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300,
    }  # fmt: skip
    config["datasets"] = {
        "chat": {"path": "data/samples/chat_openai.jsonl", "max_samples": 8},
        "prompts": {"path": "data/samples/prompts_only.jsonl", "regenerate": True, "max_samples": 2},
    }
    config["regenerate"]["max_new_tokens"] = 4
    config["merge"] = {"max_seq_len": 64, "eval_fraction": 0.2, "min_eval_samples": 1, "samples_per_range": 8}
    config["extract"]["aux_layer_ids"] = [0, 1, 2]
    config["train"] = {"epochs": 1, "batch_tokens": 256, "draft_vocab_size": 64, "ttt_steps": 2, "num_workers": 0}
    config["evaluate"] = {"draft_tokens": [2], "max_prompts": 1, "max_new_tokens": 4}
    return validate_config(config)


class _Jobs(logging.Handler):
    def __init__(self):
        super().__init__()
        self.rules: set[str] = set()

    def emit(self, record):
        from snakemake_interface_logger_plugins.common import LogEvent

        if getattr(record, "event", None) == LogEvent.JOB_INFO:
            self.rules.add(record.rule_name)


def planned_rules(workdir: Path, config: dict, touch: list[str] | None = None) -> set[str]:
    """Rules Snakemake plans for `config` in `workdir`: a dry-run of everything, or with `touch`
    (target files) a run of those targets with --touch (outputs touched, not computed)."""
    from snakemake.api import SnakemakeApi
    from snakemake.logging import logger
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, Quietness, ResourceSettings

    write_config(workdir, config, "changed.yaml")
    jobs, cwd = _Jobs(), os.getcwd()
    try:
        with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
            workflow = api.workflow(
                resource_settings=ResourceSettings(cores=1),
                config_settings=ConfigSettings(configfiles=[workdir / "config" / "changed.yaml"]),
                snakefile=workdir / "Snakefile",
                workdir=workdir,
            )
            logger.addHandler(jobs)
            try:
                dag = workflow.dag(DAGSettings(targets=set(touch or ())))
                if touch:
                    dag.execute_workflow(executor="local", pseudo_executor="touch")
                else:
                    dag.execute_workflow(executor="dryrun")
            finally:
                logger.removeHandler(jobs)
    finally:
        os.chdir(cwd)
    return jobs.rules - {"all"}


def observed_reruns(workdir: Path, config: dict, scratch: Path) -> set[str]:
    rules = planned_rules(workdir, config)
    pending = sorted(rules & RE_PLANNING.keys())
    if pending:  # what Snakemake re-plans once those checkpoints ran
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(workdir, scratch, symlinks=True)
        rules |= planned_rules(scratch, config, touch=[f"{config['results']}/{RE_PLANNING[r]}" for r in pending])
        rules |= planned_rules(scratch, config)
    return rules


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The tiny workflow run to the end, with the files some changed values point to."""
    saved = {k: os.environ.get(k) for k in ("PATH", "PYTHONPATH")}  # the Snakefile prepends to them
    workdir = copy_workflow(tmp_path_factory.mktemp("rerun") / "wf")
    write_config(workdir, tiny_config())
    snakemake(workdir, "--configfile=config/test.yaml")
    shutil.copytree(workdir / "results" / "target", workdir / "models" / "tiny")
    shutil.copy(workdir / "data" / "samples" / "chat_openai.jsonl", workdir / "data" / "samples" / "chat_copy.jsonl")
    shutil.copy(REPO / "draftflow" / "templates" / "llama3_chat.jinja", workdir / "config" / "chat_template.jinja")
    (workdir / "config" / "prompts.txt").write_text("Say hello.\n")
    yield workdir
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_the_table_is_what_snakemake_reruns(finished, tmp_path):
    schema, base = load_schema(), tiny_config()
    assert planned_rules(finished, base) == set(), "a finished run must plan nothing"
    table = read_table()
    wrong = []
    for key in schema_keys(schema):
        config = copy.deepcopy(base)
        _set(config, key, changed_value(schema, config, key))
        rules = observed_reruns(finished, config, tmp_path / "scratch")
        expected = table.get(key)
        if expected != rules:
            wrong.append(
                f"  {key}: Snakemake reruns {sorted(rules) or '—'}, the table says {sorted(expected or []) if expected is not None else '(no row)'}"
            )
    assert not wrong, f"{TABLE_DOC} ({TABLE_HEADING!r}) disagrees with Snakemake:\n" + "\n".join(wrong)
