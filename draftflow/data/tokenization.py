"""Stage `tokenize`: render conversations with the target's chat template and mark the
tokens the drafter learns from (the assistant's output) in a loss mask.

The drafter must learn to predict exactly what the target generates, so the mask is 1 on the
tokens of each assistant turn's output as the template renders it (content, rendered tool
calls, reasoning if the template shows it) and on the end-of-turn token that ends the turn
(`<|eot_id|>`, `<|im_end|>`, `<｜end▁of▁sentence｜>`, …), and 0 on everything else: system,
user and tool turns, role headers, the generation prompt, BOS, and whitespace the template
writes after the end-of-turn token.

How the assistant spans are found, for any template, without knowing its tokens:

1. Render the whole conversation as text (the template writes BOS itself if it wants one, so
   text is later encoded with `add_special_tokens=False`, exactly as `apply_chat_template`
   and the serving engines do).
2. For each assistant turn i, render the messages before it with the generation prompt: its
   length is where the turn's output starts (see `_output_start` for templates whose prompt
   differs from a finished turn's header). Render the messages up to and including it: its
   length is where the turn ends (whitespace after a trailing control token is cut off).
   These renders must be true prefixes of the whole; a template that renders a turn
   differently once later turns exist (e.g. one that drops the reasoning of past turns) is
   reported as an error, because its assistant tokens cannot be located this way.
3. Map the character spans to tokens: a fast tokenizer encodes the whole text once and its
   offsets say which tokens overlap a span; a slow or remote-code tokenizer (no offsets)
   encodes the text segment by segment, cut at span boundaries, and concatenates.

Bounded work per record: `merge` keeps only the first `max_seq_len` tokens, so a rendered
text longer than a character budget, (max_seq_len + CUT_SLACK_TOKENS) x the tokenizer's
longest token in characters, is tokenized only up to the budget (`tokenize_bounded`). A
prefix of a text tokenizes like the text except near its end (pre-tokenizers split text
into words, and a cut changes only the last of them), and the first `max_seq_len` tokens
are kept only once a cut at twice the budget gives the same ids and mask (else the budget
doubles): they and their mask are those of the whole text (tests compare against whole
texts for four chat styles, fast and slow tokenizers). The record then carries
`cut_chars`, the rendered characters never tokenized, and merge counts it as truncated.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from draftflow.cli import settings_arg
from draftflow.errors import DraftflowError, where
from draftflow.jsonl import read_jsonl, write_jsonl

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
PROGRESS_EVERY_S = 10.0
# A slow tokenizer encodes segment by segment; the first few samples of each file are also
# encoded whole, to warn when the two differ (e.g. a tokenizer that adds a prefix space to
# every call). Checking every sample would double the cost of the slow path.
SEGMENT_CHECK_SAMPLES = 8
# Tokens tokenized past max_seq_len before a cut text's prefix is compared with a longer cut.
CUT_SLACK_TOKENS = 16


class ChatTemplateError(DraftflowError):
    """The chat template cannot render a conversation, or not one turn at a time."""


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]  # same length; 1 = the drafter is trained to predict this token

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class RenderedConversation:
    text: str
    spans: list[tuple[int, int]]  # [start, end) character span of each assistant turn's output


# ---- rendering ---------------------------------------------------------------------------


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Copy `messages` with tool-call arguments that are JSON-object strings parsed to dicts.

    Our records keep OpenAI's JSON-string arguments; vLLM and SGLang parse them to dicts
    before applying the chat template (templates expect objects), so we render what the
    target sees when it is served.
    """
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_parse_arguments(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _parse_arguments(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call  # not JSON: the template renders the string as is
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def control_tokens(tokenizer) -> frozenset[str]:
    """The tokenizer's added tokens (special or not) that are not just whitespace."""
    tokens = {t.content for t in tokenizer.added_tokens_decoder.values()}
    tokens.update(tokenizer.all_special_tokens)
    return frozenset(t for t in tokens if t and not t.isspace())


def _trim_after_control_token(text: str, start: int, end: int, controls: frozenset[str]) -> int:
    """Move `end` back over whitespace that follows a control token ("<|im_end|>\\n" → "<|im_end|>").

    That whitespace is the template's separator between turns, not something the model
    generates: generation stops at the end-of-turn token.
    """
    stripped_end = len(text[start:end].rstrip()) + start
    if stripped_end == end:
        return end
    if any(text.endswith(token, start, stripped_end) for token in controls):
        return stripped_end
    return end


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search: each comparison runs in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _snap_out_of_control_token(text: str, position: int, controls: frozenset[str]) -> int:
    """Move `position` back to the start of a control token it falls inside of, if any."""
    snapped = position
    for token in controls:
        # an occurrence inside this window contains `position` strictly inside it
        j = text.find(token, max(0, position - len(token) + 1), position + len(token) - 1)
        if j != -1:
            snapped = min(snapped, j)
    return snapped


class _Renderer:
    """Renders the first `count` messages of a conversation as text, each prefix once."""

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None, chat_template: str | None):
        self.tokenizer, self.messages, self.tools, self.chat_template = (
            tokenizer,
            messages,
            tools,
            chat_template,
        )
        self._cache: dict[tuple[int, bool], str] = {}

    def __call__(self, count: int, generation_prompt: bool = False) -> str:
        key = (count, generation_prompt)
        if key not in self._cache:
            try:
                self._cache[key] = self.tokenizer.apply_chat_template(
                    self.messages[:count],
                    tools=self.tools,
                    chat_template=self.chat_template,
                    add_generation_prompt=generation_prompt,
                    tokenize=False,
                )
            except Exception as e:  # any failure inside the template is a template/data mismatch
                raise ChatTemplateError(
                    f"the chat template failed on the first {count} messages: {type(e).__name__}: {e}"
                ) from e
        return self._cache[key]


def render_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template: str | None = None
) -> RenderedConversation:
    """Render `messages` as text and find the character span of each assistant turn's output."""
    messages = normalize_messages(messages)
    render = _Renderer(tokenizer, messages, tools or None, chat_template)
    text = render(len(messages))
    controls = control_tokens(tokenizer)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if i == 0:
            raise ChatTemplateError(
                "the conversation starts with an assistant message; a chat template needs a "
                "system or user message before it (fix or drop the sample in `prepare`)"
            )
        through = render(i + 1)  # ... + this assistant turn
        _check_prefix(text, through, i + 1)
        start = _output_start(text, render, i, controls)
        end = _trim_after_control_token(text, start, len(through), controls)
        if end < start or (spans and start < spans[-1][1]):
            raise ChatTemplateError(
                f"assistant message {i}: its rendering ends (character {end}) before it starts "
                f"(character {start}); does the template render assistant turns at all?"
            )
        spans.append((start, end))
    return RenderedConversation(text=text, spans=spans)


