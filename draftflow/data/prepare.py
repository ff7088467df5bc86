"""Stage `prepare`: normalize one shard of a dataset source to the conversation schema.

    draftflow prepare --dataset NAME --shard I --settings JSON --output OUT.jsonl.zst \
        --rejects REJECTS.jsonl

Sources: JSONL (also `.jsonl.zst` / `.jsonl.gz`, and `.json` files that hold JSONL),
JSON (a list of records, or an object with the list under "data", "conversations" or
"rows"), Parquet, and folders written by `datasets` `save_to_disk` (a Dataset, or a
DatasetDict with `split`).

A JSON list cut off partway (a partial download) still yields its complete records; the
break is one malformed record, located by line, column and byte offset.

Records: OpenAI layout (`messages`, optional `tools`) or ShareGPT layout
(`conversations` of `from`/`value`, optional `system` and `tools`, the latter possibly
a JSON string). Output records follow docs/ARCHITECTURE.md:
`{"id", "dataset", "messages": [...], "tools"?: [...]}` with roles
system/user/assistant/tool; `content` is always a string ("" on an assistant message
that only calls tools).

Every shard job reads the whole source: records are validated and deduplicated in
source order, `max_samples` keeps the first N valid unique ones, and the k-th kept
record goes to shard k % shards. A malformed record (also a JSONL line that is not UTF-8,
named by line and absolute byte offset in the decompressed text) either stops the job (on_error:
fail) with its file, location and field, or (on_error: skip) goes to the rejects file
of shard (position % shards) as `{"line"|"record", "field", "reason", "raw"}`, where
"line" is the 1-based JSONL line and "record" the 0-based index in a JSON list,
Parquet table or saved dataset.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Iterator

import zstandard

from draftflow.cli import settings_arg
from draftflow.errors import DraftflowError, where
from draftflow.jsonl import write_jsonl

log = logging.getLogger(__name__)

FORMATS = ("auto", "openai", "sharegpt")
ON_ERROR = ("fail", "skip")
# Dataset config keys that only later stages read; accepted here so that a whole
# dataset entry can be passed by hand.
IGNORED_KEYS = frozenset({"enabled", "weight", "max_merged"})
# Keys under which a JSON object file may hold its list of records.
JSON_LIST_KEYS = ("data", "conversations", "rows")

# Role names of OpenAI and ShareGPT sources -> our roles (compared lowercased).
ROLE_ALIASES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool",
}
FUNCTION_CALL = "function_call"  # ShareGPT turn: an assistant message that calls tools
ROLES_HELP = ", ".join(sorted(set(ROLE_ALIASES) | {FUNCTION_CALL}))

PROGRESS_EVERY = 100_000  # log a progress line every this many source records


# ---- settings --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareSettings:
    """One dataset's entry of the config (config/schema/config.schema.yaml: datasets.*)."""

    path: str
    format: str = "auto"
    split: str | None = None
    shards: int = 1
    max_samples: int | None = None
    on_error: str = "fail"
    regenerate: bool = False

    @classmethod
    def from_dict(cls, settings: dict) -> PrepareSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known - IGNORED_KEYS)
        if unknown:
            raise DraftflowError(
                f"prepare settings: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(known))}"
            )
        if not isinstance(settings.get("path"), str) or not settings["path"]:
            raise DraftflowError("prepare settings: 'path' (the dataset source) is required")
        # null means "the default" (the schema's defaults for split and max_samples are null)
        result = cls(**{k: v for k, v in settings.items() if k in known and v is not None})
        result._check()
        return result

    def _check(self) -> None:
        problems = []
        if self.format not in FORMATS:
            problems.append(f"format must be one of {', '.join(FORMATS)} (got {self.format!r})")
        if self.on_error not in ON_ERROR:
            problems.append(f"on_error must be one of {', '.join(ON_ERROR)} (got {self.on_error!r})")
        if not isinstance(self.shards, int) or self.shards < 1:
            problems.append(f"shards must be an integer >= 1 (got {self.shards!r})")
        if self.max_samples is not None and (not isinstance(self.max_samples, int) or self.max_samples < 1):
            problems.append(f"max_samples must be null or an integer >= 1 (got {self.max_samples!r})")
        if not isinstance(self.regenerate, bool):
            problems.append(f"regenerate must be true or false (got {self.regenerate!r})")
        if self.split is not None and not isinstance(self.split, str):
            problems.append(f"split must be null or a string (got {self.split!r})")
        if problems:
            raise DraftflowError("prepare settings: " + "; ".join(problems))


