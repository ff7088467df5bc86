"""The vllm capture engine on a CPU job (issue 23): what the real vLLM 0.32.0 CPU build showed.

- A CPU job (extract.gpus_per_job 0) was refused ("extract.tensor_parallel is 1 but this job
  holds 0 GPU(s)"): it now runs vLLM's CPU build with its OpenMP threads bound to the job's
  compute CPUs; GPU jobs keep their checks.
- `max_model_len` was extract.batch_tokens, which vLLM refuses above the target's
  max_position_embeddings (embedded default: 8192 > 2048): now the smaller of the two, and a
  longer sample is refused before anything runs, naming both limits.
- vLLM's `ExampleHiddenStatesConnector` pins host memory and queries a CUDA event: on the CPU
  build it fails (reproduced here with the real class); draftflow's connector copies on the CPU.
- A vLLM release whose numbering was not read in its source is checked at run time (id 0 must
  be the embeddings).

The engine tests stand a recording `vllm` module in for the real one (they run without vLLM);
the connector test runs both connectors' own code in the vLLM venv (tests/real_vllm.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from draftflow.engines import vllm_capture as V
from draftflow.engines.capture import CaptureError, make_capture_engine
from draftflow.hidden_states.extract import Record, check_sample_lengths
from real_vllm import VLLM_ENV, vllm_python

pytestmark = pytest.mark.slow  # a real vLLM (.venv-vllm): not in make test-fast

HIDDEN, LAYERS, VOCAB = 16, 8, 64
AUX = [1, 3, 4]


@pytest.fixture
def target(tmp_path) -> Path:
    """config.json as the builtin target's (max_position_embeddings 2048) + the two tensors we read."""
    path = tmp_path / "target"
    path.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "vocab_size": VOCAB,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    save_file({"model.norm.weight": torch.rand(HIDDEN) + 0.5, "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN)},
              str(path / "model.safetensors"))  # fmt: skip
    return path


class FakeLLM:
    """Records `vllm.LLM(**kwargs)`; `generate` writes connector files ({hidden_states, token_ids})
    for the ids it was asked for: id 0 = the embeddings, other ids random."""

    instances: list["FakeLLM"] = []
    embeddings_ok = True

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=False):
        extra = self.kwargs["kv_transfer_config"]["kv_connector_extra_config"]
        ids = self.kwargs["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        from safetensors.torch import load_file

        table = load_file(str(Path(self.kwargs["model"]) / "model.safetensors"))["model.embed_tokens.weight"]
        outputs = []
        for n, prompt in enumerate(prompts):
            tokens = torch.tensor(prompt["prompt_token_ids"])
            slots = [table[tokens] if i == 0 and FakeLLM.embeddings_ok else torch.randn(len(tokens), HIDDEN) for i in ids]
            path = Path(extra["shared_storage_path"]) / f"{n}.safetensors"
            save_file({"hidden_states": torch.stack(slots, 1).contiguous(), "token_ids": tokens}, str(path))
            outputs.append(SimpleNamespace(prompt_token_ids=tokens.tolist(), num_cached_tokens=0,
                                           kv_transfer_params={"hidden_states_path": str(path)}))  # fmt: skip
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    def install(version: str = "0.32.0"):
        module = types.ModuleType("vllm")
        module.__version__ = version
        module.LLM = FakeLLM
        module.SamplingParams = lambda **kw: kw
        monkeypatch.setitem(sys.modules, "vllm", module)
        FakeLLM.instances.clear()
        FakeLLM.embeddings_ok = True

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    return install


def settings(**extra) -> dict:
    base = {"engine": "vllm", "aux_layer_ids": AUX, "dtype": "float32", "batch_tokens": 8192, "gpus_per_job": 0,
            "tensor_parallel": 1, "vllm": {"version": "0.32.0"}}  # fmt: skip
    return {**base, **extra}


def test_a_cpu_job_runs_vllm_on_the_cpu_with_a_valid_max_model_len(target, fake_vllm, monkeypatch):
    fake_vllm()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    engine = make_capture_engine(settings(), target, ["cpu"])  # was: "holds 0 GPU(s)"
    try:
        kwargs = FakeLLM.instances[-1].kwargs
        # was 8192: vLLM 0.32 refuses a max_model_len above max_position_embeddings (2048)
        assert kwargs["max_model_len"] == 2048 and kwargs["max_num_batched_tokens"] == 8192
        kv = kwargs["kv_transfer_config"]
        assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (
            "DraftflowHiddenStatesConnector", "draftflow.engines.vllm_connector")  # fmt: skip
        assert kv["kv_connector_extra_config"]["num_writer_threads"] == 1
        ids = kwargs["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        assert ids == [2, 4, 5, 8]  # 0.32 was checked: no probe slot
        import os

        bind = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        assert len(bind.split(",")) == 1 and int(bind) in os.sched_getaffinity(0)
        batch = [np.arange(5, 12), np.arange(20, 23)]
        for ids_, hidden in zip(batch, engine.capture(batch)):
            assert hidden.shape == (len(ids_), 4, HIDDEN)
        with pytest.raises(CaptureError, match=r"2049 tokens exceed vLLM's max_model_len 2048 = min\(extract.batch_tokens 8192, the target's max_position_embeddings 2048\)"):
            engine.capture([np.zeros(2049, dtype=np.int64)])
        records = [Record("s0", "d", np.zeros(10, np.int64), np.zeros(10, np.uint8), 0),
                   Record("s1", "d", np.zeros(3000, np.int64), np.zeros(3000, np.uint8), 1)]  # fmt: skip
        with pytest.raises(CaptureError, match=r"train.jsonl:2: sample s1 has 3000 tokens, more than vLLM's max_model_len 2048"):
            check_sample_lengths(records, engine, Path("train.jsonl"))
        check_sample_lengths(records[:1], engine, Path("train.jsonl"))
    finally:
        engine.close()


def test_gpu_jobs_keep_their_checks(target, fake_vllm):
    fake_vllm()
    with pytest.raises(CaptureError, match=r"tensor_parallel is 2 but this job holds 1 GPU\(s\)"):
        make_capture_engine(settings(gpus_per_job=2, tensor_parallel=2), target, ["cuda:0"])
    with pytest.raises(CaptureError, match=r"tensor_parallel is 1 but this job holds 0 GPU\(s\)"):
        make_capture_engine(settings(gpus_per_job=1), target, ["cpu"])  # GPUs asked for, none claimed
    with pytest.raises(CaptureError, match="tensor_parallel is 2 on a CPU job"):
        make_capture_engine(settings(tensor_parallel=2), target, ["cpu"])
    assert V.vllm_device(settings(gpus_per_job=2, tensor_parallel=2), ["cuda:0", "cuda:1"], 2) == "cuda"
    assert V.vllm_device(settings(gpus_per_job=2, device="cpu"), ["cpu"], 1) == "cpu"


def test_an_unchecked_release_is_checked_at_run_time(target, fake_vllm):
    fake_vllm("0.34.1")
    engine = make_capture_engine(settings(vllm={"version": "0.34.1"}), target, ["cpu"])
    try:
        ids = FakeLLM.instances[-1].kwargs["speculative_config"]["draft_model_config"]["hf_config"]
        assert ids["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4, 5, 8]  # + id 0, the embeddings
        batch = [np.arange(5, 12), np.arange(20, 23)]
        assert [h.shape for h in engine.capture(batch)] == [(7, 4, HIDDEN), (3, 4, HIDDEN)]  # probe slot dropped
    finally:
        engine.close()
    fake_vllm("0.34.1")
    FakeLLM.embeddings_ok = False  # a release that numbers layers otherwise
    engine = make_capture_engine(settings(vllm={"version": "0.34.1"}), target, ["cpu"])
    try:
        with pytest.raises(CaptureError, match="layer id 0 is not the token embeddings"):
            engine.capture([np.arange(5, 12)])
    finally:
        engine.close()


CONNECTOR_SCRIPT = textwrap.dedent('''
    import fcntl, json, os, sys, tempfile
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from safetensors.torch import load_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector, ExampleHiddenStatesConnectorMetadata, PendingSave)
    from draftflow.engines.vllm_connector import DraftflowHiddenStatesConnector

    def worker(cls, folder):
        """A worker-side connector past register_kv_caches: the state the two methods read."""
        c = object.__new__(cls)
        # the hidden-states cache as vLLM lays it out: [blocks, slots (L), block size, H]
        c._kv_cache = torch.randn(6, 4, 16, 8)
        c._block_size, c._is_tp_rank_zero, c.use_lock, c._copy_stream = 16, True, True, None
        c._executor = ThreadPoolExecutor(1)
        c._lock_fds, c._req_futures, c._req_copy_events = {}, {}, {}
        c._accumulated_finished_req_ids = set()
        token_ids = torch.arange(100, 120)  # 20 tokens in blocks 3 and 1
        path = os.path.join(folder, "req.safetensors")
        c._connector_metadata = ExampleHiddenStatesConnectorMetadata(
            pending_saves=[PendingSave("req", path, token_ids, [3, 1])])
        return c, path, token_ids

    out = {}
    for cls in (ExampleHiddenStatesConnector, DraftflowHiddenStatesConnector):
        c, path, token_ids = worker(cls, tempfile.mkdtemp())
        try:
            done = c.get_finished({"req"})
            c._executor.shutdown(wait=True)
            data = load_file(path)
            want = torch.cat([c._kv_cache[3].transpose(0, 1), c._kv_cache[1].transpose(0, 1)])[:20]
            ok = torch.equal(data["hidden_states"], want) and torch.equal(data["token_ids"], token_ids)
            with open(path + ".lock") as f:  # the writer released its exclusive lock
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out[cls.__name__] = {"done": sorted(done[0] or []), "rows_equal": ok}
        except Exception as e:
            out[cls.__name__] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(out))
''')


def test_our_connector_copies_on_the_cpu_where_vllms_fails():
    python = vllm_python()
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(repo)}
    proc = subprocess.run([str(python), "-c", CONNECTOR_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    # vLLM's own connector on the CPU build: its copy stream, pinned memory and event need CUDA
    # (here torch.cuda.Stream fails first; inside vLLM's CPU worker, pin_memory=True did)
    assert re.search(r"pin_memory|CUDA", result["ExampleHiddenStatesConnector"]["error"])
    assert result["DraftflowHiddenStatesConnector"] == {"done": ["req"], "rows_equal": True}


def test_a_failed_connector_write_is_a_capture_error(tmp_path):
    """vLLM's writer thread logs a failed save and releases the lock anyway: the file is then
    missing or cut short, which must stop the sample with a CaptureError naming the file."""
    path = tmp_path / "req.safetensors"
    Path(f"{path}.lock").write_text("")
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # cut short
    with pytest.raises(CaptureError, match=r"req.safetensors: vLLM's hidden-states file cannot be read"):
        V.load_connector_file(path, wait_s=1)
    path.unlink()
    with pytest.raises(CaptureError, match=r"req.safetensors: vLLM's hidden-states file cannot be read"):
        V.load_connector_file(path, wait_s=1)
