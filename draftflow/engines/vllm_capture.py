"""Capture engine on vLLM: `extract_hidden_states` with the hidden-states KV connector.

Design. vLLM (PR #33736; docs/features/speculative_decoding/extract_hidden_states.md)
extracts hidden states through a pseudo speculative method: `speculative_config =
{"method": "extract_hidden_states", "draft_model_config": {"hf_config":
{"eagle_aux_hidden_state_layer_ids": ids}}}` makes the target hand the listed layers to a
cache-only dummy drafter, and `ExampleHiddenStatesConnector` (vllm/distributed/kv_transfer/
kv_connector/v1/example_hidden_states_connector.py) writes each finished request's rows to
`<shared_storage_path>/<request id>.safetensors` = {"hidden_states": [T, L, H],
"token_ids": [T]}, holding an exclusive flock on `<file>.lock` until the write is done; the
request's output carries the path in `kv_transfer_params["hidden_states_path"]`. Tensors
travel as files (we point the folder at /dev/shm), never as JSON. We run the offline
`vllm.LLM` in-process with `tensor_parallel_size` GPUs and one prefill per sample
(`max_tokens=1`).

Layer ids: vLLM id 0 = embeddings, id i + 1 = output of layer i, id N = the last layer's
output *before* the final norm. We request [i + 1 for our aux ids] + [N] and apply the
target's final RMSNorm to the last slot ourselves, with the norm weight read from the
checkpoint's safetensors (only that tensor is loaded), so stored data keeps our post-norm
convention. The RMSNorm is computed like HF's (float32, then the weight in the model dtype).

Short captures: prefix caching is off (`enable_prefix_caching=False`: a cached prefix never
reaches the dummy drafter) and chunked prefill is off (the feature requires it). Every
capture is checked: the file's token ids must equal ours, the output must report 0 cached
tokens, and `check_capture` must pass (one row per token, finite).

Connector: ours, `draftflow.engines.vllm_connector.DraftflowHiddenStatesConnector`, which vLLM
loads by module path (`kv_connector_module_path`). It is the upstream connector on CUDA; on the
CPU build (where the upstream one pins memory and queries a CUDA event) it copies the rows
synchronously. The same engine therefore runs on a GPU job and on a CPU job (no GPU claimed:
vLLM's CPU build, `tensor_parallel` 1, its OpenMP threads bound to the job's compute CPUs).

Lengths: vLLM refuses a `max_model_len` above the target's `max_position_embeddings`, and with
chunked prefill off it needs `max_num_batched_tokens >= max_model_len`: max_model_len is
min(extract.batch_tokens, max_position_embeddings); a longer sample is refused naming both.

Pinned version: `extract.vllm.version` must equal the installed release; layer_ids.py holds
the version rules (the final-layer id N needs vLLM >= 0.25.0 for DeepSeek-V3 / Kimi).
Tested here without vLLM: the engine arguments, the connector's file format, the norm;
tests/test_vllm_extract_real.py runs the real vLLM CPU build against the hf engine's store.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from draftflow.config import default_aux_layer_ids
from draftflow.engines.capture import CaptureError, EngineLayerIds, check_capture, layer_names, require_gpus
from draftflow.engines.layer_ids import (
    Architecture,
    architecture_of,
    vllm_engine_layer_ids,
    vllm_extraction_checked,
    vllm_layer_ids,
)
from draftflow.engines.servers import VLLM_RPC_PATH_ENV
from draftflow.engines.sglang_capture import DTYPES, check_pinned_version, default_capture_dir

log = logging.getLogger(__name__)

# vLLM imports this module itself (in its engine process); we only name it.
CONNECTOR = "DraftflowHiddenStatesConnector"
CONNECTOR_MODULE = "draftflow.engines.vllm_connector"
UPSTREAM_CONNECTOR = "ExampleHiddenStatesConnector"


# ---------------------------------------------------------------- engine arguments


def llm_kwargs(
    target_dir: str | Path,
    layer_ids: Sequence[int],
    capture_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    tensor_parallel: int = 1,
    batch_tokens: int = 16384,
    max_model_len: int | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
    enforce_eager: bool = False,
    writer_threads: int | None = None,
    kv_cache_memory_bytes: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for extraction; `layer_ids` in vLLM's numbering.

    `max_model_len`: at most the target's max_position_embeddings (`model_len_limit`); default
    batch_tokens. `writer_threads`: the connector's file writers (vLLM's default 8 when None).
    """
    model_len = int(max_model_len if max_model_len is not None else batch_tokens)
    extra: dict[str, Any] = {"shared_storage_path": str(capture_dir)}
    if writer_threads is not None:
        extra["num_writer_threads"] = int(writer_threads)
    sizing = {} if kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": int(kv_cache_memory_bytes)}
    return {
        **sizing,
        "model": str(target_dir),
        "tensor_parallel_size": int(tensor_parallel),
        "dtype": dtype,
        "trust_remote_code": bool(trust_remote_code),
        "seed": int(seed),
        "skip_tokenizer_init": True,  # we send token ids
        "enforce_eager": bool(enforce_eager),
        # Every token must reach the capture: no prefix reuse; chunking is unsupported by the feature.
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        # Without chunked prefill vLLM needs max_num_batched_tokens >= max_model_len.
        "max_num_batched_tokens": max(int(batch_tokens), model_len),
        "max_model_len": model_len,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra,
        },
    }


