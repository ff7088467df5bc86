"""The embedded default, shrunk, with both drafter methods (config/two-methods.yaml), through
everything `rule all` asks for, then the report.

Checks that every final output exists and agrees with the others: the hidden-state summary
with the merge manifest, sample lengths with the merged splits, one extraction (each range
extracted once) feeding both methods, acceptance lengths within their bounds, servable SGLang
exports of both, nothing left to do afterwards, and a self-contained HTML report with every
figure.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import REPO, copy_workflow, planned_jobs, snakemake, write_config
from draftflow.config import default_aux_layer_ids
from test_workflow_extract import CONFIG, small_config

METHODS = ("eagle3", "dflash")
FIGURES = ("lengths", "storage", "methods", *(f"{m}/{kind}" for m in METHODS for kind in ("training", "acceptance")))


def _read_json(path: Path):
    return json.loads(path.read_text())


def _merged_lengths(path: Path) -> dict[str, int]:
    lengths = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert len(record["input_ids"]) == len(record["loss_mask"])
        lengths[record["id"]] = len(record["input_ids"])
    return lengths


@pytest.mark.slow
def test_default_workflow_end_to_end(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    config = small_config()
    config["train"]["methods"] = list(METHODS)  # what config/two-methods.yaml adds to the default
    write_config(workdir, config)
    proc = snakemake(workdir, CONFIG)  # rule all
    results = workdir / "results"

    # Hidden states: summary and lengths agree with the merge, from the indexes alone.
    manifest = _read_json(results / "merged" / "manifest.json")
    data_config = _read_json(results / "hidden_states" / "data_config.json")
    num_layers = config["target"]["builtin"].get("num_hidden_layers", 8)
    aux = default_aux_layer_ids(num_layers)
    assert data_config["aux_layer_ids"] == aux
    assert data_config["layer_ids"] == aux + [num_layers - 1]
    assert data_config["num_layers_captured"] == len(aux) + 1
    assert data_config["total_samples"] == manifest["total"]["all"]["samples"]
    assert data_config["total_tokens"] == manifest["total"]["all"]["tokens"]
    assert data_config["failed_samples"] == 0
    for split in ("train", "eval"):
        assert data_config["splits"][split]["samples"] == manifest["total"][split]["samples"]
        assert data_config["splits"][split]["tokens"] == manifest["total"][split]["tokens"]
        assert data_config["splits"][split]["ranges"] == len(manifest["ranges"][split])
    sample_lengths = _read_json(results / "hidden_states" / "sample_lengths.json")
    merged = {split: _merged_lengths(results / "merged" / f"{split}.jsonl") for split in ("train", "eval")}
    assert sample_lengths["splits"] == merged
    assert sample_lengths["total_samples"] == sum(len(v) for v in merged.values())
    assert sample_lengths["total_tokens"] == data_config["total_tokens"]

    # One extraction for both methods: each range extracted by exactly one job.
    ranges = sum(len(manifest["ranges"][split]) for split in ("train", "eval"))
    assert proc.stderr.count("rule extract:") == ranges, proc.stderr[-3000:]
    assert proc.stderr.count("rule train:") == len(METHODS)

    # Drafters and acceptance lengths: 1 <= tau <= K + 1 (DFlash: K = block_size - 1 too).
    ttt_steps, block = 7, 16  # train.ttt_steps and train.dflash.block_size defaults
    for method, steps in (("eagle3", ttt_steps), ("dflash", block - 1)):
        drafter_eval = _read_json(results / "drafter" / method / "eval.json")
        assert 1.0 <= drafter_eval["simulated_acceptance_length"] <= steps + 1
        acceptance = _read_json(results / "eval" / method / "acceptance.json")
        assert acceptance["method"] == method
        k = max(acceptance["draft_tokens"])
        assert k == (max(config["evaluate"]["draft_tokens"]) if method == "eagle3" else block - 1)
        assert 1.0 <= acceptance["acceptance_length"] <= k + 1
        assert 1.0 <= acceptance["acceptance_length_simulated"] <= steps + 1
        assert 1.0 <= acceptance["ngram"][str(k)]["acceptance_length"] <= k + 1
        assert all(r["matches_greedy"] == r["prompts"] for r in acceptance[method].values())
        assert (results / "eval" / method / "acceptance.csv").is_file()

    # Servable SGLang exports: EAGLE-3 weights without an embedding; DFlash without one or an LM head.
    sglang = results / "export" / "eagle3" / "sglang"
    assert _read_json(sglang / "config.json")["architectures"] == ["LlamaForCausalLMEagle3"]
    with safe_open(str(sglang / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "d2t", "t2d", "norm.weight", "lm_head.weight"} <= names, sorted(names)
    assert not any("embed" in name for name in names), sorted(names)
    dflash = results / "export" / "dflash" / "sglang"
    assert _read_json(dflash / "config.json")["dflash_config"]["target_layer_ids"] == aux  # the stored layers
    with safe_open(str(dflash / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names, sorted(names)
    assert not any("embed" in name or "lm_head" in name for name in names), sorted(names)
    for method in METHODS:
        assert (results / "export" / method / "vllm" / "config.json").is_file()
        assert (results / "export" / method / "export.json").is_file()

    for kind in FIGURES:
        assert (results / "plots" / f"{kind}.png").stat().st_size > 1000

    # Nothing left to do.
    proc = snakemake(workdir, "-n", CONFIG)
    assert planned_jobs(proc.stdout) == {}, proc.stdout
    assert "Nothing to be done" in proc.stdout + proc.stderr

    # A self-contained report with the four figures and their captions.
    snakemake(workdir, CONFIG, "--report", "report.html")
    report = workdir / "report.html"
    assert report.stat().st_size > 50_000
    html = report.read_text()
    for kind in FIGURES:
        png = base64.b64encode((results / "plots" / f"{kind}.png").read_bytes()).decode()
        assert png in html, f"{kind}.png is not embedded in the report"
        caption = (REPO / "report" / f"{kind.split('/')[-1]}.rst").read_text().split()
        assert " ".join(caption[:4]) in html, f"caption of {kind}.png missing: {' '.join(caption[:4])!r}"
