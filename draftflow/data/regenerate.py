"""`regenerate`: replace a shard's assistant responses with the target's own.

A drafter learns to predict the target, so training on the target's own responses (rather
than some other model's) raises acceptance. For each conversation:

- assistant turns are regenerated in order, each from the messages before it, with earlier
  assistant turns already replaced by regenerated ones;
- a conversation that ends with a user turn (a prompt-only record) gets one generated
  assistant turn appended;
- an assistant turn that carries `tool_calls` is kept as-is, and so is everything after it:
  a text engine must not invent tool protocol (call ids, argument JSON), and the tool results
  that follow answer the original calls, so nothing after them can be regenerated
  consistently.

Batching and exactness: batched greedy decoding can differ in the last bits with the batch's
composition (padding), so the batches are a FIXED partition of the input: consecutive groups
of `batch_size` conversations, and all turn rounds of a group run together (round r
generates the r-th pending turn of every conversation in the group that still has one).

Resume: each completed group is appended as one line (flush + fsync) to
`{state_dir}/{dataset}/{input stem}.partial.jsonl`, after a header line that fingerprints
the input, the target and the settings. A restarted job keeps the groups already there
(a truncated last line from a kill is dropped) and computes only the others, so a resumed
run writes exactly what an uninterrupted one would. The output is written atomically, in
input order, and then the partial file is removed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from draftflow.progress import Progress
from draftflow.engines.generation import (
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    make_generation_engine,
)
from draftflow.config import OPERATIONAL_KEYS as _OPERATIONAL
from draftflow.errors import DraftflowError, where
from draftflow.jsonl import fsync_dir, read_jsonl, write_jsonl

log = logging.getLogger(__name__)

PARTIAL_FORMAT = 1
# Settings that change how outputs are computed, not what they are: a resume may change them
# (one table for the resume key and the rule's params: draftflow.config.OPERATIONAL_KEYS).
OPERATIONAL_KEYS = {k for k in _OPERATIONAL["regenerate"] if "." not in k}
OPERATIONAL_OPENAI_KEYS = {k.removeprefix("openai.") for k in _OPERATIONAL["regenerate"] if k.startswith("openai.")}
ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True)
class RegenerateSettings:
    """The keys of config `regenerate` that the driver itself uses (the engine gets them all)."""

    batch_size: int = 16
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def from_dict(cls, settings: dict) -> "RegenerateSettings":
        keys = ("batch_size", "max_new_tokens", "temperature", "top_p", "seed")
        return cls(**{k: settings[k] for k in keys if k in settings})


# ---- one conversation ----------------------------------------------------------------------


@dataclass
class ConversationState:
    """A conversation being regenerated: the output so far and the next input message."""

    record: dict
    messages: list[dict] = field(default_factory=list)  # output messages so far
    next_index: int = 0  # first input message not yet copied or replaced
    turns: int = 0  # assistant turns generated so far
    kept_tool_calls: bool = False
    truncated: int = 0  # generated turns that hit max_new_tokens
    empty: int = 0  # generated turns with no text (the target ended its turn at once)

    def pending(self) -> bool:
        """Copy input messages up to the next turn to generate; True if there is one."""
        if self.kept_tool_calls:
            return False
        source = self.record["messages"]
        while self.next_index < len(source):
            message = source[self.next_index]
            if message["role"] == "assistant":
                if message.get("tool_calls"):
                    # Keep the call and everything after it (see the module docstring).
                    self.messages += source[self.next_index :]
                    self.next_index = len(source)
                    self.kept_tool_calls = True
                    return False
                return True  # regenerate this turn
            self.messages.append(message)
            self.next_index += 1
        # Input exhausted: a conversation that ends with a user turn gets a response.
        return bool(self.messages) and self.messages[-1]["role"] == "user"

    def request(self, settings: RegenerateSettings) -> GenerationRequest:
        return GenerationRequest(
            messages=list(self.messages),
            tools=self.record.get("tools"),
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=turn_seed(settings.seed, self.record["id"], self.turns),
        )

    def complete(self, result: GenerationResult) -> None:
        """Put the generated turn in place of the pending one (or after the final user turn)."""
        message = {"role": "assistant", "content": result.content}
        if result.reasoning_content is not None:
            message["reasoning_content"] = result.reasoning_content
        self.messages.append(message)
        if self.next_index < len(self.record["messages"]):
            self.next_index += 1  # the replaced input turn
        self.turns += 1
        self.truncated += result.finish_reason == "length"
        self.empty += not result.content.strip()

    def output(self) -> dict:
        return {**self.record, "messages": self.messages}  # id, dataset, tools unchanged


def turn_seed(seed: int, sample_id: str, turn: int) -> int:
    """A per-turn sampling seed, stable across runs, batchings and engines."""
    digest = hashlib.sha256(f"{seed}:{sample_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class GroupStats:
    turns: int = 0
    truncated: int = 0
    kept_tool_calls: int = 0
    empty: int = 0

    def add(self, other: "GroupStats") -> None:
        self.turns += other.turns
        self.truncated += other.truncated
        self.empty += other.empty
        self.kept_tool_calls += other.kept_tool_calls


def regenerate_group(
    records: list[dict], engine: GenerationEngine, settings: RegenerateSettings
) -> tuple[list[dict], GroupStats]:
    """Regenerate a group of conversations, batched turn round by turn round."""
    states = [ConversationState(r) for r in records]
    while active := [s for s in states if s.pending()]:
        results = engine.generate([s.request(settings) for s in active])
        if len(results) != len(active):
            raise RuntimeError(f"engine returned {len(results)} results for {len(active)} requests")
        for state, result in zip(active, results):
            state.complete(result)
    stats = GroupStats(
        turns=sum(s.turns for s in states),
        truncated=sum(s.truncated for s in states),
        kept_tool_calls=sum(s.kept_tool_calls for s in states),
        empty=sum(s.empty for s in states),
    )
    return [s.output() for s in states], stats


# ---- input ---------------------------------------------------------------------------------


def read_conversations(path: Path) -> list[dict]:
    """The input shard, checked enough that a bad record fails here and not mid-run."""
    records = []
    try:
        for line, record in enumerate(read_jsonl(path), start=1):
            check_record(record, path, line)
            records.append(record)
    except ValueError as e:  # bad JSON: the message names file and line
        raise DraftflowError(str(e)) from None
    except FileNotFoundError:
        raise DraftflowError(f"regenerate: input {path} does not exist") from None
    return records


def check_record(record: dict, path: Path, line: int) -> None:
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        raise DraftflowError(f"{where(path, line, 'id')}: missing; expected a conversation record")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DraftflowError(f"{where(path, line, 'messages')}: expected a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DraftflowError(
                f"{where(path, line, f'messages[{i}].role')}: expected one of {sorted(ROLES)}"
            )


# ---- resume state --------------------------------------------------------------------------


def partial_path(state_dir: Path, dataset: str, input_path: Path) -> Path:
    stem = input_path.name
    for suffix in (".zst", ".jsonl", ".json"):
        stem = stem.removesuffix(suffix)
    return Path(state_dir) / dataset / f"{stem}.partial.jsonl"


def run_fingerprint(records: list[dict], settings: dict, target: str) -> dict:
    """What a partial file's groups depend on: input ids in order, target, output-shaping settings."""
    shaping = {k: v for k, v in settings.items() if k not in OPERATIONAL_KEYS}
    if isinstance(shaping.get("openai"), dict):
        shaping["openai"] = {
            k: v for k, v in shaping["openai"].items() if k not in OPERATIONAL_OPENAI_KEYS
        }
    ids = hashlib.sha256(json.dumps([r["id"] for r in records]).encode()).hexdigest()
    return {"format": PARTIAL_FORMAT, "input_ids_sha256": ids, "target": target, "settings": shaping}


