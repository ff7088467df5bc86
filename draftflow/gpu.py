"""Claim GPUs for one job on a shared host.

Locally, Snakemake's `--resources gpu=N` only limits how many GPU jobs run at once;
nothing tells a job *which* GPUs are its own. Each job therefore claims distinct
GPU ids itself, with one `flock` lock file per GPU in a host-wide folder, and sets
`CUDA_VISIBLE_DEVICES` before CUDA initializes. The kernel drops a `flock` when its
holder dies, so a killed job never leaves a GPU claimed.

Where a scheduler (SLURM) already set `CUDA_VISIBLE_DEVICES`, those ids are the job's:
if they are exactly as many as requested they are used as they are (the scheduler
made them exclusive; inside a cgroup every job may see the same id "0", so locking
them would serialize jobs for nothing); if there are more, the job claims among them.

Environment:
  DRAFTFLOW_GPU_LOCK_DIR     lock folder (default: <tmp>/draftflow-gpu-locks, per host)
  DRAFTFLOW_FAKE_GPU_COUNT   pretend the host has this many GPUs (tests on CPU machines)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from draftflow.errors import DraftflowError

log = logging.getLogger(__name__)

FAKE_GPU_COUNT_ENV = "DRAFTFLOW_FAKE_GPU_COUNT"
LOCK_DIR_ENV = "DRAFTFLOW_GPU_LOCK_DIR"


class GpuClaimError(DraftflowError):
    """GPUs that cannot be claimed: too few on the host, or none free before the timeout."""


@dataclass
class GpuClaim:
    """GPUs this process holds. `ids` are physical ids (as the host or scheduler names them)."""

    ids: list[str]
    source: str  # "none" (CPU), "scheduler" (CUDA_VISIBLE_DEVICES as given), "lock" (claimed here)
    lock_paths: list[Path] = field(default_factory=list)
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def device(self) -> str:
        return "cuda" if self.ids else "cpu"

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the last descriptor drops the flock
        self._fds.clear()


def default_lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "draftflow-gpu-locks")


def scheduler_visible_ids() -> list[str] | None:
    """The ids in CUDA_VISIBLE_DEVICES, or None when it is unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    ids = [part.strip() for part in value.split(",") if part.strip()]
    # CUDA ignores everything from the first negative id on ("-1" hides all GPUs).
    for i, part in enumerate(ids):
        if part.startswith("-"):
            return ids[:i]
    return ids


def host_gpu_ids() -> list[str]:
    """Physical GPU ids of this host, without initializing CUDA in this process."""
    fake = os.environ.get(FAKE_GPU_COUNT_ENV)
    if fake is not None:
        try:
            return [str(i) for i in range(int(fake))]
        except ValueError:
            raise GpuClaimError(f"{FAKE_GPU_COUNT_ENV}={fake!r} is not an integer") from None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]
    except (FileNotFoundError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        pass
    # torch.cuda.device_count() would fix the visible set for the process: ask NVML instead.
    try:
        import torch

        count = torch.cuda._device_count_nvml()
        return [str(i) for i in range(max(count, 0))]
    except Exception:
        return []


def warn_if_gpus_idle(stage: str, key: str, keep_cpu: str | None = None) -> None:
    """A stage about to run on the CPU of a host that has GPUs: say so once, with the key that
    moves it (the schema's 0 is the CPU default, so a GPU run that forgot it is silently slow);
    keep_cpu names the setting that chooses the CPU on purpose, where the stage has one."""
    ids = host_gpu_ids()
    if ids:
        quiet = f" (or {keep_cpu} to keep the CPU without this warning)" if keep_cpu else ""
        log.warning("%s runs on the CPU although this host has %d GPU(s): %s is 0. Set it to use them%s",
                    stage, len(ids), key, quiet)  # fmt: skip


def _lock_path(lock_dir: Path, gpu_id: str) -> Path:
    return lock_dir / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu_id)}.lock"


