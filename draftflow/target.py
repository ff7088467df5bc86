"""The target model: the embedded default `builtin:tiny-llama`, and helpers every stage reuses.

`build-target` makes a small Llama-3-style model from the sample conversations shipped in
`data/samples/`, without downloading anything:

1. a byte-level BPE tokenizer trained on the corpus text, with Llama-3 special tokens and a
   Llama-3-style chat template (`draftflow/templates/llama3_chat.jinja`);
2. a `LlamaForCausalLM` trained briefly (AdamW, cosine schedule, fp32, CPU) on the corpus
   conversations rendered with that template, so that its greedy output is text-like and a
   drafter trained on it has something to learn;
3. both saved in Hugging Face format, loadable offline with `AutoModelForCausalLM` /
   `AutoTokenizer`, plus `build_log.json` (settings, corpus digests, loss curve).

The build is deterministic: fixed seeds, deterministic CPU kernels and one compute thread
(whatever `--threads` says; the rule declares 1) give the same bytes on every run on the
same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Iterator

from draftflow.errors import DraftflowError
from draftflow.jsonl import file_mode, fsync_dir, read_json, read_jsonl, write_json
from draftflow.progress import Progress
from draftflow.threads import torch_threads

log = logging.getLogger(__name__)

BUILTIN_TARGETS = {"builtin:tiny-llama": "target"}  # name -> folder under results/
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS_DIR = REPO_ROOT / "data" / "samples"
CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / "templates" / "llama3_chat.jinja"

BOS = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, END_OF_TEXT, START_HEADER, END_HEADER, EOT, PAD]

LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MAX_POSITION_EMBEDDINGS = 2048
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
BUILD_THREADS = 1  # the build's compute threads: bit-identical weights for any job size


# ---- settings -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltinSettings:
    """config `target.builtin` (see config.schema.yaml), plus an optional corpus file list."""

    seed: int = 0
    num_hidden_layers: int = 8
    hidden_size: int = 128
    intermediate_size: int = 344
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    train_steps: int = 400
    train_seq_len: int = 128
    train_batch_size: int = 8
    learning_rate: float = 3e-3
    corpus: tuple[str, ...] | None = None  # files or folders; None = data/samples/

    @classmethod
    def from_dict(cls, settings: dict) -> "BuiltinSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise DraftflowError(
                f"build-target --settings: unknown key(s) {unknown}; expected keys of "
                f"config target.builtin: {sorted(known)}"
            )
        values = dict(settings)
        if values.get("corpus") is not None:
            values["corpus"] = tuple(str(p) for p in values["corpus"])
        settings_obj = cls(**values)
        if settings_obj.hidden_size % settings_obj.num_attention_heads:
            raise DraftflowError(
                f"target.builtin.hidden_size ({settings_obj.hidden_size}) must be a multiple of "
                f"num_attention_heads ({settings_obj.num_attention_heads})"
            )
        if settings_obj.num_attention_heads % settings_obj.num_key_value_heads:
            raise DraftflowError(
                f"target.builtin.num_attention_heads ({settings_obj.num_attention_heads}) must be "
                f"a multiple of num_key_value_heads ({settings_obj.num_key_value_heads})"
            )
        return settings_obj


# ---- corpus: conversations from the shipped sample files -------------------------------------


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    sha256: str
    conversations: int


ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}
# Flat records (no message list): which string fields hold which role's text.
FLAT_FIELDS = {
    "system": ("system", "system_prompt"),
    "user": ("prompt", "instruction", "question", "query", "input", "text"),
    "assistant": ("response", "output", "answer", "completion", "chosen"),
}


def _text(content: Any) -> str:
    """The text of a message content: a string, a list of OpenAI content parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part.get("text") if isinstance(part, dict) else part) for part in content)
    if isinstance(content, dict):
        return _text(content.get("text"))
    return str(content)


