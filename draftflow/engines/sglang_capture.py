"""Capture engine on SGLang: the offline `sglang.Engine` (tensor parallel) with forward hooks.

Design. SGLang's own hidden-state API (`return_hidden_states`) sends every value back as a
JSON float list: at 57 KB of bf16 per token that is ~1 MB of text per token, far too slow.
Instead draftflow attaches PyTorch forward hooks inside SGLang's scheduler processes
through the `forward_hooks` server argument (python/sglang/srt/model_executor/
hook_manager.py; docs/advanced_features/forward_hooks.md; added by SGLang PR #13217,
renamed `--forward-hooks` in #13994). `capture_hook_factory` below is what SGLang imports
in each tensor-parallel worker:

- a hook on decoder layer i (`model.layers.i`; Kimi-K2.5: `language_model.model.layers.i`)
  records the layer's output. SGLang layers return `(hidden_states, residual)` with the
  residual add deferred to the next layer's fused add-norm, so the output of layer i is
  their sum (the same tensor SGLang's own EAGLE-3 capture appends, `hidden_states +
  residual`, before layer i + 1);
- a hook on the final norm records its output: the post-norm state the LM head reads.

A forward flattens the batch's tokens into one [num_tokens, H] tensor. The layer hooks find
SGLang's ForwardBatch among the layer's positional arguments and split the rows per request
with `extend_seq_lens_cpu`; each request's rows are written (by TP rank 0 only: after the
all-reduce every rank holds the same full tensor) to `<capture_dir>/<key>.s<slot>.safetensors`,
where key = sha256 of the request's token ids, which the client computes too. No request id
crosses the process boundary, so the design needs only long-stable ForwardBatch fields
(`forward_mode`, `input_ids`, `extend_seq_lens_cpu`, `extend_prefix_lens_cpu`).

Short captures. With radix (prefix) caching a request's cached prefix never runs through the
layers, and with chunked prefill a long request runs in pieces. The engine starts SGLang with
`disable_radix_cache=True` and `chunked_prefill_size=-1`, and still checks three ways: the
hook refuses a request with a nonzero prefix (it writes an ERROR file the client raises),
the client refuses `meta_info["cached_tokens"] > 0`, and every capture goes through
`check_capture` (one row per input token, finite). Unsupported here: DP attention and
expert-parallel all-to-all MoE (hidden states are then scattered across ranks), pipeline
parallelism, and SGLang's allreduce fusion into the next layer's norm (a layer's output is
then a partial sum); the engine turns off what it can and refuses the rest.

Layer ids: we hook the layers directly, so no SGLang id arithmetic applies to extraction;
`data_config.json` records SGLang's own `layers_to_capture` names (i + 1) and the ids a
draft config needs for the pinned version (layer_ids.py, including the deepseek_v2 rule).

Two ways to run it. In-process (default): `sglang.Engine(**engine_kwargs(...))` on the GPUs
the extract job claimed, or on a job without GPUs on SGLang's CPU backend (`device="cpu"`; a
CPU build of SGLang, e.g. Intel AMX hosts; one tensor-parallel rank per NUMA node). Server
(`extract.sglang.endpoint`, e.g. http://127.0.0.1:30000): a server started on the same host by
`scripts/launch_sglang.sh extract …` with the same hooks; the engine sends token ids to its
native `/generate`, reads the capture folder and the server's flags from `/server_info`
(`/get_server_info` before 0.5.6), and refuses a server with radix cache or chunked prefill on,
or hooks for other layers.

Pinned version: `extract.sglang.version` must equal the installed (or serving) SGLang
release (the version enters the store digest). Tested here without SGLang: the hooks on
real tensors shaped as SGLang passes them, the engine arguments, the server-info checks and
the response parsing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from draftflow.config import default_aux_layer_ids
from draftflow.engines.capture import CaptureError, EngineLayerIds, check_capture, layer_names, require_gpus
from draftflow.engines.layer_ids import Architecture, architecture_of, sglang_engine_layer_ids

log = logging.getLogger(__name__)

HOOK_FACTORY = "draftflow.engines.sglang_capture:capture_hook_factory"
ERROR_FILE = "ERROR"
# SGLang 0.5.14 deprecated the launch flag --disable-cuda-graph (it warns, then maps it) for
# --cuda-graph-backend-{decode,prefill} disabled: server_args.py of 0.5.13 has only the former,
# of 0.5.14 and 0.5.18 both, the former deprecated (the ServerArgs field disable_cuda_graph, which
# engine_kwargs sets, stays and is honoured).
SGLANG_GRAPH_BACKEND_FLAGS = (0, 5, 14)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------- shared by both sides


def token_key(input_ids: Sequence[int] | np.ndarray) -> str:
    """Name of a request's capture files: sha256 of its token ids (int64, little endian)."""
    ids = np.ascontiguousarray(np.asarray(input_ids, dtype="<i8"))
    return hashlib.sha256(ids.tobytes()).hexdigest()[:32]


