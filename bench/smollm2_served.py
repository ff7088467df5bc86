#!/usr/bin/env python3
"""SmolLM2-135M-Instruct served by a real vLLM on the CPU (issue 32, item 7; BENCHMARKS.md).

    hf     run the shrunk SmolLM2 workflow (tests/test_real_model.py's real_workflow_config, trained
           longer) in W with the hf engine; MT-bench, both turns, K = 3 and 7
    served clone W to W-served and rerun only evaluate (+ plots) through vLLM's CPU build, launched
           by the stage (one server per K and one without the drafter)
    compare the two acceptance.json: per-K τ, verify steps, delivered tokens, outputs equal to greedy

    PATH=.venv/bin:$PATH PYTHONPATH=$PWD python bench/smollm2_served.py hf /tmp/sv/b
    DRAFTFLOW_VLLM_PYTHON=.venv-vllm/bin/python PYTHONPATH=$PWD python bench/smollm2_served.py served /tmp/sv/b
    PYTHONPATH=$PWD python bench/smollm2_served.py compare /tmp/sv/b
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def hf(workdir: Path, a: argparse.Namespace) -> None:
    from conftest import copy_workflow, snakemake, write_config
    from test_real_model import real_workflow_config

    config = real_workflow_config(REPO / "real")
    config["datasets"]["sharegpt"]["max_samples"] = a.sharegpt
    config["datasets"]["sharegpt_regen"]["max_samples"] = a.regenerated
    config["regenerate"].update(batch_size=a.regenerated, max_new_tokens=a.regen_tokens)
    config["train"].update(epochs=a.epochs)
    config["evaluate"].update(draft_tokens=[3, 7], max_new_tokens=a.max_new_tokens, max_prompts=a.prompts)
    copy_workflow(workdir)
    write_config(workdir, config)
    start = time.monotonic()
    snakemake(workdir, "--configfile=config/test.yaml", timeout=3600)
    print(f"hf run: {time.monotonic() - start:.0f} s")


def served(workdir: Path) -> None:
    import yaml

    from conftest import kill_all, snakemake, write_config
    from real_vllm import VLLM_ENV, vllm_python
    from test_real_model import SMOLLM2_VLLM_ARGS
    from test_vllm_served import clone, served_config, vllm_processes, wait_gone

    dest = workdir.with_name(workdir.name + "-served")
    clone(workdir, dest)
    config = served_config(yaml.safe_load((dest / "config" / "test.yaml").read_text()), vllm_python())
    config["evaluate"]["server"]["extra_args"] = SMOLLM2_VLLM_ARGS
    write_config(dest, config)
    os.environ.update(VLLM_ENV)
    start = time.monotonic()
    try:
        snakemake(dest, "--configfile=config/test.yaml", timeout=3600)
    finally:
        left = wait_gone(dest, 60)
        kill_all(left)
    print(f"served run: {time.monotonic() - start:.0f} s; vLLM processes left after it: {len(left)}")


def compare(workdir: Path) -> None:
    from test_vllm_served import check_served_against_hf

    dest = workdir.with_name(workdir.name + "-served")
    hf_report = json.loads((workdir / "results" / "eval" / "eagle3" / "acceptance.json").read_text())
    vllm = json.loads((dest / "results" / "eval" / "eagle3" / "acceptance.json").read_text())
    print("| K | hf τ | vLLM τ | verify steps hf / vLLM | delivered tokens hf / vLLM | equal to greedy (vLLM) | "
          "equal to greedy (hf) | vLLM's 1 + accepted / drafts |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for k in ("3", "7"):
        h, v = hf_report["eagle3"][k], vllm["eagle3"][k]
        print(f"| {k} | {h['acceptance_length']:.4f} | {v['acceptance_length']:.4f} | {h['verify_steps']} / "
              f"{v['verify_steps']} | {h['generated_tokens'] - h['prompts']} / {v['emitted_tokens']} | "
              f"{v['matches_greedy']} / {v['prompts']} | {h['matches_greedy']} / {h['prompts']} | "
              f"{v['engine_acceptance_length']:.4f} |")  # fmt: skip
    for path, under in ((workdir, ""), (dest, "evaluate")):  # the clone's other stages are the hf run's
        for tsv in sorted((path / "results" / "benchmarks" / under).rglob("*.tsv")):
            seconds = tsv.read_text().splitlines()[1].split("\t")[0]
            print(f"{path.name}: {tsv.relative_to(path / 'results' / 'benchmarks')}: {float(seconds):.0f} s")
    check_served_against_hf(dest, workdir, "eagle3", [3, 7])
    print("check_served_against_hf: equal (outputs, per-K and per-set verify steps, delivered tokens, τ)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["hf", "served", "compare"])
    p.add_argument("workdir", type=Path)
    p.add_argument("--sharegpt", type=int, default=10)
    p.add_argument("--regenerated", type=int, default=40)
    p.add_argument("--regen-tokens", type=int, default=96)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    a = p.parse_args()
    workdir = a.workdir.resolve()
    {"hf": lambda: hf(workdir, a), "served": lambda: served(workdir), "compare": lambda: compare(workdir)}[a.step]()


if __name__ == "__main__":
    main()