def _output_start(text: str, render: _Renderer, i: int, controls: frozenset[str]) -> int:
    """Where assistant turn `i`'s output starts in `text`: right after the generation prompt.

    Usually the earlier messages rendered with the generation prompt are a prefix of the
    whole. Some templates prompt differently from how they render a finished turn (Qwen2.5
    writes no newline after the header of an empty answer; Qwen3 without thinking and
    DeepSeek-R1 append a thinking block to the prompt only): then the output starts where
    prompt and text part, moved back out of any control token that point falls inside.
    """
    before = render(i, True)
    if text.startswith(before):
        return len(before)
    plain = render(i)
    _check_prefix(text, plain, i)
    start = max(_common_prefix_length(text, before), len(plain))
    return _snap_out_of_control_token(text, start, controls)


def _check_prefix(text: str, prefix: str, count: int) -> None:
    if text.startswith(prefix):
        return
    at = _common_prefix_length(text, prefix)
    raise ChatTemplateError(
        f"the chat template does not render this conversation one turn at a time: the first "
        f"{count} messages render as {prefix[max(0, at - 40):at + 40]!r} around character {at}, "
        f"but the whole conversation has {text[max(0, at - 40):at + 40]!r} there. The template "
        "renders a turn differently once later turns exist (e.g. it drops the reasoning of past "
        "assistant turns), so the assistant tokens cannot be located. Set "
        "`tokenize.chat_template` to a template that renders every turn the same way whatever "
        "follows it."
    )


# ---- characters to tokens ----------------------------------------------------------------


