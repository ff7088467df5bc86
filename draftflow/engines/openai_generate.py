"""Generation engine for OpenAI-compatible chat endpoints: SGLang, vLLM, hosted APIs.

Config `regenerate.openai` (config/schema/config.schema.yaml) drives it:

- several `endpoints` at once (data parallel): each request goes to the endpoint with the
  fewest requests in flight, ties broken round robin; an endpoint that just failed cools
  down (longer after each failure in a row), so its share moves to the others;
- `concurrency` worker threads in total (the standard library only: http.client);
- retries with exponential backoff and jitter on HTTP 429 (honouring Retry-After), 408,
  409, 425 and 5xx, timeouts and dropped connections, up to `max_retries` per request; a
  retry prefers another endpoint;
- an abort after `max_consecutive_failures` failed attempts in a row (over all requests and
  endpoints): a DraftflowError naming the endpoints and the last errors, raised as soon as
  the running requests stop. A rejected API key or unknown model aborts at once;
- a request that still fails (retries exhausted, or a 4xx that retrying cannot fix) does not
  stop the others: `generate` finishes the batch, then raises `GenerationFailed` with the
  results it has and the errors by request index, for the stage to skip those samples or
  stop. `log_errors_to(path)` appends every failed attempt to a JSONL side file;
- `reasoning`: keep (the reply's `reasoning_content`, or a leading <think>…</think> block,
  becomes the result's reasoning_content), drop (discarded), disable (also asks the server
  not to think: chat_template_kwargs {"enable_thinking": false, "thinking": false}, the
  switches of Qwen3 and DeepSeek/Kimi templates);
- sampling: each request's temperature, top_p, max_new_tokens (sent as `max_tokens`) and
  seed; `extra_body` is merged into every request body last (it wins);
- tools: a conversation's `tools` go in the request so that the template renders them as in
  training. vLLM answers any request with tools and no `tool_choice` with HTTP 400 unless it
  runs a tool-call parser (its default tool_choice is then "auto"), so endpoints whose
  /models says `owned_by: vllm` get `tool_choice: "none"` (vLLM still renders the tools; SGLang
  would drop them from the prompt with "none", so it gets none);
- at start, every endpoint must answer /models and serve the model; an endpoint that is not
  up yet (refused, 5xx, timeout) is retried with the same backoff and `max_retries` as a
  request, so a shard job that starts while a server restarts waits for it;
- the API key comes from the environment variable `api_key_env` names. It is sent only as
  the Authorization header and never written to a file or a log: server error texts are
  redacted before they are logged or stored.

Results are placed by request index, so for a greedy server they do not depend on which
request finishes first. Progress (requests done, rate, ETA, retries) is logged every 10 s.
"""

from __future__ import annotations

import email.utils
import hashlib
import http.client
import json
import logging
import os
import random
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from draftflow.engines.generation import GenerationRequest, GenerationResult
from draftflow.errors import DraftflowError

log = logging.getLogger(__name__)

REASONING_MODES = ("keep", "drop", "disable")
DISABLE_THINKING = {"enable_thinking": False, "thinking": False}
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")  # what every API accepts
RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
FATAL_STATUS = {401: "the API key was rejected", 403: "access is forbidden", 404: "the model or route does not exist"}
MAX_BACKOFF_S = 60.0
MAX_RETRY_AFTER_S = 600.0
PROGRESS_EVERY_S = 10.0
# Servers (/models `owned_by`) that reject tools without tool_choice when no tool-call parser runs.
TOOL_CHOICE_NONE_OWNERS = {"vllm"}


