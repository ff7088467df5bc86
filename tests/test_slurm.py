"""The profiles, and the embedded default pipeline through a real SLURM
(`snakemake --profile profiles/slurm`).

The cluster is the single-node SLURM of scripts/slurm/setup_local_slurm.sh (started here
if it is not up; skipped only when it cannot be installed: not root, or no apt/network).
Its node has 2 GPUs as GRES; on a host without GPUs these are fake device nodes, so GPU
jobs are scheduled and accounted like on a GPU cluster while torch finds no CUDA and the
jobs run on CPU. Accounting goes through slurmdbd, so `sacct` shows what each job asked for.

Run just this:  .venv/bin/pytest -m slurm -v
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, copy_workflow, load_default_config, write_config
from draftflow.drafters.launch import first_host
from test_launch import HOSTLISTS

SETUP = REPO / "scripts" / "slurm" / "setup_local_slurm.sh"
# setup_local_slurm.sh exit codes that mean "SLURM cannot be installed on this host".
CANNOT_INSTALL = {10: "not root", 11: "packages cannot be installed (no apt-get or no network)"}
PARTITION = "debug"  # the partition setup_local_slurm.sh creates


STOP = REPO / "scripts" / "slurm" / "stop_local_slurm.sh"
# The daemons setup_local_slurm.sh starts, by pidfile, in the order they are stopped.
DAEMONS = {
    "slurmd": "/run/slurmd.pid",
    "slurmctld": "/run/slurmctld.pid",
    "slurmdbd": "/run/slurmdbd.pid",
    "mariadbd": "/run/mysqld/mysqld.pid",
    "munged": "/run/munge/munged.pid",
}
# Test sessions share the cluster: each holds LOCK shared while it uses it and appends the
# daemons it started to STARTED; the last one out (exclusive lock) stops all of those.
# Daemons that ran before any test (someone's own SLURM) are never in STARTED.
LOCK = Path("/run/draftflow-slurm-test.lock")
STARTED = Path("/run/draftflow-slurm-test.started")


def running_daemons() -> dict[str, int]:
    """name -> pid of the daemons whose pidfile names a live process."""
    out = {}
    for name, pidfile in DAEMONS.items():
        try:
            pid = int(Path(pidfile).read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            continue
        out[name] = pid
    return out


def stop_started_daemons(lock) -> list[str]:
    """Leave the cluster: the last session using it stops what test sessions started."""
    fcntl.flock(lock, fcntl.LOCK_UN)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return []  # another test session still uses the cluster; it stops the daemons
    try:
        names = sorted(set(STARTED.read_text().split()) & set(DAEMONS), key=list(DAEMONS).index)
    except FileNotFoundError:
        names = []
    if names:
        proc = subprocess.run(["bash", str(STOP), "--cancel-jobs", *names], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    STARTED.unlink(missing_ok=True)
    fcntl.flock(lock, fcntl.LOCK_UN)
    return names


class Cluster:
    """The running local SLURM; `leave()` stops the daemons this test session started."""

    def __init__(self, lock, started: dict[str, int]):
        self.lock, self.started, self.stopped = lock, started, None

    def leave(self) -> list[str]:
        if self.stopped is None:
            self.stopped = stop_started_daemons(self.lock)
            self.lock.close()
        return self.stopped


@pytest.fixture(scope="module")
def slurm_cluster():
    """Make sure the local SLURM runs (idempotent: about 1 s when it already does); afterwards
    stop the daemons it had to start (packages and configuration stay for the next run)."""
    try:
        lock = open(LOCK, "a")
    except OSError as e:  # not root: setup_local_slurm.sh could not run either
        pytest.skip(f"SLURM cannot be installed here (cannot write {LOCK}: {e})")
    fcntl.flock(lock, fcntl.LOCK_SH)
    before = running_daemons()
    cluster = Cluster(lock, {})
    try:
        try:
            proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{SETUP.name} took more than 15 min:\n{e.stdout}\n{e.stderr}")
        finally:
            cluster.started = {n: p for n, p in running_daemons().items() if before.get(n) != p}
            if cluster.started:
                with open(STARTED, "a") as f:  # one short append: atomic beside other sessions
                    f.write(" ".join(cluster.started) + "\n")
        if proc.returncode in CANNOT_INSTALL:
            pytest.skip(f"SLURM cannot be installed here ({CANNOT_INSTALL[proc.returncode]}): {proc.stderr.strip()}")
        assert proc.returncode == 0, f"{SETUP.name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        yield cluster
    finally:
        cluster.leave()


def small_config() -> dict:
    """The embedded default, shrunk so that every stage runs in seconds, extract on 1 GPU."""
    config = copy.deepcopy(load_default_config())
    config["target"]["builtin"] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "train_steps": 2,
        "train_seq_len": 32,
        "train_batch_size": 2,
    }
    # One chat dataset and the regenerated one: every rule still runs, with the fewest jobs (each
    # SLURM job costs ~6-10 s of start-up here, and the plugin polls between them).
    config["datasets"] = {
        "chat": {**config["datasets"]["chat"], "shards": 1, "max_samples": 4},
        "prompts": {**config["datasets"]["prompts"], "max_samples": 4},
    }
    config["regenerate"]["max_new_tokens"] = 8
    config["merge"].update(max_seq_len=128, samples_per_range=6, min_eval_samples=2)
    config["extract"]["gpus_per_job"] = 1  # -> resources gpu=1 -> sbatch --gpus=1
    config["train"].update(epochs=1, draft_vocab_size=128, batch_tokens=512)
    config["evaluate"].update(max_prompts=2, max_new_tokens=8)
    return config


def sacct_jobs(prefix: str, since: str) -> list[dict[str, str]]:
    """This run's jobs (job name starts with `prefix`) as sacct rows."""
    fields = "JobID,JobName,Comment,State,Partition,ReqTRES,AllocTRES"
    out = subprocess.run(
        ["sacct", "-X", "-P", "-n", "-S", since, "-o", fields],
        capture_output=True, text=True, check=True,
    ).stdout
    rows = [dict(zip(fields.split(","), line.split("|"))) for line in out.splitlines() if line]
    return [r for r in rows if r["JobName"].startswith(prefix)]


