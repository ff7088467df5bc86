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
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import REPO, planned_jobs, snakemake
from draftflow.config import default_aux_layer_ids
from test_evaluate import check_against_outputs
from test_workflow_extract import CONFIG

METHODS = ("eagle3", "dflash")
FIGURES = ("lengths", "storage", "methods", *(f"{m}/{kind}" for m in METHODS for kind in ("training", "acceptance")))
SIMULATED_TAU_FLOOR = 1.5  # EAGLE-3, K = 7, this test's shrunk default; measurements in BENCHMARKS.md


def _read_json(path: Path):
    return json.loads(path.read_text())


def _merged_lengths(path: Path) -> dict[str, int]:
    lengths = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert len(record["input_ids"]) == len(record["loss_mask"])
        lengths[record["id"]] = len(record["input_ids"])
    return lengths


def assert_greedy_from_generate(target: Path, outputs: list[dict], max_new_tokens: int) -> None:
    """The greedy reference of a few outputs equals `model.generate` (an independent decoder)."""
    import torch

    from draftflow.evaluation.prompt_sets import PromptSetSpec, load_prompt_set
    from draftflow.target import load_target

    model, tokenizer = load_target(target, dtype=torch.float32, device="cpu")
    ps = load_prompt_set(PromptSetSpec("humaneval", "humaneval"), tokenizer, None, 10)
    prompts = {p.source: p.ids for p in ps.prompts}
    checked = 0
    for o in outputs:
        if o["method"] == "greedy" and o["source"] in prompts:
            ids = torch.tensor([prompts[o["source"]]])
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
            assert out[: len(o["tokens"])] == o["tokens"]
            checked += 1
    assert checked == len(outputs) > 0


@pytest.mark.slow
def test_default_workflow_end_to_end(default_run):
    workdir, config, proc = default_run.workdir, default_run.config, default_run.proc  # rule all
    assert config["train"]["methods"] == list(METHODS)
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
        # τ per prompt set (the eval split and HumanEval), equal to a recount from the decoded outputs,
        # whose tokens are the target's own greedy decoding (transformers' generate, not our loop)
        assert {"eval", "humaneval"} <= set(acceptance["prompt_sets"])
        outputs = [json.loads(line) for line in (results / "eval" / method / "outputs.jsonl").read_text().splitlines()]
        assert check_against_outputs(acceptance, outputs) == 2 * len(acceptance["draft_tokens"]) * len(
            acceptance["prompt_sets"])  # fmt: skip
    # The recipe's floor (BENCHMARKS.md "Drafter quality"): this run's simulated tau was 2.03 at
    # train.seed 0 and 7.38-7.42 at seeds 1-4 (its 20-step target mostly repeats itself), and
    # 1.09 for a drafter that learned nothing (learning rate 1e-9). 1.5 sits between: seed noise
    # (worst seed 2.03) passes, a recipe change that stops the drafter from learning fails.
    eagle3_eval = _read_json(results / "drafter" / "eagle3" / "eval.json")
    assert eagle3_eval["simulated_acceptance_length"] >= SIMULATED_TAU_FLOOR, eagle3_eval
    humaneval = [o for o in outputs if o["prompt_set"] == "humaneval" and o["method"] == "greedy"]
    assert_greedy_from_generate(results / "target", humaneval[:2], config["evaluate"]["max_new_tokens"])

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

    # The report opens on the run's summary: headline figures and tables as text.
    summary = (results / "report" / "summary.rst").read_text()
    desc = html.encode().decode("unicode_escape", errors="ignore")  # the description sits in a JS string
    for method, name in (("eagle3", "EAGLE-3"), ("dflash", "DFlash")):  # both methods on the first page
        acceptance = _read_json(results / "eval" / method / "acceptance.json")
        k = max(acceptance["draft_tokens"])
        real = f"{acceptance['acceptance_length']:.3f}"
        simulated = f"{acceptance['acceptance_length_simulated']:.3f}"
        ngram = f"{acceptance['ngram'][str(k)]['acceptance_length']:.3f}"
        label = f"{name}: acceptance length τ, real (K = {k})"
        for text in (label, real, simulated, ngram, f"{name}: speedup over greedy decoding"):
            assert text in summary, text
        assert f"{label}</td>\n<td>{real}</td>" in desc, "headline table not on the report's first page"
    total = manifest["total"]["all"]
    assert f"{total['samples']:,} samples, {total['tokens']:,} tokens" in desc
    for dataset in config["datasets"]:  # stats.csv inline, one row per dataset and split
        assert f"<td>{dataset}</td>" in desc, dataset

    # Every job used exactly its declared threads (2 cores: rules asking more get 2).
    logs = results / "logs"
    expected = {"build_target.log": 1, "merge.log": 1, "serve_check/target_alone.log": 2}
    for method in METHODS:
        expected.update({f"train/{method}.log": 2, f"evaluate/{method}.log": 2, f"export/{method}.log": 1,
                         f"serve_check/{method}.log": 2})
    expected.update({str(p.relative_to(logs)): 2 for p in logs.glob("extract/*/*.log")})
    expected.update({str(p.relative_to(logs)): 2 for p in logs.glob("regenerate/*/*.log")})
    expected.update({str(p.relative_to(logs)): 1 for p in logs.glob("tokenize/*/*.log")})
    for name, threads in expected.items():
        text = (logs / name).read_text()
        usage = re.findall(r"finished in [\d.]+s; (\d+) CPU thread\(s\)(?:; torch intra-op (\d+), inter-op (\d+))?; "
                           r"threads that used CPU (\d+) of", text)  # fmt: skip
        assert usage, f"{name}: no thread report\n{text[-1500:]}"
        n, intra, inter, busy = (int(v or 0) for v in usage[-1])  # no torch pools: 0
        assert n == threads and intra <= n and inter <= n and 1 <= busy <= n, (name, usage[-1])
        if name.startswith(("build_target", "extract", "train", "evaluate")):  # torch's pools were sized
            assert intra >= 1 and inter >= 1, (name, usage[-1])

    # `draftflow status` on the finished run: every job done, Snakemake at N of N steps.
    proc = subprocess.run([sys.executable, "-m", "draftflow.cli", "status", "--json"], cwd=workdir,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    status = json.loads(proc.stdout)
    assert {job["state"] for job in status["jobs"]} == {"done"}, [j for j in status["jobs"] if j["state"] != "done"]
    assert status["stages"]["extract"] == {"done": len(manifest["ranges"]["train"]) + len(manifest["ranges"]["eval"]),
                                           "total": len(manifest["ranges"]["train"]) + len(manifest["ranges"]["eval"])}
    assert {"build_target", "train", "evaluate", "export", "summary"} <= set(status["stages"])
    sm = status["snakemake"]
    assert sm["done"] == sm["total"] and not sm["locked"], sm
    for job in status["jobs"]:
        if job["rule"] in ("build_target", "regenerate", "extract", "train", "evaluate"):  # long stages: ETA
            assert job["progress"] and job["progress"]["done"] == job["progress"]["total"], job