# ---- reading sources -------------------------------------------------------------------


@dataclass(frozen=True)
class SourceRecord:
    """One record as read: `raw` is the parsed value, or the line text when `error` is set."""

    index: int  # 0-based position: the line index in JSONL, the record index otherwise
    raw: Any
    error: str | None = None


@dataclass
class Source:
    path: Path
    kind: str  # "jsonl" | "json" | "parquet" | "hf"
    records: Iterator[SourceRecord]

    @property
    def by_line(self) -> bool:
        return self.kind == "jsonl"

    def locate(self, index: int, field_path: str | None = None) -> str:
        """`file:line: field 'x'` for JSONL, `file: record index i: field 'x'` otherwise."""
        if self.by_line:
            return where(self.path, index + 1, field_path)
        text = f"{self.path}: record index {index} (0-based)"
        return f"{text}: field '{field_path}'" if field_path else text

    def position(self, index: int) -> dict:
        """The location key of a rejects entry."""
        return {"line": index + 1} if self.by_line else {"record": index}


def resolve_source(dataset: str, path: str) -> Path:
    """The source path, relative paths taken from the working directory; must exist."""
    resolved = Path(path) if Path(path).is_absolute() else Path.cwd() / path
    if not resolved.exists():
        raise DraftflowError(
            f"dataset {dataset}: source {resolved} does not exist (datasets.{dataset}.path is "
            f"{path!r}; a relative path is resolved against the working directory {Path.cwd()})"
        )
    return resolved


def open_source(path: Path, split: str | None = None) -> Source:
    """Open a dataset source; the kind follows from the folder or the file name."""
    if path.is_dir():
        return Source(path, "hf", _read_saved_dataset(path, split))
    if split is not None:
        raise DraftflowError(
            f"{path}: 'split' ({split!r}) only applies to a folder written by datasets.save_to_disk; "
            "remove it for a file source"
        )
    name = path.name.lower()
    stem = name.removesuffix(".zst").removesuffix(".gz")
    if stem.endswith((".jsonl", ".ndjson")):
        return Source(path, "jsonl", _read_jsonl_lines(_read_text_lines(path)))
    if stem.endswith(".json"):
        return _open_json(path)
    if name.endswith(".parquet"):
        return Source(path, "parquet", _read_parquet(path))
    raise DraftflowError(
        f"{path}: unknown source type; expected .jsonl, .json, .parquet (JSON optionally .zst or "
        ".gz compressed) or a folder written by datasets.save_to_disk"
    )


def _open_binary(path: Path) -> io.BufferedIOBase:
    """The file's (decompressed) bytes; lines are decoded one by one, so that a bad byte is
    located by line and absolute offset rather than by a decoder's buffer position."""
    if path.name.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.BufferedReader(raw)
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


@dataclass(frozen=True)
class TextLine:
    index: int  # 0-based line index (line number - 1)
    offset: int  # byte offset of the line's first byte (in the decompressed stream)
    text: str  # the decoded line; with `error` set, bad bytes replaced by U+FFFD
    error: str | None = None  # "not UTF-8 …" with the absolute byte offset


