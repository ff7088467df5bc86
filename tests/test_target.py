"""The builtin tiny target: corpus readers, tokenizer + chat template, deterministic build,
offline loading, and the helpers other stages use (resolve_target, target_identity)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from draftflow.config import REPO_ROOT, validate_config
from draftflow.errors import DraftflowError
from draftflow.target import (
    DEFAULT_CORPUS_DIR,
    BuiltinSettings,
    build_target,
    load_target,
    read_corpus,
    resolve_target,
    target_identity,
)

# Small enough to build in a few seconds; the default shape is exercised by one test below.
SMALL = dict(
    seed=0, num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=400, train_steps=12, train_seq_len=64, train_batch_size=4,
    learning_rate=3e-3,
)
CITIES = [("France", "Paris"), ("Spain", "Madrid"), ("Peru", "Lima"), ("Kenya", "Nairobi"),
          ("Japan", "Tokyo"), ("Chile", "Santiago"), ("Norway", "Oslo"), ("Egypt", "Cairo")]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(i: int) -> list[dict]:
    country, city = CITIES[i % len(CITIES)]
    a, b = 3 * i + 1, 7 * i + 2
    return [
        {"role": "user", "content": f"What is the capital of {country}? And what is {a} plus {b}?"},
        {"role": "assistant", "content": f"The capital of {country} is {city}. {a} plus {b} is {a + b}."},
    ]


def write_corpus(folder: Path) -> Path:
    """One file per source layout the builder reads, plus files that hold no conversations."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "chat.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"messages": [{"role": "system", "content": "Be brief."}, *chat(i)]}) + "\n")
    sharegpt = [
        {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                           for m in chat(i)]}
        for i in range(24, 40)
    ]
    sharegpt.append({
        "conversations": [
            {"from": "human", "value": "Weather in Lima?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Lima"}})},
            {"from": "observation", "value": '{"temperature": 21}'},
            {"from": "gpt", "value": "It is 21 degrees in Lima."},
        ],
        "tools": json.dumps([WEATHER_TOOL]),
    })
    (folder / "sharegpt.json").write_text(json.dumps(sharegpt))
    table = pa.table({"messages": [chat(i) for i in range(40, 52)], "num_turns": [1] * 12})
    pq.write_table(table, folder / "chat.parquet")
    with open(folder / "prompts_only.jsonl", "w") as f:
        for i in range(52, 60):
            f.write(json.dumps({"messages": chat(i)[:1]}) + "\n")
    (folder / "prompts.txt").write_text("What is the capital of Peru?\n\nWhat is 3 plus 4?\n")
    (folder / "README.md").write_text("# not a dataset\n")
    return folder