def cpu_kv_cache_bytes() -> int:
    """An explicit KV cache for vLLM's CPU backend: without one, its worker refuses to start
    unless 92% (`gpu_memory_utilization`) of the NUMA node's memory is free, which a shared
    host rarely has. VLLM_CPU_KVCACHE_SPACE (GiB) if set, else 1 GiB."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    return int(float(space) * (1 << 30)) if space.strip() else 1 << 30


def model_len_limit(config: dict) -> int | None:
    """The target's max_position_embeddings (Kimi-K2.5: in text_config); None if it has none."""
    for source in (config, config.get("text_config") or {}):
        if source.get("max_position_embeddings"):
            return int(source["max_position_embeddings"])
    return None


def max_model_len_for(batch_tokens: int, config: dict) -> int:
    """vLLM's max_model_len for extraction: batch_tokens, capped at the target's
    max_position_embeddings (vLLM refuses a larger one)."""
    limit = model_len_limit(config)
    return min(int(batch_tokens), limit) if limit else int(batch_tokens)


def cpu_threads_bind(compute_threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a CPU job: its first `compute_threads` CPUs (of this
    process's affinity mask, e.g. a SLURM CPU set). vLLM's 'auto' would reserve a core for its
    scheduler and one more for a KV connector, and bind to whole NUMA nodes instead."""
    from draftflow.threads import first_cpus

    return first_cpus(compute_threads)


def requests_for(batch: Sequence[np.ndarray]) -> list[dict]:
    """vLLM TokensPrompt dicts, one per sample."""
    return [{"prompt_token_ids": np.asarray(ids, dtype=np.int64).tolist()} for ids in batch]


# ---------------------------------------------------------------- reading results


def hidden_states_path(sample: str, output: Any) -> Path:
    """The connector's file for one RequestOutput (or its dict form)."""
    params = output.get("kv_transfer_params") if isinstance(output, dict) else getattr(output, "kv_transfer_params", None)
    path = (params or {}).get("hidden_states_path")
    if not path:
        raise CaptureError(
            f"sample {sample}: vLLM's output has no kv_transfer_params['hidden_states_path']: the "
            f"{CONNECTOR} connector is not active (check kv_transfer_config)"
        )
    return Path(path)


def check_output(sample: str, output: Any, input_ids: np.ndarray) -> None:
    """The prompt vLLM ran must be ours, with nothing served from a prefix cache."""
    get = output.get if isinstance(output, dict) else (lambda k, d=None: getattr(output, k, d))
    prompt = get("prompt_token_ids")
    if prompt is not None and list(prompt) != np.asarray(input_ids).tolist():
        raise CaptureError(f"sample {sample}: vLLM ran other prompt tokens than the sample's")
    cached = int(get("num_cached_tokens", 0) or 0)
    if cached:
        raise CaptureError(
            f"sample {sample}: vLLM served {cached} of {len(input_ids)} prompt tokens from its prefix "
            "cache, so their hidden states were never computed; start vLLM with --no-enable-prefix-caching"
        )


def load_connector_file(path: Path, wait_s: float = 60.0) -> dict[str, torch.Tensor]:
    """Read a connector file once its writer has released the exclusive lock on `<path>.lock`."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + wait_s
    while not path.exists() and not lock.exists():
        if time.monotonic() > deadline:
            raise CaptureError(f"{path}: vLLM never wrote this hidden-states file")
        time.sleep(0.05)
    if lock.exists():
        with open(lock) as f:
            while True:  # poll the lock so a dead writer cannot hang us forever
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise CaptureError(f"{path}: vLLM's writer still holds {lock} after {wait_s:.0f}s") from None
                    time.sleep(0.02)
            return _load(path)
    return _load(path)


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # the writer failed (vLLM logs "Hidden-states write failed") or was killed
        raise CaptureError(f"{path}: vLLM's hidden-states file cannot be read ({type(e).__name__}: {e})") from None


def parse_capture(
    sample: str, data: dict[str, torch.Tensor], input_ids: np.ndarray, num_slots: int, hidden_size: int
) -> torch.Tensor:
    """[T, L, H] (last slot still pre-norm) from a connector file's tensors; CaptureError naming `sample`."""
    if "hidden_states" not in data:
        raise CaptureError(f"sample {sample}: hidden-states file lacks 'hidden_states' (keys {sorted(data)})")
    hidden = data["hidden_states"]
    tokens = len(input_ids)
    token_ids = data.get("token_ids")
    if token_ids is not None and token_ids.numel() != tokens:
        raise CaptureError(
            f"sample {sample}: vLLM captured {token_ids.numel()} tokens of {tokens}; "
            "a short capture (prefix caching or chunked prefill on?)"
        )
    ours = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))
    if token_ids is not None and not torch.equal(token_ids.to(torch.int64), ours):
        raise CaptureError(f"sample {sample}: the hidden-states file holds other token ids than the sample's")
    if hidden.dim() != 3 or hidden.shape[0] != tokens or hidden.shape[2] != hidden_size:
        raise CaptureError(
            f"sample {sample}: hidden states of shape {tuple(hidden.shape)}, expected [{tokens}, {num_slots}, {hidden_size}]"
        )
    if hidden.shape[1] != num_slots:
        raise CaptureError(
            f"sample {sample}: vLLM returned {hidden.shape[1]} layers, {num_slots} requested; vLLM "
            "silently drops a final-layer id it cannot capture (deepseek_v2 before vLLM PR #46973)"
        )
    return hidden


