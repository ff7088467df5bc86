"""The workflow as Snakemake sees it: dry-runs of every shipped config, lint, format,
and which jobs a config change makes stale (read from Snakemake's own dry-run reasons)."""

from __future__ import annotations

import csv
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, copy_workflow, load_default_config, planned_jobs, snakemake, write_config
from draftflow.config import enabled_datasets, load_config
from draftflow.drafters.dflash import DFlashSettings

EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))


def _expected_shard_jobs(config: dict) -> int:
    return sum(config["datasets"][name]["shards"] for name in enabled_datasets(config))


def test_dry_run_default_plans_one_job_per_shard(workflow_copy):
    proc = snakemake(workflow_copy, "-n")
    jobs = planned_jobs(proc.stdout)
    config = load_config(workflow_copy / "config" / "config.yaml")
    assert len(jobs["prepare"]) == _expected_shard_jobs(config)
    assert len(jobs["tokenize"]) == _expected_shard_jobs(config)
    regenerated = [n for n in enabled_datasets(config) if config["datasets"][n]["regenerate"]]
    assert len(jobs["regenerate"]) == sum(config["datasets"][n]["shards"] for n in regenerated)
    assert len(jobs["build_target"]) == 1 and len(jobs["merge"]) == 1
    assert not (workflow_copy / "results").exists(), "a dry-run must not touch data"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_dry_run_examples_with_absent_data(workflow_copy, example):
    config = load_config(example)
    proc = snakemake(workflow_copy, "-n", "--configfile", f"config/examples/{example.name}")
    jobs = planned_jobs(proc.stdout)
    assert len(jobs["prepare"]) == _expected_shard_jobs(config)
    assert "build_target" not in jobs, "a local model needs no build"
    if config["extract"]["engine"] == "sglang":
        assert config["extract"]["tensor_parallel"] == 8
    assert not Path(config["results"]).exists()


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_two_methods_overlay_plans_each_drafter_once_from_one_pipeline(workflow_copy):
    """config/two-methods.yaml on the default: one build, merge and vocab, a train / evaluate /
    export / figure per method, one comparison figure; the default trains EAGLE-3 only."""
    default = planned_jobs(snakemake(workflow_copy, "-n").stdout)
    assert len(default["train"]) == len(default["evaluate"]) == len(default["export"]) == 1
    proc = snakemake(workflow_copy, "-n", "-p", "--configfile", "config/config.yaml", "config/two-methods.yaml")
    jobs = planned_jobs(proc.stdout)
    assert {r: len(jobs[r]) for r in ("train", "evaluate", "export", "plot_training", "plot_acceptance")} == dict.fromkeys(
        ("train", "evaluate", "export", "plot_training", "plot_acceptance"), 2
    )
    assert len(jobs["vocab"]) == len(jobs["merge"]) == len(jobs["plot_methods"]) == 1
    assert jobs.keys() - default.keys() == set() and len(jobs["prepare"]) == len(default["prepare"])
    for method in ("eagle3", "dflash"):
        assert f"results/drafter/{method}" in proc.stdout and f"results/eval/{method}/acceptance.json" in proc.stdout
    dflash = DFlashSettings.from_dict(printed_train_settings(proc.stdout, "dflash")["dflash"])
    assert (dflash.num_hidden_layers, dflash.loss_weighting) == (1, "dpace")  # the schema's default recipe


def printed_train_settings(dry_run_stdout: str, method: str) -> dict:
    """The --settings JSON of one method's train job in a `snakemake -n -p` listing."""
    for block in dry_run_stdout.split("\n\n"):
        if "rule train:" in block and f"results/drafter/{method}" in block:
            command = next(line for line in block.splitlines() if "launch-train" in line)
            args = shlex.split(command.split("Shell command:", 1)[1].split(">", 1)[0])
            return json.loads(args[args.index("--settings") + 1])
    raise AssertionError(f"no train job for {method} in the dry-run:\n{dry_run_stdout[-3000:]}")


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_dflash_set_to_decay_trains_decay_and_keeps_its_params(workflow_copy):
    """decay is no longer the default: a config that names it must still train it, with the params
    it had before D-PACE existed (no loss_weighting key), so such a drafter does not retrain."""
    config = load_default_config()
    config["train"]["methods"] = ["eagle3", "dflash"]
    config["train"]["dflash"] = {"loss_weighting": "decay"}
    write_config(workflow_copy, config)
    proc = snakemake(workflow_copy, "-n", "-p", "--configfile", "config/test.yaml")
    settings = printed_train_settings(proc.stdout, "dflash")["dflash"]
    assert "loss_weighting" not in settings and "dpace_alpha" not in settings
    assert DFlashSettings.from_dict(settings).loss_weighting == "decay"