@contextlib.contextmanager
def single_thread():
    """Tiny models run best on one thread, and a shared CPU makes more threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_small(corpus: Path, out: Path, **overrides) -> Path:
    with single_thread():
        build_target(BuiltinSettings.from_dict({**SMALL, **overrides, "corpus": [str(corpus)]}), out)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def small_target(corpus, tmp_path_factory) -> Path:
    return build_small(corpus, tmp_path_factory.mktemp("build") / "target")


# ---- corpus ------------------------------------------------------------------------------


def test_corpus_reads_every_layout(corpus):
    conversations, used = read_corpus([corpus])
    counts = {f.path.name: f.conversations for f in used}
    # README holds no conversations; a folder's prompts.txt is held out (evaluation prompts).
    assert counts == {"chat.jsonl": 24, "sharegpt.json": 17, "chat.parquet": 12, "prompts_only.jsonl": 8}
    assert conversations[0].messages[0] == {"role": "system", "content": "Be brief."}
    tool_conv = next(c for c in conversations if c.tools)
    assert tool_conv.tools == [WEATHER_TOOL]  # the ShareGPT JSON string was parsed
    call = tool_conv.messages[1]
    assert call["role"] == "assistant" and call["content"] == ""
    assert call["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    assert [m["role"] for m in tool_conv.messages] == ["user", "assistant", "tool", "assistant"]
    # Named explicitly, a prompt list is read: one user turn per non-empty line.
    prompts, _ = read_corpus([corpus / "prompts.txt"])
    assert [c.messages for c in prompts] == [
        [{"role": "user", "content": "What is the capital of Peru?"}],
        [{"role": "user", "content": "What is 3 plus 4?"}],
    ]


def test_corpus_errors_name_the_problem(tmp_path):
    with pytest.raises(DraftflowError, match="does not exist"):
        read_corpus([tmp_path / "missing.jsonl"])
    (tmp_path / "notes.md").write_text("hello")
    with pytest.raises(DraftflowError, match="no conversations"):
        read_corpus([tmp_path])


def test_default_corpus_is_the_shipped_samples():
    _, used = read_corpus(None)
    names = {f.path.name for f in used}
    assert all(f.path.parent == DEFAULT_CORPUS_DIR for f in used)
    assert "prompts.txt" not in names and "README.md" not in names
    assert sum(f.conversations for f in used) >= 100


# ---- build -------------------------------------------------------------------------------


def test_build_is_deterministic(small_target, corpus, tmp_path):
    again = build_small(corpus, tmp_path / "again")
    files = sorted(p.name for p in small_target.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json", "build_log.json"} <= set(files)
    for name in files:
        assert (small_target / name).read_bytes() == (again / name).read_bytes(), name
    # A different seed gives a different model: the comparison above can fail.
    other = build_small(corpus, tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (small_target / "model.safetensors").read_bytes()


def test_build_log_records_settings_corpus_and_loss(small_target):
    build_log = json.loads((small_target / "build_log.json").read_text())
    assert build_log["settings"] == SMALL
    assert len(build_log["loss"]) == SMALL["train_steps"]
    assert build_log["loss"][-1] < build_log["loss"][0]
    assert {c["file"] for c in build_log["corpus"]} == {
        "chat.jsonl", "sharegpt.json", "chat.parquet", "prompts_only.jsonl"}


def test_unknown_setting_is_rejected():
    with pytest.raises(DraftflowError, match="unknown key.*train_step"):
        BuiltinSettings.from_dict({"train_step": 3})


OFFLINE_CHECK = r"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 plus 4?"}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=5, do_sample=False)
print(json.dumps({"class": type(model).__name__, "new_tokens": out.shape[1] - ids["input_ids"].shape[1]}))
"""


def test_loads_offline_in_a_fresh_process(small_target, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-c", OFFLINE_CHECK, str(small_target)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["class"] == "LlamaForCausalLM"
    assert 1 <= result["new_tokens"] <= 5


def test_model_and_tokenizer_shape(small_target):
    model, tok = load_target(small_target, "float32", "cpu")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (4, 64, 400)
    assert config.max_position_embeddings == 2048
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert not config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not model.training and model.dtype == torch.float32
    assert tok.eos_token == "<|eot_id|>" and tok.bos_token == "<|begin_of_text|>"
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    for special in ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
    text = "Grüße, 東京! 12 + 30 = 42\n\ttabs  and  spaces"  # byte-level: every string round-trips
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # like Llama 3, plain encoding prepends BOS
    assert tok.decode(ids[1:]) == text
    # Written for transformers 4.x readers too (vLLM, SGLang): generic class, template inline.
    tokenizer_config = json.loads((small_target / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["chat_template"] == tok.chat_template
    assert set(model.generation_config.eos_token_id) == {
        tok.eos_token_id, tok.convert_tokens_to_ids("<|end_of_text|>")}


def test_chat_template_renders_llama3_style(small_target):
    _, tok = load_target(small_target, "float32", "cpu")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"t": 21}'},
        {"role": "assistant", "content": "  It is 21 degrees.\n"},
    ]
    text = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n"
        "You can call these functions:\n" + json.dumps(WEATHER_TOOL) + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Lima?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "arguments": {"city": "Lima"}}<|eot_id|>'
        '<|start_header_id|>tool<|end_header_id|>\n\n{"t": 21}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n  It is 21 degrees.\n<|eot_id|>"  # not trimmed
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # No system message and no tools: no system header; dict arguments become JSON.
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Checking.", "tool_calls": [
             {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
             {"type": "function", "function": {"name": "g", "arguments": "{}"}}]}],
        tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\nChecking.\n{"name": "f", "arguments": {"x": 1}}'
        '\n{"name": "g", "arguments": {}}<|eot_id|>'
    )