def cancel_leftovers(prefix: str) -> None:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout
    ids = [i for i, name in (line.split(maxsplit=1) for line in out.splitlines()) if name.startswith(prefix)]
    if ids:
        subprocess.run(["scancel", *ids])


def tres(text: str) -> dict[str, str]:
    """'billing=1,cpu=1,gres/gpu=1,mem=600M,node=1' -> {'cpu': '1', 'gres/gpu': '1', …}"""
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def render_profile(path: Path, argv: list[str], env: dict[str, str]) -> dict:
    """The profile as Snakemake reads it (yte), for a Snakemake started with `argv`."""
    code = (
        "import json, sys, yte; sys.argv = json.loads(sys.argv[1]); "
        f"print(json.dumps(yte.process_yaml(open({str(path)!r}), require_use_yte=True)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argv)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout)


def test_default_profile_sets_host_limits_only_for_local_runs():
    profile = REPO / "profiles" / "default" / "profile.yaml"
    env = {k: v for k, v in os.environ.items() if k != "SNAKEMAKE_PROFILE"}
    local = render_profile(profile, ["snakemake"], dict(env, CUDA_VISIBLE_DEVICES="0,3"))
    assert local["cores"] == "all" and local["resources"] == {"gpu": 2}
    assert render_profile(profile, ["snakemake"], dict(env, CUDA_VISIBLE_DEVICES=""))["resources"] == {"gpu": 0}
    # Snakemake applies profiles/default on top of a cluster profile, and its keys win:
    # a host limit there would cap every SLURM job at the login node's cores and GPUs.
    for argv in (
        ["snakemake", "--profile", "profiles/slurm"],
        ["snakemake", "--profile=profiles/slurm"],
        ["snakemake", "--executor", "slurm"],
        ["snakemake", "-e", "slurm-jobstep"],  # how the plugin runs a job's own Snakemake
    ):
        cluster = render_profile(profile, argv, dict(env, CUDA_VISIBLE_DEVICES="0,3"))
        assert "cores" not in cluster and "resources" not in cluster, argv
        assert cluster["rerun-incomplete"] is True
    cluster = render_profile(profile, ["snakemake"], dict(env, SNAKEMAKE_PROFILE="profiles/slurm"))
    assert "resources" not in cluster


def test_slurm_profile_takes_partition_and_account_from_sbatch_variables():
    profile = REPO / "profiles" / "slurm" / "profile.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBATCH_")}
    bare = render_profile(profile, ["snakemake"], env)
    assert bare["executor"] == "slurm" and bare["default-resources"] == {}
    given = render_profile(profile, ["snakemake"], dict(env, SBATCH_PARTITION="gpu", SBATCH_ACCOUNT="proj-1"))
    assert given["default-resources"] == {"slurm_partition": "'gpu'", "slurm_account": "'proj-1'"}


