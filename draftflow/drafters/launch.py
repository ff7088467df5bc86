"""`draftflow launch-train`: run `draftflow train` under torchrun, on one node or many.

The command depends on where it runs:

- 1 process in total: `python -m draftflow.cli train …` as one plain process (no torchrun);
- one node: `torchrun --standalone --nproc-per-node P …` (a free local port, no rendezvous
  server to configure; several such jobs can share a host);
- N > 1 nodes, inside a SLURM allocation of N nodes: one torchrun per node, started by
  `srun --nodes=N --ntasks-per-node=1`, meeting at a c10d rendezvous on the allocation's
  first host: `torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
  --rdzv-endpoint <first host>:<port> --rdzv-id <job id> …`.

P is the GPUs per node, or, with 0 GPUs, the number of CPU processes (gloo backend). The
job's CPU threads (`draftflow --threads N`) are shared by the node's P processes: each gets
N // P (at least 1), through $DRAFTFLOW_THREADS and the OpenMP/MKL variables.
torchrun is run as `<this python> -m torch.distributed.run` so that every node uses the
same environment as the caller. The launcher exports `DRAFTFLOW_DIST_BACKEND` (`nccl` with
GPUs, `gloo` without) for the trainer's `torch.distributed.init_process_group`.

SLURM facts used here: Snakemake's SLURM job step removes every `SLURM_*` variable except
`SLURM_JOB_ID` before running a rule's command, so the node list and CPU count are read
from `scontrol show job` when the variables are missing. A multi-node rule must be
submitted as an "mpi" job (resource `mpi`), so that its command runs once in the batch
script and our `srun` can start one task per node (see docs/cluster.md).

`python -m draftflow.drafters.launch` (what `--check` runs under the launcher) is a distributed
smoke test: every process all-reduces its rank and prints what it saw.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Mapping, Sequence

from draftflow.errors import DraftflowError
from draftflow.threads import default_threads, per_process, thread_env

log = logging.getLogger(__name__)

BACKEND_ENV = "DRAFTFLOW_DIST_BACKEND"
PORT_ENV = "DRAFTFLOW_RDZV_PORT"
TRAIN_ARGS = ["-m", "draftflow.cli", "train"]
CHECK_ARGS = ["-m", "draftflow.drafters.launch"]


class LaunchError(DraftflowError):
    """A launch that cannot work as asked (e.g. several nodes outside a SLURM allocation)."""


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list, as `scontrol show hostnames` prints it first.

    `gpu[007-009,012],login1` -> `gpu007`; `node1,node2` -> `node1`; `a[1-2]b[3-4]` -> `a1b3`.
    """
    text = nodelist.strip()
    if not text:
        raise LaunchError("empty SLURM node list")
    # The first comma outside brackets ends the first host expression.
    depth = 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            text = text[:i]
            break
    # Each bracket group contributes the start of its first range: [007-009,012] -> 007.
    host = re.sub(r"\[([^\],\-]+)[^\]]*\]", r"\1", text)
    if any(c in host for c in "[],"):
        raise LaunchError(f"cannot read the SLURM node list {nodelist!r}")
    return host


def rdzv_port(job_id: str, env: Mapping[str, str]) -> int:
    """The rendezvous port: $DRAFTFLOW_RDZV_PORT, else 20000 + job id mod 10000.

    Derived from the job id so that two multi-node jobs whose first host is the same
    do not collide, and below Linux's ephemeral range (32768+).
    """
    if env.get(PORT_ENV):
        return int(env[PORT_ENV])
    digits = re.sub(r"\D", "", job_id) or "0"
    return 20000 + int(digits) % 10000


