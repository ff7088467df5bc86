"""Stage `tokenize`: chat templates and the assistant-only loss mask.

Expected token lists are built by hand: each test conversation is written out as the pieces
its template must render, each piece marked trainable or not; the pieces are encoded one by
one and concatenated. `tokenize_conversation` must reproduce those ids and that mask exactly,
for four template styles and for a fast tokenizer (offsets) and a slow one (no offsets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftflow import cli
from draftflow.errors import DraftflowError
from draftflow.jsonl import read_jsonl, write_jsonl
from draftflow.data.merge import MergeSettings, merge
from draftflow.data.tokenization import (
    ChatTemplateError,
    TokenizeSettings,
    char_budget,
    mask_by_segments,
    mask_from_offsets,
    render_conversation,
    tokenize_bounded,
    tokenize_conversation,
    tokenize_file,
    tokenize_rendered,
)
from helpers_tokenizers import (
    STYLES,
    TEMPLATES_DIR,
    build_fast_tokenizer,
    build_slow_tokenizer,
    save_remote_code_tokenizer,
)

REPO = Path(__file__).resolve().parent.parent

WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Get the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOLS = [{"type": "function", "function": WEATHER_FUNCTION}]

# system prompt, two user turns, an assistant tool call (arguments as the JSON string our
# records store), a tool result, and a final answer
MESSAGES = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
]

# What each template must render for MESSAGES: (text, trainable) pieces, written by hand.
EXPECTED_PIECES: dict[str, list[tuple[str, int]]] = {
    "llama3": [
        ("<|begin_of_text|>", 0),
        (
            "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nYou can call these "
            'functions. To call one, answer with a JSON object {"name": function name, "parameters": '
            "an object of argument names and values}.\n" + json.dumps(WEATHER_FUNCTION) + "\n\n"
            "You are a weather bot.<|eot_id|>",
            0,
        ),
        ("<|start_header_id|>user<|end_header_id|>\n\nHello there!<|eot_id|>", 0),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("Hello! How can I help you today?<|eot_id|>", 1),
        ("<|start_header_id|>user<|end_header_id|>\n\nWhat is the weather in Paris?<|eot_id|>", 0),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ('Let me check.\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', 1),
        ('<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 21}<|eot_id|>', 0),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("It is sunny and 21 degrees in Paris.<|eot_id|>", 1),
    ],
    "chatml": [
        (
            "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n\nYou may call one or more functions "
            "to assist with the user query.\n\nYou are provided with function signatures within "
            "<tools></tools> XML tags:\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\nFor each "
            "function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call><|im_end|>\n",
            0,
        ),
        ("<|im_start|>user\nHello there!<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        ("Hello! How can I help you today?<|im_end|>", 1),
        ("\n<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            1,
        ),
        ('\n<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n', 0),
        ("<|im_start|>assistant\n", 0),
        ("It is sunny and 21 degrees in Paris.<|im_end|>", 1),
        ("\n", 0),
    ],
    "kimi_k2": [
        (
            "<|im_system|>tool_declare<|im_middle|>"
            + json.dumps(TOOLS, separators=(",", ":"))
            + "<|im_end|>",
            0,
        ),
        ("<|im_system|>system<|im_middle|>You are a weather bot.<|im_end|>", 0),
        ("<|im_user|>user<|im_middle|>Hello there!<|im_end|>", 0),
        ("<|im_assistant|>assistant<|im_middle|>", 0),
        ("Hello! How can I help you today?<|im_end|>", 1),
        ("<|im_user|>user<|im_middle|>What is the weather in Paris?<|im_end|>", 0),
        ("<|im_assistant|>assistant<|im_middle|>", 0),
        (
            "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
            1,
        ),
        ('<|im_system|>get_weather<|im_middle|>## Return of call_0\n{"temperature": 21}<|im_end|>', 0),
        ("<|im_assistant|>assistant<|im_middle|>", 0),
        ("It is sunny and 21 degrees in Paris.<|im_end|>", 1),
    ],
    "deepseek_v3": [
        ("<｜begin▁of▁sentence｜>", 0),
        (
            "You are a weather bot.\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\n"
            "Description: Get the weather in a city.\n\nParameters: "
            + json.dumps(WEATHER_FUNCTION["parameters"])
            + "<｜User｜>Hello there!<｜Assistant｜>",
            0,
        ),
        ("Hello! How can I help you today?<｜end▁of▁sentence｜>", 1),
        ("<｜User｜>What is the weather in Paris?<｜Assistant｜>", 0),
        (
            "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
            1,
        ),
        (
            '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temperature": 21}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>',
            0,
        ),
        ("It is sunny and 21 degrees in Paris.<｜end▁of▁sentence｜>", 1),
    ],
}

# Harder cases for the fast/slow comparison: unicode, multi-line content, content with
# surrounding spaces, an assistant turn that only calls tools (two of them), two tool
# results in a row, an empty answer, consecutive assistant turns.
TRICKY_MESSAGES = [
    {"role": "user", "content": "Is it café weather ☀️ in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 21}'},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 25}'},
    {"role": "assistant", "content": "Paris: 21 °C.\nRome: 25 °C.\n\n  Both sunny.  "},
    {"role": "user", "content": "  Thanks!  "},
    {"role": "assistant", "content": ""},
    {"role": "assistant", "content": "Anything else?"},
]


@pytest.fixture(scope="module")
def fast_tokenizers():
    return {name: build_fast_tokenizer(name) for name in STYLES}


@pytest.fixture(scope="module")
def slow_tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    return {name: build_slow_tokenizer(name, root / name) for name in STYLES}


@pytest.fixture(params=["fast", "slow"])
def tokenizers(request, fast_tokenizers, slow_tokenizers):
    return fast_tokenizers if request.param == "fast" else slow_tokenizers


def expected_sample(tokenizer, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for text, trainable in pieces:
        piece_ids = tokenizer.encode(text, add_special_tokens=False)
        ids += piece_ids
        mask += [trainable] * len(piece_ids)
    return ids, mask


def with_dict_arguments(messages: list[dict]) -> list[dict]:
    """MESSAGES as Hugging Face's docs write them (arguments as objects)."""
    out = json.loads(json.dumps(messages))
    for message in out:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


