"""A job uses exactly the CPU threads its rule declares (draftflow/threads.py), and the builtin
target's weights do not depend on them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draftflow.target import BuiltinSettings, build_target
from draftflow.threads import busy_threads, per_process, split_threads, thread_env

# Shapes of the default build (intermediate 344, 8 x 128 tokens) on two layers: with 3 torch
# threads, SiLU's per-thread chunks do not end on a vector boundary, and without the build's
# one-thread pin the weights differed from a 1-thread build after one step.
TINY_BUILD = {"train_steps": 3, "num_hidden_layers": 2}
USAGE_RE = re.compile(
    r"(?P<n>\d+) CPU thread\(s\); torch intra-op (?P<intra>\d+), inter-op (?P<inter>\d+); "
    r"threads that used CPU (?P<busy>\d+) of (?P<live>\d+) live"
)


def run_python(code: str, env: dict | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_split_between_compute_and_helpers():
    assert split_threads(8, 0) == (8, 0)
    assert split_threads(5, 4) == (1, 4)  # extract: writer_threads 4 + 1 (the rule's threads)
    assert split_threads(8, 2) == (6, 2)  # train on CPU: 2 DataLoader workers
    assert split_threads(2, 4) == (1, 1)  # clamped to 2 cores: one writer, one capture thread
    assert split_threads(1, 2) == (1, 1)  # the least a pipeline with helpers runs on
    assert per_process(8, 4) == 2 and per_process(2, 4) == 1


def test_thread_env_covers_every_pool_and_keeps_a_users_wait_policy():
    env = thread_env(1, env={})
    for var in ("DRAFTFLOW_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        assert env[var] == "1", var
    assert env["TOKENIZERS_PARALLELISM"] == "false" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert thread_env(3, env={"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert thread_env(3, env={})["TOKENIZERS_PARALLELISM"] == "true"
    with pytest.raises(ValueError):
        thread_env(0)


def test_busy_threads_counts_threads_that_did_real_work():
    assert busy_threads({1: 10.0, 2: 9.0, 3: 0.01, 4: 0.0}) == 2
    assert busy_threads({1: 0.0}) == 1 and busy_threads({}) == 0


@pytest.mark.parametrize("n", [1, 2])
def test_torch_imported_after_apply_runs_on_exactly_n_threads(n):
    """Stages import torch lazily: its intra- and inter-op pools still get n, and a parallel
    matmul loop never runs more than n threads at once (process CPU time over wall time).

    Distinct busy threads are no measure of this: matmul (BLAS) and elementwise ops (OpenMP)
    may each run a pool of n threads that take turns, three distinct threads for n = 2."""
    out = run_python(f"""
        import importlib.util, os, time
        from draftflow.threads import apply_threads, usage_line
        apply_threads({n})
        assert importlib.util.find_spec("torch")  # transformers asks first, imports later
        import torch
        a = torch.randn(512, 512)
        start_cpu, start_wall = sum(os.times()[:2]), time.perf_counter()
        for _ in range(150):
            a = torch.tanh(a @ a.T / 512)
        cpu, wall = sum(os.times()[:2]) - start_cpu, time.perf_counter() - start_wall
        print(usage_line({n}))
        print(f"concurrency {{cpu / wall:.3f}}")
    """)
    usage = USAGE_RE.search(out).groupdict()
    assert int(usage["intra"]) == n and int(usage["inter"]) == n, out
    concurrency = float(re.search(r"concurrency ([\d.]+)", out).group(1))
    # a busy machine only lowers it; 10% + 0.1 for the clock ticks of os.times
    assert concurrency <= n * 1.1 + 0.1, out


def test_build_target_weights_do_not_depend_on_the_jobs_threads(tmp_path: Path):
    """`draftflow --threads 3 build-target` sizes the job's pools to 3 but builds on one thread:
    the same bytes as a build in this process."""
    proc = subprocess.run(
        [sys.executable, "-m", "draftflow.cli", "--threads", "3", "build-target",
         "--settings", '{"train_steps": 3, "num_hidden_layers": 2}', "--output", str(tmp_path / "t3")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    usage = USAGE_RE.search(proc.stderr).groupdict()
    assert (usage["n"], usage["intra"], usage["inter"], usage["busy"]) == ("3", "3", "3", "1"), proc.stderr[-2000:]
    assert re.search(r"progress: 3/3 steps \(100\.0%\), .* ETA 0s \| loss ", proc.stderr), proc.stderr[-2000:]

    build_target(BuiltinSettings.from_dict(TINY_BUILD), tmp_path / "here")
    assert (tmp_path / "t3" / "model.safetensors").read_bytes() == (tmp_path / "here" / "model.safetensors").read_bytes()
