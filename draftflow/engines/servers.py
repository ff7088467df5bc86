"""Servers: preflight checks for server-based stages, and a small OpenAI-compatible test server.

Checks (each returns a `draftflow.checks.CheckResult`; `server_checks` adapts them to preflight's
`CHECKS` signature):
- `check_endpoint`: GET <base>/models answers within a timeout (base = e.g.
  http://127.0.0.1:30000/v1, as `regenerate.openai.endpoints` lists it);
- `check_served_model`: the endpoint serves the configured `regenerate.openai.model`;
- `check_gpus_free`: no other process holds a compute context on the GPUs a job will use
  (`nvidia-smi --query-compute-apps`); skipped, with a note, where nvidia-smi is absent.
  A stray server holding all GPUs cost the user a day; `scripts/launch_*.sh` run this first.

`OpenAITestServer` serves `/v1/models` and `/v1/chat/completions` on 127.0.0.1 from a
`ChatBackend` (by default the builtin target, greedy, one request at a time), with a
schedule of injected faults: HTTP 429 with Retry-After, HTTP 500/503, a delay past the
client's timeout, and a dropped connection (the socket closed halfway through the body).
It stops by itself after `lifetime_s` or `max_requests`. `scripts/serve_openai_test.py`
runs it by hand.

`python -m draftflow.engines.servers check-gpus|check-endpoint …` runs the checks from a shell.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from draftflow.checks import CheckResult
from draftflow.errors import DraftflowError

log = logging.getLogger(__name__)

# vLLM binds its processes' ZMQ sockets as files in this folder (default: the temp folder) and leaves
# them there when it stops: 2-3 a launch, thousands on a shared /tmp over time. Where the user has not
# set it, the processes we start get a folder of their own, removed when they have stopped.
VLLM_RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"


# ---------------------------------------------------------------- endpoint checks


def models_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port/v1/models (OpenAI clients' base-URL convention)."""
    return base_url.rstrip("/") + "/models"