# ---- the mask, per template style ----------------------------------------------------------


@pytest.mark.parametrize("style", sorted(STYLES))
def test_mask_is_exactly_the_assistant_output(style, tokenizers):
    tokenizer = tokenizers[style]
    pieces = EXPECTED_PIECES[style]
    # the template renders what we wrote down by hand
    assert tokenizer.apply_chat_template(
        with_dict_arguments(MESSAGES), tools=TOOLS, tokenize=False
    ) == "".join(text for text, _ in pieces)
    expected_ids, expected_mask = expected_sample(tokenizer, pieces)

    sample = tokenize_conversation(tokenizer, MESSAGES, TOOLS)

    assert sample.input_ids == expected_ids
    assert sample.loss_mask == expected_mask
    assert sample.num_trainable == sum(expected_mask) > 0
    # the ids are those of the whole text, as the served target tokenizes it
    whole = tokenizer.encode("".join(text for text, _ in pieces), add_special_tokens=False)
    assert sample.input_ids == whole


@pytest.mark.parametrize("style", sorted(STYLES))
def test_ids_are_those_of_apply_chat_template(style, fast_tokenizers):
    tokenizer = fast_tokenizers[style]
    sample = tokenize_conversation(tokenizer, MESSAGES, TOOLS)
    reference = tokenizer.apply_chat_template(
        with_dict_arguments(MESSAGES), tools=TOOLS, tokenize=True, return_dict=False
    )
    assert sample.input_ids == list(reference)