# ---------------------------------------------------------------- the final norm


def _checkpoint_tensor(target_dir: Path, names: list[str], read: Callable):
    """read(safe_open handle, name) for the first of `names` that the checkpoint's safetensors
    hold (sharded through model.safetensors.index.json, or one model.safetensors); None if none."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        found = [(n, target_dir / weight_map[n]) for n in names if n in weight_map]
    else:
        found = [(n, target_dir / "model.safetensors") for n in names]
    for name, file in found:
        if file.exists():
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():
                    return read(f, name)
    return None


def final_norm_weight(target_dir: str | Path, arch: Architecture) -> torch.Tensor:
    """The final RMSNorm weight [H], loaded alone from the checkpoint's safetensors."""
    names = [f"{prefix}norm.weight" for prefix in arch.module_prefixes]
    weight = _checkpoint_tensor(Path(target_dir), names, lambda f, name: f.get_tensor(name))
    if weight is None:
        raise CaptureError(
            f"{target_dir}: no final norm weight ({' or '.join(names)}) in its safetensors files; "
            "the vllm engine needs it to turn vLLM's pre-norm last layer into the post-norm final state"
        )
    return weight


def embedding_rows(target_dir: str | Path, arch: Architecture, token_ids: Sequence[int]) -> torch.Tensor:
    """Rows of the input embedding for `token_ids` [n, H], read row by row from the safetensors."""

    def rows(f, name: str) -> torch.Tensor:
        table = f.get_slice(name)
        return torch.cat([table[int(t) : int(t) + 1] for t in token_ids])

    names = [f"{prefix}embed_tokens.weight" for prefix in arch.module_prefixes]
    found = _checkpoint_tensor(Path(target_dir), names, rows)
    if found is None:
        raise CaptureError(
            f"{target_dir}: no input embedding ({' or '.join(names)}) in its safetensors files; the vllm "
            "engine needs it to check an unchecked vLLM release's layer numbering at run time"
        )
    return found