class PartialFile:
    """Append-only log of completed groups: a header line, then one line per group."""

    def __init__(self, path: Path, fingerprint: dict):
        self.path = path
        self.fingerprint = fingerprint
        self.groups: dict[int, list[dict]] = {}
        self._file = None

    def load(self, expected_ids: Callable[[int], list[str]]) -> None:
        """Read the groups already done; drop a truncated tail; start over on a stale file."""
        if not self.path.exists():
            return
        valid_bytes = 0
        with open(self.path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                try:
                    entry = json.loads(raw) if raw.endswith(b"\n") else None
                except json.JSONDecodeError:
                    entry = None
                if entry is None:
                    log.warning("%s:%d: incomplete line (a killed run); dropping it", self.path, line_no)
                    break
                if line_no == 1:
                    if entry.get("header") != self.fingerprint:
                        log.warning(
                            "%s: written for another input, target or settings; starting over",
                            self.path,
                        )
                        self.path.unlink()
                        return
                else:
                    group, records = entry["group"], entry["records"]
                    if [r["id"] for r in records] != expected_ids(group):
                        log.warning("%s:%d: group %d does not match the input; starting over",
                                    self.path, line_no, group)
                        self.groups.clear()
                        self.path.unlink()
                        return
                    self.groups[group] = records
                valid_bytes += len(raw)
        if valid_bytes < self.path.stat().st_size:
            os.truncate(self.path, valid_bytes)  # so the next append starts a fresh line
        if valid_bytes == 0:
            self.path.unlink()

    def append(self, group: int, records: list[dict]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists()
            self._file = open(self.path, "ab")
            if new:
                self._write({"header": self.fingerprint})
                fsync_dir(self.path.parent)
        self._write({"group": group, "records": records})
        self.groups[group] = records

    def _write(self, obj: dict) -> None:
        line = json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
        self._file.write(line.encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        if self.path.exists():
            self.path.unlink()
            fsync_dir(self.path.parent)


# ---- the stage -----------------------------------------------------------------------------


def target_fingerprint(target_dir: Path) -> str:
    if (Path(target_dir) / "config.json").is_file():
        from draftflow.target import target_identity

        return target_identity(target_dir)
    return str(target_dir)  # e.g. an OpenAI engine whose model is not local


@dataclass
class RegenerateReport:
    samples: int
    resumed_samples: int
    stats: GroupStats


def regenerate_shard(
    dataset: str,
    input_path: Path,
    target_dir: Path,
    settings: dict,
    state_dir: Path,
    output_path: Path,
) -> RegenerateReport:
    """Regenerate one shard, resuming from `state_dir`; writes `output_path` atomically."""
    config = RegenerateSettings.from_dict(settings)
    records = read_conversations(Path(input_path))
    size = config.batch_size
    groups = [records[i : i + size] for i in range(0, len(records), size)]
    log.info("%s: %d conversations in %d groups of <= %d (engine %s)",
             input_path, len(records), len(groups), size, settings.get("engine", "hf"))

    partial = PartialFile(
        partial_path(state_dir, dataset, Path(input_path)),
        run_fingerprint(records, settings, target_fingerprint(target_dir)),
    )
    partial.load(lambda g: [r["id"] for r in groups[g]] if g < len(groups) else [])
    resumed = sum(len(groups[g]) for g in partial.groups)
    if partial.groups:
        log.info("resuming: %d of %d samples already done (%s)", resumed, len(records), partial.path)

    progress = Progress(len(records), "samples", every_s=10.0, resumed=resumed, logger=log)
    stats = GroupStats()
    engine: GenerationEngine | None = None
    try:
        for index, group in enumerate(groups):
            if index in partial.groups:
                continue
            if engine is None:  # only when there is work: a finished resume loads nothing
                engine = make_generation_engine(settings, Path(target_dir))
            outputs, group_stats = regenerate_group(group, engine, config)
            partial.append(index, outputs)
            stats.add(group_stats)
            progress.update(advance=len(group))
    finally:
        if engine is not None:
            engine.close()
        partial.close()

    ordered = [record for index in range(len(groups)) for record in partial.groups[index]]
    write_jsonl(output_path, ordered)
    partial.remove()
    log.info(
        "wrote %s: %d samples (%d resumed); this run generated %d turns, %d hit max_new_tokens, "
        "%d conversations kept from a tool call on",
        output_path, len(ordered), resumed, stats.turns, stats.truncated, stats.kept_tool_calls,
    )
    if stats.empty:
        # kept: the target's own answer, which trains its end-of-turn token; but `prepare`
        # refuses an empty assistant turn, so this file cannot be fed back as a dataset as is
        log.warning(
            "%s: %d of %d generated turns are empty (the target ended its turn at once); they train "
            "only the end-of-turn token, and `draftflow prepare` refuses them if this file is reused "
            "as a dataset (set on_error: skip there)", output_path, stats.empty, stats.turns,
        )  # fmt: skip
    return RegenerateReport(len(ordered), resumed, stats)


# ---- CLI -----------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument("--dataset", required=True, help="dataset name (names the resume state)")
    parser.add_argument("--input", required=True, type=Path, help="conversation shard (.jsonl[.zst])")
    parser.add_argument("--target", required=True, type=Path, help="target model folder")
    parser.add_argument("--settings", required=True, type=settings_arg, help="config `regenerate` as JSON")
    parser.add_argument("--state-dir", required=True, type=Path, help="resume state folder (survives reruns)")
    parser.add_argument("--output", required=True, type=Path, help="regenerated shard (.jsonl[.zst])")


def main(args: argparse.Namespace) -> int:
    regenerate_shard(args.dataset, args.input, args.target, args.settings, args.state_dir, args.output)
    return 0