@pytest.mark.parametrize("style", ["llama3", "deepseek_v3"])
def test_bos_written_by_the_template_appears_once_untrained(style, tokenizers):
    tokenizer = tokenizers[style]
    bos_id = tokenizer.convert_tokens_to_ids(STYLES[style].bos)
    assert tokenizer.encode("Hello")[0] == bos_id  # plain encode() would add a second one
    sample = tokenize_conversation(tokenizer, MESSAGES, TOOLS)
    assert sample.input_ids[0] == bos_id and sample.input_ids.count(bos_id) == 1
    assert sample.loss_mask[0] == 0


def test_bos_not_added_when_the_template_does_not_write_it(tokenizers):
    tokenizer = tokenizers["kimi_k2"]
    bos_id = tokenizer.convert_tokens_to_ids("[BOS]")
    assert tokenizer.encode("Hello")[0] == bos_id
    assert bos_id not in tokenize_conversation(tokenizer, MESSAGES, TOOLS).input_ids


def test_end_of_turn_trained_but_not_the_newline_after_it(tokenizers):
    tokenizer = tokenizers["chatml"]
    sample = tokenize_conversation(tokenizer, MESSAGES, TOOLS)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    ids, mask = sample.input_ids, sample.loss_mask
    ends = [t for t, token in enumerate(ids) if token == im_end]
    assistant_ends = [t for t in ends if mask[t] == 1]
    assert len(assistant_ends) == 3  # one per assistant turn; system/user/tool ends are 0
    for t in ends:
        assert ids[t + 1] == newline[0] and mask[t + 1] == 0
        if t + 2 < len(ids):
            assert ids[t + 2] == im_start and mask[t + 2] == 0
    # the generation prompt "<|im_start|>assistant\n" is never trained
    for t, token in enumerate(ids):
        if token == im_start:
            assert mask[t] == 0