def check_embeddings_slot(sample: str, slot: torch.Tensor, input_ids: np.ndarray, rows: dict[int, torch.Tensor]) -> None:
    """vLLM id 0 must be the embeddings of the sample's tokens: else the release numbers layers
    otherwise than layer_ids.py says (an off-by-one would store every aux layer shifted)."""
    want = torch.stack([rows[int(t)] for t in input_ids]).to(torch.float32)
    got = slot.to(torch.float32)
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    if not err <= 1e-3 * scale + 1e-6:
        raise CaptureError(
            f"sample {sample}: vLLM's layer id 0 is not the token embeddings (max abs difference {err:.3g}, "
            f"embeddings up to {scale:.3g}): this vLLM release numbers extract_hidden_states layers otherwise "
            "than draftflow/engines/layer_ids.py assumes (id 0 = embeddings, id i + 1 = output of layer i); "
            "read its model file's aux_hidden_state_layers code and update layer_ids.py"
        )


def rms_norm_eps(config: dict) -> float:
    for source in (config, config.get("text_config") or {}):
        if "rms_norm_eps" in source:
            return float(source["rms_norm_eps"])
    raise CaptureError("target config.json has no rms_norm_eps (needed for the final norm)")


def apply_final_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`hidden` [T, L, H] with its last slot replaced by RMSNorm(last slot), as HF's LlamaRMSNorm computes it."""
    last = hidden[:, -1]
    x = last.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    out = hidden.clone()
    out[:, -1] = weight.to(last.dtype) * x.to(last.dtype)
    return out


# ---------------------------------------------------------------- the engine


def installed_vllm_version() -> str:
    try:
        import vllm
    except ModuleNotFoundError:
        raise CaptureError(
            "extract.engine is 'vllm' but vLLM is not installed in this environment: "
            "pip install 'vllm==<extract.vllm.version>' on the GPU hosts, or use engine 'hf'"
        ) from None
    return str(getattr(vllm, "__version__", "unknown"))


def vllm_device(settings: dict, devices: Sequence[str], tensor_parallel: int) -> str:
    """'cuda' for a job that claimed GPUs (at least tensor_parallel of them), 'cpu' for a CPU job
    (extract.gpus_per_job 0 or extract.device cpu: vLLM's CPU build, tensor_parallel 1)."""
    gpus = [d for d in devices if d.startswith("cuda")]
    wants_gpu = settings.get("device", "auto") != "cpu" and int(settings.get("gpus_per_job", 0) or 0) > 0
    if not gpus and not wants_gpu:
        if tensor_parallel != 1:
            raise CaptureError(
                f"extract.tensor_parallel is {tensor_parallel} on a CPU job (extract.gpus_per_job 0): the vllm "
                "engine runs vLLM's CPU build in one process there; set extract.tensor_parallel to 1"
            )
        return "cpu"
    require_gpus(tensor_parallel, gpus, devices)
    return "cuda"