class GenerationFailed(DraftflowError):
    """Some requests of a `generate` call failed for good; the others have results."""

    def __init__(self, message: str, results: list[GenerationResult | None], failures: dict[int, str]):
        super().__init__(message)
        self.results = results  # None where the request failed
        self.failures = failures  # request index -> last error


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class OpenAISettings:
    """config `regenerate.openai`."""

    endpoints: tuple[str, ...]
    model: str | None = None
    api_key_env: str | None = None
    concurrency: int = 32
    timeout_s: float = 600.0
    max_retries: int = 6
    backoff_s: float = 1.0
    max_consecutive_failures: int = 50
    reasoning: str = "drop"
    extra_body: dict = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: dict) -> "OpenAISettings":
        """From config `regenerate` (the whole section; only its `openai` part is read)."""
        raw = dict(settings.get("openai") or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise DraftflowError(f"regenerate.openai: unknown key(s) {unknown}; expected {sorted(known)}")
        endpoints = tuple(str(e).rstrip("/") for e in raw.pop("endpoints", None) or ())
        if not endpoints:
            raise DraftflowError(
                "regenerate.engine is 'openai' but regenerate.openai.endpoints is empty: list the servers' "
                "base URLs, e.g. [http://127.0.0.1:30000/v1]"
            )
        for url in endpoints:
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
                raise DraftflowError(f"regenerate.openai.endpoints: {url!r} is not an http(s) URL")
        result = cls(endpoints=endpoints, **raw)
        if result.reasoning not in REASONING_MODES:
            raise DraftflowError(f"regenerate.openai.reasoning: {result.reasoning!r}; use one of {list(REASONING_MODES)}")
        if result.concurrency < 1 or result.max_consecutive_failures < 1 or result.max_retries < 0:
            raise DraftflowError(
                "regenerate.openai: concurrency and max_consecutive_failures must be >= 1, max_retries >= 0"
            )
        return result


def read_api_key(env_name: str | None) -> str | None:
    """The key from the environment variable `env_name` (None: no key)."""
    if not env_name:
        return None
    value = os.environ.get(env_name)
    if not value:
        raise DraftflowError(
            f"regenerate.openai.api_key_env is {env_name!r} but that environment variable is not set "
            f"(or empty): export {env_name}=<your key> before running (the key never goes into the config)"
        )
    return value


# ---------------------------------------------------------------- requests and replies


def build_body(request: GenerationRequest, model: str, settings: OpenAISettings) -> dict[str, Any]:
    """The JSON body of POST /chat/completions for one request."""
    keys = MESSAGE_KEYS + (("reasoning_content",) if settings.reasoning == "keep" else ())
    body: dict[str, Any] = {
        "model": model,
        "messages": [{k: m[k] for k in keys if k in m} for m in request.messages],
        "max_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stream": False,
    }
    if request.tools:
        body["tools"] = request.tools
    if settings.reasoning == "disable":
        body["chat_template_kwargs"] = dict(DISABLE_THINKING)
    extra = dict(settings.extra_body)
    if isinstance(extra.get("chat_template_kwargs"), dict) and "chat_template_kwargs" in body:
        extra["chat_template_kwargs"] = {**body["chat_template_kwargs"], **extra["chat_template_kwargs"]}
    if "max_completion_tokens" in extra:  # newer OpenAI models take this name instead
        body.pop("max_tokens")
    body.update(extra)
    return body


def body_for(body: dict[str, Any], owned_by: str | None) -> dict[str, Any]:
    """The request body as sent to one endpoint: `tool_choice: "none"` for vLLM when tools are sent
    (and extra_body did not choose one)."""
    if body.get("tools") and "tool_choice" not in body and owned_by in TOOL_CHOICE_NONE_OWNERS:
        return {**body, "tool_choice": "none"}
    return body


def split_think(content: str) -> tuple[str | None, str]:
    """A leading '<think>…</think>' block (servers without a reasoning parser) -> (reasoning, answer)."""
    stripped = content.lstrip()
    if stripped.startswith("<think>") and "</think>" in stripped:
        thought, _, answer = stripped[len("<think>") :].partition("</think>")
        return thought.strip(), answer.lstrip()
    return None, content


def parse_completion(reply: Any, reasoning: str) -> GenerationResult:
    """A GenerationResult from a /chat/completions JSON reply; RequestError if it has none."""
    try:
        choice = reply["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RequestError("retry", None, f"reply has no choices[0].message: {str(reply)[:200]}") from None
    content = message.get("content")
    if message.get("tool_calls") and not content:
        raise RequestError(
            "request", None,
            "the server answered with tool_calls (a tool-call parser is on); regeneration stores text "
            "turns only: start the server without --tool-call-parser / --enable-auto-tool-choice",
        )  # fmt: skip
    content = content or ""
    thought = message.get("reasoning_content") or message.get("reasoning")
    think, content = split_think(content)
    thought = thought or think
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    kept = thought if reasoning == "keep" else None
    return GenerationResult(content=content, reasoning_content=kept, finish_reason=finish)


# ---------------------------------------------------------------- HTTP


class RequestError(Exception):
    """One failed attempt. kind: 'retry' (try again), 'request' (this request cannot succeed),
    'fatal' (no request can: stop everything)."""

    def __init__(self, kind: str, status: int | None, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.status, self.message, self.retry_after = kind, status, message, retry_after


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds: a number, or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def post_json(url: str, body: dict | None, headers: dict[str, str], timeout_s: float) -> Any:
    """POST `body` to `url` (GET when it is None); the decoded JSON reply, or RequestError
    classifying the failure."""
    parts = urlsplit(url)
    connection_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_cls(parts.hostname, parts.port, timeout=timeout_s)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        if body is None:
            connection.request("GET", path, headers=headers)
        else:
            data = json.dumps(body).encode("utf-8")
            connection.request("POST", path, body=data, headers={**headers, "Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read()
        status = response.status
        retry_after = retry_after_seconds(response.getheader("Retry-After"))
    except (socket.timeout, TimeoutError):
        raise RequestError("retry", None, f"no answer within the timeout of {timeout_s:g}s") from None
    except (http.client.IncompleteRead, http.client.RemoteDisconnected, http.client.BadStatusLine) as e:
        raise RequestError("retry", None, f"connection dropped mid-response ({type(e).__name__})") from None
    except (ConnectionError, OSError, http.client.HTTPException) as e:
        raise RequestError("retry", None, f"connection failed ({type(e).__name__}: {e})") from None
    finally:
        connection.close()
    text = raw.decode("utf-8", errors="replace")
    if status == 200:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RequestError("retry", status, f"HTTP 200 with a body that is not JSON: {text[:200]!r}") from None
    detail = text[:300].strip()
    if status in RETRYABLE_STATUS or status >= 500:
        raise RequestError("retry", status, f"HTTP {status}: {detail}", retry_after)
    if status in FATAL_STATUS:
        raise RequestError("fatal", status, f"HTTP {status} ({FATAL_STATUS[status]}): {detail}")
    raise RequestError("request", status, f"HTTP {status}: {detail}")


# ---------------------------------------------------------------- endpoints and failures


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:30000/v1
    in_flight: int = 0
    cooldown_until: float = 0.0  # monotonic time before which it is not picked if another is free
    consecutive_failures: int = 0
    served: int = 0
    owned_by: str | None = None  # what its /models says (e.g. vllm, sglang): server quirks

    @property
    def chat_url(self) -> str:
        return self.url + "/chat/completions"


class EndpointPool:
    """Least busy first (ties round robin), endpoints cooling down after a failure last.

    A failed endpoint cools down for the retry delay, and at least `backoff_s × 2^(k-1)` after
    its k-th failure in a row (at most 64×), so a dead server among live ones is tried rarely.
    """

    def __init__(self, urls: tuple[str, ...], backoff_s: float = 1.0, owners: dict[str, str] | None = None):
        self.endpoints = [Endpoint(u, owned_by=(owners or {}).get(u)) for u in urls]
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._turn = 0

    def acquire(self, avoid: Endpoint | None = None) -> tuple[Endpoint, float]:
        """An endpoint (its in-flight count taken) and the seconds to wait before using it."""
        with self._lock:
            now = time.monotonic()
            self._turn += 1
            n = len(self.endpoints)

            def rank(k: int) -> tuple:
                e = self.endpoints[k]
                return (e.cooldown_until > now, e is avoid and n > 1, e.in_flight, (k - self._turn) % n)

            best = self.endpoints[min(range(n), key=rank)]
            best.in_flight += 1
            return best, max(0.0, best.cooldown_until - now)

    def release(self, endpoint: Endpoint, ok: bool | None, cooldown_s: float = 0.0) -> None:
        """ok: the attempt succeeded / failed (cool down), None: not used after all."""
        with self._lock:
            endpoint.in_flight -= 1
            if ok is None:
                return
            if ok:
                endpoint.served += 1
                endpoint.consecutive_failures = 0
            else:
                endpoint.consecutive_failures += 1
                penalty = self.backoff_s * 2 ** min(endpoint.consecutive_failures - 1, 6)
                endpoint.cooldown_until = max(endpoint.cooldown_until, time.monotonic() + max(cooldown_s, penalty))


class FailureTracker:
    """Failed attempts in a row over all requests; the last few errors for the abort message."""

    def __init__(self, limit: int, keep: int = 5):
        self.limit = limit
        self.consecutive = 0
        self.recent: deque[str] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def success(self) -> None:
        with self._lock:
            self.consecutive = 0

    def failure(self, endpoint: str, error: str) -> bool:
        """Record one; True when the limit is reached."""
        with self._lock:
            self.consecutive += 1
            self.recent.append(f"{endpoint}: {error}")
            return self.consecutive >= self.limit


class _Aborted(Exception):
    pass


# ---------------------------------------------------------------- the engine


class OpenAIGenerationEngine:
    """GenerationEngine over OpenAI-compatible /chat/completions endpoints."""

    def __init__(
        self, settings: OpenAISettings, model: str, api_key: str | None = None, owners: dict[str, str] | None = None
    ):
        """owners: endpoint URL -> the `owned_by` of its /models (resolve_model finds them)."""
        self.settings = settings
        self.model = model
        self._headers = {"Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._secret = api_key
        self.pool = EndpointPool(settings.endpoints, settings.backoff_s, owners)
        self.failures = FailureTracker(settings.max_consecutive_failures)
        self._executor = ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix="openai")
        self._abort = threading.Event()
        self._abort_message: str | None = None
        self._errors_path: Path | None = None
        self._errors_lock = threading.Lock()
        self._random = random.Random()
        self._counts = {"requests": 0, "retries": 0, "failed": 0}
        self._counts_lock = threading.Lock()

    def __repr__(self) -> str:  # never show the headers (they hold the key)
        return f"OpenAIGenerationEngine(model={self.model!r}, endpoints={list(self.settings.endpoints)})"

    def log_errors_to(self, path: str | Path | None) -> None:
        """Append every failed attempt to this JSONL file (None: stop)."""
        self._errors_path = Path(path) if path is not None else None

    # -------------------------------------------------------------- generate

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One result per request, in request order (see GenerationFailed for partial failure)."""
        if self._abort.is_set():
            raise DraftflowError(self._abort_message or "the openai engine was aborted")
        results: list[GenerationResult | None] = [None] * len(requests)
        failures: dict[int, str] = {}
        progress = _Progress(len(requests), self._counts)
        futures = {self._executor.submit(self._run_one, i, r): i for i, r in enumerate(requests)}
        for future in as_completed(futures):
            index = futures[future]
            try:
                results[index] = future.result()
            except _Aborted:
                pass
            except RequestError as e:
                failures[index] = self._redact(e.message)
            progress.tick()
        if self._abort.is_set():
            raise DraftflowError(self._abort_message or "the openai engine was aborted")
        progress.finish()
        if failures:
            with self._counts_lock:
                self._counts["failed"] += len(failures)
            index, error = min(failures.items())
            message = f"{len(failures)} of {len(requests)} requests failed (request {index}: {error})"
            raise GenerationFailed(message, results, failures)
        return results  # type: ignore[return-value]

    def _run_one(self, index: int, request: GenerationRequest) -> GenerationResult:
        body = build_body(request, self.model, self.settings)
        attempt, avoid = 0, None
        while True:
            if self._abort.is_set():
                raise _Aborted()
            endpoint, wait = self.pool.acquire(avoid)
            if wait and self._abort.wait(wait):
                self.pool.release(endpoint, ok=None)
                raise _Aborted()
            try:
                sent = body_for(body, endpoint.owned_by)
                reply = post_json(endpoint.chat_url, sent, self._headers, self.settings.timeout_s)
                result = parse_completion(reply, self.settings.reasoning)
            except RequestError as e:
                delay = self._backoff(attempt, e.retry_after)
                # A request the server rightly refused (4xx) says nothing against the server.
                self.pool.release(endpoint, ok=e.kind == "request", cooldown_s=delay)
                will_retry = e.kind == "retry" and attempt < self.settings.max_retries
                self._log_attempt(index, body, endpoint.url, attempt, e, will_retry)
                if e.kind == "fatal":
                    self._abort_with(f"{endpoint.url} refused the request: {self._redact(e.message)}; fix the "
                                     "endpoint, regenerate.openai.model or the key, then rerun")  # fmt: skip
                    raise _Aborted() from None
                if self.failures.failure(endpoint.url, self._redact(e.message)):
                    self._abort_with(self._consecutive_message())
                    raise _Aborted() from None
                if not will_retry:
                    raise
                with self._counts_lock:
                    self._counts["retries"] += 1
                attempt, avoid = attempt + 1, endpoint
                continue
            self.pool.release(endpoint, ok=True)
            self.failures.success()
            with self._counts_lock:
                self._counts["requests"] += 1
            return result

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """Exponential backoff with jitter; at least the server's Retry-After."""
        delay = min(MAX_BACKOFF_S, self.settings.backoff_s * 2**attempt) * self._random.uniform(0.5, 1.5)
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
        return delay

    def _abort_with(self, message: str) -> None:
        if not self._abort.is_set():
            self._abort_message = message
            self._abort.set()
            log.error("openai engine: %s", message)

    def _consecutive_message(self) -> str:
        endpoints = sorted({line.split(": ", 1)[0] for line in self.failures.recent})
        last = "\n".join(f"  {line}" for line in self.failures.recent)
        return (
            f"giving up after {self.failures.consecutive} failed requests in a row to {', '.join(endpoints)}; "
            f"last errors:\n{last}\nCheck that the server(s) run and answer "
            "(python -m draftflow.engines.servers check-endpoint --url <endpoint>), then rerun: finished samples "
            "are kept. regenerate.openai.max_consecutive_failures sets this limit."
        )

    def _redact(self, text: str) -> str:
        return text.replace(self._secret, "[redacted]") if self._secret else text

    def _log_attempt(
        self, index: int, body: dict, endpoint: str, attempt: int, error: RequestError, will_retry: bool
    ) -> None:
        message = self._redact(error.message)
        (log.warning if will_retry else log.error)(
            "request %d attempt %d at %s failed: %s%s", index, attempt + 1, endpoint, message,
            " (retrying)" if will_retry else "",
        )  # fmt: skip
        if self._errors_path is None:
            return
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "request": index,
            "messages_sha256": _digest(body["messages"]),
            "endpoint": endpoint,
            "attempt": attempt + 1,
            "status": error.status,
            "error": message,
            "will_retry": will_retry,
        }
        with self._errors_lock:
            self._errors_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._errors_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._abort.set()  # running requests stop at their next step
        self._executor.shutdown(wait=True, cancel_futures=True)


def _digest(obj: Any) -> str:
    """A short hash to find a request in the side file without copying its text there."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class _Progress:
    """Requests of one `generate` call done, with rate and ETA, at most every 10 s."""

    def __init__(self, total: int, counts: dict[str, int]):
        self.total, self.done, self.counts = total, 0, counts
        self.started = self.last = time.monotonic()

    def tick(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self._log(now)

    def finish(self) -> None:
        if time.monotonic() - self.started >= PROGRESS_EVERY_S:
            self._log(time.monotonic())

    def _log(self, now: float) -> None:
        rate = self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        log.info(
            "openai: %d/%d requests (%.2f req/s, ETA %.0fs); so far %d done, %d retries, %d failed",
            self.done, self.total, rate, eta, self.counts["requests"], self.counts["retries"], self.counts["failed"],
        )  # fmt: skip


def wait_for_endpoint(url: str, settings: OpenAISettings, api_key: str | None) -> str | None:
    """GET <url>/models until it answers, retrying what a request would retry (refused, 5xx,
    timeouts; same backoff, at most `max_retries` retries); the `owned_by` of its first model.

    Gives up quietly on an answer no retry can change (401, 404, …): `resolve_model`'s check
    then says what is wrong.
    """
    headers = {"Accept": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    timeout = min(settings.timeout_s, 30.0)
    jitter = random.Random()
    for attempt in range(settings.max_retries + 1):
        try:
            reply = post_json(url + "/models", None, headers, timeout)
        except RequestError as e:
            if e.kind != "retry" or attempt == settings.max_retries:
                return None
            delay = min(MAX_BACKOFF_S, settings.backoff_s * 2**attempt) * jitter.uniform(0.5, 1.5)
            message = e.message.replace(api_key, "[redacted]") if api_key else e.message
            log.warning("%s/models attempt %d failed: %s (retrying in %.1fs; regenerate.openai.max_retries)",
                        url, attempt + 1, message, delay)  # fmt: skip
            time.sleep(delay)
            continue
        data = reply.get("data") if isinstance(reply, dict) else None
        first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        owner = first.get("owned_by")
        return str(owner) if owner is not None else None
    return None


def resolve_model(settings: OpenAISettings, api_key: str | None) -> tuple[str, dict[str, str]]:
    """The served model every endpoint must offer (regenerate.openai.model, or the one model
    served), and each endpoint's `owned_by` (server quirks: `body_for`)."""
    from draftflow.engines.servers import check_served_model

    model = settings.model
    owners: dict[str, str] = {}
    timeout = min(settings.timeout_s, 30.0)
    for url in settings.endpoints:
        owner = wait_for_endpoint(url, settings, api_key)
        if owner is not None:
            owners[url] = owner
        result = check_served_model(url, model, timeout, api_key)
        if not result.ok:
            raise DraftflowError(f"regenerate.openai: {result.message}")
        model = model or result.details["models"][0]
    return str(model), owners


def create_engine(settings: dict, target_dir: Path) -> OpenAIGenerationEngine:
    """The engine for config `regenerate` with engine 'openai' (target_dir is not used)."""
    openai = OpenAISettings.from_settings(settings)
    api_key = read_api_key(openai.api_key_env)
    model, owners = resolve_model(openai, api_key)
    log.info(
        "openai engine: model %r at %s (%s), %d concurrent requests, reasoning %s",
        model, ", ".join(openai.endpoints), ", ".join(sorted(set(owners.values()))) or "server unknown",
        openai.concurrency, openai.reasoning,
    )  # fmt: skip
    return OpenAIGenerationEngine(openai, model, api_key, owners)