def test_trained_text_is_the_assistant_output(fast_tokenizers):
    tokenizer = fast_tokenizers["llama3"]
    sample = tokenize_conversation(tokenizer, TRICKY_MESSAGES, TOOLS)
    trained = tokenizer.decode([i for i, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert trained == (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>'
        "Paris: 21 °C.\nRome: 25 °C.\n\n  Both sunny.<|eot_id|>"  # the template trims content
        "<|eot_id|>"  # an empty answer still ends its turn
        "Anything else?<|eot_id|>"
    )


# ---- fast (offsets) and slow (pieces) paths ------------------------------------------------


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("messages", [MESSAGES, TRICKY_MESSAGES], ids=["weather", "tricky"])
def test_offsets_and_pieces_give_the_same_mask(style, messages, fast_tokenizers):
    tokenizer = fast_tokenizers[style]
    rendered = render_conversation(tokenizer, messages, TOOLS)
    by_offsets = mask_from_offsets(tokenizer, rendered.text, rendered.spans)
    by_pieces = mask_by_segments(tokenizer, rendered.text, rendered.spans)
    assert by_pieces.input_ids == by_offsets.input_ids  # the tokenizations agree here ...
    assert by_pieces.loss_mask == by_offsets.loss_mask  # ... so the masks must too
    assert by_offsets.num_trainable > 0


def test_token_straddling_the_start_of_an_answer_is_trained():
    # a token "t\nH" covers the end of the header "assistant\n" and the answer's first letter:
    # it is trained, since the model generates (part of) it
    tokenizer = build_fast_tokenizer("chatml")
    tokenizer.add_tokens(["t\nH"])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    sample = tokenize_conversation(tokenizer, messages)
    trained = [i for i, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert trained == tokenizer.convert_tokens_to_ids(["t\nH"]) + tokenizer.encode(
        "ello!<|im_end|>", add_special_tokens=False
    )


def test_slow_tokenizer_is_used_without_offsets(slow_tokenizers):
    tokenizer = slow_tokenizers["chatml"]
    assert not tokenizer.is_fast
    rendered = render_conversation(tokenizer, TRICKY_MESSAGES, TOOLS)
    sample = tokenize_conversation(tokenizer, TRICKY_MESSAGES, TOOLS)
    assert sample == mask_by_segments(tokenizer, rendered.text, rendered.spans)
    assert sample.input_ids == tokenizer.encode(rendered.text, add_special_tokens=False)


# ---- conversations the mask cannot come from ---------------------------------------------


def test_conversation_without_assistant_has_nothing_to_train(fast_tokenizers):
    sample = tokenize_conversation(fast_tokenizers["chatml"], [{"role": "user", "content": "Hello there!"}])
    assert sample.input_ids and sample.num_trainable == 0


def test_template_that_rewrites_earlier_turns_is_an_error(fast_tokenizers):
    # like Qwen3: reasoning is shown for the last assistant turn only
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and loop.last %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "look"},
    ]
    with pytest.raises(ChatTemplateError, match="one turn at a time"):
        tokenize_conversation(fast_tokenizers["chatml"], messages, chat_template=template)


def test_assistant_first_is_an_error(fast_tokenizers):
    with pytest.raises(ChatTemplateError, match="starts with an assistant message"):
        tokenize_conversation(fast_tokenizers["chatml"], [{"role": "assistant", "content": "Hi"}])


def test_empty_answer_trains_only_its_end_of_turn(tokenizers):
    # ChatML (like Qwen2.5) writes no newline after the header of an empty answer, so the
    # generation prompt "<|im_start|>assistant\n" is not a prefix of the rendered turn
    tokenizer = tokenizers["chatml"]
    messages = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": ""}]
    rendered = render_conversation(tokenizer, messages)
    [(start, end)] = rendered.spans
    assert rendered.text[start:end] == "<|im_end|>"
    sample = tokenize_conversation(tokenizer, messages)
    assert [i for i, m in zip(sample.input_ids, sample.loss_mask) if m] == tokenizer.convert_tokens_to_ids(
        ["<|im_end|>"]
    )


def test_generation_prompt_with_extra_text_is_not_part_of_the_turn(tokenizers):
    # like Qwen3 without thinking: the prompt alone appends an empty thinking block
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
    )
    tokenizer = tokenizers["chatml"]
    messages = [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is the weather in Paris?"},
        # starts like the prompt's "<think>": the start must not fall inside "<tool_call>"
        {"role": "assistant", "content": '<tool_call>\n{"city": "Paris"}\n</tool_call>'},
    ]
    pieces = [
        ("<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>", 1),
        ("\n<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n", 0),
        ('<tool_call>\n{"city": "Paris"}\n</tool_call><|im_end|>', 1),
        ("\n", 0),
    ]
    sample = tokenize_conversation(tokenizer, messages, chat_template=template)
    assert (sample.input_ids, sample.loss_mask) == expected_sample(tokenizer, pieces)


def test_override_template_is_used(fast_tokenizers):
    tokenizer = fast_tokenizers["chatml"]
    template = (
        (TEMPLATES_DIR / "chatml.jinja").read_text().replace("You are a helpful assistant.", "Be brief.")
    )
    rendered = render_conversation(tokenizer, MESSAGES[1:3], chat_template=template)
    assert rendered.text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_tool_arguments_that_are_not_json_render_as_written(fast_tokenizers):
    messages = [
        {"role": "user", "content": "Hello there!"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "not json"}}],
        },
    ]
    rendered = render_conversation(fast_tokenizers["chatml"], messages)
    start, end = rendered.spans[0]
    assert (
        rendered.text[start:end]
        == '<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call><|im_end|>'
    )


# ---- the stage: files and CLI --------------------------------------------------------------


def conversation_records() -> list[dict]:
    return [
        {"id": "weather-0", "dataset": "D", "messages": MESSAGES, "tools": TOOLS},
        {"id": "no-answer-1", "dataset": "D", "messages": [{"role": "user", "content": "Hello there!"}]},
        {"id": "tricky-2", "dataset": "D", "messages": TRICKY_MESSAGES},
    ]