def _tool_calls(calls: Any) -> list[dict] | None:
    if not isinstance(calls, list) or not calls:
        return None
    result = []
    for call in calls:
        if not isinstance(call, dict):
            continue
        fn = call.get("function", call)
        arguments = fn.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        result.append(
            {"type": "function", "function": {"name": str(fn.get("name", "")), "arguments": arguments}}
        )
    return result or None


def _message(raw: Any) -> dict | None:
    if not isinstance(raw, dict):
        return None
    role = str(raw.get("role", raw.get("from", "user"))).lower()
    message = {
        "role": ROLE_ALIASES.get(role, "user"),
        "content": _text(raw.get("content", raw.get("value"))),
    }
    calls = _tool_calls(raw.get("tool_calls"))
    if role == "function_call":  # ShareGPT: the value is the call as {"name", "arguments"} JSON
        try:
            calls = _tool_calls([json.loads(message["content"])])
        except json.JSONDecodeError:
            calls = None
        if calls:
            message["content"] = ""
    if calls and message["role"] == "assistant":
        message["tool_calls"] = calls
    return message


def _tools(raw: Any) -> list[dict] | None:
    if isinstance(raw, str):  # some sources store the tool list as a JSON string
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    if isinstance(raw, list) and raw and all(isinstance(t, dict) for t in raw):
        return raw
    return None


def conversation_from_record(record: Any) -> Conversation | None:
    """Read one record robustly: OpenAI `messages`, ShareGPT `conversations`, or flat fields."""
    if not isinstance(record, dict):
        return None
    for key in ("messages", "conversations", "conversation"):
        if isinstance(record.get(key), list):
            messages = [m for m in map(_message, record[key]) if m is not None]
            break
    else:
        messages = []
        for role, names in FLAT_FIELDS.items():
            text = next((record[n] for n in names if isinstance(record.get(n), str)), None)
            if text:
                messages.append({"role": role, "content": text})
    if not any(m["content"] or m.get("tool_calls") for m in messages):
        return None
    return Conversation(messages=messages, tools=_tools(record.get("tools")))


def conversations_from_file(path: Path) -> list[Conversation]:
    """All conversations in one file; a file that holds none (README, config) gives []."""
    name = path.name.lower()
    try:
        if name.endswith((".jsonl", ".jsonl.zst")):
            records: list = list(read_jsonl(path))
        elif name.endswith(".json"):
            data = read_json(path)
            records = data if isinstance(data, list) else data.get("data", [data])
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq

            records = pq.read_table(path).to_pylist()
        elif name.endswith(".txt"):  # one user prompt per line
            lines = path.read_text(encoding="utf-8").splitlines()
            return [Conversation([{"role": "user", "content": ln.strip()}]) for ln in lines if ln.strip()]
        else:
            return []
    except (ValueError, OSError) as e:
        log.warning("corpus: skipping %s: %s", path, e)
        return []
    return [c for c in map(conversation_from_record, records) if c is not None]


def corpus_files(corpus: Iterable[str | Path] | None) -> list[Path]:
    """The corpus files: the given files, every file of given folders, or data/samples/.

    In folders, `.txt` prompt lists are left out: they hold evaluation prompts, not
    conversations (data/samples/prompts.txt is held out on purpose). Name one explicitly
    to train on it.
    """
    entries = [DEFAULT_CORPUS_DIR] if corpus is None else [Path(p) for p in corpus]
    files: list[Path] = []
    for entry in entries:
        if entry.is_dir():
            files += sorted(
                p for p in entry.rglob("*")
                if p.is_file() and not p.name.startswith(".") and p.suffix != ".txt"
            )
        elif entry.is_file():
            files.append(entry)
        else:
            raise DraftflowError(
                f"build-target: corpus entry {entry} does not exist; set the settings key "
                "'corpus' to existing files or folders (default: the repo's data/samples/)"
            )
    return files