def fetch_models(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> list[str]:
    """Model ids an OpenAI-compatible endpoint serves; DraftflowError saying why not."""
    request = urllib.request.Request(models_url(base_url), headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        hint = ""
        if e.code in (401, 403):
            hint = " (the API key was rejected: check the variable regenerate.openai.api_key_env names)"
        raise DraftflowError(f"{models_url(base_url)} answered HTTP {e.code}{hint}") from None
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DraftflowError(
            f"{models_url(base_url)} is not reachable within {timeout_s:g}s ({reason}): is the server "
            "running (scripts/launch_sglang.sh / launch_vllm.sh) and the URL in regenerate.openai.endpoints right?"
        ) from None
    except json.JSONDecodeError:
        raise DraftflowError(f"{models_url(base_url)} did not answer JSON: not an OpenAI-compatible endpoint") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise DraftflowError(f"{models_url(base_url)} answered without a 'data' list: not an OpenAI-compatible endpoint")
    return [str(m.get("id")) for m in data if isinstance(m, dict)]


def check_endpoint(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> CheckResult:
    details: dict[str, Any] = {"endpoint": base_url, "timeout_s": timeout_s}
    try:
        models = fetch_models(base_url, timeout_s, api_key)
    except DraftflowError as e:
        return CheckResult("endpoint", False, str(e), details)
    details["models"] = models
    return CheckResult("endpoint", True, f"{base_url} serves {models}", details)


def check_served_model(base_url: str, model: str | None, timeout_s: float = 10.0, api_key: str | None = None) -> CheckResult:
    details: dict[str, Any] = {"endpoint": base_url, "model": model}
    try:
        models = fetch_models(base_url, timeout_s, api_key)
    except DraftflowError as e:
        return CheckResult("served_model", False, str(e), details)
    details["models"] = models
    if not model:
        if len(models) == 1:
            return CheckResult("served_model", True, f"{base_url} serves one model, {models[0]!r}", details)
        return CheckResult(
            "served_model", False,
            f"{base_url} serves {models}; set regenerate.openai.model to the one to use",
            details,
        )  # fmt: skip
    if model in models:
        return CheckResult("served_model", True, f"{base_url} serves {model!r}", details)
    return CheckResult(
        "served_model", False,
        f"{base_url} serves {models}, not regenerate.openai.model = {model!r}: the server runs another "
        "model than the config names (regenerating with it would train the drafter on the wrong target); "
        "start the right model or fix regenerate.openai.model",
        details,
    )  # fmt: skip


# ---------------------------------------------------------------- GPUs held by other processes


@dataclass(frozen=True)
class ComputeApp:
    gpu_index: str
    gpu_uuid: str
    pid: int
    name: str
    used_mib: str


def parse_compute_apps(gpus_csv: str, apps_csv: str) -> list[ComputeApp]:
    """Parse `nvidia-smi --query-gpu=index,uuid` and `--query-compute-apps=gpu_uuid,pid,process_name,used_memory`
    (both `--format=csv,noheader,nounits`)."""
    index_of = {}
    for line in gpus_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2:
            index_of[parts[1]] = parts[0]
    apps = []
    for line in apps_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[1].isdigit():
            continue
        uuid, pid, name, used = parts[0], int(parts[1]), ",".join(parts[2:-1]), parts[-1]
        apps.append(ComputeApp(index_of.get(uuid, "?"), uuid, pid, name, used))
    return apps


def _nvidia_smi(args: list[str], timeout_s: float) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout_s, check=True
    ).stdout


def check_gpus_free(gpu_ids: Sequence[str] | None = None, timeout_s: float = 30.0) -> CheckResult:
    """No foreign compute process on `gpu_ids` (indices or UUIDs; None = CUDA_VISIBLE_DEVICES or all)."""
    if gpu_ids is None and os.environ.get("CUDA_VISIBLE_DEVICES"):
        gpu_ids = [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    details: dict[str, Any] = {"gpus": list(gpu_ids) if gpu_ids is not None else "all"}
    try:
        gpus = _nvidia_smi(["--query-gpu=index,uuid", "--format=csv,noheader,nounits"], timeout_s)
        apps_csv = _nvidia_smi(
            ["--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader,nounits"], timeout_s
        )
    except FileNotFoundError:
        details["skipped"] = True
        note = "nvidia-smi not found: GPU occupancy not checked (no NVIDIA driver here?)"
        return CheckResult("gpus_free", True, note, details)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return CheckResult("gpus_free", False, f"nvidia-smi failed ({e}); cannot tell whether the GPUs are free", details)
    wanted = set(gpu_ids) if gpu_ids is not None else None
    foreign = [
        a for a in parse_compute_apps(gpus, apps_csv)
        if a.pid != os.getpid() and (wanted is None or a.gpu_index in wanted or a.gpu_uuid in wanted)
    ]  # fmt: skip
    details["held_by"] = [a.__dict__ for a in foreign]
    if not foreign:
        return CheckResult("gpus_free", True, f"no other process on GPU(s) {details['gpus']}", details)
    held = "; ".join(f"GPU {a.gpu_index}: pid {a.pid} {a.name} ({a.used_mib} MiB)" for a in foreign)
    return CheckResult(
        "gpus_free", False,
        f"GPU(s) already held by other processes: {held}. Stop them (e.g. a stray inference server: "
        "`kill <pid>`) or choose other GPUs (CUDA_VISIBLE_DEVICES) before starting.",
        details,
    )  # fmt: skip


def server_checks(regenerate_settings: dict, timeout_s: float = 10.0) -> list[Callable[[Any], CheckResult]]:
    """Checks for preflight's CHECKS list (each takes the PreflightContext and ignores it):
    every configured endpoint reachable and serving `regenerate.openai.model` (none for engine hf)."""
    if regenerate_settings.get("engine", "hf") != "openai":
        return []
    openai = regenerate_settings.get("openai") or {}
    key_env = openai.get("api_key_env")
    checks: list[Callable[[Any], CheckResult]] = []
    for url in openai.get("endpoints") or []:
        def check(ctx: Any, url: str = url) -> CheckResult:
            api_key = os.environ.get(key_env) if key_env else None
            return check_served_model(url, openai.get("model"), timeout_s, api_key)

        checks.append(check)
    return checks


# ---------------------------------------------------------------- the test server


@dataclass
class ChatReply:
    content: str
    finish_reason: str = "stop"
    reasoning: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatBackend(Protocol):
    """What the test server generates with: one chat request (the parsed JSON body) -> a reply."""

    def complete(self, body: dict) -> ChatReply: ...


# Small enough to build in seconds on a busy CPU; trained briefly so its replies vary by prompt.
TINY_TARGET = {
    "num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 400, "train_steps": 30, "train_batch_size": 4, "train_seq_len": 32,
}  # fmt: skip


def ensure_tiny_target(folder: str | Path, **overrides: Any) -> Path:
    """A small builtin target in `folder` (built once; a few seconds on a CPU) for tests and demos."""
    from draftflow.config import REPO_ROOT
    from draftflow.target import BuiltinSettings, build_target

    folder = Path(folder)
    corpus = REPO_ROOT / "data" / "samples" / "chat_openai.jsonl"
    settings = {**TINY_TARGET, **({"corpus": [str(corpus)]} if corpus.is_file() else {}), **overrides}
    if not (folder / "config.json").is_file():
        build_target(BuiltinSettings.from_dict(settings), folder)
    return folder


def thinking_disabled(body: dict) -> bool:
    kwargs = body.get("chat_template_kwargs") or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


class TargetChatBackend:
    """Chat completions from a local target through draftflow's HF generation engine, batch size 1:
    exactly what `regenerate` with engine 'hf' and batch_size 1 generates for the same messages.

    With `reasoning=True` replies also carry a `reasoning_content` (a fixed sentence about the
    prompt) unless the request disables thinking, to exercise reasoning keep/drop/disable.
    """

    def __init__(self, target_dir: str | Path, device: str = "cpu", reasoning: bool = False):
        from draftflow.engines.hf_generate import HFGenerationEngine

        self.engine = HFGenerationEngine.from_settings({"device": device, "batch_size": 1}, Path(target_dir))
        self.reasoning = reasoning

    def complete(self, body: dict) -> ChatReply:
        from draftflow.engines.generation import GenerationRequest

        request = GenerationRequest(
            messages=list(body.get("messages") or []),
            tools=body.get("tools") or None,
            max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 128),
            temperature=float(body.get("temperature") or 0.0),
            top_p=float(body.get("top_p") or 1.0),
            seed=int(body.get("seed") or 0),
        )
        result = self.engine.generate([request])[0]
        reasoning = None
        if self.reasoning and not thinking_disabled(body):
            reasoning = f"The request has {len(request.messages)} messages; answer the last one."
        tokenizer = self.engine.tokenizer
        return ChatReply(
            content=result.content,
            finish_reason=result.finish_reason,
            reasoning=reasoning,
            prompt_tokens=len(self.engine.prompt_ids(request)),
            completion_tokens=len(tokenizer(result.content, add_special_tokens=False)["input_ids"]),
        )


@dataclass(frozen=True)
class Fault:
    kind: str  # ok | 429 | 500 | 503 | delay | drop
    seconds: float = 0.0  # Retry-After for 429, sleep for delay

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """'ok', '429' or '429:2' (Retry-After 2), '500', '503', 'delay:5', 'drop'."""
        kind, _, arg = text.strip().partition(":")
        if kind not in ("ok", "429", "500", "503", "delay", "drop"):
            raise DraftflowError(f"unknown fault {text!r}; use ok, 429[:retry_after], 500, 503, delay:<s>, drop")
        return cls(kind, float(arg) if arg else (1.0 if kind == "delay" else 0.0))


class FaultPlan:
    """Faults assigned to chat requests in arrival order; requests past the list get 'ok'."""

    def __init__(self, faults: Sequence[str | Fault] = ()):
        self.faults = [f if isinstance(f, Fault) else Fault.parse(f) for f in faults]
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> Fault:
        with self._lock:
            i, self._next = self._next, self._next + 1
        return self.faults[i] if i < len(self.faults) else Fault("ok")


@dataclass
class RequestRecord:
    path: str
    fault: str
    status: int  # 0 while answering; -1 connection dropped on purpose; -2 the client had left
    body: dict | None
    authorized: bool  # whether an expected API key was presented (the key itself is never kept)


@dataclass
class OpenAITestServer:
    """An OpenAI-compatible chat server on 127.0.0.1 for tests and by-hand checks."""

    backend: ChatBackend
    model_name: str = "draftflow-tiny"
    faults: FaultPlan = field(default_factory=FaultPlan)
    api_key: str | None = None
    port: int = 0  # 0: any free port
    lifetime_s: float = 600.0
    max_requests: int = 100_000
    latency_s: float = 0.0  # added to every chat completion (to make runs slow enough to interrupt)
    requests: list[RequestRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._generate_lock = threading.Lock()  # the backend runs one request at a time
        self._records_lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._httpd.timeout = 0.2
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def serve(self) -> None:
        """Handle requests until stop(), `lifetime_s`, or `max_requests` (bounded by design)."""
        deadline = time.monotonic() + self.lifetime_s
        while not self._stop.is_set() and time.monotonic() < deadline and len(self.requests) < self.max_requests:
            self._httpd.handle_request()
        self._httpd.server_close()

    def start(self) -> "OpenAITestServer":
        self._thread = threading.Thread(target=self.serve, name="openai-test-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "OpenAITestServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def record(self, record: RequestRecord) -> None:
        with self._records_lock:
            self.requests.append(record)

    def chat_requests(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def complete(self, body: dict) -> dict:
        with self._generate_lock:
            reply = self.backend.complete(body)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}],
            "usage": {
                "prompt_tokens": reply.prompt_tokens,
                "completion_tokens": reply.completion_tokens,
                "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            },
        }


def _handler_for(server: OpenAITestServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            log.debug("test server: " + format, *args)

        def _authorized(self) -> bool:
            if server.api_key is None:
                return True
            return self.headers.get("Authorization", "") == f"Bearer {server.api_key}"

        def _send_json(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
            self._send_json(status, {"error": {"message": message, "code": status}}, headers)

        def do_GET(self) -> None:
            authorized = self._authorized()
            if self.path.rstrip("/") == "/v1/models":
                status = 200 if authorized else 401
                if authorized:
                    model = {"id": server.model_name, "object": "model", "owned_by": "draftflow"}
                    self._send_json(200, {"object": "list", "data": [model]})
                else:
                    self._error(401, "invalid API key")
            else:
                status = 404
                self._error(404, f"no route {self.path}")
            server.record(RequestRecord(self.path, "ok", status, None, authorized))

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            authorized = self._authorized()
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._error(404, f"no route {self.path}")
                server.record(RequestRecord(self.path, "ok", 404, None, authorized))
                return
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                self._error(400, "body is not JSON")
                server.record(RequestRecord(self.path, "ok", 400, None, authorized))
                return
            fault = server.faults.take()
            record = RequestRecord(self.path, fault.kind, 0, body, authorized)  # status 0: still answering
            server.record(record)
            record.status = self._answer(body, fault, authorized)

        def _answer(self, body: dict, fault: Fault, authorized: bool) -> int:
            if not authorized:
                self._error(401, "invalid API key")
                return 401
            if fault.kind == "429":
                self._error(429, "rate limited", {"Retry-After": f"{fault.seconds:g}"})
                return 429
            if fault.kind in ("500", "503"):
                self._error(int(fault.kind), "injected server error")
                return int(fault.kind)
            if body.get("model") != server.model_name:
                self._error(404, f"model {body.get('model')!r} is not served here")
                return 404
            time.sleep(server.latency_s + (fault.seconds if fault.kind == "delay" else 0.0))
            reply = server.complete(body)
            if fault.kind == "drop":
                data = json.dumps(reply).encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)  # mid-body: the client sees a cut response
                self.close_connection = True
                return -1
            try:
                self._send_json(200, reply)
            except (BrokenPipeError, ConnectionResetError):
                return -2  # the client left (it timed out)
            return 200

    return Handler


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftflow.engines.servers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gpus = sub.add_parser("check-gpus", help="exit 1 if another process holds a compute context on the GPUs")
    gpus.add_argument("--gpus", default=None, help="comma-separated indices or UUIDs (default: CUDA_VISIBLE_DEVICES or all)")
    endpoint = sub.add_parser("check-endpoint", help="exit 1 unless <url>/models answers (and serves --model)")
    endpoint.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:30000/v1")
    endpoint.add_argument("--model", default=None)
    endpoint.add_argument("--timeout-s", type=float, default=10.0)
    endpoint.add_argument("--api-key-env", default=None, help="name of the environment variable holding the key")
    args = parser.parse_args(argv)
    if args.command == "check-gpus":
        result = check_gpus_free(args.gpus.split(",") if args.gpus else None)
    else:
        key = os.environ.get(args.api_key_env) if args.api_key_env else None
        result = (
            check_served_model(args.url, args.model, args.timeout_s, key)
            if args.model
            else check_endpoint(args.url, args.timeout_s, key)
        )
    status = "ok" if result.ok else "FAILED"
    print(f"{result.name}: {status}: {result.message}", file=sys.stdout if result.ok else sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