def test_cli_writes_token_records_and_drops_samples_without_answer(tmp_path, fast_tokenizers, caplog):
    tokenizer_dir = tmp_path / "tokenizer"
    fast_tokenizers["chatml"].save_pretrained(tokenizer_dir)
    write_jsonl(tmp_path / "in.jsonl.zst", conversation_records())
    out = tmp_path / "out" / "shard-0.jsonl.zst"
    caplog.set_level("INFO", logger="draftflow.data.tokenization")

    rc = cli.main(
        [
            "tokenize",
            "--input",
            str(tmp_path / "in.jsonl.zst"),
            "--tokenizer",
            str(tokenizer_dir),
            "--settings",
            '{"chat_template": null, "trust_remote_code": false}',
            "--output",
            str(out),
        ]
    )

    assert rc == 0
    records = list(read_jsonl(out))
    assert [r["id"] for r in records] == ["weather-0", "tricky-2"]
    assert all(set(r) == {"id", "dataset", "input_ids", "loss_mask"} and r["dataset"] == "D" for r in records)
    for record, messages, tools in zip(records, [MESSAGES, TRICKY_MESSAGES], [TOOLS, None]):
        expected = tokenize_conversation(fast_tokenizers["chatml"], messages, tools)
        assert record["input_ids"] == expected.input_ids and record["loss_mask"] == expected.loss_mask
    assert "3 conversations, 2 written, 1 dropped" in caplog.text
    assert "tokens/s" in caplog.text


# ---- bounded work per record ----------------------------------------------------------------

LONG_WORDS = "The quick brown fox jumps over the lazy dog. Hello there! café ☀️ 12345\n"
LONG_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Question " + LONG_WORDS * 40},
    {"role": "assistant", "content": "Let me check. " + LONG_WORDS * 1000},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "Anything else?"},
]


@pytest.mark.parametrize("style", ["llama3", "kimi_k2"])
@pytest.mark.parametrize("max_seq_len", [8, 100, 333, 600])
def test_long_record_is_cut_before_tokenizing_keeping_the_exact_prefix(style, max_seq_len, tokenizers):
    """The cut lands in the system, user or assistant turn: the kept tokens and their mask are
    exactly the first max_seq_len of the whole text's, and the work is bounded by the budget."""
    tokenizer = tokenizers[style]
    rendered = render_conversation(tokenizer, LONG_MESSAGES)
    whole = tokenize_rendered(tokenizer, rendered)
    assert len(whole.input_ids) > 4 * max_seq_len  # the record is far longer than merge keeps
    budget = char_budget(tokenizer, max_seq_len)
    sample, cut_chars = tokenize_bounded(tokenizer, rendered, max_seq_len, budget)
    assert sample.input_ids == whole.input_ids[:max_seq_len]
    assert sample.loss_mask == whole.loss_mask[:max_seq_len]
    assert cut_chars == len(rendered.text) - budget > 0  # the first cut held: nothing more was read
    # a text within the budget is tokenized whole, as before
    assert tokenize_bounded(tokenizer, rendered, max_seq_len, len(rendered.text)) == (whole, 0)