def mask_from_offsets(tokenizer, text: str, spans: list[tuple[int, int]]) -> TokenizedSample:
    """Fast tokenizers: encode the whole text once; a token is trainable if it overlaps a span."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    loss_mask = [0] * len(input_ids)
    k = 0  # spans and offsets are both in text order: one pass
    for t, (a, b) in enumerate(encoding["offset_mapping"]):
        while k < len(spans) and spans[k][1] <= a:  # span ends before this token
            k += 1
        if k == len(spans):
            break
        s, e = spans[k]
        # [a, b) overlaps [s, e); a zero-width token counts where it sits
        if (a < e and b > s) or (a == b and s <= a < e):
            loss_mask[t] = 1
    return TokenizedSample(input_ids, loss_mask)


def mask_by_segments(tokenizer, text: str, spans: list[tuple[int, int]]) -> TokenizedSample:
    """Tokenizers without offsets: encode the text in pieces cut at span boundaries.

    Exact when the tokenizer encodes the text after a control token or newline the same
    whether or not it starts the string, which holds for the byte-level BPE and sentencepiece
    tokenizers of chat models (they split text at control tokens themselves).
    """
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for piece_start, piece_end, trainable in _segments(len(text), spans):
        if piece_start == piece_end:
            continue
        ids = tokenizer.encode(text[piece_start:piece_end], add_special_tokens=False)
        input_ids.extend(ids)
        loss_mask.extend([trainable] * len(ids))
    return TokenizedSample(input_ids, loss_mask)


def _segments(length: int, spans: list[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    position = 0
    for start, end in spans:
        yield position, start, 0
        yield start, end, 1
        position = end
    yield position, length, 0


def tokenize_rendered(tokenizer, rendered: RenderedConversation) -> TokenizedSample:
    if getattr(tokenizer, "is_fast", False):
        return mask_from_offsets(tokenizer, rendered.text, rendered.spans)
    return mask_by_segments(tokenizer, rendered.text, rendered.spans)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: its longest vocabulary string (a byte-level
    token's string has one character per byte, so at least as many as the text it encodes)."""
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


def char_budget(tokenizer, max_seq_len: int) -> int:
    """Characters of rendered text that always hold max_seq_len + CUT_SLACK_TOKENS tokens."""
    return (max_seq_len + CUT_SLACK_TOKENS) * longest_token_chars(tokenizer)


def _cut(rendered: RenderedConversation, limit: int) -> RenderedConversation:
    spans = [(s, min(e, limit)) for s, e in rendered.spans if s < limit]
    return RenderedConversation(rendered.text[:limit], spans)


def _prefix(sample: TokenizedSample, length: int) -> TokenizedSample:
    return TokenizedSample(sample.input_ids[:length], sample.loss_mask[:length])


def tokenize_bounded(
    tokenizer, rendered: RenderedConversation, max_seq_len: int | None, budget: int | None
) -> tuple[TokenizedSample, int]:
    """(sample, characters never tokenized): the whole text when it fits in `budget` characters,
    else its first `max_seq_len` tokens and their mask, exactly as the whole text gives them."""
    if max_seq_len is None or budget is None or len(rendered.text) <= budget:
        return tokenize_rendered(tokenizer, rendered), 0
    limit = budget
    sample = tokenize_rendered(tokenizer, _cut(rendered, limit))
    while True:
        if 2 * limit >= len(rendered.text):  # short enough to tokenize whole; merge truncates
            return tokenize_rendered(tokenizer, rendered), 0
        longer = tokenize_rendered(tokenizer, _cut(rendered, 2 * limit))
        # Enough tokens before the cut, and a cut twice as far changes none of the kept ones.
        enough = len(sample.input_ids) >= max_seq_len + CUT_SLACK_TOKENS
        if enough and _prefix(sample, max_seq_len) == _prefix(longer, max_seq_len):
            return _prefix(sample, max_seq_len), len(rendered.text) - limit
        limit, sample = 2 * limit, longer


def tokenize_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, chat_template: str | None = None
) -> TokenizedSample:
    """Token ids of the rendered conversation and its assistant-only loss mask.

    `chat_template` (Jinja source) overrides the tokenizer's own template.
    Raises ChatTemplateError when the template cannot render the conversation turn by turn.
    """
    return tokenize_rendered(tokenizer, render_conversation(tokenizer, messages, tools, chat_template))


