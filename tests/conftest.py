"""Shared fixtures: a private copy of the workflow to run Snakemake in."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from dataclasses import dataclass

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOW_PARTS = ["Snakefile", "rules", "config", "data", "report", "envs", "profiles"]


# `make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup`). A module runs on one
# worker (its module fixtures are built once), and so do all modules that read the shared
# default run (built once per worker otherwise). Groups start longest first (seconds measured in
# the last full run, BENCHMARKS.md "The test suite's minutes") so that neither worker is left
# with a long tail; the rest keep their file order.
SHARED_RUN_GROUP = "default_run"
GROUP_SECONDS = {
    SHARED_RUN_GROUP: 940, "test_real_model": 540, "test_slurm": 340, "test_workflow_extract": 290,
    "test_vllm_extract_real": 155, "test_workflow": 110, "test_target": 105, "test_rerun_table": 100,
    "test_train": 50, "test_sampling": 45,
}  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items) -> None:
    shared = {item.module.__name__ for item in items if SHARED_RUN_GROUP in getattr(item, "fixturenames", ())}

    def group(item) -> str:
        return SHARED_RUN_GROUP if item.module.__name__ in shared else item.module.__name__

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=lambda item: -GROUP_SECONDS.get(group(item), 0))  # stable: file order within a group


def copy_workflow(dest: Path) -> Path:
    """Copy the workflow (not results) into `dest`, so a test's runs touch nothing shared."""
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, dirs_exist_ok=True)
        elif src.exists():
            shutil.copy2(src, dest / part)
    return dest


def write_config(workdir: Path, config: dict, name: str = "test.yaml") -> Path:
    path = workdir / "config" / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake_env(serve_check: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a Snakemake run that does not use SLURM. Snakemake imports every installed
    executor plugin at start, and the SLURM plugin's import runs `scontrol show config`, which waits
    9-10 s when no slurmctld answers (this suite outside test_slurm; a host with no slurm.conf too).
    An empty SLURM_CONF makes scontrol fail at once: ~10 s less per Snakemake start (BENCHMARKS.md,
    "The test suite's minutes"). test_slurm's runs keep the host's SLURM_CONF.

    Without `serve_check`, the export gate finds no vLLM (DRAFTFLOW_VLLM_PYTHON is dropped) and
    checks statically: only the default run (and test_serve_check) serve; the tiny targets of other
    runs are not what the served part is tested on, and each launch costs ~45 s here."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SLURM_CONF": "/dev/null", **extra}
    if not serve_check:
        env.pop("DRAFTFLOW_VLLM_PYTHON", None)
    return env


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: int = 1200,
              serve_check: bool = False, extra_env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run the real Snakemake CLI in `workdir` with this interpreter's environment (no SLURM)."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    env = {**snakemake_env(serve_check), **(extra_env or {})}
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def kill_all(processes: list[psutil.Process], timeout: float = 30) -> None:
    """SIGKILL each process and wait for it; one that already exited is fine (a torchrun worker can
    end on its own between being listed and being killed)."""
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout)


def kill_tree(pid: int) -> None:
    """SIGKILL a process, its descendants and what else lives in their process groups: a child
    forked after the listing (a DataLoader worker starting an epoch) outlives its killed parent in
    the parent's group, reparented out of the tree (seen once: a rank's worker, asleep for good)."""
    tree = process_tree(pid)
    groups = {_group_of(p) for p in tree} - {None, os.getpgrp()}  # never this test process's own group
    kill_all(tree)
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
    left = [p for p in psutil.process_iter() if _group_of(p) in groups]
    psutil.wait_procs(left, timeout=30)


def _group_of(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except ProcessLookupError:  # it has exited
        return None


def process_tree(pid: int) -> list[psutil.Process]:
    """The process, then all its descendants; empty if it is already gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def planned_jobs(output: str) -> dict[str, list[str]]:
    """Parse a dry-run's job listing: rule name -> list of 'reason:' lines of its jobs."""
    jobs: dict[str, list[str]] = {}
    rule = None
    for line in output.splitlines():
        stripped = line.strip()
        if stripped.startswith(("rule ", "checkpoint ", "localrule ", "localcheckpoint ")) and stripped.endswith(":"):
            rule = stripped.split()[1].rstrip(":")
            jobs.setdefault(rule, [])
        elif rule and stripped.startswith("reason:"):
            jobs[rule].append(stripped[len("reason:"):].strip())
    return jobs


def load_default_config() -> dict:
    with open(REPO / "config" / "config.yaml") as f:
        return yaml.safe_load(f)


@pytest.fixture
def workflow_copy(tmp_path: Path) -> Path:
    return copy_workflow(tmp_path / "wf")


@dataclass
class DefaultRun:
    """The shrunk embedded default with both drafter methods, run once through `rule all`."""

    workdir: Path
    config: dict
    proc: subprocess.CompletedProcess  # the run's Snakemake output


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> DefaultRun:
    """One run for the tests that read its outputs (the end-to-end checks, the real-vLLM tests);
    a test that changes anything works on a `clone` of its workdir."""
    from real_vllm import VLLM_SERVER_ARGS, VLLM_SERVER_ENV
    from test_workflow_extract import CONFIG, small_config

    workdir = copy_workflow(tmp_path_factory.mktemp("default-run") / "wf")
    config = small_config()
    config["train"]["methods"] = ["eagle3", "dflash"]  # what config/two-methods.yaml adds to the default
    config["merge"]["samples_per_range"] = 32  # 2 train ranges + 1 eval (each extract job: ~8 s of start-up)
    # The gate's four servers as the tests' own (~10 s less each); test_serve_check serves with
    # the gate's default CPU arguments.
    config.setdefault("export", {})["serve_check"] = {"extra_args": VLLM_SERVER_ARGS}
    write_config(workdir, config)
    return DefaultRun(workdir, config, snakemake(workdir, CONFIG, serve_check=True, extra_env=VLLM_SERVER_ENV))
