"""Generation engine on Hugging Face transformers: the target in-process, CPU or GPU.

Requests are rendered with the tokenizer's chat template (add_generation_prompt) and run in
batches of `batch_size`, left-padded so that every row's next token sits in the last column.
Greedy when temperature is 0; otherwise sampled with a seed derived from the batch's request
seeds (one `generate` call draws for the whole batch, so per-request seeds cannot be
honoured separately; the same batch always samples the same tokens). Generation stops at
the tokenizer's eos, `<|eot_id|>`/`<|end_of_text|>`/`<|eom_id|>` when present, and the
model's generation_config eos ids.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from draftflow.engines.generation import GenerationRequest, GenerationResult
from draftflow.errors import DraftflowError
from draftflow.target import load_target, resolve_device

log = logging.getLogger(__name__)

STOP_TOKENS = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


class HFGenerationEngine:
    def __init__(self, model, tokenizer, batch_size: int = 16):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(model, tokenizer)
        # Left padding: rows end at the same column, so one forward step extends all of them.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    @classmethod
    def from_settings(cls, settings: dict, target_dir: Path) -> "HFGenerationEngine":
        device = resolve_device(settings.get("device", "auto"))
        # As the evaluate stage: a bf16 checkpoint computes in float32 on a CPU, where half-precision
        # matmuls are slow (SmolLM2-135M on 2 cores: 10 prompts x 24 tokens, 88 s in bf16, 18 s in float32)
        model, tokenizer = load_target(
            target_dir,
            dtype=torch.float32 if device.type == "cpu" else "auto",
            device=str(device),
            trust_remote_code=settings.get("trust_remote_code", False),
        )
        log.info("hf engine: %s on %s (%s)", target_dir, model.device, model.dtype)
        return cls(model, tokenizer, batch_size=settings.get("batch_size", 16))

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids of the chat-template rendering of `request`, ending with the generation prompt."""
        text = self.tokenizer.apply_chat_template(
            request.messages, tools=request.tools, tokenize=False, add_generation_prompt=True
        )
        # The template writes its own BOS; do not let the tokenizer add another.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        for start in range(0, len(requests), self.batch_size):
            results += self._generate_batch(requests[start : start + self.batch_size])
        return results

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        first = requests[0]
        if any(
            (r.max_new_tokens, r.temperature, r.top_p) != (first.max_new_tokens, first.temperature, first.top_p)
            for r in requests
        ):
            # Mixed decoding settings cannot share one generate call: run them one by one.
            return [res for r in requests for res in self._generate_batch([r])]
        prompts = [self.prompt_ids(r) for r in requests]
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, T]
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        sampling = first.temperature > 0
        kwargs = {"do_sample": False}
        if sampling:
            torch.manual_seed(batch_seed(requests))
            kwargs = {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p, "top_k": 0}
        try:
            output = self.model.generate(
                input_ids=input_ids.to(self.model.device),
                attention_mask=attention_mask.to(self.model.device),
                max_new_tokens=first.max_new_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
                **kwargs,
            )
        except torch.OutOfMemoryError as e:
            # one long prompt pads its whole group (H200, SmolLM2: a 7k-token ShareGPT prompt in a
            # group of 128 asked for a 6 TiB attention mask)
            raise DraftflowError(
                f"regenerate: out of GPU memory answering {len(prompts)} prompts at once, the longest "
                f"{width} tokens (every prompt of the group is padded to it, plus {first.max_new_tokens} new "
                "tokens); lower regenerate.batch_size, or leave prompts this long out of the dataset "
                "(merge.max_seq_len cuts them anyway)"
            ) from e
        new_tokens = output[:, width:].tolist()  # [B, <= max_new_tokens]
        return [self._result(tokens) for tokens in new_tokens]

    def _result(self, tokens: list[int]) -> GenerationResult:
        stop = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
        if stop is not None:
            tokens, finish_reason = tokens[:stop], "stop"
        else:
            finish_reason = "length"
        content = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationResult(content=content, finish_reason=finish_reason)

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def stop_token_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: tokenizer eos, the Llama-3 stop tokens it knows, generation_config eos."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in STOP_TOKENS if t in vocab]
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    ids += config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else []
    unique = list(dict.fromkeys(ids))
    if not unique:
        raise ValueError("the target's tokenizer and generation_config define no end-of-turn token")
    return unique


def batch_seed(requests: list[GenerationRequest]) -> int:
    """One seed for a batch, from its requests' seeds (stable across runs and processes)."""
    text = ",".join(str(r.seed) for r in requests)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def create_engine(settings: dict, target_dir: Path) -> HFGenerationEngine:
    return HFGenerationEngine.from_settings(settings, target_dir)