def test_vllm_cpu_overlay_evaluates_the_vllm_export_through_the_vllm_venv(workflow_copy):
    """config/vllm-cpu.yaml: the evaluate stage launches .venv-vllm's vLLM with the exported
    drafter (an input of the job), and reads no hidden states (no simulated τ when served)."""
    proc = snakemake(workflow_copy, "-n", "-p", "--configfile", "config/config.yaml", "config/vllm-cpu.yaml")
    evaluate = [block for block in proc.stdout.split("\n\n") if "rule evaluate:" in block]
    assert len(evaluate) == 1, proc.stdout
    assert "results/export/eagle3/vllm" in evaluate[0] and "results/hidden_states/eval" not in evaluate[0]
    assert '"engine":"vllm"' in proc.stdout and ".venv-vllm/bin/python" in proc.stdout
    assert '"engine_version":"0.32.0"' in proc.stdout  # export.vllm_version: the release it runs


def test_disabled_dataset_is_not_planned(workflow_copy):
    proc = snakemake(workflow_copy, "-n", "--configfile", "config/examples/kimi-k2.5.yaml")
    assert "A1_deepswekimi" not in proc.stdout
    assert "A2_kimik25" in proc.stdout


def test_lint_is_clean(workflow_copy):
    proc = snakemake(workflow_copy, "--lint")
    assert "Lints for" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_rules_are_snakefmt_formatted():
    snakefmt = shutil.which("snakefmt", path=str(Path(sys.executable).parent))
    assert snakefmt, "snakefmt is a test dependency (pyproject [test])"
    files = [str(REPO / "Snakefile"), *map(str, sorted((REPO / "rules").glob("*.smk")))]
    proc = subprocess.run([snakefmt, "--check", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_invalid_config_fails_before_planning(workflow_copy):
    config = load_default_config()
    config["datasets"]["chat"]["shards"] = 0
    write_config(workflow_copy, config)
    proc = snakemake(workflow_copy, "-n", "--configfile", "config/test.yaml", check=False)
    assert proc.returncode != 0
    assert "datasets.chat.shards" in proc.stdout + proc.stderr


@pytest.mark.parametrize("layers", [4, 6])
def test_small_builtin_target_plans_with_distinct_default_aux_ids(workflow_copy, layers):
    """The builtin target's minimum depth (4) and 6 layers repeated default ids ([1, 1, 0], [1, 2, 2])."""
    config = load_default_config()
    config["target"]["builtin"] = {"num_hidden_layers": layers}
    write_config(workflow_copy, config)
    proc = snakemake(workflow_copy, "-n", "--configfile", "config/test.yaml", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "build_target" in planned_jobs(proc.stdout)


def _job_resources(output: str, rule: str) -> str:
    """The `resources:` line of the first job of `rule` in a dry run's listing."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"rule {rule}:")
    return next(line.strip() for line in lines[start:] if line.strip().startswith("resources:"))


@pytest.mark.parametrize("serves", [True, False])
def test_export_gate_asks_for_a_gpu_only_when_it_serves_on_a_gpu_workflow(workflow_copy, serves):
    """On a GPU cluster a job that asks for a GPU waits for one: the static gate must not ask
    (the SLURM run's gate job did), the served one needs export.tensor_parallel GPUs."""
    args = ("-n", "results/export/eagle3/serve_check.json", "--config", "extract={gpus_per_job: 1}",
            "--resources", "gpu=4")  # fmt: skip
    env_python = {"DRAFTFLOW_VLLM_PYTHON": sys.executable} if serves else {}
    proc = snakemake(workflow_copy, *args, serve_check=serves, extra_env=env_python)
    assert _job_resources(proc.stdout, "serve_check").endswith(f"gpu={int(serves)}"), proc.stdout[-3000:]
    # the target alone is served by a job of its own, once for every method; it asks for GPUs as the gate
    assert _job_resources(proc.stdout, "serve_target").endswith(f"gpu={int(serves)}"), proc.stdout[-3000:]


def test_nested_config_from_the_command_line_reaches_the_rules(workflow_copy):
    proc = snakemake(workflow_copy, "-n", "-p", "--config", "train={draft_vocab_size: 100, learning_rate: 0.001}",
                     "evaluate={draft_tokens: [2, 5]}", check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '{"draft_vocab_size":100}' in proc.stdout  # the vocab rule's settings: a number, not "100"


def test_unknown_key_on_the_command_line_gets_a_did_you_mean(workflow_copy):
    proc = snakemake(workflow_copy, "-n", "--config", "train={learning_rat: 0.001}", check=False)
    assert proc.returncode != 0
    assert "train: unknown key 'learning_rat'; did you mean 'learning_rate'?" in proc.stdout + proc.stderr


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_a_target_after_configfile_is_reported_not_read_as_config(workflow_copy):
    """README step 5 used to read `--configfile my.yaml results/merged/storage_plan.json`."""
    write_config(workflow_copy, load_default_config(), "my.yaml")
    plan = workflow_copy / "results" / "merged" / "storage_plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text('{"aux_layer_ids": [1, 3, 4], "ranges": {"train": []}, "total": {"tokens": 1}}')
    proc = snakemake(workflow_copy, "-n", "--configfile", "config/my.yaml", "results/merged/storage_plan.json",
                     check=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert "--configfile results/merged/storage_plan.json is not a draftflow config" in out
    assert "name targets first" in out
    # the README's form: the target first
    plan.unlink()
    proc = snakemake(workflow_copy, "-n", "results/merged/storage_plan.json", "--configfile", "config/my.yaml")
    assert "plan_storage" in planned_jobs(proc.stdout)


# ---- rerun reasons after a real run through merge ------------------------------------


def small_config() -> dict:
    """The default, shrunk so a real run through merge takes seconds."""
    config = load_default_config()
    config["target"]["builtin"] = {"train_steps": 20}
    for dataset in config["datasets"].values():
        dataset["max_samples"] = 12
    config["regenerate"]["max_new_tokens"] = 8
    # one malformed line, skipped: its count must reach the manifest and stats.csv
    config["datasets"]["flaky"] = {"path": "data/flaky.jsonl", "on_error": "skip"}
    return config


FLAKY_LINES = [
    {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
    {"messages": [{"role": "bot", "content": "malformed role"}]},
    {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]},
]


@pytest.fixture(scope="module")
def merged_workflow(tmp_path_factory):
    workdir = copy_workflow(tmp_path_factory.mktemp("merged") / "wf")
    (workdir / "data" / "flaky.jsonl").write_text("".join(json.dumps(line) + "\n" for line in FLAKY_LINES))
    write_config(workdir, small_config())
    snakemake(workdir, "results/merged/manifest.json", "--configfile=config/test.yaml")
    return workdir


def _dry_run_after(workdir: Path, config: dict) -> dict[str, list[str]]:
    write_config(workdir, config, "changed.yaml")
    proc = snakemake(workdir, "-n", "results/merged/manifest.json", "--configfile=config/changed.yaml")
    return planned_jobs(proc.stdout)


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_nothing_to_do_after_a_run(merged_workflow):
    jobs = _dry_run_after(merged_workflow, small_config())
    assert jobs == {}, f"an unchanged config must plan no jobs, got {jobs}"


def test_rejected_records_are_counted_in_manifest_and_stats(merged_workflow):
    manifest = json.loads((merged_workflow / "results" / "merged" / "manifest.json").read_text())
    assert manifest["datasets"]["flaky"]["rejected"] == 1
    assert manifest["datasets"]["flaky"]["input_samples"] == 2
    assert manifest["datasets"]["chat"]["rejected"] == 0
    assert manifest["total"]["rejected"] == 1
    with open(merged_workflow / "results" / "merged" / "stats.csv", newline="") as f:
        rows = {(r["dataset"], r["split"]): r for r in csv.DictReader(f)}
    assert rows[("flaky", "all")]["rejected"] == "1" and rows[("total", "all")]["rejected"] == "1"
    assert rows[("flaky", "train")]["rejected"] == ""


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_an_empty_eval_split_stops_the_plan_before_training(merged_workflow, tmp_path):
    workdir = tmp_path / "wf"
    shutil.copytree(merged_workflow, workdir, symlinks=True)
    config = small_config()
    config["merge"].update(eval_fraction=0, min_eval_samples=0)
    write_config(workdir, config, "no-eval.yaml")
    snakemake(workdir, "results/merged/manifest.json", "--configfile=config/no-eval.yaml")
    manifest = json.loads((workdir / "results" / "merged" / "manifest.json").read_text())
    assert manifest["ranges"]["eval"] == [] and manifest["ranges"]["train"]
    proc = snakemake(workdir, "-n", "results/drafter/eagle3", "--configfile=config/no-eval.yaml", check=False)
    assert proc.returncode != 0
    assert "merged/manifest.json: the eval split is empty" in proc.stdout + proc.stderr
    assert "merge.min_eval_samples" in proc.stdout + proc.stderr


def test_merge_seed_reruns_merge_only(merged_workflow):
    config = small_config()
    config["merge"]["seed"] = 7
    jobs = _dry_run_after(merged_workflow, config)
    assert set(jobs) == {"merge"}, jobs
    assert any("Params have changed" in reason for reason in jobs["merge"])


def test_one_dataset_change_reruns_its_shards_and_merge(merged_workflow):
    config = small_config()
    config["datasets"]["chat"]["max_samples"] = 10
    jobs = _dry_run_after(merged_workflow, config)
    chat_shards = config["datasets"]["chat"]["shards"]
    assert set(jobs) == {"prepare", "tokenize", "merge"}, jobs
    assert len(jobs["prepare"]) == chat_shards
    assert all("Params have changed" in reason for reason in jobs["prepare"])
    assert len(jobs["tokenize"]) == chat_shards
    assert all("chat" in reason for reason in jobs["tokenize"])