@pytest.mark.slurm
def test_default_pipeline_on_slurm(slurm_cluster, tmp_path: Path):
    wf = copy_workflow(tmp_path / "wf")
    config_path = write_config(wf, small_config(), "slurm-test.yaml")
    prefix = f"dftest{uuid.uuid4().hex[:8]}"
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    cmd = [
        sys.executable, "-m", "snakemake",
        "--profile", "profiles/slurm",
        "--configfile", str(config_path.relative_to(wf)),
        # Rules size threads from workflow.cores, which a cluster run must be given; the
        # test node has 2 CPUs, so no job may ask for more.
        "--cores", "2",
        "--slurm-init-seconds-before-status-checks", "2",
        "--slurm-jobname-prefix", prefix,
    ]
    env = dict(os.environ, SBATCH_PARTITION=PARTITION, PYTHONUNBUFFERED="1")
    env.pop("DRAFTFLOW_VLLM_PYTHON", None)  # the export gate checks statically here (test_serve_check serves)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=wf, env=env, capture_output=True, text=True, timeout=1500)
    finally:
        cancel_leftovers(prefix)
    if proc.returncode != 0:
        # The plugin keeps the SLURM logs of failed jobs: the job step's own errors are there.
        slurm_logs = "".join(
            f"\n--- {p.relative_to(wf)} ---\n{p.read_text()[-2500:]}"
            for p in sorted((wf / ".snakemake" / "slurm_logs").rglob("*.log"))
        )
        pytest.fail(
            f"snakemake on SLURM failed ({proc.returncode}) after {time.monotonic() - t0:.0f}s:\n"
            f"{proc.stdout[-6000:]}{proc.stderr[-6000:]}\nSLURM logs of failed jobs:{slurm_logs}"
        )

    # Every target of the default `all` rule exists and is up to date.
    assert (wf / "results" / "hidden_states" / "data_config.json").is_file()
    dry = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", str(config_path.relative_to(wf))],
        cwd=wf, capture_output=True, text=True, timeout=300,
    )
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-4000:]

    # Every job went through SLURM, and sacct shows it with the resources it asked for.
    submitted = proc.stdout.count("has been submitted with SLURM jobid") + proc.stderr.count(
        "has been submitted with SLURM jobid"
    )
    jobs: list[dict[str, str]] = []
    for _ in range(30):  # slurmctld hands finished jobs to slurmdbd asynchronously
        jobs = sacct_jobs(prefix, since)
        if len(jobs) >= submitted:
            break
        time.sleep(1)
    assert submitted >= 5 and len(jobs) == submitted, (submitted, jobs)
    for job in jobs:
        assert job["State"] == "COMPLETED", job
        assert job["Partition"] == PARTITION, job  # from $SBATCH_PARTITION via the profile
    # Extraction asks for extract.gpus_per_job; evaluation runs the target too and takes
    # one GPU when extraction has them.
    gpu_rules = ("rule_extract", "rule_evaluate")
    extract = [j for j in jobs if j["Comment"].startswith(gpu_rules)]
    others = [j for j in jobs if not j["Comment"].startswith(gpu_rules)]
    assert sum(j["Comment"].startswith("rule_extract") for j in extract) >= 2, [j["Comment"] for j in jobs]
    for job in extract:
        assert tres(job["ReqTRES"]).get("gres/gpu") == "1", job
        assert tres(job["AllocTRES"]).get("gres/gpu") == "1", job
    for job in others:  # CPU stages ask for no GPU
        assert "gres/gpu" not in tres(job["ReqTRES"]), job


@pytest.mark.slurm
def test_first_host_agrees_with_scontrol(slurm_cluster):
    """draftflow's node-list parser (the rendezvous host of a multi-node launch) against
    `scontrol show hostnames`, here where the fixture has installed SLURM's client tools."""
    for nodelist in HOSTLISTS:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        assert first_host(nodelist) == out.stdout.split()[0], nodelist


@pytest.mark.slurm
def test_leaving_stops_every_daemon_the_tests_started(slurm_cluster):
    """Last in this module: the machine is left as the tests found it (daemons that ran
    before stay; packages and configuration stay, so the next run starts in seconds)."""
    started = dict(slurm_cluster.started)
    stopped = slurm_cluster.leave()
    if stopped == [] and STARTED.exists():
        pytest.skip("another test session still uses the local SLURM; it stops the daemons")
    assert set(started) <= set(stopped)
    still = running_daemons()
    for name, pid in started.items():
        assert name not in still, f"{name} (pid {pid}) still runs"
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) still runs"