def _try_lock(path: Path) -> int | None:
    """Non-blocking exclusive flock on `path`; the open descriptor, or None if held elsewhere."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # Who holds it, for people reading the lock folder (the lock itself is the flock).
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {os.uname().nodename}\n".encode(), 0)
    return fd


def _holders(paths: list[Path]) -> str:
    parts = []
    for path in paths:
        with contextlib.suppress(OSError):
            parts.append(f"{path.stem}: pid {path.read_text().split()[0]}")
    return ", ".join(parts) or "unknown"


def _ensure_lock_dir(lock_dir: Path) -> None:
    if not lock_dir.exists():
        lock_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(lock_dir, 0o1777)  # shared by every user's jobs on this host, like /tmp


def _claim_among(
    candidates: list[str], n: int, lock_dir: Path, poll_s: float, timeout_s: float | None
) -> tuple[list[str], list[int], list[Path]]:
    """Lock n of `candidates` (all or nothing per attempt, so two jobs never deadlock)."""
    _ensure_lock_dir(lock_dir)
    paths = {gpu: _lock_path(lock_dir, gpu) for gpu in candidates}
    start = last_log = time.monotonic()
    logged = False
    while True:
        held: list[tuple[str, int]] = []
        for gpu in candidates:
            fd = _try_lock(paths[gpu])
            if fd is not None:
                held.append((gpu, fd))
                if len(held) == n:
                    return [g for g, _ in held], [fd for _, fd in held], [paths[g] for g, _ in held]
        for _, fd in held:
            os.close(fd)
        now = time.monotonic()
        if timeout_s is not None and now - start >= timeout_s:
            raise GpuClaimError(
                f"no {n} free GPU(s) among {candidates} after {timeout_s:.0f} s "
                f"(held by {_holders(list(paths.values()))}; lock folder {lock_dir})"
            )
        if not logged or now - last_log >= 60:
            log.info(
                "waiting for %d free GPU(s) among %s (held by %s; lock folder %s)",
                n, candidates, _holders(list(paths.values())), lock_dir,
            )
            logged, last_log = True, now
        time.sleep(poll_s)


def _warn_if_cuda_initialized() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        log.warning(
            "CUDA was initialized before the GPU claim: CUDA_VISIBLE_DEVICES cannot take "
            "effect any more in this process"
        )


@contextlib.contextmanager
def claim_gpus(
    n: int,
    lock_dir: str | Path | None = None,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
) -> Iterator[GpuClaim]:
    """Hold `n` distinct GPUs for the duration of the block (n == 0: CPU, nothing claimed).

    Sets CUDA_VISIBLE_DEVICES to the claimed ids (restored on exit), so call it before
    anything initializes CUDA. Waits, logging, while none are free; `timeout_s` bounds the wait.
    """
    if n < 0:
        raise ValueError(f"cannot claim {n} GPUs")
    if n == 0:
        yield GpuClaim(ids=[], source="none")
        return
    lock_dir = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    visible = scheduler_visible_ids()
    if visible is not None and len(visible) == n:
        claim = GpuClaim(ids=visible, source="scheduler")
    else:
        candidates = visible if visible is not None else host_gpu_ids()
        where = "CUDA_VISIBLE_DEVICES" if visible is not None else "this host"
        if not candidates:
            log.warning("%d GPU(s) requested but %s has none: running on CPU", n, where)
            yield GpuClaim(ids=[], source="none")
            return
        if len(candidates) < n:
            raise GpuClaimError(
                f"{n} GPU(s) requested per job but {where} has only {len(candidates)} "
                f"({','.join(candidates)}): lower extract.gpus_per_job"
            )
        ids, fds, paths = _claim_among(candidates, n, lock_dir, poll_s, timeout_s)
        claim = GpuClaim(ids=ids, source="lock", lock_paths=paths, _fds=fds)

    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    _warn_if_cuda_initialized()
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(claim.ids)
    log.info("claimed physical GPU(s) %s (%s)", ",".join(claim.ids), claim.source)
    try:
        yield claim
    finally:
        claim.release()
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