def read_corpus(corpus: Iterable[str | Path] | None) -> tuple[list[Conversation], list[CorpusFile]]:
    conversations: list[Conversation] = []
    used: list[CorpusFile] = []
    for path in corpus_files(corpus):
        found = conversations_from_file(path)
        if not found:
            log.info("corpus: %s holds no conversations; skipped", path)
            continue
        conversations += found
        used.append(CorpusFile(path, _sha256_file(path), len(found)))
        log.info("corpus: %d conversations from %s", len(found), path)
    if not conversations:
        where = DEFAULT_CORPUS_DIR if corpus is None else list(corpus)
        raise DraftflowError(
            f"build-target: found no conversations in {where}; the builtin target trains on "
            "conversation files (JSONL with 'messages', ShareGPT JSON, Parquet, prompts .txt)"
        )
    return conversations, used


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- tokenizer ---------------------------------------------------------------------------


def chat_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def _tokenizer_training_text(conversations: list[Conversation]) -> Iterator[str]:
    for conv in conversations:
        if conv.tools:
            yield "\n".join(json.dumps(t, ensure_ascii=False) for t in conv.tools)
        for message in conv.messages:
            yield message["role"] + "\n\n" + message["content"]
            for call in message.get("tool_calls") or ():
                fn = call["function"]
                yield f'{{"name": {json.dumps(fn["name"])}, "arguments": {fn["arguments"]}}}'


def train_tokenizer(conversations: list[Conversation], vocab_size: int):
    """Byte-level BPE with Llama-3 special tokens, as a PreTrainedTokenizerFast."""
    return train_tokenizer_on_texts(_tokenizer_training_text(conversations), vocab_size)


