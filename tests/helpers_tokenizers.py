"""Tiny tokenizers built locally for tests: no downloads, each builds in well under a second.

Four chat styles, each a Jinja template under `tests/fixtures/templates/` with the control
tokens of the model family it imitates (Llama 3, ChatML/Qwen, Kimi-K2, DeepSeek-V3), and two
tokenizer kinds per style:

- fast: a byte-level BPE `tokenizers` model with Llama-3's pre-tokenizer regex, wrapped in
  `PreTrainedTokenizerFast` (has offsets). Where the style has a BOS token, plain `encode()`
  prepends it, as Llama 3's tokenizer does;
- slow: a sentencepiece BPE model (byte fallback) behind a pure-Python remote-code tokenizer
  class (`tests/fixtures/templates/tiny_sp/`), with no offsets, like Kimi-K2's tiktoken
  tokenizer. It can also be saved as a directory that `AutoTokenizer.from_pretrained(dir,
  trust_remote_code=True)` loads.

Other tests may reuse these builders.
"""

from __future__ import annotations

import io
import json
import shutil
import types
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent / "fixtures" / "templates"
REMOTE_CODE_FILE = TEMPLATES_DIR / "tiny_sp" / "tokenization_tiny_sp.py"
REMOTE_CODE_CLASS = "TinySentencePieceTokenizer"

# Llama 3's pre-tokenizer: newlines are their own pre-tokens, so text split after a newline
# tokenizes the same as the whole.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Training text: the words of the test conversations, so they become a few tokens each.
CORPUS = [
    "You are a helpful assistant.",
    "You are a weather bot.",
    "You are Kimi, an AI assistant created by Moonshot AI.",
    "Hello there! Hello! How can I help you today?",
    "What is the weather in Paris? What is the weather in Rome?",
    "Let me check. It is sunny and 21 degrees in Paris.",
    "Get the weather in a city.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
    '{"temperature": 21}',
    "system user assistant tool ipython function functions",
    "Environment: ipython",
    "You can call these functions. To call one, answer with a JSON object.",
    "You may call one or more functions to assist with the user query.",
    "Tools Description Parameters Return of call",
    "The quick brown fox jumps over the lazy dog.",
]


@dataclass(frozen=True)
class ChatStyle:
    """A model family's chat format: template file and its control tokens."""

    name: str
    template_file: str
    bos: str | None
    eos: str
    special_tokens: tuple[str, ...]  # control tokens, tokenized as one special token each
    added_tokens: tuple[str, ...] = ()  # added but not special (like Qwen's <tool_call>)

    @property
    def chat_template(self) -> str:
        return (TEMPLATES_DIR / self.template_file).read_text(encoding="utf-8")

    @property
    def template_path(self) -> Path:
        return TEMPLATES_DIR / self.template_file


STYLES: dict[str, ChatStyle] = {
    "llama3": ChatStyle(
        name="llama3",
        template_file="llama3.jinja",
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
    ),
    "chatml": ChatStyle(
        name="chatml",
        template_file="chatml.jinja",
        bos=None,
        eos="<|im_end|>",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    "kimi_k2": ChatStyle(
        name="kimi_k2",
        template_file="kimi_k2.jinja",
        bos="[BOS]",  # the tokenizer has one, the template never writes it
        eos="[EOS]",
        special_tokens=(
            "[BOS]",
            "[EOS]",
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
    ),
    "deepseek_v3": ChatStyle(
        name="deepseek_v3",
        template_file="deepseek_v3.jinja",
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        special_tokens=(
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ),
    ),
}


def _special_kwargs(style: ChatStyle) -> dict:
    """bos/eos plus the other control tokens, as transformers tokenizer kwargs."""
    others = [t for t in style.special_tokens if t not in (style.bos, style.eos)]
    return {"bos_token": style.bos, "eos_token": style.eos, "additional_special_tokens": others}


def build_fast_tokenizer(style: ChatStyle | str, vocab_size: int = 600):
    """Byte-level BPE with the style's control tokens, as a PreTrainedTokenizerFast."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    style = STYLES[style] if isinstance(style, str) else style
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(style.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in style.added_tokens])
    post = [processors.ByteLevel(trim_offsets=False)]
    if style.bos:  # like Llama 3: plain encode() prepends BOS
        post.append(
            processors.TemplateProcessing(
                single=f"{style.bos} $A", special_tokens=[(style.bos, tok.token_to_id(style.bos))]
            )
        )
    tok.post_processor = processors.Sequence(post)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=style.chat_template,
        clean_up_tokenization_spaces=False,
        **_special_kwargs(style),
    )


@lru_cache(maxsize=1)
def _sentencepiece_model() -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=450,
        hard_vocab_limit=False,
        byte_fallback=True,  # "\n" and any unseen character become byte tokens
        add_dummy_prefix=False,  # text after a control token is encoded as written
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=-1,  # BOS/EOS are the style's own added tokens
        eos_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


@lru_cache(maxsize=1)
def _remote_code_class():
    # executed from source, not imported: nothing (no __pycache__) is written next to the fixture
    module = types.ModuleType(REMOTE_CODE_FILE.stem)
    exec(compile(REMOTE_CODE_FILE.read_text(encoding="utf-8"), str(REMOTE_CODE_FILE), "exec"), module.__dict__)
    return getattr(module, REMOTE_CODE_CLASS)


def build_slow_tokenizer(style: ChatStyle | str, workdir: Path):
    """A pure-Python sentencepiece tokenizer (no offsets); its model file goes under `workdir`."""
    style = STYLES[style] if isinstance(style, str) else style
    workdir.mkdir(parents=True, exist_ok=True)
    model_file = workdir / "tokenizer.model"
    model_file.write_bytes(_sentencepiece_model())
    tokenizer = _remote_code_class()(
        vocab_file=str(model_file),
        unk_token="<unk>",
        special_tokens_pattern="bos" if style.bos else "none",
        chat_template=style.chat_template,
        **_special_kwargs(style),
    )
    if style.added_tokens:
        tokenizer.add_tokens(list(style.added_tokens))
    return tokenizer


def save_remote_code_tokenizer(style: ChatStyle | str, out_dir: Path) -> Path:
    """Save the slow tokenizer as a directory that needs `trust_remote_code=True` to load."""
    out_dir = Path(out_dir)
    tokenizer = build_slow_tokenizer(style, out_dir / "_build")
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(out_dir / "_build")
    shutil.copy(REMOTE_CODE_FILE, out_dir / REMOTE_CODE_FILE.name)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = REMOTE_CODE_CLASS
    config["auto_map"] = {"AutoTokenizer": [f"{REMOTE_CODE_FILE.stem}.{REMOTE_CODE_CLASS}", None]}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return out_dir
