"""The OpenAI-compatible generation engine against a real local server backed by a tiny target.

The server (draftflow.engines.servers.OpenAITestServer) runs draftflow's HF generation engine with
batch size 1 and injects faults: 429 with Retry-After, 500, a delay past the client timeout,
and a connection dropped mid-body. Regeneration through the real `draftflow regenerate` CLI
must survive them and a SIGKILL, and write exactly what the in-process HF engine writes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from draftflow.engines.generation import GenerationRequest, GenerationResult, make_generation_engine
from draftflow.engines.openai_generate import (
    DISABLE_THINKING,
    GenerationFailed,
    OpenAIGenerationEngine,
    OpenAISettings,
    build_body,
    parse_completion,
    read_api_key,
    retry_after_seconds,
    split_think,
)
from draftflow.errors import DraftflowError
from draftflow.jsonl import read_jsonl, write_jsonl
from draftflow.data.regenerate import regenerate_shard
from draftflow.engines.servers import FaultPlan, OpenAITestServer, TargetChatBackend, ensure_tiny_target

MODEL = "draftflow-tiny"
MAX_NEW = 12
KEY_ENV = "DRAFTFLOW_TEST_OPENAI_KEY"
SECRET = "sk-test-" + "7f3a9c2e4b1d8e6f0a5c"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    # Shared with test_servers.py through the session's base temp folder: built once per run.
    return ensure_tiny_target(tmp_path_factory.getbasetemp() / "openai-tiny-target")


@pytest.fixture(scope="module")
def backend(target) -> TargetChatBackend:
    return TargetChatBackend(target, reasoning=True)


def serve(backend, **kwargs) -> OpenAITestServer:
    kwargs.setdefault("lifetime_s", 120)
    return OpenAITestServer(backend=backend, model_name=MODEL, **kwargs).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(*endpoints: str, **openai) -> OpenAISettings:
    values = {"endpoints": endpoints, "model": MODEL, "timeout_s": 5.0, "backoff_s": 0.01, "concurrency": 3, **openai}
    return OpenAISettings.from_settings({"openai": values})


def requests(n: int) -> list[GenerationRequest]:
    topics = ["the sea", "bread", "a red bicycle", "rain in spring", "old maps", "tea", "snow", "a clock"]
    return [
        GenerationRequest([{"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}], max_new_tokens=MAX_NEW)
        for i in range(n)
    ]


_REFERENCE: dict[str, GenerationResult] = {}


def reference(backend: TargetChatBackend, reqs: list[GenerationRequest]) -> list[GenerationResult]:
    """What the in-process HF engine generates for each request alone (batch size 1)."""
    for r in reqs:
        key = json.dumps([r.messages, r.max_new_tokens])
        if key not in _REFERENCE:
            _REFERENCE[key] = backend.engine.generate([r])[0]
    return [_REFERENCE[json.dumps([r.messages, r.max_new_tokens])] for r in reqs]


# ---------------------------------------------------------------- request building and reply parsing


def test_request_body():
    request = GenerationRequest(
        [{"role": "user", "content": "hi", "name": "u"}, {"role": "assistant", "content": "x", "reasoning_content": "r"}],
        tools=[{"type": "function", "function": {"name": "f"}}], max_new_tokens=7, temperature=0.5, top_p=0.9, seed=11,
    )  # fmt: skip
    body = build_body(request, "m", settings("http://h:1/v1"))
    assert body["model"] == "m" and body["max_tokens"] == 7 and body["seed"] == 11 and body["stream"] is False
    assert (body["temperature"], body["top_p"]) == (0.5, 0.9) and body["tools"] == request.tools
    assert body["messages"][1] == {"role": "assistant", "content": "x"}  # reasoning only sent when kept
    assert "chat_template_kwargs" not in body
    assert build_body(request, "m", settings("http://h:1/v1", reasoning="keep"))["messages"][1]["reasoning_content"] == "r"
    disabled = build_body(request, "m", settings("http://h:1/v1", reasoning="disable",
                          extra_body={"chat_template_kwargs": {"x": 1}, "max_completion_tokens": 9, "top_k": 5}))  # fmt: skip
    assert disabled["chat_template_kwargs"] == {**DISABLE_THINKING, "x": 1}
    assert disabled["top_k"] == 5 and disabled["max_completion_tokens"] == 9 and "max_tokens" not in disabled


def test_reply_parsing():
    def reply(message, finish="stop"):
        return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}]}

    r = parse_completion(reply({"content": "A", "reasoning_content": "R"}), "keep")
    assert (r.content, r.reasoning_content, r.finish_reason) == ("A", "R", "stop")
    assert parse_completion(reply({"content": "A", "reasoning_content": "R"}), "drop").reasoning_content is None
    r = parse_completion(reply({"content": "<think>\nhmm\n</think>\n\nAnswer."}, "length"), "keep")
    assert (r.content, r.reasoning_content, r.finish_reason) == ("Answer.", "hmm", "length")
    assert parse_completion(reply({"content": "<think></think>Answer."}), "disable").content == "Answer."
    assert split_think("no thinking") == (None, "no thinking")
    with pytest.raises(Exception, match="tool_calls"):
        parse_completion(reply({"content": None, "tool_calls": [{"id": "c"}]}), "drop")
    assert retry_after_seconds("3") == 3.0 and retry_after_seconds(None) is None
    assert 9 <= retry_after_seconds("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) <= 11


def test_settings_and_key_errors_are_clear(monkeypatch):
    with pytest.raises(DraftflowError, match="endpoints is empty"):
        OpenAISettings.from_settings({"engine": "openai", "openai": {}})
    with pytest.raises(DraftflowError, match="reasoning: 'think'"):
        settings("http://h:1/v1", reasoning="think")
    with pytest.raises(DraftflowError, match="not an http"):
        settings("h:1/v1")
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(DraftflowError, match=f"{KEY_ENV}.*not set"):
        read_api_key(KEY_ENV)


# ---------------------------------------------------------------- the engine against the server


def test_faults_are_retried_and_results_match_the_hf_engine(backend):
    faults = FaultPlan(["429:0.3", "500", "delay:3", "drop", "503"])
    with serve(backend, faults=faults) as server:
        engine = OpenAIGenerationEngine(settings(server.base_url, timeout_s=1.5, concurrency=3), MODEL)
        reqs = requests(6)
        started = time.monotonic()
        results = engine.generate(reqs)
        elapsed = time.monotonic() - started
        engine.close()
    assert results == reference(backend, reqs)  # placed by index, whatever finished first
    statuses = [r.status for r in server.chat_requests()]
    assert {429, 500, 503} <= set(statuses) and -1 in statuses  # -1: the dropped connection
    assert engine._counts["retries"] >= 5 and engine._counts["requests"] == 6
    assert elapsed >= 1.5  # the delayed attempt ran into the client timeout before its retry


def test_retry_after_is_honoured(backend):
    with serve(backend, faults=FaultPlan(["429:0.8"])) as server:
        engine = OpenAIGenerationEngine(settings(server.base_url, concurrency=1), MODEL)
        started = time.monotonic()
        engine.generate(requests(1))
        elapsed = time.monotonic() - started
        engine.close()
    assert elapsed >= 0.8 and [r.status for r in server.chat_requests()] == [429, 200]


def test_requests_spread_over_endpoints_and_avoid_a_dead_one(backend):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with serve(backend) as a, serve(backend) as b:
        engine = OpenAIGenerationEngine(settings(a.base_url, b.base_url, dead, concurrency=4), MODEL)
        reqs = requests(8)
        assert engine.generate(reqs) == reference(backend, reqs)
        engine.close()
    assert len(a.chat_requests()) >= 2 and len(b.chat_requests()) >= 2  # data parallel
    served = {e.url: e.served for e in engine.pool.endpoints}
    assert served[dead] == 0 and served[a.base_url] + served[b.base_url] == 8


def test_abort_after_consecutive_failures_names_the_endpoint():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    engine = OpenAIGenerationEngine(settings(dead, max_consecutive_failures=4, max_retries=20), MODEL)
    with pytest.raises(DraftflowError) as error:
        engine.generate(requests(3))
    message = str(error.value)
    assert "giving up after 4 failed requests in a row" in message and dead in message
    assert "connection failed (ConnectionRefusedError" in message
    with pytest.raises(DraftflowError, match="giving up"):  # stays aborted
        engine.generate(requests(1))
    engine.close()


def test_failed_requests_are_reported_and_logged_while_others_finish(backend, tmp_path):
    with serve(backend, faults=FaultPlan(["500", "500"])) as server:
        engine = OpenAIGenerationEngine(settings(server.base_url, max_retries=1, concurrency=1), MODEL)
        engine.log_errors_to(tmp_path / "errors.jsonl")
        reqs = requests(3)
        with pytest.raises(GenerationFailed) as failed:
            engine.generate(reqs)
        engine.close()
    assert list(failed.value.failures) == [0] and "HTTP 500" in failed.value.failures[0]
    assert failed.value.results[0] is None and failed.value.results[1:] == reference(backend, reqs)[1:]
    lines = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [(e["request"], e["attempt"], e["status"], e["will_retry"]) for e in lines] == [(0, 1, 500, True), (0, 2, 500, False)]


def test_reasoning_keep_drop_disable(backend):
    with serve(backend) as server:
        reqs = requests(2)
        out = {}
        for mode in ("keep", "drop", "disable"):
            engine = OpenAIGenerationEngine(settings(server.base_url, reasoning=mode), MODEL)
            out[mode] = engine.generate(reqs)
            engine.close()
        bodies = [r.body for r in server.chat_requests()]
    assert all(r.reasoning_content and r.reasoning_content.startswith("The request has") for r in out["keep"])
    assert all(r.reasoning_content is None for r in out["drop"] + out["disable"])
    assert [r.content for r in out["keep"]] == [r.content for r in out["drop"]] == [r.content for r in reference(backend, reqs)]
    assert [b.get("chat_template_kwargs") for b in bodies] == [None] * 4 + [DISABLE_THINKING] * 2


def test_wrong_key_and_wrong_model_stop_at_once(backend, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    with serve(backend, api_key="another-key") as server:
        config = {"engine": "openai", "openai": {"endpoints": [server.base_url], "model": MODEL, "api_key_env": KEY_ENV}}
        with pytest.raises(DraftflowError, match="HTTP 401 .*API key was rejected") as error:
            make_generation_engine(config, Path("unused"))
        assert SECRET not in str(error.value)
    with serve(backend) as server:
        config = {"engine": "openai", "openai": {"endpoints": [server.base_url], "model": "Kimi-K2.5"}}
        with pytest.raises(DraftflowError, match=r"serves \['draftflow-tiny'\], not regenerate.openai.model = 'Kimi-K2.5'"):
            make_generation_engine(config, Path("unused"))
        engine = make_generation_engine({"engine": "openai", "openai": {"endpoints": [server.base_url]}}, Path("unused"))
        assert engine.model == MODEL  # the one served model when none is configured
        engine.close()


# ---------------------------------------------------------------- the real `draftflow regenerate` CLI


def conversations() -> list[dict]:
    prompts = ["What is bread made of?", "Describe the sea.", "Why is the sky blue?", "Name a fruit.",
               "How do bicycles work?", "Write a line about rain.", "What is tea?"]  # fmt: skip
    records = [{"id": f"D-{i:02d}", "dataset": "D", "messages": [{"role": "user", "content": p}]} for i, p in enumerate(prompts)]
    records.append({"id": "D-07", "dataset": "D", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "And snow?"},
        {"role": "assistant", "content": "old answer 2"}]})  # fmt: skip
    return records


def run_cli(tmp: Path, shard: Path, target: Path, settings_: dict, out: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "draftflow.cli", "regenerate", "--dataset", "D", "--input", str(shard),
           "--target", str(target), "--settings", json.dumps(settings_), "--state-dir", str(tmp / "state"),
           "--output", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_regenerate_cli_survives_faults_and_sigkill(backend, target, tmp_path):
    shard = tmp_path / "shard-0.jsonl.zst"
    write_jsonl(shard, conversations())
    # What an uninterrupted run of the in-process HF engine (batch size 1) writes.
    hf = {"engine": "hf", "batch_size": 1, "max_new_tokens": MAX_NEW, "device": "cpu"}
    regenerate_shard("D", shard, target, hf, tmp_path / "hf-state", tmp_path / "hf.jsonl.zst")
    expected = list(read_jsonl(tmp_path / "hf.jsonl.zst"))
    assert [r["id"] for r in expected] == [r["id"] for r in conversations()]

    env = {**os.environ, KEY_ENV: SECRET, "PYTHONUNBUFFERED": "1"}
    openai = {"model": MODEL, "api_key_env": KEY_ENV, "timeout_s": 1.5, "backoff_s": 0.01, "concurrency": 2}
    logs = []
    with serve(backend, api_key=SECRET, faults=FaultPlan(["429:0.2", "500", "delay:2.5", "drop", "ok", "500"])) as server:
        config = {"engine": "openai", "batch_size": 3, "max_new_tokens": MAX_NEW,
                  "openai": {**openai, "endpoints": [server.base_url]}}  # fmt: skip
        # 1. faults on every kind, one uninterrupted run
        proc = run_cli(tmp_path, shard, target, config, tmp_path / "faults.jsonl.zst", env)
        logs.append(proc.communicate(timeout=120)[0])
        assert proc.returncode == 0, logs[-1]
        assert list(read_jsonl(tmp_path / "faults.jsonl.zst")) == expected
        assert {"429", "500", "delay", "drop"} <= {r.fault for r in server.chat_requests()}
        assert all(r.authorized for r in server.requests)

        # 2. SIGKILL once the first groups are on disk, then rerun
        server.latency_s = 0.4
        out = tmp_path / "killed.jsonl.zst"
        partial = tmp_path / "state" / "D" / "shard-0.partial.jsonl"
        proc = run_cli(tmp_path, shard, target, config, out, env)
        deadline = time.monotonic() + 60
        while not (partial.exists() and len(partial.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        logs.append(proc.communicate(timeout=30)[0])
        assert proc.returncode == -signal.SIGKILL and not out.exists()
        server.latency_s = 0.0
        proc = run_cli(tmp_path, shard, target, config, out, env)
        logs.append(proc.communicate(timeout=120)[0])
        assert proc.returncode == 0, logs[-1]
        assert "resuming:" in logs[-1]
    records = list(read_jsonl(out))
    assert [r["id"] for r in records] == [r["id"] for r in expected]  # every sample exactly once, in order
    assert records == expected  # equal to the uninterrupted greedy run
    assert not partial.exists()

    # The key never reaches a file or a log.
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".zst":
                data = zstandard.ZstdDecompressor().stream_reader(data).read()
            assert SECRET.encode() not in data, path
    assert all(SECRET not in text for text in logs)