def train_tokenizer_on_texts(texts: Iterable[str], vocab_size: int):
    """`train_tokenizer` over any text (bench/real_target.py: Python sources): the same BPE,
    special tokens and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Llama 3's split: a run of newlines is one piece whatever follows it, so the generation
    # prompt's trailing "\n\n" encodes as it does inside a rendered conversation.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: plain encoding prepends <|begin_of_text|>; the chat template writes it
    # itself, so rendered chats are encoded with add_special_tokens=False.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,  # end of an assistant turn: what generation stops at
        pad_token=PAD,
        additional_special_tokens=[END_OF_TEXT, START_HEADER, END_HEADER],
        chat_template=chat_template(),
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


def make_tokenizer_config_portable(folder: Path) -> None:
    """Rewrite tokenizer_config.json so transformers 4.x loads it too (vLLM and SGLang pin 4.x):
    the generic class name, `additional_special_tokens`, and the chat template inline.
    transformers 5 reads this form identically."""
    path = folder / "tokenizer_config.json"
    config = read_json(path)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    config["chat_template"] = chat_template()
    write_json(path, config)


def render(tokenizer, conv: Conversation, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        conv.messages, tools=conv.tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


# ---- model -------------------------------------------------------------------------------


def make_model_config(settings: BuiltinSettings, tokenizer):
    from transformers import LlamaConfig

    if len(tokenizer) > settings.vocab_size:
        raise DraftflowError(
            f"tokenizer has {len(tokenizer)} tokens, more than target.builtin.vocab_size "
            f"({settings.vocab_size})"
        )
    return LlamaConfig(
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        num_key_value_heads=settings.num_key_value_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def token_stream(conversations: list[Conversation], tokenizer):
    """All conversations rendered with the chat template and concatenated: [N] int64."""
    import torch

    ids: list[int] = []
    for conv in conversations:
        ids += tokenizer(render(tokenizer, conv), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup, then cosine decay to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_model(model, stream, settings: BuiltinSettings) -> list[float]:
    """Next-token training on random windows of the token stream; returns the loss per step."""
    import torch

    seq_len = settings.train_seq_len
    if stream.numel() < seq_len + 1:  # a tiny corpus: repeat it to fill one window
        stream = stream.repeat(math.ceil((seq_len + 1) / stream.numel()))
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95), weight_decay=0.01
    )
    warmup = max(1, settings.train_steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_lr(step, settings.train_steps, warmup)
    )
    losses: list[float] = []
    progress = Progress(settings.train_steps, "steps", every_s=15.0, logger=log)
    model.train()
    for step in range(settings.train_steps):
        starts = torch.randint(0, stream.numel() - seq_len, (settings.train_batch_size,), generator=generator)
        batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss  # labels are shifted inside the model
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 6))
        progress.update(step + 1, extra=f"loss {losses[-1]:.4f}")
    model.eval()
    return losses


@dataclass
class BuildReport:
    output: Path
    losses: list[float] = field(default_factory=list)
    train_tokens: int = 0
    parameters: int = 0
    seconds: float = 0.0


def build_target(settings: BuiltinSettings, output: str | Path) -> BuildReport:
    """Build the builtin target into `output` (replaced atomically: built next to it, then renamed)."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    started = time.monotonic()
    output = Path(output)
    conversations, used = read_corpus(settings.corpus)
    tokenizer = train_tokenizer(conversations, settings.vocab_size)
    stream = token_stream(conversations, tokenizer)
    log.info(
        "tokenizer: %d tokens; corpus: %d conversations, %d tokens",
        len(tokenizer), len(conversations), stream.numel(),
    )

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        # One thread, whatever the job has: CPU kernels split elementwise work into one
        # chunk per thread, and a chunk's vectorized body and scalar tail round differently,
        # so the weights would depend on the thread count (draftflow/threads.py).
        with torch_threads(BUILD_THREADS):
            torch.manual_seed(settings.seed)
            config = make_model_config(settings, tokenizer)
            model = LlamaForCausalLM(config)
            losses = train_model(model, stream, settings)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TEXT)],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    parameters = sum(p.numel() for p in model.parameters())

    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        make_tokenizer_config_portable(tmp)
        for file in tmp.iterdir():  # safetensors writes 0600
            if file.is_file():
                file.chmod(file_mode())
        write_json(
            tmp / "build_log.json",
            {
                "target": "builtin:tiny-llama",
                "settings": {k: v for k, v in asdict(settings).items() if k != "corpus"},
                "corpus": [
                    {"file": p.path.name, "sha256": p.sha256, "conversations": p.conversations}
                    for p in used
                ],
                "tokenizer_size": len(tokenizer),
                "train_tokens": int(stream.numel()),
                "parameters": parameters,
                "loss": losses,
            },
        )
        if output.exists():
            shutil.rmtree(output)
        os.replace(tmp, output)
        fsync_dir(output.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - started
    log.info(
        "built %s: %d parameters, loss %.3f -> %.3f, %.1fs",
        output, parameters, losses[0] if losses else float("nan"),
        losses[-1] if losses else float("nan"), seconds,
    )
    return BuildReport(output, losses, int(stream.numel()), parameters, seconds)


# ---- helpers for other stages ------------------------------------------------------------


def resolve_target(model: str, results_dir: str | Path) -> Path:
    """config `target.model` -> the model folder: a builtin name, or an existing local folder."""
    if model.startswith("builtin:"):
        if model not in BUILTIN_TARGETS:
            raise DraftflowError(
                f"target.model: unknown builtin target '{model}'; known: {sorted(BUILTIN_TARGETS)}"
            )
        return Path(results_dir) / BUILTIN_TARGETS[model]
    path = Path(model).expanduser()
    if not path.is_dir():
        raise DraftflowError(
            f"target.model: '{model}' is not an existing local directory. Set target.model in "
            "your config to 'builtin:tiny-llama' or to a local Hugging Face model folder "
            "(download it first, e.g. `huggingface-cli download ORG/NAME --local-dir DIR`)."
        )
    if not (path / "config.json").is_file():
        raise DraftflowError(
            f"target.model: '{model}' has no config.json; point target.model at the folder "
            "that holds the model's config.json and weight files"
        )
    return path.resolve()


def resolve_device(device: str = "auto"):
    """'auto' -> cuda when available, else cpu; anything else as torch understands it."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target(
    path: str | Path,
    dtype: str | Any = "auto",
    device: str = "auto",
    tokenizer_path: str | Path | None = None,
    trust_remote_code: bool = False,
):
    """(model, tokenizer) from a local folder, offline, in eval mode on `device`.

    dtype: "auto" (as stored), "float32", "bfloat16", "float16" or a torch.dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise DraftflowError(
            f"{path}: not a model folder (no config.json); build the builtin target first "
            "(`draftflow build-target`) or set target.model to a local model folder"
        )
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_path or path, local_files_only=True, trust_remote_code=trust_remote_code
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
    )
    return model.to(resolve_device(device)).eval(), tokenizer


