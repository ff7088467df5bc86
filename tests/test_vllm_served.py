"""A real vLLM (its CPU build, `make vllm-setup`) serving our exports, launched by the evaluate
stage itself through the workflow: one server per K and one without the drafter, each stopped
afterwards; a stage killed mid-set leaves no server behind and its rerun measures only the rest.

The shared default run (conftest `default_run`, both drafter methods, evaluated by the hf
engine) is the reference: the same prompts served by vLLM must decode to the same tokens, and
give the same τ under the one definition (tokens delivered per verify step). EAGLE-3 is served
at K = 7 here; its K = 3 is served by the run's export gate.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import kill_all, snakemake, snakemake_env, write_config
from real_vllm import VLLM_SERVER_ARGS, VLLM_SERVER_ENV, vllm_python
from test_workflow_extract import CONFIG, clone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the default run, then ~5 vLLM launches

SERVED_TAU_FLOOR = 1.5  # EAGLE-3, K = 7, the shrunk default (measurements in BENCHMARKS.md)
UNIT = re.compile(r"INFO draftflow\.evaluation\.served: (\S+): prompt set (\S+) \(")


def served_config(config: dict, python: Path) -> dict:
    config = json.loads(json.dumps(config))
    config["evaluate"]["engine"] = "vllm"
    # EAGLE-3 at K = 7 only: one launch less (~30 s here). K = 3 is served, and compared with the
    # hf engine step for step, by the default run's export gate (test_serve_check).
    config["evaluate"]["draft_tokens"] = [7]
    config["evaluate"]["server"] = {
        "launcher": [str(python), "-m", "vllm.entrypoints.openai.api_server"],
        "extra_args": VLLM_SERVER_ARGS,
        "startup_timeout_s": 900,
    }
    return config


def read_json(path: Path):
    return json.loads(path.read_text())


def vllm_processes(workdir: Path) -> list[psutil.Process]:
    """vLLM servers (and their engine processes) started in `workdir`."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd", "name"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
            if ("vllm" in text or "VLLM" in text) and p.info["cwd"] == str(workdir):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(workdir: Path, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = vllm_processes(workdir)
        if not left:
            return []
        time.sleep(1)
    return vllm_processes(workdir)


def served_units(state: Path) -> dict[str, int]:
    """Unit files a served evaluation saved (name -> mtime_ns), both methods."""
    return {p.name: p.stat().st_mtime_ns for p in state.glob("evaluate*/*/*.json") if "-k" in p.name or
            ".baseline." in p.name}  # fmt: skip


@pytest.fixture(scope="module")
def served(default_run, tmp_path_factory):
    """The default run's clone evaluated through vLLM: killed once a first unit is saved, rerun."""
    python = vllm_python()
    workdir = clone(default_run.workdir, tmp_path_factory.mktemp("served") / "wf")
    hf_units = served_units(workdir / "results" / "state")  # the hf engine's units are named otherwise
    assert not hf_units, hf_units
    write_config(workdir, served_config(default_run.config, python))
    env = snakemake_env(**VLLM_SERVER_ENV)
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", CONFIG]
    log = (workdir / "killed-run.log").open("w")
    first = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state = workdir / "results" / "state"
    deadline = time.monotonic() + 1200
    try:
        while not served_units(state):
            assert first.poll() is None, (workdir / "killed-run.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no served unit finished in 20 minutes"
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # Snakemake, its job and `draftflow evaluate`; not the server's session
        first.wait()
        log.close()
    saved_at_kill = served_units(state)
    left = wait_gone(workdir, 120)
    kill_all(left)  # never leave a server running, whatever the assertion below says
    snakemake(workdir, "--unlock", CONFIG)
    rerun = snakemake(workdir, CONFIG, timeout=3600)
    yield {"workdir": workdir, "hf": default_run.workdir, "left_after_kill": left, "saved_at_kill": saved_at_kill,
           "rerun": rerun}  # fmt: skip
    kill_all(vllm_processes(workdir))


def test_a_killed_stage_leaves_no_server_and_its_rerun_measures_only_the_rest(served):
    assert served["left_after_kill"] == [], "vLLM outlived the evaluate stage that launched it"
    state = served["workdir"] / "results" / "state"
    after = served_units(state)
    for name, mtime in served["saved_at_kill"].items():  # finished units are kept, not measured again
        assert after[name] == mtime, name
    measured = set()
    for method in ("eagle3", "dflash"):
        text = (served["workdir"] / "results" / "logs" / "evaluate" / f"{method}.log").read_text()
        measured |= {f"{s}.{server}.t0.json" for server, s in UNIT.findall(text)}
    assert measured == set(after) - set(served["saved_at_kill"]), (measured, sorted(after), served["saved_at_kill"])
    assert "rule evaluate:" in served["rerun"].stderr
    assert vllm_processes(served["workdir"]) == []  # every launched server was stopped


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_vllm_decodes_as_greedy_and_agrees_with_hf_on_tau(served, method):
    """Greedy outputs with the drafter equal the target's alone, and equal the hf engine's; per K,
    the verify steps and delivered tokens are the hf engine's, so τ is too."""
    vllm = check_served_against_hf(served["workdir"], served["hf"], method,
                                   [7] if method == "eagle3" else [15])  # DFlash: its full block
    if method == "eagle3":  # a drafter that learned nothing gives τ ~ 1 in both engines alike
        assert vllm["acceptance_length"] >= SERVED_TAU_FLOOR, vllm["acceptance_length"]


def check_served_against_hf(served_dir: Path, hf_dir: Path, method: str, ks: list[int]) -> dict:
    """The served run's acceptance.json against the hf run's (same prompts, same max_new_tokens):
    at each K every output equals greedy, and the verify steps and delivered tokens, pooled and per
    prompt set, are the hf engine's (so τ is too); the baseline server decodes the hf engine's
    greedy reference, turn by turn. Returns the served report."""
    results = served_dir / "results" / "eval" / method
    vllm = read_json(results / "acceptance.json")
    hf = read_json(hf_dir / "results" / "eval" / method / "acceptance.json")
    assert vllm["engine"] == "vllm" and vllm["method"] == method
    assert sorted(vllm[method], key=int) == [str(k) for k in ks]
    for k in map(str, ks):
        ours, theirs = vllm[method][k], hf[method][k]
        assert ours["matches_greedy"] == ours["prompts"] > 0, (method, k, ours)
        assert ours["verify_steps"] > 0 and ours["drafted_tokens"] >= ours["verify_steps"]
        assert (ours["verify_steps"], ours["emitted_tokens"]) == (theirs["verify_steps"], theirs["generated_tokens"] -
                                                                  theirs["prompts"]), (method, k, ours, theirs)
        assert ours["acceptance_length"] == pytest.approx(theirs["acceptance_length"], abs=1e-12)
        # vLLM's own count (1 + accepted / drafts) is kept beside it, with the raw counters
        assert ours["engine_acceptance_length"] == pytest.approx(1 + ours["accepted_tokens"] / ours["verify_steps"])
        assert ours["engine_acceptance_length"] >= ours["acceptance_length"] - 1e-12
    # per prompt set too: a pooled figure can hide sets that moved in opposite directions
    def per_set(report):
        return {(r["prompt_set"], r["draft_tokens"]): r["verify_steps"] for r in report["per_set"]
                if r["method"] == method and r["temperature"] == 0 and r.get("measured", "real") == "real"}  # fmt: skip

    served_sets = per_set(vllm)
    assert served_sets and served_sets == {key: v for key, v in per_set(hf).items() if key[1] in ks}
    # the baseline server (no drafter) decodes what the hf engine's greedy reference decodes, every turn
    def decoded(path: Path, kind: str) -> dict:
        return {(o["prompt_set"], o["source"], o.get("turn", 1)): o["tokens"]
                for o in map(json.loads, path.read_text().splitlines()) if o["method"] == kind}  # fmt: skip

    baseline = decoded(results / "outputs.jsonl", "baseline")
    assert baseline and baseline == decoded(hf_dir / "results" / "eval" / method / "outputs.jsonl", "greedy")
    return vllm
