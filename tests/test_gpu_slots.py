"""GPU slot claiming (draftflow.gpu) with fake GPU ids: real processes, real flock locks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from draftflow.gpu import FAKE_GPU_COUNT_ENV, GpuClaimError, claim_gpus

# A child that claims GPUs, prints its CUDA_VISIBLE_DEVICES, and holds the claim until
# the file named by argv[3] exists.
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from draftflow.gpu import claim_gpus
    with claim_gpus(int(sys.argv[1]), sys.argv[2], poll_s=0.05, timeout_s=30) as claim:
        print(os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
        while not Path(sys.argv[3]).exists():
            time.sleep(0.05)
    """
)


def _env(fake_count: int | None = None, visible: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", FAKE_GPU_COUNT_ENV)}
    if fake_count is not None:
        env[FAKE_GPU_COUNT_ENV] = str(fake_count)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def _start_holder(n: int, lock_dir: Path, release: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(n), str(lock_dir), str(release)],
        env=env, stdout=subprocess.PIPE, text=True,
    )


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(FAKE_GPU_COUNT_ENV, raising=False)
    return monkeypatch


def test_two_processes_get_distinct_gpus(tmp_path):
    release = tmp_path / "release"
    env = _env(fake_count=2)
    a = _start_holder(1, tmp_path / "locks", release, env)
    b = _start_holder(1, tmp_path / "locks", release, env)
    try:
        ids = {a.stdout.readline().strip(), b.stdout.readline().strip()}
    finally:
        release.touch()
        a.wait(30), b.wait(30)
    assert ids == {"0", "1"}
    assert a.returncode == 0 and b.returncode == 0


def test_waits_while_all_busy_then_times_out(tmp_path, clean_env):
    clean_env.setenv(FAKE_GPU_COUNT_ENV, "1")
    release = tmp_path / "release"
    holder = _start_holder(1, tmp_path / "locks", release, _env(fake_count=1))
    try:
        assert holder.stdout.readline().strip() == "0"
        t0 = time.monotonic()
        with pytest.raises(GpuClaimError, match="no 1 free GPU"):
            with claim_gpus(1, tmp_path / "locks", poll_s=0.05, timeout_s=0.5):
                pass
        assert time.monotonic() - t0 >= 0.5
    finally:
        release.touch()
        holder.wait(30)


def test_killed_holder_releases_its_gpu(tmp_path, clean_env):
    clean_env.setenv(FAKE_GPU_COUNT_ENV, "1")
    holder = _start_holder(1, tmp_path / "locks", tmp_path / "never", _env(fake_count=1))
    assert holder.stdout.readline().strip() == "0"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(30)
    with claim_gpus(1, tmp_path / "locks", poll_s=0.05, timeout_s=5) as claim:
        assert claim.ids == ["0"] and claim.device == "cuda"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # restored on exit


def test_scheduler_ids_are_respected(tmp_path, clean_env):
    # A scheduler gave exactly the requested GPUs: used as they are, whatever the host has.
    clean_env.setenv(FAKE_GPU_COUNT_ENV, "8")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with claim_gpus(2, tmp_path / "locks") as claim:
        assert claim.ids == ["5", "7"] and claim.source == "scheduler"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"


def test_claims_only_among_visible_ids(tmp_path):
    # More visible ids than requested: two jobs claim distinct ones, never outside the list.
    release = tmp_path / "release"
    env = _env(fake_count=8, visible="3,6")
    a = _start_holder(1, tmp_path / "locks", release, env)
    b = _start_holder(1, tmp_path / "locks", release, env)
    try:
        ids = {a.stdout.readline().strip(), b.stdout.readline().strip()}
    finally:
        release.touch()
        a.wait(30), b.wait(30)
    assert ids == {"3", "6"}


def test_too_few_gpus_and_cpu_cases(tmp_path, clean_env):
    clean_env.setenv(FAKE_GPU_COUNT_ENV, "1")
    with pytest.raises(GpuClaimError, match="only 1"):
        with claim_gpus(2, tmp_path / "locks"):
            pass
    with claim_gpus(0, tmp_path / "locks") as claim:
        assert claim.device == "cpu" and "CUDA_VISIBLE_DEVICES" not in os.environ
    clean_env.setenv(FAKE_GPU_COUNT_ENV, "0")
    with claim_gpus(1, tmp_path / "locks") as claim:  # no GPUs on the host: CPU, with a warning
        assert claim.device == "cpu"


def test_a_cpu_stage_on_a_gpu_host_says_which_key_moves_it(monkeypatch, caplog):
    from draftflow.gpu import warn_if_gpus_idle

    monkeypatch.setenv(FAKE_GPU_COUNT_ENV, "2")
    with caplog.at_level("WARNING", logger="draftflow.gpu"):
        warn_if_gpus_idle("extraction", "extract.gpus_per_job")
    assert "extraction runs on the CPU although this host has 2 GPU(s): extract.gpus_per_job is 0" in caplog.text
    caplog.clear()
    monkeypatch.setenv(FAKE_GPU_COUNT_ENV, "0")  # a CPU-only host: nothing to say
    with caplog.at_level("WARNING", logger="draftflow.gpu"):
        warn_if_gpus_idle("extraction", "extract.gpus_per_job")
    assert caplog.text == ""