def slurm_job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o <id>` as a dict (NodeList, NumNodes, CPUs/Task, …)."""
    if shutil.which("scontrol") is None:
        raise LaunchError(
            f"SLURM_JOB_ID={job_id} is set but 'scontrol' is not on PATH: "
            "run inside a SLURM job on a host with the SLURM client tools"
        )
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise LaunchError(f"scontrol show job {job_id} failed: {out.stderr.strip()}")
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def _slurm_allocation(env: Mapping[str, str]) -> tuple[str, str, int | None, int | None]:
    """(job id, node list, node count, CPUs per task) of the SLURM job we run in."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise LaunchError(
            "more than one node needs a SLURM allocation of that many nodes, but "
            "SLURM_JOB_ID is not set: run the workflow with '--profile profiles/slurm' "
            "(or inside 'salloc'/'sbatch --nodes=N'), or set train.nodes: 1"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    cpus = env.get("SLURM_CPUS_PER_TASK")
    if not nodelist:  # Snakemake's job step strips SLURM_*: ask slurmctld
        fields = slurm_job_fields(job_id)
        nodelist, nnodes = fields.get("NodeList", ""), fields.get("NumNodes")
        cpus = fields.get("CPUs/Task")
    return job_id, nodelist, _int_or_none(nnodes), _int_or_none(cpus)


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def torchrun_command(
    nprocs_per_node: int,
    nnodes: int,
    script_args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    gpus_per_node: int | None = None,
    slurm: bool | None = None,
) -> list[str]:
    """The command that starts `script_args` (`file.py …` or `-m module …`) under torchrun.

    nprocs_per_node: processes per node (GPUs per node, or CPU processes with 0 GPUs).
    nnodes: nodes; more than one needs a SLURM allocation of exactly that many nodes.
    env: where SLURM variables are read (default: os.environ).
    gpus_per_node: GPUs each srun task gets (multi-node only; default nprocs_per_node).
    slurm: force (True) or forbid (False) the srun + c10d form; default: when nnodes > 1.
    """
    env = os.environ if env is None else env
    if nprocs_per_node < 1 or nnodes < 1:
        raise LaunchError(
            f"need at least 1 process per node and 1 node, got {nprocs_per_node} and {nnodes}"
        )
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    use_slurm = nnodes > 1 if slurm is None else slurm
    if not use_slurm:
        if nnodes > 1:
            raise LaunchError(f"{nnodes} nodes need SLURM (srun); got slurm=False")
        return [*torchrun, "--standalone", f"--nproc-per-node={nprocs_per_node}", *script_args]

    job_id, nodelist, alloc_nodes, cpus_per_task = _slurm_allocation(env)
    if alloc_nodes is not None and alloc_nodes != nnodes:
        raise LaunchError(
            f"asked for {nnodes} nodes but SLURM job {job_id} has {alloc_nodes} "
            f"({nodelist}): make the rule request nodes={nnodes} (train.nodes in the config)"
        )
    host = first_host(nodelist)
    gpus = nprocs_per_node if gpus_per_node is None else gpus_per_node
    srun = ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1"]
    if cpus_per_task:
        srun.append(f"--cpus-per-task={cpus_per_task}")
    if gpus > 0:
        srun.append(f"--gres=gpu:{gpus}")
    return [
        *srun,
        *torchrun,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nprocs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={host}:{rdzv_port(job_id, env)}",
        f"--rdzv-id={job_id}",
        *script_args,
    ]


def launch_command(
    nnodes: int,
    gpus_per_node: int,
    cpu_procs: int,
    script_args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    slurm: bool | None = None,
) -> list[str]:
    """What `launch-train` runs: plain python for 1 process in total, else torchrun."""
    nprocs = gpus_per_node if gpus_per_node > 0 else cpu_procs
    if nnodes * nprocs == 1 and not slurm:
        return [sys.executable, *script_args]
    return torchrun_command(
        nprocs, nnodes, script_args, env, gpus_per_node=gpus_per_node, slurm=slurm
    )


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.description = (
        "Run `draftflow train ARGS` under torchrun: one process per GPU on each node "
        "(or CPU processes with --gpus-per-node 0); several nodes through srun inside "
        "a SLURM allocation."
    )
    parser.usage = "draftflow launch-train --nodes N --gpus-per-node G [--cpu-procs P] -- TRAIN_ARGS…"
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs per node; 0 = CPU processes (gloo)"
    )
    parser.add_argument(
        "--cpu-procs", type=int, default=1, help="processes per node when --gpus-per-node is 0"
    )
    parser.add_argument(
        "--slurm-rendezvous",
        action="store_true",
        help="use srun + c10d rendezvous even on one node (to test a SLURM setup)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="instead of training, run an all-reduce over every process and print the world",
    )
    parser.add_argument("--print", action="store_true", help="print the command, do not run it")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: draftflow train arguments")


def main(args: argparse.Namespace) -> int:
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if args.nodes < 1 or args.gpus_per_node < 0 or args.cpu_procs < 1:
        raise LaunchError("--nodes and --cpu-procs must be >= 1 and --gpus-per-node >= 0")
    script = CHECK_ARGS if args.check else TRAIN_ARGS
    cmd = launch_command(
        args.nodes, args.gpus_per_node, args.cpu_procs, [*script, *train_args],
        slurm=True if args.slurm_rendezvous else None,
    )
    backend = "nccl" if args.gpus_per_node > 0 else "gloo"
    if args.print:
        print(f"{BACKEND_ENV}={backend} {shlex.join(cmd)}")
        return 0
    nprocs = args.gpus_per_node if args.gpus_per_node > 0 else args.cpu_procs
    # the job's threads, shared by this node's processes
    threads = per_process(getattr(args, "threads", None) or default_threads(), nprocs)
    log.info("launching: %s (%d CPU thread(s) per process)", shlex.join(cmd), threads)
    env = {**os.environ, **thread_env(threads), BACKEND_ENV: backend}
    # Replace this process: signals (Snakemake cancelling the job, scancel) reach
    # torchrun / srun directly, and the exit status is theirs.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached


def _allreduce_check() -> None:
    """Every process: all-reduce its rank over the group and print what it saw."""
    import socket

    import torch
    import torch.distributed as dist

    backend = os.environ.get(BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ:  # one plain process
        print(f"rank 0/1 on {socket.gethostname()}: no torch.distributed (single process)")
        return
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    total = torch.tensor([rank], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    expected = world * (world - 1) // 2
    line = (
        f"rank {rank}/{world} on {socket.gethostname()} backend={backend} "
        f"local_rank={os.environ.get('LOCAL_RANK')} threads={torch.get_num_threads()} "
        f"allreduce_sum={int(total)} "
        f"expected={expected}\n"
    )
    os.write(1, line.encode())  # one write: lines of concurrent ranks never interleave
    dist.destroy_process_group()
    if int(total) != expected:
        sys.exit(f"all-reduce gave {int(total)}, expected {expected}")


if __name__ == "__main__":
    _allreduce_check()