def test_cut_records_are_counted_and_merge_counts_them_truncated(tmp_path, fast_tokenizers):
    tokenizer = fast_tokenizers["llama3"]
    long = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": LONG_WORDS * 1000}]
    short = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hello!"}]
    records = [{"id": "long-0", "dataset": "D", "messages": long}, {"id": "short-1", "dataset": "D", "messages": short}]
    write_jsonl(tmp_path / "in.jsonl.zst", records)
    stats = tokenize_file(tmp_path / "in.jsonl.zst", tmp_path / "tok.jsonl.zst", tokenizer, max_seq_len=64)
    out = list(read_jsonl(tmp_path / "tok.jsonl.zst"))
    rendered = render_conversation(tokenizer, long)
    assert (stats.cut_records, stats.cut_chars) == (1, len(rendered.text) - char_budget(tokenizer, 64))
    assert out[0]["cut_chars"] == stats.cut_chars and len(out[0]["input_ids"]) == 64
    assert out[0]["input_ids"] == tokenize_conversation(tokenizer, long).input_ids[:64]
    assert "cut_chars" not in out[1]  # short records are tokenized whole
    assert out[1]["input_ids"] == tokenize_conversation(tokenizer, short).input_ids

    merged = tmp_path / "merged"
    merge([("D", tmp_path / "tok.jsonl.zst")], MergeSettings.from_dict({"max_seq_len": 64, "min_eval_samples": 0,
                                                                       "eval_fraction": 0}), merged)  # fmt: skip
    manifest = json.loads((merged / "manifest.json").read_text())
    assert manifest["datasets"]["D"]["cut_before_tokenize"] == {"records": 1, "chars": stats.cut_chars}
    assert manifest["total"]["cut_before_tokenize"] == {"records": 1, "chars": stats.cut_chars}
    assert manifest["datasets"]["D"]["all"]["truncated"] == 1 and manifest["datasets"]["D"]["all"]["samples"] == 2
    # a merge with a larger max_seq_len than tokenize used cannot be exact: refused
    with pytest.raises(DraftflowError, match="tokenize ran with a smaller max_seq_len"):
        merge([("D", tmp_path / "tok.jsonl.zst")], MergeSettings.from_dict({"max_seq_len": 128}), tmp_path / "m2")