def slot_path(capture_dir: str | Path, key: str, slot: int) -> Path:
    return Path(capture_dir) / f"{key}.s{slot}.safetensors"


# ---------------------------------------------------------------- worker side (inside SGLang)


@dataclass
class _ForwardMeta:
    """One forward's per-request layout: row offsets, lengths, prefix lengths, file keys."""

    starts: list[int]
    lengths: list[int]
    prefixes: list[int]
    keys: list[str]


_CURRENT: dict[str, Any] = {"batch": None, "meta": None}  # the forward the layer hooks last saw


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # outside SGLang (tests) or before its groups exist
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return 0


def _find_forward_batch(args: tuple) -> Any | None:
    # Decoder layers are called as layer(positions, hidden_states, forward_batch, residual, …).
    for arg in args:
        if hasattr(arg, "forward_mode") and hasattr(arg, "extend_seq_lens_cpu"):
            return arg
    return None


def _forward_meta(batch: Any) -> _ForwardMeta | None:
    """The layout of an extend (prefill) forward, computed once per forward; None otherwise."""
    if _CURRENT["batch"] is batch:
        return _CURRENT["meta"]
    meta = None
    mode = batch.forward_mode
    if mode is not None and mode.is_extend() and batch.extend_seq_lens_cpu is not None:
        lengths = [int(n) for n in batch.extend_seq_lens_cpu]
        prefixes = [int(p) for p in (batch.extend_prefix_lens_cpu or [0] * len(lengths))]
        ids = batch.input_ids.detach().to("cpu", torch.int64).numpy()
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
        keys = [token_key(ids[s : s + n]) for s, n in zip(starts, lengths)]
        meta = _ForwardMeta(starts, lengths, prefixes, keys)
    _CURRENT["batch"], _CURRENT["meta"] = batch, meta
    return meta


def _layer_output(output: Any) -> torch.Tensor:
    """Residual stream after a decoder layer: hidden + residual (SGLang defers the add)."""
    if isinstance(output, torch.Tensor):
        return output
    hidden = output[0]
    residual = output[1] if len(output) > 1 else None
    if isinstance(residual, torch.Tensor) and residual.shape == hidden.shape:
        return hidden + residual
    return hidden


def _norm_output(output: Any) -> torch.Tensor:
    """The final norm's normalized output (SGLang's fused add-norm returns (out, residual))."""
    return output if isinstance(output, torch.Tensor) else output[0]