# ---- the stage ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizeSettings:
    chat_template: str | None = None  # path to a Jinja file overriding the tokenizer's template
    trust_remote_code: bool = False
    max_seq_len: int | None = None  # merge.max_seq_len: bounds the work per record; None: no bound

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> TokenizeSettings:
        unknown = set(settings) - {"chat_template", "trust_remote_code", "max_seq_len"}
        if unknown:
            raise DraftflowError(
                f"tokenize --settings: unknown key(s) {sorted(unknown)}; expected "
                "'chat_template' (path or null), 'trust_remote_code' (bool) and 'max_seq_len' (int or null)"
            )
        chat_template = settings.get("chat_template")
        trust_remote_code = settings.get("trust_remote_code", False)
        max_seq_len = settings.get("max_seq_len")
        if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len < 1):
            raise DraftflowError(
                f"tokenize --settings: 'max_seq_len' must be a positive integer or null, not {max_seq_len!r}"
            )
        if chat_template is not None and not isinstance(chat_template, str):
            raise DraftflowError(
                f"tokenize --settings: 'chat_template' must be a path or null, not {chat_template!r}"
            )
        if not isinstance(trust_remote_code, bool):
            raise DraftflowError(
                f"tokenize --settings: 'trust_remote_code' must be true or false, not {trust_remote_code!r}"
            )
        return cls(chat_template=chat_template, trust_remote_code=trust_remote_code, max_seq_len=max_seq_len)

    def read_chat_template(self) -> str | None:
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        try:
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DraftflowError(
                f"tokenize.chat_template: {path} does not exist (relative paths start at the "
                "workflow directory)"
            ) from None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load a tokenizer from a local directory, never from the network."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise DraftflowError(f"tokenizer directory {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise DraftflowError(
                f"the tokenizer in {path} ships its own code; set `target.trust_remote_code: true` "
                "if you trust it"
            ) from None
        raise DraftflowError(f"cannot load the tokenizer in {path}: {e}") from None


@dataclass
class TokenizeStats:
    conversations: int = 0
    written: int = 0
    dropped_no_trainable: int = 0  # no assistant output to learn from
    tokens: int = 0  # in written samples
    trainable_tokens: int = 0
    seconds: float = 0.0
    segment_mismatches: int = 0  # slow path: checked samples whose piecewise ids differ
    cut_records: int = 0  # written samples whose rendered text was cut before tokenizing
    cut_chars: int = 0  # rendered characters of those never tokenized

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _check_record(record: Any, path: Path, line: int) -> None:
    if not isinstance(record, dict):
        raise DraftflowError(f"{where(path, line)}: a record must be a JSON object")
    for key in ("id", "dataset"):
        if not isinstance(record.get(key), str):
            raise DraftflowError(f"{where(path, line, key)}: missing or not a string")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DraftflowError(
            f"{where(path, line, 'messages')}: must be a non-empty list (sample {record['id']})"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DraftflowError(
                f"{where(path, line, f'messages[{i}].role')}: must be one of {', '.join(ROLES)} "
                f"(sample {record['id']})"
            )
    if record.get("tools") is not None and not isinstance(record["tools"], list):
        raise DraftflowError(f"{where(path, line, 'tools')}: must be a list (sample {record['id']})")


def _read_records(path: Path) -> Iterator[Any]:
    if not path.is_file():
        raise DraftflowError(f"input file {path} does not exist")
    try:
        yield from read_jsonl(path)
    except ValueError as e:  # a line that is not JSON; the message names file and line
        raise DraftflowError(str(e)) from None


def tokenize_records(
    input_path: Path, tokenizer, chat_template: str | None, stats: TokenizeStats, max_seq_len: int | None = None
) -> Iterator[dict]:
    """Yield the tokenized records of a conversation file; samples with no trainable token are dropped.

    With `max_seq_len`, a record longer than the character budget is tokenized only as far as
    merge keeps it (module docstring) and carries `cut_chars`."""
    fast = getattr(tokenizer, "is_fast", False)
    budget = char_budget(tokenizer, max_seq_len) if max_seq_len is not None else None
    started = last_report = time.monotonic()
    # Our writers put one record per line, so the record number is the line number.
    for line, record in enumerate(_read_records(input_path), start=1):
        _check_record(record, input_path, line)
        try:
            rendered = render_conversation(tokenizer, record["messages"], record.get("tools"), chat_template)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{where(input_path, line)}: sample {record['id']}: {e}") from None
        sample, cut_chars = tokenize_bounded(tokenizer, rendered, max_seq_len, budget)
        if not fast and not cut_chars and stats.conversations < SEGMENT_CHECK_SAMPLES:
            if tokenizer.encode(rendered.text, add_special_tokens=False) != sample.input_ids:
                stats.segment_mismatches += 1
        stats.conversations += 1
        if cut_chars:
            stats.cut_records += 1
            stats.cut_chars += cut_chars
            log.info(
                "%s: sample %s: %d rendered characters, cut to %d before tokenizing (merge keeps %d tokens)",
                where(input_path, line), record["id"], len(rendered.text), len(rendered.text) - cut_chars,
                max_seq_len,
            )  # fmt: skip
        elif sample.num_trainable == 0:
            stats.dropped_no_trainable += 1
            log.debug("%s: sample %s has no assistant output: dropped", where(input_path, line), record["id"])
            continue
        stats.written += 1
        stats.tokens += len(sample.input_ids)
        stats.trainable_tokens += sample.num_trainable
        if time.monotonic() - last_report > PROGRESS_EVERY_S:
            last_report = time.monotonic()
            log.info(
                "%d conversations, %d tokens (%.0f tokens/s)",
                stats.conversations,
                stats.tokens,
                stats.tokens / (last_report - started),
            )
        out = {
            "id": record["id"],
            "dataset": record["dataset"],
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
        }
        if cut_chars:  # merge counts the sample as truncated (it keeps every token given)
            out["cut_chars"] = cut_chars
        yield out


def tokenize_file(
    input_path: str | Path,
    output_path: str | Path,
    tokenizer,
    chat_template: str | None = None,
    max_seq_len: int | None = None,
) -> TokenizeStats:
    """Tokenize a conversation shard (JSONL(.zst)) into a token shard, atomically.

    `max_seq_len` (merge's) bounds the work per record; None tokenizes every text whole."""
    input_path, output_path = Path(input_path), Path(output_path)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise DraftflowError(
            "the tokenizer has no chat template; set `tokenize.chat_template` to a Jinja file"
        )
    stats = TokenizeStats()
    started = time.monotonic()
    write_jsonl(output_path, tokenize_records(input_path, tokenizer, chat_template, stats, max_seq_len))
    stats.seconds = time.monotonic() - started
    _log_summary(input_path, stats)
    return stats


def _log_summary(input_path: Path, stats: TokenizeStats) -> None:
    log.info(
        "%s: %d conversations, %d written, %d dropped (no assistant output); %d tokens, %d trainable "
        "(%.1f%%); %.1f s, %.0f tokens/s",
        input_path,
        stats.conversations,
        stats.written,
        stats.dropped_no_trainable,
        stats.tokens,
        stats.trainable_tokens,
        100.0 * stats.trainable_tokens / max(stats.tokens, 1),
        stats.seconds,
        stats.tokens_per_second,
    )
    if stats.cut_records:
        log.info(
            "%s: %d samples longer than the character budget were cut before tokenizing "
            "(%d characters not tokenized; merge truncates them to max_seq_len anyway)",
            input_path, stats.cut_records, stats.cut_chars,
        )  # fmt: skip
    if stats.segment_mismatches:
        log.warning(
            "%d of the first %d samples tokenize differently in pieces than whole: this tokenizer "
            "has no offsets, so samples are encoded in pieces cut at assistant turns; their ids may "
            "differ slightly from what the served target sees",
            stats.segment_mismatches,
            min(stats.conversations, SEGMENT_CHECK_SAMPLES),
        )


# ---- CLI ---------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.add_argument("--input", required=True, type=Path, help="conversation shard (.jsonl[.zst])")
    parser.add_argument("--tokenizer", required=True, type=Path, help="local tokenizer directory")
    parser.add_argument(
        "--settings",
        type=settings_arg,
        default={},
        help='JSON: {"chat_template": path|null, "trust_remote_code": bool, "max_seq_len": int|null}',
    )
    parser.add_argument("--output", required=True, type=Path, help="token shard (.jsonl[.zst])")


def main(args: argparse.Namespace) -> int:
    settings = TokenizeSettings.from_dict(args.settings)
    chat_template = settings.read_chat_template()
    tokenizer = load_tokenizer(args.tokenizer, settings.trust_remote_code)
    tokenize_file(args.input, args.output, tokenizer, chat_template, settings.max_seq_len)
    return 0
