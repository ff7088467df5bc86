"""A job's CPU threads: every stage uses exactly the `threads` its rule declares.

Rules run `draftflow --threads {threads} <stage> …`; `apply_threads(n)` runs before the stage
module is imported and sizes every pool a stage may start:

- torch intra-op and inter-op pools (`torch.set_num_threads`, `set_num_interop_threads`),
  and OpenMP / MKL / OpenBLAS / Arrow through their environment variables, which also reach
  child processes (torchrun ranks, DataLoader workers);
- HF tokenizers (Rust/rayon): `RAYON_NUM_THREADS`, parallelism off with one thread;
- OpenMP threads wait passively (`OMP_WAIT_POLICY=PASSIVE`, unless set): a spinning
  thread at a barrier holds a core that a descheduled sibling needs, and on a machine with
  other busy processes that made a 2-thread build 5-9x slower than with 1 thread.

Stages split their `n` between pools that run at the same time: extraction's writer pool
and the capture (`split_threads`), training's DataLoader workers and the training loop, the
torchrun processes of one node (`DRAFTFLOW_THREADS` per process). zstd compresses on the
calling thread (no zstd worker threads anywhere).

Floating-point results on CPU can depend on the intra-op thread count (elementwise kernels
run a vectorized body and a scalar tail per thread's chunk, and the two round differently;
SiLU differs in the last bit with 3 threads on the builtin target's shapes), so stages that
promise bit-identical results pin their compute to one thread (`build-target`).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

THREADS_ENV = "DRAFTFLOW_THREADS"  # the job's threads, read by child `draftflow` processes
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "RAYON_NUM_THREADS",  # HF tokenizers
)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a SLURM or cgroup CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """$DRAFTFLOW_THREADS (set for child processes of a job), else every available CPU."""
    value = os.environ.get(THREADS_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else available_cpus()


def thread_env(n: int, env: dict | None = None) -> dict[str, str]:
    """The environment variables that give a process (and its children) n threads."""
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    out = {var: str(n) for var in (THREADS_ENV, *THREAD_ENV_VARS)}
    out["TOKENIZERS_PARALLELISM"] = "true" if n > 1 else "false"
    # read when libgomp loads (torch import); a user's own choice wins
    out["OMP_WAIT_POLICY"] = (env if env is not None else os.environ).get("OMP_WAIT_POLICY", "PASSIVE")
    return out


def first_cpus(n: int) -> str:
    """The first n CPUs of this process's affinity mask (e.g. a SLURM CPU set), as "0,1,…":
    the form of VLLM_CPU_OMP_THREADS_BIND. vLLM's CPU build binds its worker's OpenMP threads
    itself, and its "auto" takes whole NUMA nodes, less cores it reserves for its other processes."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus[: max(1, min(int(n), len(cpus)))])


def vllm_cpu_env(n: int) -> dict[str, str]:
    """A vLLM server within a job of n threads: its worker on n - 1 of the job's CPUs, one left
    for its API server and engine core (one thread in all when n is 1)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": first_cpus(max(1, n - 1))}


def apply_threads(n: int) -> None:
    """Size every thread pool of this process and its children to `n` (call before stage imports)."""
    os.environ.update(thread_env(n))
    for hook in [h for h in sys.meta_path if isinstance(h, _TorchThreadsOnImport)]:
        sys.meta_path.remove(hook)
    if "torch" in sys.modules:  # already imported: its pools were sized from the old environment
        set_torch_threads(n)
    else:  # torch caps OMP_NUM_THREADS at the core count and has no variable for inter-op
        sys.meta_path.insert(0, _TorchThreadsOnImport(n))


class _TorchThreadsOnImport(importlib.abc.MetaPathFinder):
    """Sizes torch's pools right after torch is imported (stages import it lazily)."""

    def __init__(self, n: int):
        self.n = n

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        # Also asked by `importlib.util.find_spec("torch")` (transformers' availability check),
        # which imports nothing: the hook stays until torch really executes.
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None  # found elsewhere: imported without the hook (env variables still apply)
        run = spec.loader.exec_module

        def exec_module(module) -> None:  # on this one loader instance only
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            set_torch_threads(self.n)

        spec.loader.exec_module = exec_module
        return spec


def set_torch_threads(n: int) -> None:
    """torch's intra-op pool to n; its inter-op pool too, where it is not started yet."""
    import torch

    torch.set_num_threads(n)
    if torch.get_num_interop_threads() != n:
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:  # only possible before any inter-op work ran; ours never uses it
            log.debug("torch inter-op pool already started with %d threads", torch.get_num_interop_threads())


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with n torch intra-op threads (fewer than the job's: e.g. for bit-identical results)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def split_threads(n: int, helpers: int) -> tuple[int, int]:
    """(compute, helpers) threads out of a job's n, for helper threads or processes (writers,
    DataLoader workers) that run beside the compute: helpers get at most n - 1, compute the rest;
    at least one each, so n = 1 gives (1, 1) when helpers are asked for."""
    if helpers <= 0:
        return n, 0
    helpers = max(1, min(helpers, n - 1))
    return max(1, n - helpers), helpers


def per_process(n: int, processes: int) -> int:
    """Threads of each of `processes` processes sharing a job's n (at least 1)."""
    return max(1, n // max(1, processes))


# ---------------------------------------------------------------- what the job really used


def thread_cpu_seconds(pid: int | str = "self") -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of a process, from /proc (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def busy_threads(cpu: dict[int, float], share: float = 0.1) -> int:
    """Threads that did a real part of the work: at least `share` of the busiest one's CPU time."""
    if not cpu:
        return 0
    top = max(cpu.values())
    return sum(t >= share * top for t in cpu.values()) if top > 0 else 1


def usage_line(n: int) -> str:
    """One log line: the threads asked for and what this process's pools and threads show."""
    parts = [f"{n} CPU thread(s)"]
    if "torch" in sys.modules:
        import torch

        parts.append(f"torch intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}")
    if Path("/proc/self/task").is_dir():
        cpu = thread_cpu_seconds()
        parts.append(f"threads that used CPU {busy_threads(cpu)} of {len(cpu)} live")
    return "; ".join(parts)