class CaptureHook:
    """The forward hook SGLang attaches to one module; writes this slot's rows per request."""

    def __init__(self, capture_dir: str | Path, slot: int, kind: str):
        if kind not in ("layer", "norm"):
            raise ValueError(f"capture hook kind must be 'layer' or 'norm', got {kind!r}")
        self.dir = Path(capture_dir)
        self.slot = slot
        self.kind = kind

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        try:
            self._capture(args, output)
        except Exception as e:  # never crash the server; the client reports the ERROR file
            self._fail(f"{type(e).__name__}: {e}")
        return None  # keep the module's output unchanged

    def _capture(self, args: tuple, output: Any) -> None:
        if self.kind == "layer":
            batch = _find_forward_batch(args)
            if batch is None:
                self._fail(
                    "no ForwardBatch among a decoder layer's positional arguments: this SGLang "
                    "version calls its layers differently; the sglang capture engine cannot split rows"
                )
                return
            meta = _forward_meta(batch)
            hidden = _layer_output(output)
        else:  # the norm sees no ForwardBatch; it runs after the layers of the same forward
            meta = _CURRENT["meta"]
            hidden = _norm_output(output)
        if meta is None or _tp_rank() != 0:
            return
        total = sum(meta.lengths)
        if hidden.dim() != 2 or hidden.shape[0] < total:
            self._fail(
                f"slot {self.slot}: hidden states of shape {tuple(hidden.shape)} for {total} tokens; "
                "DP attention or sequence-parallel layouts scatter rows across ranks (unsupported)"
            )
            return
        for start, n, prefix, key in zip(meta.starts, meta.lengths, meta.prefixes, meta.keys):
            if prefix:
                self._fail(
                    f"a request ran with {prefix} cached or earlier-chunk tokens: radix cache or "
                    "chunked prefill is on, so its capture would be short (start SGLang with "
                    "--disable-radix-cache --chunked-prefill-size -1)"
                )
                continue
            self._write(key, hidden[start : start + n])

    def _write(self, key: str, rows: torch.Tensor) -> None:
        from safetensors.torch import save_file

        path = slot_path(self.dir, key, self.slot)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({"hidden": rows.detach().to("cpu").contiguous()}, str(tmp))
        os.replace(tmp, path)  # readers see whole files only

    def _fail(self, message: str) -> None:
        log.error("draftflow capture hook: %s", message)
        try:
            (self.dir / ERROR_FILE).write_text(message + "\n")
        except OSError:
            pass


def capture_hook_factory(config: dict) -> CaptureHook:
    """Entry point named in SGLang's `forward_hooks`: config {"dir", "slot", "kind"}."""
    return CaptureHook(config["dir"], int(config["slot"]), config["kind"])


# ---------------------------------------------------------------- client side: engine arguments


def hook_specs(arch: Architecture, aux_layer_ids: Sequence[int], capture_dir: str | Path) -> list[dict]:
    """`forward_hooks` entries: one per aux layer (its output), one on the final norm."""
    specs = [
        {
            "name": f"draftflow-aux-layer-{i}",
            "target_modules": [f"{prefix}layers.{i}" for prefix in arch.module_prefixes],
            "hook_factory": HOOK_FACTORY,
            "config": {"dir": str(capture_dir), "slot": slot, "kind": "layer"},
        }
        for slot, i in enumerate(aux_layer_ids)
    ]
    specs.append(
        {
            "name": "draftflow-final-norm",
            "target_modules": [f"{prefix}norm" for prefix in arch.module_prefixes],
            "hook_factory": HOOK_FACTORY,
            "config": {"dir": str(capture_dir), "slot": len(aux_layer_ids), "kind": "norm"},
        }
    )
    return specs


