"""Fake SGLang and vLLM servers on 127.0.0.1 for tests: the endpoints, JSON fields and
Prometheus metric names of the pinned releases (see draftflow.evaluation.engine_counters for
where each name comes from), a scripted "model", and injected faults.

The scripted model is deterministic: a prompt's output tokens and the number of drafts each
verify step accepts follow from the prompt ids, K and the temperature, and every request's
per-step acceptance is logged (`server.log`), so a test can count τ by hand and compare it with
what the client computed from the counters. A verify step drafts K tokens and accepts a of
them (a ≤ tokens still to generate - 1), emitting a + 1; the first token comes from prefill.

Faults (constructor arguments or `--fake-*` flags on the command line):
- `die_after=N`: the (N+1)-th generate request loses its connection and the server stops
  listening (a crash mid-run);
- `no_spec_metrics`: the server speculates but reports no acceptance (SGLang: no spec fields
  in meta_info or server info; vLLM: no spec_decode series in /metrics);
- `reset_after=N`: after N generate requests every counter restarts from zero (vLLM: an engine
  restart behind the same URL; SGLang: the lifetime average restarts).

`python tests/fake_engines.py sglang --model-path M --speculative-algorithm EAGLE3 …` and
`python tests/fake_engines.py vllm --model M --speculative-config '{…}' …` take
the real launch commands' arguments, so `evaluate.server.launcher` can point at them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.14"
VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class ScriptedModel:
    """Outputs and acceptance as pure functions of (prompt, K, temperature)."""

    vocab: int = 1000
    pattern: tuple[int, ...] = (3, 0, 1, 7, 2, 5, 1, 0, 4, 2)  # accepted drafts, capped by K

    def _seed(self, ids: list[int]) -> int:
        return int.from_bytes(hashlib.sha256(json.dumps(ids).encode()).digest()[:4], "little")

    def tokens(self, ids: list[int], n: int) -> list[int]:
        seed = self._seed(ids)
        return [(seed + 7919 * i) % self.vocab for i in range(n)]

    def steps(self, ids: list[int], n: int, k: int, temperature: float) -> list[int]:
        """Accepted drafts per verify step for n generated tokens (the first from prefill)."""
        seed, out, remaining = self._seed(ids), [], n - 1
        while remaining > 0:
            a = self.pattern[(seed + len(out)) % len(self.pattern)]
            a = max(a - 1, 0) if temperature > 0 else a  # sampling accepts a little less
            a = min(a, k, remaining - 1)
            out.append(a)
            remaining -= a + 1
        return out


@dataclass
class Logged:
    path: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    accepted: list[int]  # per verify step ([] without speculative decoding)
    tokens: list[int]


@dataclass
class FakeEngineServer:
    """Base: HTTP plumbing, the scripted model, counters, faults. K = 0: no speculative decoding."""

    k: int = 3
    model_name: str = "fake-target"
    version: str = ""
    model: ScriptedModel = field(default_factory=ScriptedModel)
    die_after: int | None = None
    no_spec_metrics: bool = False
    frozen_metrics: bool = False  # the counters exist but never move (a release that counts elsewhere)
    reset_after: int | None = None
    latency_s: float = 0.0
    port: int = 0
    lifetime_s: float = 600.0
    log: list[Logged] = field(default_factory=list)
    gets: list[str] = field(default_factory=list)  # every GET path asked, in order

    def __post_init__(self) -> None:
        self.version = self.version or self.default_version
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._generate_requests = 0
        self.reset_counters()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._httpd.timeout = 0.2
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    default_version = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- lifecycle (bounded: stops by itself after lifetime_s)

    def serve(self) -> None:
        deadline = time.monotonic() + self.lifetime_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._httpd.handle_request()
        self._httpd.server_close()

    def start(self) -> "FakeEngineServer":
        self._thread = threading.Thread(target=self.serve, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "FakeEngineServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ---- generation with counters

    def reset_counters(self) -> None:
        self.counters = {"steps": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * self.k, "generated": 0}

    def admit(self) -> bool:
        """Count a generate request; False when the server dies on it (fault die_after)."""
        with self._lock:
            self._generate_requests += 1
            if self.die_after is not None and self._generate_requests > self.die_after:
                self._stop.set()
                return False
            if self.reset_after is not None and self._generate_requests == self.reset_after + 1:
                self.reset_counters()
            return True

    def generate(self, path: str, ids: list[int], max_new: int, temperature: float) -> Logged:
        time.sleep(self.latency_s)
        tokens = self.model.tokens(ids, max_new)
        accepted = self.model.steps(ids, max_new, self.k, temperature) if self.k else []
        with self._lock:
            c = self.counters
            c["steps"] += len(accepted)
            c["draft_tokens"] += self.k * len(accepted)
            c["accepted"] += sum(accepted)
            for a in accepted:
                for i in range(a):
                    c["per_pos"][i] += 1
            c["generated"] += len(tokens)
            entry = Logged(path, list(ids), max_new, temperature, accepted, tokens)
            self.log.append(entry)
        return entry

    # ---- routes (subclasses)

    def get(self, path: str) -> tuple[int, Any, str]:
        raise NotImplementedError

    def post(self, path: str, body: dict) -> tuple[int, Any]:
        raise NotImplementedError


def _text(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


@dataclass
class FakeSGLang(FakeEngineServer):
    """SGLang 0.5.14 to 0.5.18: /health, /server_info (and the deprecated /get_server_info),
    /get_model_info, /generate. `info_paths=("/get_server_info",)`: a release before 0.5.6."""

    default_version = SGLANG_VERSION
    info_paths: tuple[str, ...] = ("/server_info", "/get_server_info")

    def server_info(self) -> dict:
        state: dict[str, Any] = {"last_gen_throughput": 0.0}
        c = self.counters
        if self.k and c["steps"] and not self.no_spec_metrics:
            state["avg_spec_accept_length"] = (c["accepted"] + c["steps"]) / c["steps"]
        spec = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": self.k, "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": self.k + 1} if self.k else {  # fmt: skip
            "speculative_algorithm": None, "speculative_num_steps": None, "speculative_eagle_topk": None,
            "speculative_num_draft_tokens": None}  # fmt: skip
        return {"model_path": self.model_name, "tp_size": 1, **spec, "internal_states": [state], "version": self.version}

    def get(self, path: str) -> tuple[int, Any, str]:
        if path in ("/health", "/health_generate"):
            return 200, None, ""
        if path in self.info_paths:
            return 200, self.server_info(), ""
        if path in ("/get_model_info", "/model_info"):
            return 200, {"model_path": self.model_name, "is_generation": True}, ""
        return 404, {"detail": "Not Found"}, ""

    def post(self, path: str, body: dict) -> tuple[int, Any]:
        if path != "/generate":
            return 404, {"detail": "Not Found"}
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids:
            return 400, {"error": {"message": "input_ids required", "code": 400}}
        max_new = int(params.get("max_new_tokens") or 128)
        entry = self.generate(path, ids, max_new, float(params.get("temperature", 1.0)))
        meta: dict[str, Any] = {
            "id": f"req-{len(self.log)}", "finish_reason": {"type": "length", "length": max_new},
            "prompt_tokens": len(ids), "completion_tokens": len(entry.tokens), "cached_tokens": 0,
            "e2e_latency": self.latency_s,
        }  # fmt: skip
        steps = len(entry.accepted)
        if self.k and steps and not self.no_spec_metrics:
            hist = [0] * (max(entry.accepted) + 1)
            for a in entry.accepted:
                hist[a] += 1
            meta.update(
                spec_accept_rate=sum(entry.accepted) / (steps * self.k), spec_accept_length=len(entry.tokens) / steps,
                spec_num_correct_drafts=sum(entry.accepted), spec_num_proposed_drafts=steps * self.k,
                spec_verify_ct=steps, spec_correct_drafts_histogram=hist,
            )  # fmt: skip
        return 200, {"text": _text(entry.tokens), "output_ids": entry.tokens, "meta_info": meta}


class FakeVllm(FakeEngineServer):
    """vLLM 0.25.1 to 0.33.0 (the same routes and spec-decode metrics; 0.32.0 also run here, CPU
    build): /health, /version, /v1/models, /v1/completions, /metrics."""

    default_version = VLLM_VERSION

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.model_name}"'
        c = self.counters
        if self.frozen_metrics:
            c = {**c, "steps": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * self.k}
        lines = [
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(c['generated'])}",
            f"vllm:generation_tokens_created{{{labels}}} 1.7e9",
        ]
        if self.k and not self.no_spec_metrics:
            for name, doc, value in (
                ("spec_decode_num_drafts", "Number of spec decoding drafts.", c["steps"]),
                ("spec_decode_num_draft_tokens", "Number of draft tokens.", c["draft_tokens"]),
                ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", c["accepted"]),
            ):
                lines += [f"# HELP vllm:{name}_total {doc}", f"# TYPE vllm:{name}_total counter",
                          f"vllm:{name}_total{{{labels}}} {float(value)}", f"vllm:{name}_created{{{labels}}} 1.7e9"]  # fmt: skip
            lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
                      "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]  # fmt: skip
            for pos, value in enumerate(c["per_pos"]):
                lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{pos}"}} {float(value)}')
        return "\n".join(lines) + "\n"

    def get(self, path: str) -> tuple[int, Any, str]:
        if path == "/health":
            return 200, None, ""
        if path == "/version":
            return 200, {"version": self.version}, ""
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "vllm"}]}, ""
        if path == "/metrics":
            return 200, self.metrics(), "text/plain; version=0.0.4; charset=utf-8"
        return 404, {"detail": "Not Found"}, ""

    def post(self, path: str, body: dict) -> tuple[int, Any]:
        if path != "/v1/completions":
            return 404, {"detail": "Not Found"}
        if body.get("model") not in (None, self.model_name):
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}}
        ids = body.get("prompt")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": {"message": "this fake takes token-id prompts only", "code": 400}}
        max_new = int(body.get("max_tokens") or 16)
        temperature = body.get("temperature")
        entry = self.generate(path, ids, max_new, 1.0 if temperature is None else float(temperature))
        choice: dict[str, Any] = {"index": 0, "text": _text(entry.tokens), "finish_reason": "length"}
        if body.get("return_token_ids"):
            choice["token_ids"] = entry.tokens
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(entry.tokens), "total_tokens": len(ids) + len(entry.tokens)}
        return 200, {"id": f"cmpl-{len(self.log)}", "object": "text_completion", "model": self.model_name,
                     "choices": [choice], "usage": usage}  # fmt: skip


def _handler_for(server: FakeEngineServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("fake engine: " + format, *args)

        def _send(self, status: int, body: Any, content_type: str = "") -> None:
            if isinstance(body, str):
                data, content_type = body.encode("utf-8"), content_type or "text/plain"
            else:
                data, content_type = (b"" if body is None else json.dumps(body).encode("utf-8")), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0].rstrip("/") or "/"
            server.gets.append(path)
            status, body, content_type = server.get(path)
            self._send(status, body, content_type)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                self._send(400, {"error": {"message": "body is not JSON", "code": 400}})
                return
            path = self.path.split("?")[0].rstrip("/")
            if path in ("/generate", "/v1/completions") and not server.admit():
                self.connection.shutdown(socket.SHUT_RDWR)  # the crash: no answer at all
                self.close_connection = True
                return
            status, answer = server.post(path, body)
            self._send(status, answer)

    return Handler


# ---------------------------------------------------------------- command line (launch tests)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--fake-version", default="")
    parser.add_argument("--fake-die-after", type=int, default=None)
    parser.add_argument("--fake-lifetime-s", type=float, default=600.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake_engines.py")
    sub = parser.add_subparsers(dest="engine", required=True)
    sg = sub.add_parser("sglang", help="takes `python -m sglang.launch_server` arguments")
    sg.add_argument("--model-path", required=True)
    sg.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    sg.add_argument("--speculative-algorithm", default=None)
    sg.add_argument("--speculative-draft-model-path", default=None)
    sg.add_argument("--speculative-num-steps", type=int, default=None)
    sg.add_argument("--speculative-eagle-topk", type=int, default=None)
    sg.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    sg.add_argument("--disable-radix-cache", action="store_true")
    _common(sg)
    vl = sub.add_parser("vllm", help="takes `python -m vllm.entrypoints.openai.api_server` arguments")
    vl.add_argument("--model", required=True)
    vl.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    vl.add_argument("--no-enable-prefix-caching", action="store_true")
    vl.add_argument("--speculative-config", default=None)
    vl.add_argument("--served-model-name", default=None)
    _common(vl)
    args = parser.parse_args(argv)
    if args.engine == "sglang":
        k = (args.speculative_num_draft_tokens - 1) if args.speculative_algorithm else 0
        server: FakeEngineServer = FakeSGLang(k=k, model_name=args.model_path, port=args.port)
    else:
        spec = json.loads(args.speculative_config) if args.speculative_config else {}
        server = FakeVllm(k=int(spec.get("num_speculative_tokens", 0)), model_name=args.served_model_name or args.model,
                          port=args.port)  # fmt: skip
    server.version = args.fake_version or server.version
    server.die_after = args.fake_die_after
    server.lifetime_s = args.fake_lifetime_s
    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    cache_off = getattr(args, "disable_radix_cache", False) or getattr(args, "no_enable_prefix_caching", False)
    cache = "prefix cache off" if cache_off else "prefix cache ON"
    print(f"fake {args.engine} {server.version} on {server.url}, K = {server.k}, dtype {args.dtype}, {cache}", flush=True)
    ipc = bind_ipc_socket() if args.engine == "vllm" else None
    server.serve()
    if ipc is not None:
        ipc.close()  # the file stays, as vLLM's do
    return 0


def bind_ipc_socket() -> socket.socket:
    """As vLLM's `get_open_zmq_ipc_path`: a socket file named by a uuid4 in VLLM_RPC_BASE_PATH (else the
    temp folder), left there when the server stops (vLLM 0.32 on the CPU leaves 2-3 a launch)."""
    path = os.path.join(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir(), str(uuid.uuid4()))
    ipc = socket.socket(socket.AF_UNIX)
    ipc.bind(path)
    print(f"ipc socket {path}", flush=True)
    return ipc


if __name__ == "__main__":
    raise SystemExit(main())