# Files besides weights that define a target (identity): configs, tokenizer, remote code.
IDENTITY_CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
_SAMPLE_BYTES = 1 << 16  # weight bytes hashed at each of a few fixed places per file


def _weight_fingerprint(path: Path) -> list:
    """[name, size, sha256 of the safetensors header (tensor names, dtypes, shapes, offsets) and of
    64 KiB of data at its start, middle and end]: a few reads, never the whole file, yet a
    fine-tuned checkpoint of the same shapes (same header and size) differs in the sampled bytes."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        data_start = 0
        if path.name.endswith(".safetensors"):
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            if 8 + header_len > size:
                raise DraftflowError(f"{path}: not a safetensors file (header length {header_len}, file {size} bytes)")
            h.update(prefix + f.read(header_len))
            data_start = 8 + header_len
        span = size - data_start
        for offset in sorted({data_start, data_start + max(0, span // 2 - _SAMPLE_BYTES // 2), max(data_start, size - _SAMPLE_BYTES)}):
            f.seek(offset)
            h.update(f.read(_SAMPLE_BYTES))
    return [path.name, size, h.hexdigest()]


def tokenizer_files(path: str | Path) -> list[Path]:
    """The tokenizer files of a model or tokenizer folder (plus *.tiktoken and remote-code *.py)."""
    path = Path(path)
    return sorted(
        p for p in path.iterdir()
        if p.is_file() and (p.name in TOKENIZER_FILES or p.name.endswith((".tiktoken", ".py")))
    )  # fmt: skip


def tokenizer_identity(path: str | Path) -> str:
    """A stable id of a tokenizer folder's content (its tokenizer files), whatever its path."""
    files = {p.name: _sha256_file(p) for p in tokenizer_files(path)}
    if not files:
        raise DraftflowError(f"{path}: no tokenizer files (tokenizer.json, tokenizer_config.json …)")
    return "tokenizer@" + hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def target_identity(path: str | Path) -> str:
    """A stable id of a target model by content, not by path: a moved or copied model is the same target.

    Hashes config.json (+ generation_config.json), the tokenizer files and remote code, the
    weight index files, and per weight file its name, size and `_weight_fingerprint` (header
    and sampled bytes: milliseconds for Kimi's ~1 TB). `<model_type>@<16 hex>`.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DraftflowError(f"{path}: no config.json; cannot identify the target model")
    files = sorted(p for p in path.iterdir() if p.is_file())
    description = {
        "configs": {p.name: _sha256_file(p) for p in files if p.name in IDENTITY_CONFIG_FILES},
        "tokenizer": {p.name: _sha256_file(p) for p in tokenizer_files(path)},
        "indexes": {p.name: _sha256_file(p) for p in files if p.name.endswith(".index.json")},
        "weights": [_weight_fingerprint(p) for p in files if p.name.endswith(WEIGHT_SUFFIXES)],
    }
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    try:
        model_type = str(read_json(config_file).get("model_type") or "model")
    except ValueError:
        raise DraftflowError(f"{config_file}: not valid JSON") from None
    return f"{''.join(c for c in model_type if c.isalnum() or c in '_-') or 'model'}@{digest[:16]}"


# ---- CLI ---------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument(
        "--settings", type=settings_arg, default={},
        help="config target.builtin as JSON, plus optional \"corpus\": [files or folders]",
    )
    parser.add_argument("--output", required=True, type=Path, help="model folder to write")


def main(args: argparse.Namespace) -> int:
    build_target(BuiltinSettings.from_dict(args.settings), args.output)
    return 0