# ---- helpers for other stages ------------------------------------------------------------


def test_resolve_target(tmp_path):
    assert resolve_target("builtin:tiny-llama", tmp_path / "results") == tmp_path / "results" / "target"
    with pytest.raises(DraftflowError, match="unknown builtin"):
        resolve_target("builtin:huge", tmp_path)
    with pytest.raises(DraftflowError, match="target.model.*not an existing local directory"):
        resolve_target(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftflowError, match="no config.json"):
        resolve_target(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve_target(str(tmp_path / "model"), tmp_path) == (tmp_path / "model").resolve()


def _fake_model(folder: Path, seed: int = 0, rows: int = 64) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    g = torch.Generator().manual_seed(seed)
    for i in (1, 2):  # two shards, the second one large enough that sampling skips most of it
        tensors = {f"layer{i}.weight": torch.randn(rows * i, 1024, generator=g)}
        save_file(tensors, str(folder / f"model-0000{i}-of-00002.safetensors"))
    return folder


def test_target_identity_is_content_not_path(tmp_path):
    model = _fake_model(tmp_path / "m")
    first = target_identity(model)
    assert first == target_identity(str(model)) and first.startswith("llama@") and len(first) < 40

    # Moved or copied elsewhere, under another name, with unrelated files around it: the same target.
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(model, copy)
    (copy / "README.md").write_text("notes")
    (copy / "build_log.json").write_text("{}")
    assert target_identity(copy) == first
    model.rename(tmp_path / "moved")
    assert target_identity(tmp_path / "moved") == first

    # Fine-tuned weights of the same shapes: same headers and sizes, other bytes.
    tuned = _fake_model(tmp_path / "tuned", seed=1)
    assert [p.stat().st_size for p in sorted(tuned.glob("*.safetensors"))] == [
        p.stat().st_size for p in sorted(copy.glob("*.safetensors"))
    ]
    assert target_identity(tuned) != first
    # Another shape, another config, another tokenizer: another target.
    assert target_identity(_fake_model(tmp_path / "wider", rows=65)) != first
    (copy / "config.json").write_text('{"model_type": "llama", "hidden_size": 9}')
    assert target_identity(copy) != first
    (copy / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    assert target_identity(copy) == first
    (copy / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    assert target_identity(copy) != first


# ---- the default build: fast and not degenerate ------------------------------------------


def is_degenerate(tokens: list[int]) -> bool:
    """One repeated token, or a loop of period <= 4 over the second half."""
    if len(set(tokens)) <= 2:
        return True
    tail = tokens[len(tokens) // 2 :]
    return any(all(tail[i] == tail[i % p] for i in range(len(tail))) for p in range(1, 5))


def test_is_degenerate():
    assert is_degenerate([5] * 48)
    assert is_degenerate([1, 2, 3, 4, 5, 6] + [7, 8, 9] * 14)
    assert not is_degenerate(list(range(48)))


@pytest.mark.slow  # the default build itself (~45 s on 2 cores; timed in BENCHMARKS.md, not here)
def test_default_settings_build_fast_and_not_degenerate(tmp_path):
    settings = validate_config({"datasets": {"x": {"path": "x.jsonl"}}})["target"]["builtin"]
    report = build_target(BuiltinSettings.from_dict(settings), tmp_path / "target")
    losses = report.losses
    assert len(losses) == settings["train_steps"]
    assert sum(losses[-10:]) / 10 < 0.35 * losses[0]  # from ~ln(vocab) to well below

    model, tok = load_target(tmp_path / "target", "float32", "cpu")
    held_out = (REPO_ROOT / "data" / "samples" / "prompts.txt").read_text().splitlines()[:6]
    for prompt in held_out:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        # 48 tokens, end-of-turn or not: the continuation must still look like text.
        out = model.generate(**ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        new = out[0, ids["input_ids"].shape[1]:].tolist()
        assert len(new) == 48
        assert not is_degenerate(new), (prompt, tok.decode(new))
        assert sum(ch.isalpha() for ch in tok.decode(new, skip_special_tokens=True)) >= 20
