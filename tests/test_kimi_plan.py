"""The Kimi-K2.5 example at full scale: once merge has produced 37,312 training samples,
the plan fans out to 19 extraction ranges of 2,000 samples, each asking for 8 GPUs.
Upstream files are fabricated (the user's data and model are not here)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from conftest import REPO, copy_workflow, planned_jobs, snakemake, write_config
from draftflow.config import enabled_datasets, load_config

TRAIN_SAMPLES = 37_312
EVAL_SAMPLES = 377


def _ranges(total: int, per_range: int) -> list[dict]:
    return [
        {
            "name": f"rows_{start}-{min(start + per_range, total)}",
            "start": start,
            "end": min(start + per_range, total),
            "samples": min(start + per_range, total) - start,
            "tokens": 0,
            "digest": f"fabricated-{start}",
        }
        for start in range(0, total, per_range)
    ]


def _fabricate_upstream(results: Path, config: dict) -> None:
    """Write every file up to merge, oldest first, so Snakemake sees them as up to date."""
    stamp = time.time() - 1000

    def touch(path: Path, text: str = "") -> None:
        nonlocal stamp
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.utime(path, (stamp, stamp))
        stamp += 1

    datasets = enabled_datasets(config)
    for stage in ("datasets", "regenerated", "tokenized"):
        for name in datasets:
            if stage == "regenerated" and not config["datasets"][name]["regenerate"]:
                continue
            for shard in range(config["datasets"][name]["shards"]):
                touch(results / stage / name / f"shard-{shard}.jsonl.zst")
                if stage == "datasets":
                    touch(results / stage / name / f"shard-{shard}.rejects.jsonl")
    per_range = config["merge"]["samples_per_range"]
    manifest = {"ranges": {"train": _ranges(TRAIN_SAMPLES, per_range), "eval": _ranges(EVAL_SAMPLES, per_range)}}
    for name in ("train.jsonl", "eval.jsonl", "stats.csv"):
        touch(results / "merged" / name)
    touch(results / "merged" / "manifest.json", json.dumps(manifest))


def test_kimi_plan_fans_out_to_19_gpu_range_jobs(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((REPO / "config" / "examples" / "kimi-k2.5.yaml").read_text())
    config["results"] = str(tmp_path / "results")
    write_config(workdir, config)
    _fabricate_upstream(tmp_path / "results", load_config(workdir / "config" / "test.yaml"))

    started = time.monotonic()
    # As on the 8-GPU host the example is for (this machine has none to count).
    proc = snakemake(workdir, "-n", "--configfile", "config/test.yaml", "--resources", "gpu=8")
    elapsed = time.monotonic() - started

    jobs = planned_jobs(proc.stdout)
    train_ranges = [line for line in proc.stdout.splitlines() if "hidden_states/train/rows_" in line and "output:" in line]
    assert len(train_ranges) == 19, proc.stdout[-3000:]
    assert "rows_36000-37312" in proc.stdout
    assert len(jobs["extract"]) == 19 + 1  # plus the one eval range
    blocks = proc.stdout.split("\nrule ")
    extract_resources = [
        line.strip() for block in blocks if block.startswith("extract:") for line in block.splitlines()
        if line.strip().startswith("resources:")
    ]
    assert len(extract_resources) == 20 and all("gpu=8" in line for line in extract_resources)
    train_block = next(block for block in blocks if block.startswith("train:"))
    assert "gpu=8" in train_block, "training asks for the example's 8 GPUs"
    assert elapsed < 60, f"planning took {elapsed:.1f} s"


def test_kimi_plan_through_the_slurm_profile(tmp_path):
    """`snakemake --profile profiles/slurm -n` shows what each sbatch will ask for:
    8 GPUs per extraction range, 8 GPUs on one node for training and for the SGLang evaluation."""
    workdir = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((REPO / "config" / "examples" / "kimi-k2.5.yaml").read_text())
    config["results"] = str(tmp_path / "results")
    write_config(workdir, config)
    _fabricate_upstream(tmp_path / "results", load_config(workdir / "config" / "test.yaml"))

    proc = snakemake(workdir, "-n", "--profile", "profiles/slurm", "--configfile", "config/test.yaml")
    blocks = proc.stdout.split("\nrule ")
    extract = [block for block in blocks if block.startswith("extract:")]
    assert len(extract) == 20
    for block in extract:
        resources = next(line for line in block.splitlines() if line.strip().startswith("resources:"))
        assert "gpu=8" in resources, resources
    train = next(block for block in blocks if block.startswith("train:"))
    train_resources = next(line for line in train.splitlines() if line.strip().startswith("resources:"))
    assert "gpu=8" in train_resources and "nodes=" not in train_resources, train_resources
    # evaluation serves the exported drafter through SGLang with TP 8 on MT-bench and HumanEval
    evaluate = next(block for block in blocks if block.startswith("evaluate:"))
    evaluate_resources = next(line for line in evaluate.splitlines() if line.strip().startswith("resources:"))
    assert "gpu=8" in evaluate_resources, evaluate_resources
    assert "--served-drafter" in evaluate and "/export/eagle3/sglang" in evaluate, evaluate
    for setting in ('"engine":"sglang"', '"kind":"mtbench"', '"turns":2', '"kind":"humaneval"', '"tensor_parallel":8'):
        assert setting in evaluate, setting
