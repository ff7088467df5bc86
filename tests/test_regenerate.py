"""`regenerate` with the in-process HF engine: which turns are regenerated, that greedy
results equal `model.generate`, and that a run killed with SIGKILL resumes to the same output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftflow.engines.generation import GenerationRequest, GenerationResult, make_generation_engine
from draftflow.errors import DraftflowError
from draftflow.jsonl import read_jsonl, write_jsonl
from draftflow.data.regenerate import (
    RegenerateSettings,
    partial_path,
    regenerate_group,
    regenerate_shard,
    run_fingerprint,
    target_fingerprint,
)
from draftflow.target import BuiltinSettings, build_target, load_target

TARGET = dict(
    seed=0, num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=400, train_steps=150, train_seq_len=64, train_batch_size=8,
    learning_rate=1e-2,
)  # trained enough that greedy answers depend on the prompt
SETTINGS = {"engine": "hf", "batch_size": 3, "max_new_tokens": 16, "temperature": 0.0,
            "top_p": 1.0, "seed": 0, "device": "cpu", "openai": {}}
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}
QUESTIONS = [f"What is {a} plus {b}?" for a, b in [(3, 4), (12, 30), (7, 81), (45, 9), (2, 2), (60, 17)]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run best on one thread, and a shared CPU makes more threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    with open(folder / "chat.jsonl", "w") as f:
        for a in range(40):
            b = (a * 7) % 50
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}. The answer is {a + b}."}]}) + "\n")
    out = tmp_path_factory.mktemp("target") / "target"
    build_target(BuiltinSettings.from_dict({**TARGET, "corpus": [str(folder)]}), out)
    return out


@pytest.fixture(scope="module")
def model_and_tokenizer(target):
    return load_target(target, "float32", "cpu")


def reference_greedy(model_and_tokenizer, messages: list[dict], max_new_tokens: int = 16, tools=None) -> str:
    """What `model.generate` answers for one unpadded prompt, cut at the end of turn."""
    model, tok = model_and_tokenizer
    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eot)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    return tok.decode(new[: new.index(eot)] if eot in new else new, skip_special_tokens=True)


def record(i: int, messages: list[dict], **extra) -> dict:
    return {"id": f"d-{i:04d}", "dataset": "d", "messages": messages, **extra}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **extra) -> dict:
    return {"role": "assistant", "content": text, **extra}


def run(tmp_path: Path, target: Path, records: list[dict], settings: dict = SETTINGS, name="in") -> list[dict]:
    src = tmp_path / f"{name}.jsonl.zst"
    write_jsonl(src, records)
    out = tmp_path / f"{name}.out.jsonl.zst"
    regenerate_shard("d", src, target, settings, tmp_path / "state", out)
    return list(read_jsonl(out))


def test_greedy_equals_model_generate(tmp_path, target, model_and_tokenizer):
    # Prompts of different lengths in batches of 3: left padding must not change the answer.
    records = [record(i, [user(q)]) for i, q in enumerate(QUESTIONS)]
    records[1]["messages"].insert(0, {"role": "system", "content": "Answer with the sum only, then stop."})
    out = run(tmp_path, target, records)
    assert [r["id"] for r in out] == [r["id"] for r in records]
    for rec, got in zip(records, out):
        assert got["messages"][:-1] == rec["messages"]
        expected = reference_greedy(model_and_tokenizer, rec["messages"])
        assert got["messages"][-1] == {"role": "assistant", "content": expected}
    assert len({r["messages"][-1]["content"] for r in out}) > 1  # the answers depend on the prompt


def test_multi_turn_regenerates_each_turn_from_the_regenerated_history(tmp_path, target, model_and_tokenizer):
    system = {"role": "system", "content": "Be brief."}
    original = [system, user(QUESTIONS[0]), assistant("OLD ONE"), user(QUESTIONS[1]), assistant("OLD TWO"),
                user(QUESTIONS[2])]
    out = run(tmp_path, target, [record(0, original)])[0]["messages"]
    first = reference_greedy(model_and_tokenizer, original[:2])
    second = reference_greedy(model_and_tokenizer, [*original[:2], assistant(first), original[3]])
    third = reference_greedy(
        model_and_tokenizer, [*original[:2], assistant(first), original[3], assistant(second), original[5]])
    assert out == [*original[:2], assistant(first), original[3], assistant(second), original[5], assistant(third)]
    assert "OLD" not in json.dumps(out)


def test_tool_calls_and_everything_after_them_are_kept(tmp_path, target, model_and_tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = assistant("", tool_calls=[TOOL_CALL])
    result = {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"t": 21}'}
    only_tools = [user("Weather in Lima?"), call, result, assistant("It is 21 degrees."), user("Thanks")]
    mixed = [user(QUESTIONS[3]), assistant("OLD"), user("Weather in Lima?"), call, result, assistant("21.")]
    out = run(tmp_path, target, [record(0, only_tools, tools=tools), record(1, mixed, tools=tools)])
    assert out[0] == record(0, only_tools, tools=tools)  # untouched, even the final user turn
    regenerated = reference_greedy(model_and_tokenizer, mixed[:1], tools=tools)  # tools are in the prompt
    assert out[1] == record(1, [mixed[0], assistant(regenerated), *mixed[2:]], tools=tools)


def test_sampling_is_seeded(tmp_path, target):
    records = [record(i, [user(q)]) for i, q in enumerate(QUESTIONS)]
    sampled = {**SETTINGS, "temperature": 1.5, "top_p": 0.95}
    a = run(tmp_path / "a", target, records, sampled)
    b = run(tmp_path / "b", target, records, sampled)
    c = run(tmp_path / "c", target, records, {**sampled, "seed": 1})
    assert a == b
    assert a != c


def test_engine_interface_directly(target, model_and_tokenizer):
    engine = make_generation_engine({"engine": "hf", "device": "cpu", "batch_size": 2}, target)
    try:
        requests = [GenerationRequest([user(q)], max_new_tokens=3) for q in QUESTIONS[:3]]
        results = engine.generate(requests)
    finally:
        engine.close()
    assert len(results) == 3
    for request, result in zip(requests, results):
        assert result.content == reference_greedy(model_and_tokenizer, request.messages, 3)
        assert result.finish_reason in {"stop", "length"} and result.reasoning_content is None
    with pytest.raises(DraftflowError, match="unknown engine 'vllm'"):
        make_generation_engine({"engine": "vllm"}, target)


def test_out_of_gpu_memory_names_the_group_and_the_fix(target, monkeypatch):
    """transformers' generate running out of GPU memory (seen on an H200 with one 7k-token prompt in
    a group of 128) becomes an error that names the group's size, its longest prompt and what to change."""
    engine = make_generation_engine({"engine": "hf", "device": "cpu", "batch_size": 2}, target)

    def out_of_memory(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6359.59 GiB.")

    monkeypatch.setattr(engine.model, "generate", out_of_memory)
    requests = [GenerationRequest([user("Hi " * n)], max_new_tokens=8) for n in (3, 40)]
    longest = max(len(engine.prompt_ids(r)) for r in requests)
    with pytest.raises(DraftflowError, match=rf"answering 2 prompts at once, the longest {longest} tokens .*"
                                             r"lower regenerate.batch_size"):
        engine.generate(requests)
    engine.close()


def test_empty_generated_turns_are_kept_and_counted():
    """A target that ends its turn at once gives an empty assistant turn: kept (it is the
    target's answer) and counted, since `prepare` would refuse it on reuse. The engine here is
    a stand-in for a target that answers some prompts with nothing at all."""

    class Silent:  # the GenerationEngine interface: empty for the questions with a 2 in them
        def generate(self, requests):
            return [GenerationResult("" if "2" in r.messages[-1]["content"] else "Four.") for r in requests]

        def close(self):
            pass

    records = [record(i, [user(q)]) for i, q in enumerate(QUESTIONS)]
    out, stats = regenerate_group(records, Silent(), RegenerateSettings.from_dict(SETTINGS))
    silent = [i for i, q in enumerate(QUESTIONS) if "2" in q]
    assert stats.turns == len(QUESTIONS) and stats.empty == len(silent) > 0
    expected = [assistant("" if i in silent else "Four.") for i in range(len(QUESTIONS))]
    assert [r["messages"][-1] for r in out] == expected


def test_bad_input_names_file_line_and_field(tmp_path, target):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(record(0, [user("hi")])) + "\n" + json.dumps({"id": "x", "messages": []}) + "\n")
    with pytest.raises(DraftflowError, match=r"bad.jsonl:2: field 'messages'"):
        regenerate_shard("d", src, target, SETTINGS, tmp_path / "state", tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_keeps_completed_groups_and_discards_stale_state(tmp_path, target):
    records = [record(i, [user(q)]) for i, q in enumerate(QUESTIONS)]
    src = tmp_path / "in.jsonl.zst"
    write_jsonl(src, records)
    clean = run(tmp_path / "clean", target, records)
    partial = partial_path(tmp_path / "state", "d", src)
    assert partial.name == "in.partial.jsonl"
    partial.parent.mkdir(parents=True)

    # A matching header: group 0 is taken as done, whatever it holds (proves it is skipped).
    marked = [{**r, "messages": [*r["messages"], assistant("FROM STATE")]} for r in records[:3]]
    header = run_fingerprint(records, SETTINGS, target_fingerprint(target))
    partial.write_text(json.dumps({"header": header}) + "\n" + json.dumps({"group": 0, "records": marked}) + "\n")
    out = tmp_path / "out.jsonl.zst"
    regenerate_shard("d", src, target, SETTINGS, tmp_path / "state", out)
    assert list(read_jsonl(out)) == marked + clean[3:]
    assert not partial.exists()

    # Written under other settings: discarded, everything recomputed.
    header = run_fingerprint(records, {**SETTINGS, "max_new_tokens": 5}, target_fingerprint(target))
    partial.write_text(json.dumps({"header": header}) + "\n" + json.dumps({"group": 0, "records": marked}) + "\n")
    regenerate_shard("d", src, target, SETTINGS, tmp_path / "state", out)
    assert list(read_jsonl(out)) == clean


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path, target):
    # 20 prompts in groups of 2: 10 groups, each appended to the partial file when done.
    records = [record(i, [user(f"What is {i} plus {2 * i + 1}?")]) for i in range(20)]
    settings = {**SETTINGS, "batch_size": 2, "max_new_tokens": 24}
    src = tmp_path / "shard-0.jsonl.zst"
    write_jsonl(src, records)
    out = tmp_path / "shard-0.out.jsonl.zst"
    state = tmp_path / "state"
    command = [sys.executable, "-m", "draftflow.cli", "regenerate", "--dataset", "d", "--input", str(src),
               "--target", str(target), "--settings", json.dumps(settings), "--state-dir", str(state),
               "--output", str(out)]
    partial = partial_path(state, "d", src)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as in this process (one_thread)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and partial.read_bytes().count(b"\n") >= 3:  # header + 2 groups
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert not out.exists()
    lines = partial.read_bytes().splitlines(keepends=True)
    done = len(lines) - 1
    assert 2 <= done < 10
    # As if the kill had landed mid-write: half a group line at the end.
    with open(partial, "ab") as f:
        f.write(lines[-1][: len(lines[-1]) // 2].replace(b'"group":', b'"group":9'))

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming: {2 * done} of 20 samples already done" in rerun.stderr
    assert "incomplete line" in rerun.stderr
    assert not partial.exists()

    uninterrupted = run(tmp_path / "clean", target, records, settings)
    resumed = list(read_jsonl(out))
    assert resumed == uninterrupted
    assert [r["id"] for r in resumed] == [r["id"] for r in records]  # each sample exactly once, in order
