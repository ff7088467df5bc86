"""An out-of-tree vLLM KV connector for `extract_hidden_states` that also runs on vLLM's CPU build.

vLLM loads this module itself (`kv_transfer_config = {"kv_connector": CONNECTOR_NAME,
"kv_connector_module_path": "draftflow.engines.vllm_connector", …}`, see
`vllm/distributed/kv_transfer/kv_connector/factory.py`), inside its engine-core process,
so it imports vLLM at module level; draftflow's own modules only name it.

Why. vLLM's `ExampleHiddenStatesConnector` (v1/example_hidden_states_connector.py, 0.32.0 and
0.33.0) copies a finished request's rows out of the hidden-states KV cache on a dedicated CUDA
stream into pinned host memory and reports the request finished once a CUDA event says the
copy is done. On the CPU build all three fail: `pin_memory=True` needs an accelerator,
`torch.cuda.Event()` / `.query()` need CUDA (tests/test_vllm_extract_real.py reproduces it).

What differs. Only the worker-side copy, and only when the cache is not on a CUDA device:
the rows are gathered from the cache with the same slot arithmetic, copied (`clone`: the
blocks are freed once the request is reported finished), and the write is handed to the
connector's writer pool behind the same exclusive flock on `<file>.lock`, with an already
completed stand-in for the CUDA event. On CUDA every call goes to the upstream class
unchanged. The scheduler side, file names, file format ({"hidden_states": [T, L, H],
"token_ids": [T]}) and lock protocol are the upstream ones.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

CONNECTOR_NAME = "DraftflowHiddenStatesConnector"


class _Done:
    """Stands in for the upstream connector's CUDA event once a CPU copy has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def slot_mapping_of(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of a request's blocks, in token order (upstream's arithmetic)."""
    blocks = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
    return (torch.arange(block_size, dtype=torch.long).reshape(1, -1) + blocks * block_size).flatten()


class DraftflowHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous copy when the cache is on the CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        num_tokens = pending.token_ids.shape[0]
        slots = slot_mapping_of(pending.block_ids, self._block_size)
        # A copy: the cache blocks are freed as soon as get_finished reports the request.
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"another hidden-states save for request {pending.req_id} is in flight")
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