class VllmCaptureEngine:
    """CaptureEngine over `vllm.LLM` (or anything with its `generate(prompts, params)`)."""

    name = "vllm"

    def __init__(
        self,
        llm: Any,
        sampling_params: Any,
        arch: Architecture,
        num_layers: int,
        hidden_size: int,
        aux_layer_ids: Sequence[int],
        dtype: torch.dtype,
        norm_weight: torch.Tensor,
        eps: float,
        capture_dir: Path,
        version: str,
        owns_capture_dir: bool = False,
        max_tokens: int | None = None,
        max_tokens_why: str = "",
        embeddings_probe: Any = None,
    ):
        self.llm = llm
        self.sampling_params = sampling_params
        self.arch = arch
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.layer_ids: EngineLayerIds = vllm_engine_layer_ids(self.aux_layer_ids, num_layers, arch, version)
        self.dtype = dtype
        self.norm_weight = norm_weight
        self.eps = eps
        self.capture_dir = Path(capture_dir)
        self.version = version
        self.max_tokens = max_tokens
        self.max_tokens_why = max_tokens_why or f"vLLM's max_model_len {max_tokens}"
        # token ids -> embedding rows [n, H]: vLLM was also asked for id 0, checked on the first batch
        self.embeddings_probe = embeddings_probe
        self._probed = False
        self._owns_dir = owns_capture_dir
        self._names = layer_names(self.aux_layer_ids)

    @classmethod
    def from_settings(cls, settings: dict, target_dir: Path, devices: list[str]) -> "VllmCaptureEngine":
        installed = installed_vllm_version()
        pinned = str((settings.get("vllm") or {}).get("version") or installed)
        check_pinned_version(installed, pinned, "vllm", "extract.vllm.version")
        config_path = Path(target_dir) / "config.json"
        if not config_path.is_file():
            raise CaptureError(f"{config_path} does not exist: the target folder must hold the model's config.json")
        config = json.loads(config_path.read_text())
        text = config.get("text_config") or config
        arch = architecture_of(config)
        num_layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
        aux = settings.get("aux_layer_ids") or default_aux_layer_ids(num_layers)
        tp = int(settings.get("tensor_parallel", 1))
        on_cpu = vllm_device(settings, devices, tp) == "cpu"
        batch_tokens = int(settings.get("batch_tokens", 16384))
        model_len = max_model_len_for(batch_tokens, config)
        capture_dir = default_capture_dir()
        if VLLM_RPC_PATH_ENV not in os.environ:  # its engine core's socket files go when the folder does
            (capture_dir / "rpc").mkdir()
            os.environ[VLLM_RPC_PATH_ENV] = str(capture_dir / "rpc")
        # A release whose numbering was not read in its source is checked at run time: also
        # ask for id 0 (the embeddings) and compare it with the checkpoint's rows.
        probe = not vllm_extraction_checked(installed)
        ids = ([0] if probe else []) + vllm_layer_ids(aux, num_layers, arch, pinned)
        if probe:
            log.warning("vllm %s: layer ids not checked against this release's source; checking id 0 = "
                        "the embeddings on the first batch", installed)  # fmt: skip
        kwargs = llm_kwargs(
            target_dir, ids, capture_dir,
            dtype=settings.get("dtype", "bfloat16"), tensor_parallel=tp, batch_tokens=batch_tokens,
            max_model_len=model_len, trust_remote_code=bool(settings.get("trust_remote_code", False)),
            enforce_eager=bool((settings.get("vllm") or {}).get("enforce_eager", False)),
            writer_threads=1 if on_cpu else None,
            kv_cache_memory_bytes=cpu_kv_cache_bytes() if on_cpu else None,
        )  # fmt: skip
        if on_cpu:
            # vLLM's CPU worker runs its OpenMP pool on these CPUs (one process, tp 1); the
            # stage set torch's pool to the job's compute share (its writers run beside it).
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(torch.get_num_threads())
            log.info("vllm CPU build: OpenMP threads bound to CPUs %s", os.environ["VLLM_CPU_OMP_THREADS_BIND"])
        from vllm import LLM, SamplingParams

        log.info(
            "vllm %s engine on %s: %s, tp %d, aux layers %s, max_model_len %d, captures in %s",
            installed, "cpu" if on_cpu else ",".join(devices), target_dir, tp, aux, model_len, capture_dir,
        )  # fmt: skip
        llm = LLM(**kwargs)
        dtype = DTYPES[settings.get("dtype", "bfloat16")]
        return cls(
            llm, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), arch, num_layers, hidden, aux, dtype,
            final_norm_weight(target_dir, arch), rms_norm_eps(config), capture_dir, pinned, owns_capture_dir=True,
            embeddings_probe=(lambda tokens: embedding_rows(target_dir, arch, tokens)) if probe else None,
            max_tokens=model_len, max_tokens_why=(
                f"vLLM's max_model_len {model_len} = min(extract.batch_tokens {batch_tokens}, the target's "
                f"max_position_embeddings {model_len_limit(config)})"
            ),
        )  # fmt: skip

    @property
    def engine_layer_ids(self) -> list[int]:
        return self.layer_ids.aux_ids

    def versions(self) -> dict[str, str]:
        return {"engine": f"vllm {self.version}"}

    def capture(self, batch: list[np.ndarray]) -> list[torch.Tensor]:
        """Per sample [T_i, L, H] (aux in config order + final post-norm), on the CPU."""
        too_long = [len(ids) for ids in batch if self.max_tokens and len(ids) > self.max_tokens]
        if too_long:
            raise CaptureError(
                f"{len(too_long)} sample(s) of up to {max(too_long)} tokens exceed {self.max_tokens_why}; "
                "chunked prefill must be off for extraction, so a sample must fit in one prefill: raise "
                "extract.batch_tokens or lower merge.max_seq_len to fit"
            )
        outputs = self.llm.generate(requests_for(batch), self.sampling_params, use_tqdm=False)
        if len(outputs) != len(batch):
            raise CaptureError(f"vLLM answered {len(outputs)} of {len(batch)} requests")
        num_slots = len(self.aux_layer_ids) + 1
        probe = self.embeddings_probe is not None
        rows: dict[int, torch.Tensor] = {}
        if probe and not self._probed:
            tokens = sorted({int(t) for ids in batch for t in ids})
            rows = dict(zip(tokens, self.embeddings_probe(tokens).to(self.dtype)))
        results = []
        for k, (ids, out) in enumerate(zip(batch, outputs)):
            sample = f"at batch position {k} ({len(ids)} tokens)"
            check_output(sample, out, ids)
            path = hidden_states_path(sample, out)
            try:
                hidden = parse_capture(sample, load_connector_file(path), ids, num_slots + probe, self.hidden_size)
            finally:
                for leftover in (path, Path(f"{path}.lock")):
                    leftover.unlink(missing_ok=True)
            if probe:
                if rows:
                    check_embeddings_slot(sample, hidden[:, 0], ids, rows)
                hidden = hidden[:, 1:]
            hidden = apply_final_norm(hidden.to(self.dtype), self.norm_weight, self.eps)
            check_capture(sample, ids, hidden, num_slots, self.hidden_size, self._names)
            results.append(hidden)
        self._probed = self._probed or bool(rows)
        return results

    def close(self) -> None:
        # vLLM frees its workers when the LLM object goes; drop our reference first.
        self.llm = None
        if self._owns_dir:
            shutil.rmtree(self.capture_dir, ignore_errors=True)
            if os.environ.get(VLLM_RPC_PATH_ENV) == str(self.capture_dir / "rpc"):  # set by from_settings
                del os.environ[VLLM_RPC_PATH_ENV]  # a later engine in this process gets a folder of its own