def test_a_50_mb_record_is_tokenized_in_bounded_memory(tmp_path, fast_tokenizers):
    """The report: one 50 MB record drove tokenize to 8.6 GB and no end. Run the CLI under a 2 GiB
    address-space limit: it must finish, keep max_seq_len tokens and count the cut."""
    fast_tokenizers["llama3"].save_pretrained(tmp_path / "tokenizer")
    words = "The quick brown fox jumps over the lazy dog. Hello there!\n"
    answer = words * (50_000_000 // len(words))
    write_jsonl(tmp_path / "in.jsonl.zst", [{"id": "big-0", "dataset": "D", "messages": [
        {"role": "user", "content": "Write a lot."}, {"role": "assistant", "content": answer}]}])  # fmt: skip
    del answer
    child = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from draftflow import cli\n"
        "rc = cli.main(sys.argv[1:])\n"
        # VmHWM: this process's own peak (ru_maxrss keeps the forking pytest's across exec, and
        # pytest holds ~2 GB once test_real_model has loaded SmolLM2)
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
        "print('maxrss_kb', hwm)\n"
        "sys.exit(rc)\n"
    )
    args = ["tokenize", "--input", str(tmp_path / "in.jsonl.zst"), "--tokenizer", str(tmp_path / "tokenizer"),
            "--settings", '{"max_seq_len": 2048}', "--output", str(tmp_path / "out.jsonl.zst")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (record,) = read_jsonl(tmp_path / "out.jsonl.zst")
    assert len(record["input_ids"]) == len(record["loss_mask"]) == 2048
    assert record["cut_chars"] > 49_000_000
    assert "1 samples longer than the character budget were cut" in proc.stderr
    maxrss_mb = int(proc.stdout.split("maxrss_kb")[1]) / 1024
    assert maxrss_mb < 1200, f"peak memory {maxrss_mb:.0f} MB"


def test_cli_override_template_for_tokenizer_without_one(tmp_path):
    tokenizer = build_fast_tokenizer("kimi_k2")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    write_jsonl(tmp_path / "in.jsonl", conversation_records()[:1])
    args = [
        "tokenize",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--tokenizer",
        str(tmp_path / "tokenizer"),
        "--output",
        str(tmp_path / "out.jsonl"),
    ]

    assert cli.main([*args, "--settings", "{}"]) == 1  # no template anywhere: a clear error
    assert not (tmp_path / "out.jsonl").exists()

    settings = json.dumps({"chat_template": str(STYLES["kimi_k2"].template_path), "trust_remote_code": False})
    assert cli.main([*args, "--settings", settings]) == 0
    [record] = read_jsonl(tmp_path / "out.jsonl")
    expected, mask = expected_sample(tokenizer, EXPECTED_PIECES["kimi_k2"])
    assert record["input_ids"] == expected and record["loss_mask"] == mask


def test_sample_that_fails_to_render_names_file_line_and_id(tmp_path, fast_tokenizers):
    records = conversation_records()
    records.insert(1, {"id": "bad-9", "dataset": "D", "messages": [{"role": "assistant", "content": "Hi"}]})
    write_jsonl(tmp_path / "in.jsonl.zst", records)
    with pytest.raises(DraftflowError, match=r"in\.jsonl\.zst:2: sample bad-9: .*assistant message"):
        tokenize_file(tmp_path / "in.jsonl.zst", tmp_path / "out.jsonl.zst", fast_tokenizers["chatml"])
    assert not (tmp_path / "out.jsonl.zst").exists()


def test_malformed_record_names_the_field(tmp_path, fast_tokenizers):
    write_jsonl(
        tmp_path / "in.jsonl", [{"id": "x", "dataset": "D", "messages": [{"role": "robot", "content": "?"}]}]
    )
    with pytest.raises(DraftflowError, match=r"in\.jsonl:1: field 'messages\[0\]\.role'"):
        tokenize_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", fast_tokenizers["chatml"])


def test_line_that_is_not_json_names_file_and_line(tmp_path, fast_tokenizers):
    good = json.dumps(conversation_records()[0])
    (tmp_path / "in.jsonl").write_text(good + "\n" + good[:-1] + "\n")
    with pytest.raises(DraftflowError, match=r"in\.jsonl:2: not valid JSON"):
        tokenize_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", fast_tokenizers["chatml"])
    assert not (tmp_path / "out.jsonl").exists()


def test_settings_are_checked():
    assert TokenizeSettings.from_dict({}) == TokenizeSettings(None, False)
    with pytest.raises(DraftflowError, match="unknown key"):
        TokenizeSettings.from_dict({"chat_templat": "x.jinja"})
    with pytest.raises(DraftflowError, match="does not exist"):
        TokenizeSettings.from_dict({"chat_template": "/nonexistent/t.jinja"}).read_chat_template()


def test_remote_code_tokenizer_needs_trust(tmp_path, capsys):
    tokenizer_dir = save_remote_code_tokenizer("chatml", tmp_path / "tokenizer")
    write_jsonl(tmp_path / "in.jsonl", conversation_records())
    rc = cli.main(
        [
            "tokenize",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--tokenizer",
            str(tokenizer_dir),
            "--settings",
            '{"chat_template": null, "trust_remote_code": false}',
            "--output",
            str(tmp_path / "out.jsonl"),
        ]
    )
    assert rc == 1 and "trust_remote_code: true" in capsys.readouterr().err


def test_cli_remote_code_tokenizer(tmp_path, slow_tokenizers):
    """A slow tokenizer shipped as remote code, loaded as the rule loads it, in a fresh process
    (so that its module copy goes to a private HF_MODULES_CACHE)."""
    tokenizer_dir = save_remote_code_tokenizer("chatml", tmp_path / "tokenizer")
    write_jsonl(tmp_path / "in.jsonl.zst", conversation_records())
    settings = json.dumps({"chat_template": None, "trust_remote_code": True})
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftflow.cli",
            "tokenize",
            "--input",
            str(tmp_path / "in.jsonl.zst"),
            "--tokenizer",
            str(tokenizer_dir),
            "--settings",
            settings,
            "--output",
            str(tmp_path / "out.jsonl.zst"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    records = list(read_jsonl(tmp_path / "out.jsonl.zst"))
    assert [r["id"] for r in records] == ["weather-0", "tricky-2"]
    expected_ids, expected_mask = expected_sample(slow_tokenizers["chatml"], EXPECTED_PIECES["chatml"])
    assert records[0]["input_ids"] == expected_ids and records[0]["loss_mask"] == expected_mask