def engine_kwargs(
    target_dir: str | Path,
    arch: Architecture,
    aux_layer_ids: Sequence[int],
    capture_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    tensor_parallel: int = 1,
    batch_tokens: int = 16384,
    trust_remote_code: bool = False,
    seed: int = 0,
    device: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine` for extraction (all are ServerArgs fields); `device`
    None: SGLang's own choice (the GPUs), "cpu": its CPU backend."""
    return {
        **({"device": device} if device else {}),
        "model_path": str(target_dir),
        "tp_size": int(tensor_parallel),
        "dtype": dtype,
        "trust_remote_code": bool(trust_remote_code),
        "random_seed": int(seed),
        "skip_tokenizer_init": True,  # we send token ids
        # Every token must run through every layer: no prefix reuse, no chunking.
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "max_prefill_tokens": int(batch_tokens),
        # Hooks fire only when modules run eagerly; prefill-only work gains nothing from graphs.
        "disable_cuda_graph": True,
        "enable_torch_compile": False,
        # A fused allreduce+norm leaves a layer's output a per-rank partial sum.
        "enable_flashinfer_allreduce_fusion": False,
        "enable_dp_attention": False,
        "pp_size": 1,
        "forward_hooks": hook_specs(arch, aux_layer_ids, capture_dir),
        "log_level": "error",
    }


def fit_to_server_args(kwargs: dict[str, Any], fields: set[str], version: str) -> dict[str, Any]:
    """Drop optional arguments this SGLang does not know; refuse if a required one is missing."""
    required = {"model_path", "tp_size", "disable_radix_cache", "chunked_prefill_size", "forward_hooks"}
    missing = sorted(required - fields)
    if missing:
        raise CaptureError(
            f"SGLang {version} lacks the server argument(s) {missing} the sglang capture engine needs "
            "(forward_hooks appeared with SGLang PR #13217/#13994, late 2025); install the release "
            "pinned in extract.sglang.version"
        )
    dropped = sorted(set(kwargs) - fields)
    if dropped:
        log.info("SGLang %s has no %s; not set", version, dropped)
    return {k: v for k, v in kwargs.items() if k in fields}


def cuda_graph_off_flags(version: str | None) -> list[str]:
    """The `sglang.launch_server` flags that turn CUDA graphs off (hooks fire only on modules run
    eagerly) in SGLang `version`; None (not installed here): the current spelling."""
    from draftflow.engines.layer_ids import parse_version

    if version is not None and parse_version(version) < SGLANG_GRAPH_BACKEND_FLAGS:
        return ["--disable-cuda-graph"]
    return ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


def installed_sglang_release() -> str | None:
    """The installed SGLang's version from its package metadata (without importing it), or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def sglang_device(devices: Sequence[str], tensor_parallel: int) -> str:
    """'cuda' for a job holding GPUs (at least tensor_parallel of them); 'cpu' for a job holding
    none (extract.gpus_per_job 0, extract.device cpu, or a host without GPUs, where the claim
    already fell back to the CPU): SGLang's CPU backend (ServerArgs.device "cpu"), which runs
    `sglang.Engine` capture as on a GPU (issue 33: run on a CPU build with this check bypassed)."""
    gpus = [d for d in devices if d.startswith("cuda")]
    if not gpus:
        check_cpu_tensor_parallel(tensor_parallel, numa_node_count(), os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"))
        return "cpu"
    require_gpus(tensor_parallel, gpus, devices)
    return "cuda"


def check_cpu_tensor_parallel(tensor_parallel: int, numa_nodes: int, bind: str | None) -> None:
    """SGLang's CPU backend runs one tensor-parallel rank per NUMA node, or per '|'-separated CPU
    list in SGLANG_CPU_OMP_THREADS_BIND (sglang/srt/utils/numa_utils.py init_threads_binding, 0.5.18,
    asserts the same inside its workers): refuse here what it would refuse there."""
    if bind:
        ranks = len(bind.split("|"))
        if ranks != tensor_parallel:
            raise CaptureError(
                f"SGLANG_CPU_OMP_THREADS_BIND={bind!r} names the CPUs of {ranks} tensor-parallel rank(s) but "
                f"extract.tensor_parallel is {tensor_parallel}: give one '|'-separated CPU list per rank"
            )
    elif tensor_parallel > max(numa_nodes, 1):
        raise CaptureError(
            f"extract.tensor_parallel is {tensor_parallel} on a CPU job but this host has {numa_nodes} NUMA node(s): "
            "SGLang's CPU backend runs one rank per NUMA node; set extract.tensor_parallel to at most that, or "
            "name each rank's CPUs in SGLANG_CPU_OMP_THREADS_BIND (e.g. 0-15|16-31 for 2)"
        )


def numa_node_count() -> int:
    """NUMA nodes of this host (Linux sysfs; 1 where it cannot tell)."""
    nodes = [p for p in Path("/sys/devices/system/node").glob("node[0-9]*") if p.name[4:].isdigit()]
    return len(nodes) or 1


# ---------------------------------------------------------------- client side: reading results


def check_not_cached(sample: str, meta_info: dict, num_tokens: int) -> None:
    """A response whose prompt was partly served from cache has a short capture."""
    cached = int(meta_info.get("cached_tokens") or 0)
    prompt = meta_info.get("prompt_tokens")
    if cached:
        raise CaptureError(
            f"sample {sample}: SGLang served {cached} of {num_tokens} prompt tokens from its prefix "
            "cache, so their hidden states were never computed; start SGLang with --disable-radix-cache"
        )
    if prompt is not None and int(prompt) != num_tokens:
        raise CaptureError(f"sample {sample}: SGLang saw {prompt} prompt tokens, we sent {num_tokens}")


def raise_worker_error(capture_dir: str | Path) -> None:
    path = Path(capture_dir) / ERROR_FILE
    if path.exists():
        raise CaptureError(f"SGLang capture hook failed: {path.read_text().strip()}")


def read_capture(
    capture_dir: str | Path,
    sample: str,
    input_ids: np.ndarray,
    num_slots: int,
    hidden_size: int,
    wait_s: float = 10.0,
) -> torch.Tensor:
    """[T, L, H] from the slot files of one request; CaptureError naming `sample` if incomplete."""
    key = token_key(input_ids)
    paths = [slot_path(capture_dir, key, k) for k in range(num_slots)]
    deadline = time.monotonic() + wait_s
    while not all(p.exists() for p in paths):  # files land before the response; waiting is a safety net
        raise_worker_error(capture_dir)
        if time.monotonic() > deadline:
            missing = [k for k, p in enumerate(paths) if not p.exists()]
            raise CaptureError(
                f"sample {sample}: no hidden states arrived for slot(s) {missing} in {capture_dir}: "
                "the hooks did not match the model's modules or the request never ran a prefill"
            )
        time.sleep(0.05)
    from safetensors.torch import load_file

    slots = [load_file(str(p))["hidden"] for p in paths]
    tokens = len(input_ids)
    for k, rows in enumerate(slots):
        if rows.dim() != 2 or rows.shape != (tokens, hidden_size):
            raise CaptureError(
                f"sample {sample}: slot {k} has shape {tuple(rows.shape)}, expected [{tokens}, {hidden_size}]"
                + ("; a short capture: prefix caching or chunked prefill skipped tokens" if rows.shape[0] < tokens else "")
            )
    return torch.stack(slots, dim=1)  # [T, L, H]


def remove_capture(capture_dir: str | Path, input_ids: np.ndarray, num_slots: int) -> None:
    key = token_key(input_ids)
    for k in range(num_slots):
        slot_path(capture_dir, key, k).unlink(missing_ok=True)


# ---------------------------------------------------------------- client side: a running server


class SglangHttpRuntime:
    """`generate(input_ids=…, sampling_params=…)` over a running server's native /generate."""

    def __init__(self, endpoint: str, timeout_s: float = 3600.0):
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s

    def _send(self, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """(HTTP status, body) of one request; CaptureError when the server does not answer."""
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.endpoint + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read() or b""
        except (urllib.error.URLError, OSError) as e:
            raise CaptureError(
                f"{self.endpoint}{path}: not reachable ({getattr(e, 'reason', e)}); start it with "
                "scripts/launch_sglang.sh extract … or unset extract.sglang.endpoint"
            ) from None

    def _call(self, path: str, body: dict | None = None) -> Any:
        status, raw = self._send(path, body)
        if status != 200:
            raise CaptureError(f"{self.endpoint}{path}: HTTP {status}: {raw[:300]!r}")
        return json.loads(raw)

    def server_info(self) -> dict:
        """/server_info, else /get_server_info (releases before 0.5.6): engines/sglang_http.py."""
        from draftflow.engines.sglang_http import server_info

        return server_info(self._send, self.endpoint, CaptureError)

    def generate(self, input_ids: list[list[int]], sampling_params: dict) -> list[dict]:
        return self._call("/generate", {"input_ids": input_ids, "sampling_params": sampling_params})


def capture_dir_from_server(info: dict, arch: Architecture, aux_layer_ids: Sequence[int], pinned: str) -> Path:
    """The capture folder of a running server, after checking it is fit for extraction."""
    from draftflow.engines.layer_ids import parse_version

    version = str(info.get("version") or "")
    if version and parse_version(version) != parse_version(pinned):
        raise CaptureError(f"the SGLang server runs {version} but extract.sglang.version is {pinned}")
    if info.get("disable_radix_cache") is not True:
        raise CaptureError(
            "the SGLang server has its radix (prefix) cache on: cached prefixes skip the layers and "
            "captures come back short; restart it with scripts/launch_sglang.sh extract (--disable-radix-cache)"
        )
    chunk = info.get("chunked_prefill_size")
    if chunk is not None and int(chunk) > 0:
        raise CaptureError(
            f"the SGLang server runs chunked prefill (chunked_prefill_size={chunk}): long samples would "
            "be captured in pieces; restart it with --chunked-prefill-size -1"
        )
    unsupported = {
        "enable_dp_attention": info.get("enable_dp_attention") is True,
        "pp_size > 1": int(info.get("pp_size") or 1) > 1,
        "moe_a2a_backend": str(info.get("moe_a2a_backend") or "none") != "none",
        "enable_flashinfer_allreduce_fusion": info.get("enable_flashinfer_allreduce_fusion") is True,
    }
    on = [name for name, flag in unsupported.items() if flag]
    if on:
        raise CaptureError(
            f"the SGLang server runs with {on}: hidden states are then scattered over ranks or partial "
            "sums per rank; the sglang capture engine supports plain tensor parallelism only"
        )
    expected = hook_specs(arch, aux_layer_ids, "")
    hooks = info.get("forward_hooks") or []
    ours = [h for h in hooks if h.get("hook_factory") == HOOK_FACTORY]
    if [h.get("target_modules") for h in ours] != [h["target_modules"] for h in expected]:
        raise CaptureError(
            f"the SGLang server's draftflow hooks capture {[h.get('target_modules') for h in ours]}, not the "
            f"configured aux layers {list(aux_layer_ids)} + final norm; restart it with "
            "scripts/launch_sglang.sh extract --aux " + ",".join(map(str, aux_layer_ids))
        )
    dirs = {h["config"]["dir"] for h in ours}
    if len(dirs) != 1 or not Path(next(iter(dirs))).is_dir():
        raise CaptureError(f"the SGLang server writes captures to {sorted(dirs)}, which is not a folder on this host")
    return Path(next(iter(dirs)))


# ---------------------------------------------------------------- the engine


def installed_sglang_version() -> str:
    try:
        import sglang
    except ModuleNotFoundError:
        raise CaptureError(
            "extract.engine is 'sglang' but SGLang is not installed in this environment: "
            "pip install 'sglang[all]==<extract.sglang.version>' on the GPU hosts, or use engine 'hf'"
        ) from None
    return str(getattr(sglang, "__version__", "unknown"))


def check_pinned_version(installed: str, pinned: str, package: str, key: str) -> None:
    from draftflow.engines.layer_ids import parse_version

    if parse_version(installed) != parse_version(pinned):
        raise CaptureError(
            f"{package} {installed} is installed but {key} is {pinned}: the version enters the store "
            f"digest and the layer-id rules, so install {package}=={pinned} or set {key}: \"{installed}\""
        )


def default_capture_dir() -> Path:
    """A fresh folder for capture files: RAM-backed /dev/shm when there is one."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="draftflow-sglang-capture-", dir=base))


def _read_config(target_dir: Path) -> dict:
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise CaptureError(f"{path} does not exist: the target folder must hold the model's config.json")
    with open(path) as f:
        config = json.load(f)
    text = config.get("text_config") or {}
    return {**config, **{k: v for k, v in text.items() if k in ("num_hidden_layers", "hidden_size")}}


class SglangCaptureEngine:
    """CaptureEngine over `sglang.Engine` (or anything with its `generate(input_ids=…)`)."""

    name = "sglang"

    def __init__(
        self,
        runtime: Any,
        arch: Architecture,
        num_layers: int,
        hidden_size: int,
        aux_layer_ids: Sequence[int],
        dtype: torch.dtype,
        capture_dir: Path,
        version: str,
        owns_capture_dir: bool = False,
    ):
        self.runtime = runtime
        self.arch = arch
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.layer_ids: EngineLayerIds = sglang_engine_layer_ids(self.aux_layer_ids, num_layers, arch, version)
        self.dtype = dtype
        self.capture_dir = Path(capture_dir)
        self.version = version
        self._owns_dir = owns_capture_dir
        self._names = layer_names(self.aux_layer_ids)

    @classmethod
    def from_settings(cls, settings: dict, target_dir: Path, devices: list[str]) -> "SglangCaptureEngine":
        endpoint = (settings.get("sglang") or {}).get("endpoint")
        installed = None if endpoint else installed_sglang_version()  # a server's client needs no sglang
        config = _read_config(target_dir)
        arch = architecture_of(config)
        num_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
        aux = settings.get("aux_layer_ids") or default_aux_layer_ids(num_layers)
        dtype = DTYPES[settings.get("dtype", "bfloat16")]
        if endpoint:  # a server launched by scripts/launch_sglang.sh extract on this host
            runtime = SglangHttpRuntime(endpoint)
            info = runtime.server_info()
            pinned = str((settings.get("sglang") or {}).get("version") or info.get("version") or "unknown")
            capture_dir = capture_dir_from_server(info, arch, aux, pinned)
            log.info("sglang server %s (%s): aux layers %s, captures in %s", endpoint, pinned, aux, capture_dir)
            return cls(runtime, arch, num_layers, hidden, aux, dtype, capture_dir, pinned)
        pinned = str((settings.get("sglang") or {}).get("version") or installed)
        check_pinned_version(installed, pinned, "sglang", "extract.sglang.version")
        tp = int(settings.get("tensor_parallel", 1))
        on_cpu = sglang_device(devices, tp) == "cpu"
        capture_dir = default_capture_dir()
        kwargs = engine_kwargs(
            target_dir, arch, aux, capture_dir,
            dtype=settings.get("dtype", "bfloat16"), tensor_parallel=tp,
            batch_tokens=int(settings.get("batch_tokens", 16384)),
            trust_remote_code=bool(settings.get("trust_remote_code", False)),
            device="cpu" if on_cpu else None,
        )  # fmt: skip
        import dataclasses

        import sglang
        from sglang.srt.server_args import ServerArgs

        kwargs = fit_to_server_args(kwargs, {f.name for f in dataclasses.fields(ServerArgs)}, installed)
        log.info("sglang %s engine on %s: %s, tp %d, aux layers %s, captures in %s", installed,
                 "the CPU" if on_cpu else ",".join(devices), target_dir, tp, aux, capture_dir)  # fmt: skip
        if on_cpu and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
            log.info("sglang CPU backend: each tensor-parallel rank takes one NUMA node's cores "
                     "(set SGLANG_CPU_OMP_THREADS_BIND to choose them)")  # fmt: skip
        runtime = sglang.Engine(**kwargs)
        for leftover in capture_dir.iterdir():  # warm-up forwards may have written files
            leftover.unlink()
        return cls(runtime, arch, num_layers, hidden, aux, dtype, capture_dir, pinned, owns_capture_dir=True)

    @property
    def engine_layer_ids(self) -> list[int]:
        return self.layer_ids.aux_ids

    def versions(self) -> dict[str, str]:
        return {"engine": f"sglang {self.version}"}

    def capture(self, batch: list[np.ndarray]) -> list[torch.Tensor]:
        """Per sample [T_i, L, H] (aux in config order + final post-norm), on the CPU."""
        outputs = self.runtime.generate(
            input_ids=[np.asarray(ids).tolist() for ids in batch],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        )
        if isinstance(outputs, dict):  # a batch of one comes back unwrapped
            outputs = [outputs]
        if len(outputs) != len(batch):
            raise CaptureError(f"SGLang answered {len(outputs)} of {len(batch)} requests")
        raise_worker_error(self.capture_dir)
        num_slots = len(self.aux_layer_ids) + 1
        results = []
        for k, (ids, out) in enumerate(zip(batch, outputs)):
            sample = f"at batch position {k} ({len(ids)} tokens, key {token_key(ids)})"
            check_not_cached(sample, out.get("meta_info") or {}, len(ids))
            hidden = read_capture(self.capture_dir, sample, ids, num_slots, self.hidden_size)
            check_capture(sample, ids, hidden, num_slots, self.hidden_size, self._names)
            results.append(hidden.to(self.dtype))
        for ids in batch:  # after all reads: identical samples in one batch share files
            remove_capture(self.capture_dir, ids, num_slots)
        return results

    def close(self) -> None:
        shutdown = getattr(self.runtime, "shutdown", None)
        if callable(shutdown):
            shutdown()
        if self._owns_dir:
            shutil.rmtree(self.capture_dir, ignore_errors=True)


# ---------------------------------------------------------------- command line (for scripts/launch_sglang.sh)


def main(argv: list[str] | None = None) -> int:
    """`python -m draftflow.engines.sglang_capture hooks --target DIR --aux 2,30,58 --capture-dir D`
    prints the --forward-hooks JSON an extraction server needs; `… graph-flags [--version V]`
    the flags that turn CUDA graphs off in that SGLang release (default: the installed one), one
    per line."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m draftflow.engines.sglang_capture")
    sub = parser.add_subparsers(dest="command", required=True)
    hooks = sub.add_parser("hooks", help="print the forward_hooks JSON for an extraction server")
    hooks.add_argument("--target", type=Path, required=True, help="model folder (its config.json)")
    hooks.add_argument("--aux", default=None, help="comma-separated aux layer ids (default: [1, N//2-1, N-4])")
    hooks.add_argument("--capture-dir", type=Path, required=True)
    graph = sub.add_parser("graph-flags", help="print the flags that turn CUDA graphs off, one per line")
    graph.add_argument("--version", default=None, help="SGLang release (default: the installed one)")
    args = parser.parse_args(argv)
    if args.command == "graph-flags":
        print("\n".join(cuda_graph_off_flags(args.version or installed_sglang_release())))
        return 0
    config = _read_config(args.target)
    arch = architecture_of(config)
    num_layers = int(config["num_hidden_layers"])
    aux = [int(i) for i in args.aux.split(",")] if args.aux else default_aux_layer_ids(num_layers)
    from draftflow.engines.layer_ids import sglang_layers_to_capture

    sglang_layers_to_capture(aux, num_layers)  # range check
    print(json.dumps(hook_specs(arch, aux, args.capture_dir)))
    return 0


if __name__ == "__main__":
    import sys

    try:
        sys.exit(main())
    except CaptureError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