# ---------------------------------------------------------------- command line (for scripts/launch_vllm.sh)


def main(argv: list[str] | None = None) -> int:
    """`python -m draftflow.engines.vllm_capture server-configs --target DIR --aux 2,30,58 --version V
    --capture-dir D` prints two lines: the --speculative-config and --kv-transfer-config JSON."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m draftflow.engines.vllm_capture")
    sub = parser.add_subparsers(dest="command", required=True)
    configs = sub.add_parser("server-configs", help="print the speculative and kv-transfer configs for `vllm serve`")
    configs.add_argument("--target", type=Path, required=True, help="model folder (its config.json)")
    configs.add_argument("--aux", default=None, help="comma-separated aux layer ids (default: [1, N//2-1, N-4])")
    configs.add_argument("--version", required=True, help="the vLLM release that will serve")
    configs.add_argument("--capture-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    config = json.loads((args.target / "config.json").read_text())
    text = config.get("text_config") or config
    num_layers = int(text["num_hidden_layers"])
    aux = [int(i) for i in args.aux.split(",")] if args.aux else default_aux_layer_ids(num_layers)
    ids = vllm_layer_ids(aux, num_layers, architecture_of(config), args.version)
    kwargs = llm_kwargs(args.target, ids, args.capture_dir)
    # A GPU server for inspection by hand: vLLM's own connector (ours is the same on CUDA, and
    # would need draftflow importable in the server's Python).
    kv = {k: v for k, v in kwargs["kv_transfer_config"].items() if k != "kv_connector_module_path"}
    kv["kv_connector"] = UPSTREAM_CONNECTOR
    print(json.dumps(kwargs["speculative_config"]))
    print(json.dumps(kv))
    return 0


if __name__ == "__main__":
    import sys

    try:
        sys.exit(main())
    except CaptureError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
