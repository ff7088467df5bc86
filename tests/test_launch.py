"""draftflow.drafters.launch: the torchrun / srun command for 1 process, one node, several nodes;
and a real 2-process gloo run through the launcher."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draftflow.drafters.launch import LaunchError, first_host, launch_command, torchrun_command

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "draftflow.cli", "train", "--settings", "{}"]
LAUNCH_TRAIN = [sys.executable, "-m", "draftflow.cli", "launch-train"]


def test_one_node_is_standalone_torchrun():
    cmd = torchrun_command(4, 1, TRAIN, env={})
    assert cmd == [*TORCHRUN, "--standalone", "--nproc-per-node=4", *TRAIN]


def test_one_process_in_total_is_a_plain_process():
    assert launch_command(1, 0, 1, TRAIN, env={}) == [sys.executable, *TRAIN]
    assert launch_command(1, 1, 1, TRAIN, env={}) == [sys.executable, *TRAIN]


def test_zero_gpus_runs_the_given_number_of_cpu_processes():
    assert launch_command(1, 0, 3, TRAIN, env={}) == [*TORCHRUN, "--standalone", "--nproc-per-node=3", *TRAIN]
    # GPUs, when given, set the process count; --cpu-procs is ignored
    assert "--nproc-per-node=8" in launch_command(1, 8, 3, TRAIN, env={})


def test_several_nodes_under_slurm_use_srun_and_c10d_on_the_first_host():
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_PER_TASK": "32",
    }
    cmd = torchrun_command(8, 2, TRAIN, env=env)
    assert cmd == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "--cpus-per-task=32", "--gres=gpu:8",
        *TORCHRUN,
        "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu007:24242", "--rdzv-id=4242",
        *TRAIN,
    ]


def test_several_nodes_of_cpu_processes_ask_for_no_gpu():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1,n2", "DRAFTFLOW_RDZV_PORT": "31000"}
    cmd = launch_command(2, 0, 4, TRAIN, env=env)
    assert not any(a.startswith("--gres") for a in cmd)
    assert "--nproc-per-node=4" in cmd and "--rdzv-endpoint=n1:31000" in cmd


def test_several_nodes_without_slurm_say_how_to_fix():
    with pytest.raises(LaunchError, match="profiles/slurm"):
        torchrun_command(8, 2, TRAIN, env={})


def test_allocation_with_other_node_count_is_refused():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "3"}
    with pytest.raises(LaunchError, match="asked for 2 nodes but SLURM job 9 has 3"):
        torchrun_command(8, 2, TRAIN, env=env)


HOSTLISTS = {
    "vm": "vm",
    "node1,node2": "node1",
    "gpu[007-009,012]": "gpu007",
    "gpu[012,007-009]": "gpu012",
    "a[1-2]b[3-4],c5": "a1b3",
    "rack1-n[10-11]": "rack1-n10",
}


@pytest.mark.parametrize("nodelist,host", HOSTLISTS.items())
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


# test_slurm.py checks these against scontrol itself, once its fixture has installed SLURM


def test_cli_prints_the_command_with_the_backend():
    proc = subprocess.run(
        [*LAUNCH_TRAIN, "--gpus-per-node", "0", "--cpu-procs", "2", "--print", "--", "--settings", "{}"],
        capture_output=True, text=True, check=True,
    )
    assert proc.stdout.startswith("DRAFTFLOW_DIST_BACKEND=gloo ")
    assert proc.stdout.rstrip().endswith("--standalone --nproc-per-node=2 -m draftflow.cli train --settings '{}'")


def test_two_cpu_processes_all_reduce_through_the_launcher():
    """A real torchrun with 2 gloo processes: each all-reduces its rank (0 + 1 = 1), and the
    job's 2 CPU threads are shared: one torch thread per process."""
    proc = subprocess.run(
        [sys.executable, "-m", "draftflow.cli", "--threads", "2", "launch-train",
         "--gpus-per-node", "0", "--cpu-procs", "2", "--check"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(l for l in proc.stdout.splitlines() if l.startswith("rank "))
    assert len(lines) == 2, proc.stdout + proc.stderr
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank}/2 ") and "backend=gloo" in line, line
        assert "allreduce_sum=1 expected=1" in line, line
        assert " threads=1 " in line, line