def _decode_line(path: Path, index: int, offset: int, raw: bytes) -> TextLine:
    try:
        return TextLine(index, offset, raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        stream = " of the decompressed text" if path.name.endswith((".zst", ".gz")) else ""
        error = (
            f"not UTF-8: {e.reason} at byte {offset + e.start}{stream} "
            f"(byte {e.start + 1} of the line: {raw[e.start:e.end]!r}); "
            "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        )
        return TextLine(index, offset, raw.decode("utf-8", errors="replace"), error)


def _read_text_lines(path: Path) -> Iterator[TextLine]:
    """Every line of a text file (split at b"\\n", as line numbers in editors count)."""
    offset = 0
    with _open_binary(path) as f:
        for index, raw in enumerate(f):
            yield _decode_line(path, index, offset, raw)
            offset += len(raw)


def _read_jsonl_lines(lines: Iterable[TextLine]) -> Iterator[SourceRecord]:
    for line in lines:
        if line.error is not None:  # a record like any malformed one: on_error decides
            yield SourceRecord(line.index, line.text.rstrip("\r\n"), line.error)
            continue
        if not line.text.strip():
            continue  # blank lines are not records (but still count as lines)
        text = line.text.rstrip("\r\n")
        try:
            yield SourceRecord(line.index, json.loads(text))
        except json.JSONDecodeError as e:
            yield SourceRecord(line.index, text, f"not valid JSON ({e.msg} at column {e.colno})")


def _open_json(path: Path) -> Source:
    lines = list(_read_text_lines(path))
    bad = next((line for line in lines if line.error is not None), None)
    text = "".join(line.text for line in lines)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object per line: JSONL under a .json name
            return Source(path, "jsonl", _read_jsonl_lines(lines))
        if bad is not None:
            raise DraftflowError(f"{where(path, bad.index + 1)}: {bad.error}") from None
        if text.lstrip().startswith("["):  # a list cut off or broken partway: its complete records count
            return Source(path, "json", _read_json_list_until_break(path, text))
        raise DraftflowError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if bad is not None:  # one JSON document: a bad byte cannot be skipped as a record
        raise DraftflowError(f"{where(path, bad.index + 1)}: {bad.error}")
    if isinstance(data, dict):
        key = next((k for k in JSON_LIST_KEYS if isinstance(data.get(k), list)), None)
        if key is None:
            raise DraftflowError(
                f"{path}: a JSON object file must hold its records as a list under one of "
                f"{', '.join(repr(k) for k in JSON_LIST_KEYS)}; "
                f"found keys {', '.join(map(repr, data)) or 'none'}"
            )
        data = data[key]
    if not isinstance(data, list):
        raise DraftflowError(f"{path}: expected a JSON list of records, got a JSON {type(data).__name__}")
    return Source(path, "json", (SourceRecord(i, r) for i, r in enumerate(data)))


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _json_break(path: Path, text: str, pos: int, complete: int, what: str) -> str:
    """Where a JSON list breaks, for people: line, column and byte offset, and what came before."""
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    offset = len(text[:pos].encode("utf-8"))
    stream = " of the decompressed text" if path.name.endswith((".zst", ".gz")) else ""
    return (
        f"the JSON list breaks at line {line}, column {column} (byte offset {offset}{stream}): {what}; "
        f"{complete} complete record(s) come before it. The file looks cut off or damaged (a partial "
        f"download?): fetch it again, or set on_error: skip to keep the {complete} complete record(s)"
    )


def _read_json_list_until_break(path: Path, text: str) -> Iterator[SourceRecord]:
    """The records of a top-level JSON list that `json.loads` refused, one by one up to the break;
    the break itself is one malformed record (index = the number of complete records before it).

    `text` is the whole document: the records before the break are what a truncated download
    still holds intact (ShareGPT V3 as some packages ship it: 17,671 complete records)."""
    decoder = json.JSONDecoder()
    pos = _skip_whitespace(text, text.index("[") + 1)
    index = 0
    while True:
        start = pos
        try:
            value, pos = decoder.raw_decode(text, start)
        except json.JSONDecodeError as e:
            what = f"record {index} is not complete JSON ({e.msg} line {e.lineno}, column {e.colno})"
            yield SourceRecord(index, text[start:start + 200], _json_break(path, text, start, index, what))
            return
        yield SourceRecord(index, value)
        index += 1
        pos = _skip_whitespace(text, pos)
        if pos >= len(text):
            yield SourceRecord(index, "", _json_break(path, text, pos, index, "the file ends before the list's closing ']'"))
            return
        if text[pos] == "]":  # (text after it made json.loads read the file as JSONL instead)
            return
        if text[pos] != ",":
            what = f"expected ',' or ']' after record {index - 1}, found {text[pos]!r}"
            yield SourceRecord(index, text[pos:pos + 200], _json_break(path, text, pos, index, what))
            return
        pos = _skip_whitespace(text, pos + 1)


def _read_parquet(path: Path) -> Iterator[SourceRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DraftflowError(f"{path}: not a readable Parquet file ({e})") from None
    index = 0
    for batch in table.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield SourceRecord(index, row)
            index += 1


def _read_saved_dataset(path: Path, split: str | None) -> Iterator[SourceRecord]:
    if not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise DraftflowError(
            f"{path}: a folder source must be written by datasets.save_to_disk "
            "(it has neither dataset_dict.json nor state.json)"
        )
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            wanted = "no split is set" if split is None else f"split {split!r} is not there"
            raise DraftflowError(
                f"{path}: the saved DatasetDict has splits {', '.join(splits)} but {wanted}; "
                "set the dataset's 'split' to one of them"
            )
        loaded = loaded[split]
    elif split is not None:
        raise DraftflowError(
            f"{path}: split {split!r} is set but the folder holds a single Dataset; remove 'split'"
        )
    for index, row in enumerate(loaded):
        yield SourceRecord(index, row)


# ---- normalizing records ---------------------------------------------------------------


class RecordError(Exception):
    """A malformed record: which field (a path like `messages[2].role`) and why."""

    def __init__(self, field_path: str | None, reason: str):
        super().__init__(reason)
        self.field = field_path
        self.reason = reason


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)


def normalize_record(raw: Any, fmt: str = "auto", *, prompt_only: bool = False) -> Conversation:
    """Normalize one source record; raises RecordError naming the offending field.

    `fmt` selects the list to read: "openai" -> `messages`, "sharegpt" -> `conversations`,
    "auto" -> whichever is present. Messages may use either role/content or from/value keys.
    `prompt_only` accepts records without an assistant turn (they will be regenerated).
    """
    if not isinstance(raw, dict):
        raise RecordError(None, f"expected a JSON object with a conversation, got {_kind(raw)}")
    key = _messages_key(raw, fmt)
    turns = raw[key]
    if not isinstance(turns, list) or not turns:
        raise RecordError(key, f"expected a non-empty list of messages, got {_kind(turns)}")

    messages: list[dict] = []
    system = raw.get("system") if key == "conversations" else None
    if system is not None:  # ShareGPT variants keep the system prompt beside the turns
        if not isinstance(system, str):
            raise RecordError("system", f"expected a string, got {_kind(system)}")
        if system.strip():
            messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        _append_message(messages, turn, f"{key}[{i}]")

    tools = _normalize_tools(raw.get("tools"), "tools")
    _check_turns(messages, key, prompt_only)
    return Conversation(messages, tools)


def _messages_key(raw: dict, fmt: str) -> str:
    wanted = {"openai": ("messages",), "sharegpt": ("conversations",)}.get(fmt, ("messages", "conversations"))
    for key in wanted:
        if key in raw and raw[key] is not None:
            return key
    expected = " or ".join(f"a '{k}' list" for k in wanted)
    found = ", ".join(map(repr, raw)) or "none"
    raise RecordError(wanted[0], f"missing: expected {expected} (format {fmt}); the record has keys {found}")


def _append_message(messages: list[dict], turn: Any, path: str) -> None:
    if not isinstance(turn, dict):
        raise RecordError(path, f"expected a message object, got {_kind(turn)}")
    role_key = "from" if turn.get("from") is not None else "role"
    content_key = "content" if turn.get("content") is not None or "value" not in turn else "value"
    source_role = turn.get(role_key)
    if not isinstance(source_role, str) or source_role.lower() not in (*ROLE_ALIASES, FUNCTION_CALL):
        raise RecordError(f"{path}.{role_key}", f"expected one of {ROLES_HELP}, got {source_role!r}")
    source_role = source_role.lower()

    if source_role == FUNCTION_CALL:
        calls = _function_call_turn(turn.get(content_key), f"{path}.{content_key}")
        previous = messages[-1] if messages else None
        if previous is not None and previous["role"] == "assistant":
            # "gpt: let me check" + "function_call" (or parallel calls) are one assistant turn.
            previous.setdefault("tool_calls", []).extend(calls)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        return

    role = ROLE_ALIASES[source_role]
    content = _normalize_content(turn.get(content_key), f"{path}.{content_key}")
    message: dict = {"role": role, "content": content}
    tool_calls = _normalize_tool_calls(turn, path, role)
    if tool_calls:
        message["tool_calls"] = tool_calls
    if not content.strip() and not tool_calls:
        raise RecordError(
            f"{path}.{content_key}",
            "empty content; only an assistant message that carries tool_calls may have no content",
        )
    for key in ("tool_call_id", "name") if role == "tool" else ("name",):
        value = turn.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise RecordError(f"{path}.{key}", f"expected a string, got {_kind(value)}")
            message[key] = value
    reasoning = turn.get("reasoning_content")
    if role == "assistant" and reasoning is not None:
        if not isinstance(reasoning, str):
            raise RecordError(f"{path}.reasoning_content", f"expected a string, got {_kind(reasoning)}")
        message["reasoning_content"] = reasoning
    messages.append(message)


def _normalize_content(value: Any, path: str) -> str:
    """A string, null (-> ""), or a list of text parts joined by newlines (as vLLM does)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if isinstance(part, str):
                texts.append(part)
            elif _is_text_part(part):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise RecordError(f"{path}[{j}]", f"only text content parts are supported, got {kind!r}")
        return "\n".join(texts)
    raise RecordError(path, f"expected a string or a list of text parts, got {_kind(value)}")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)


def _normalize_tool_calls(turn: dict, path: str, role: str) -> list[dict]:
    """OpenAI `tool_calls`, or the legacy single `function_call`, of an assistant message."""
    calls: list[dict] = []
    raw_calls = turn.get("tool_calls")
    if raw_calls is not None:
        if not isinstance(raw_calls, list):
            raise RecordError(f"{path}.tool_calls", f"expected a list, got {_kind(raw_calls)}")
        for j, call in enumerate(raw_calls):
            calls.append(_tool_call(call, f"{path}.tool_calls[{j}]"))
    legacy = turn.get("function_call")
    if legacy is not None:
        calls.append(_function(legacy, f"{path}.function_call", call_id=None))
    if calls and role != "assistant":
        raise RecordError(f"{path}.tool_calls", f"only assistant messages may call tools, not {role}")
    return calls


def _tool_call(call: Any, path: str) -> dict:
    if not isinstance(call, dict):
        raise RecordError(path, f"expected a tool call object, got {_kind(call)}")
    if call.get("type", "function") not in ("function", None):
        raise RecordError(f"{path}.type", f"only 'function' tool calls are supported, got {call['type']!r}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise RecordError(f"{path}.id", f"expected a string, got {_kind(call_id)}")
    if "function" not in call:
        raise RecordError(
            f"{path}.function", "missing: a tool call needs a 'function' with 'name' and 'arguments'"
        )
    return _function(call["function"], f"{path}.function", call_id)


def _function(fn: Any, path: str, call_id: str | None) -> dict:
    """{"name", "arguments"} -> our tool call; arguments become a JSON string."""
    if not isinstance(fn, dict):
        raise RecordError(path, f"expected an object with 'name' and 'arguments', got {_kind(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RecordError(f"{path}.name", f"expected the function name as a non-empty string, got {name!r}")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        raise RecordError(f"{path}.arguments", f"expected a JSON string or an object, got {_kind(arguments)}")
    call: dict = {"id": call_id} if call_id is not None else {}
    call.update({"type": "function", "function": {"name": name, "arguments": arguments}})
    return call


def _function_call_turn(value: Any, path: str) -> list[dict]:
    """A ShareGPT function_call value: JSON (string or object) of one call or a list of calls."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RecordError(
                path, f"a function_call value must be JSON with 'name' and 'arguments' ({e.msg})"
            ) from None
    if isinstance(value, dict):
        return [_function(value, path, call_id=None)]
    if isinstance(value, list) and value:
        return [_function(v, f"{path}[{j}]", call_id=None) for j, v in enumerate(value)]
    raise RecordError(
        path, f"a function_call value must be an object with 'name' and 'arguments', got {_kind(value)}"
    )


def _normalize_tools(value: Any, path: str) -> list[dict]:
    """OpenAI tool schemas; a JSON string and bare function schemas are accepted too."""
    if value is None:
        return []
    if isinstance(value, str):
        if not value.strip():
            return []
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RecordError(path, f"a tools string must be a JSON list of tool schemas ({e.msg})") from None
    if not isinstance(value, list):
        raise RecordError(path, f"expected a list of tool schemas, got {_kind(value)}")
    tools = []
    for j, tool in enumerate(value):
        item_path = f"{path}[{j}]"
        if isinstance(tool, dict) and "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}  # a bare function schema
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise RecordError(item_path, "expected a tool schema {'type': 'function', 'function': {'name': …}}")
        if tool.get("type", "function") != "function":
            raise RecordError(f"{item_path}.type", f"only 'function' tools are supported, got {tool['type']!r}")
        name = tool["function"].get("name")
        if not isinstance(name, str) or not name:
            raise RecordError(f"{item_path}.function.name", f"expected a non-empty string, got {name!r}")
        tools.append({**tool, "type": "function"})
    return tools


def _check_turns(messages: list[dict], key: str, prompt_only: bool) -> None:
    roles = {m["role"] for m in messages}
    if messages and messages[0]["role"] == "assistant":  # ShareGPT V3's split-off continuations
        raise RecordError(f"{key}[0].role", "the conversation starts with an assistant message; a chat template "
                                            "needs a system or user message before it")
    if "user" not in roles:
        raise RecordError(key, "no user message; a conversation needs at least one user turn")
    if "assistant" not in roles and not prompt_only:
        raise RecordError(
            key,
            "no assistant message; a conversation needs at least one assistant turn "
            "(set regenerate: true for a prompt-only dataset)",
        )


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ---- ids -------------------------------------------------------------------------------


def canonical_json(value: Any) -> str:
    """Key-sorted, compact JSON: equal data gives equal text whatever the key order."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sample_id(dataset: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    """`{dataset}-{first 16 hex of sha256(canonical JSON of messages and tools)}`."""
    digest = hashlib.sha256(canonical_json({"messages": messages, "tools": tools or []}).encode("utf-8"))
    return f"{dataset}-{digest.hexdigest()[:16]}"


def conversation_record(dataset: str, conversation: Conversation) -> dict:
    record = {
        "id": sample_id(dataset, conversation.messages, conversation.tools),
        "dataset": dataset,
        "messages": conversation.messages,
    }
    if conversation.tools:
        record["tools"] = conversation.tools
    return record


# ---- the stage -------------------------------------------------------------------------


@dataclass
class PrepareStats:
    read: int = 0  # source records looked at (stops early once max_samples are kept)
    kept: int = 0  # valid, unique records kept over all shards
    duplicates: int = 0
    rejected: int = 0  # malformed records over all shards
    written: int = 0  # records written to this shard
    rejects_written: int = 0  # rejects written to this shard's rejects file


def _jsonable(value: Any) -> Any:
    """The raw record as JSON (Parquet/HF rows may hold bytes, dates, …)."""
    return json.loads(json.dumps(value, default=str, ensure_ascii=False))


def prepare_shard(
    dataset: str,
    shard: int,
    settings: PrepareSettings,
    output: str | Path,
    rejects: str | Path,
) -> PrepareStats:
    """Write shard `shard` of `dataset` to `output` and its rejects; an empty dataset is an error
    under on_error: fail, an empty output (with a warning) under skip."""
    if not 0 <= shard < settings.shards:
        raise DraftflowError(f"dataset {dataset}: shard {shard} does not exist (shards: {settings.shards})")
    source = open_source(resolve_source(dataset, settings.path), settings.split)
    stats = PrepareStats()
    reject_entries: list[dict] = []
    started = time.monotonic()

    def shard_records() -> Iterator[dict]:
        seen: set[str] = set()
        for record in source.records:
            if settings.max_samples is not None and stats.kept >= settings.max_samples:
                break
            stats.read += 1
            if stats.read % PROGRESS_EVERY == 0:
                rate = stats.read / max(time.monotonic() - started, 1e-9)
                log.info("%s: read %d records (%.0f/s), kept %d", dataset, stats.read, rate, stats.kept)
            try:
                if record.error is not None:
                    raise RecordError(None, record.error)
                conversation = normalize_record(record.raw, settings.format, prompt_only=settings.regenerate)
            except RecordError as e:
                stats.rejected += 1
                if settings.on_error == "fail":
                    raise DraftflowError(
                        f"{source.locate(record.index, e.field)}: {e.reason} (dataset {dataset}; fix the "
                        f"record, or set on_error: skip to write malformed records to the rejects file)"
                    ) from None
                if record.index % settings.shards == shard:
                    reject_entries.append({**source.position(record.index), "field": e.field,
                                           "reason": e.reason, "raw": _jsonable(record.raw)})
                continue
            out = conversation_record(dataset, conversation)
            if out["id"] in seen:
                stats.duplicates += 1
                continue
            seen.add(out["id"])
            if stats.kept % settings.shards == shard:
                stats.written += 1
                yield out
            stats.kept += 1

    write_jsonl(output, shard_records())
    if stats.kept == 0 and settings.on_error == "fail":
        Path(output).unlink(missing_ok=True)  # no output: the job failed
        raise DraftflowError(
            f"dataset {dataset}: {source.path} holds no records ({stats.read} read); an empty dataset is "
            f"an error under on_error: fail. Check datasets.{dataset}.path (and split), or set "
            f"datasets.{dataset}.enabled: false"
        )
    stats.rejects_written = write_jsonl(rejects, reject_entries)
    log.info(
        "%s shard %d/%d from %s: read %d records, kept %d, duplicates %d, rejected %d; "
        "wrote %d to %s and %d rejects to %s (%.1fs)",
        dataset, shard, settings.shards, source.path, stats.read, stats.kept, stats.duplicates,
        stats.rejected, stats.written, output, stats.rejects_written, rejects, time.monotonic() - started,
    )
    if stats.kept == 0:  # on_error: skip
        log.warning(
            "%s: no valid records in %s (%d read, %d rejected); the dataset is empty",
            dataset, source.path, stats.read, stats.rejected,
        )  # fmt: skip
    return stats


# ---- CLI -------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.add_argument("--dataset", required=True, help="dataset name (the key under datasets:)")
    parser.add_argument("--shard", required=True, type=int, help="shard index, 0 <= I < shards")
    parser.add_argument("--settings", required=True, type=settings_arg,
                        help="JSON: the dataset's config entry (path, format, split, shards, "
                             "max_samples, on_error, regenerate)")
    parser.add_argument("--output", required=True, help="conversation shard (.jsonl.zst)")
    parser.add_argument("--rejects", required=True, help="rejected records of this shard (.jsonl)")


def main(args: argparse.Namespace) -> int:
    settings = PrepareSettings.from_dict(args.settings)
    prepare_shard(args.dataset, args.shard, settings, args.output, args.rejects)
    return 0
