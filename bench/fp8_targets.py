#!/usr/bin/env python3
"""What fp8 storage does to the training targets: the target's next-token distribution computed
from a stored final state, bf16 (as the lossless store holds it) and fp8, each against the
float32 state it was rounded from.

An EAGLE-3 trainer reads the target's final (post-norm) state from the store and turns it into its
soft target, softmax(lm_head(state)). With `extract.storage: fp8` that state carries ~2.7% row
error, so every training target is perturbed. This measures the perturbation on a real model and
real answers, on the CPU, without training: over the answer tokens of the first N conversations of
a conversations file,
  * top-1 agreement: the target's argmax from the stored state equals the one from the float32 state;
  * total variation 0.5 Σ|p − q| and KL(p ‖ q) between the two distributions (p from float32);
  * the row error of the final and the aux states (what the drafter's inputs carry);
  * stored / raw bytes of the captured [T, aux + 1, H] bf16 states as each `extract.storage` mode
    writes them (fp8_aux: the aux states as fp8, the final state lossless).
The model runs in float32, so that bf16's own rounding is measured beside fp8's (the extraction's
forward runs in bf16; its rounding inside the model is not counted here).

Prints one JSON line.

    .venv/bin/python bench/fp8_targets.py --model real/smollm2-135m-instruct \
        --conversations bench/data/smollm2_sharegpt_regenerated.jsonl.gz --records 64 --threads 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftflow.hidden_states.storage import STORAGE_MODES, encode_sample, quantize_fp8  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="an HF model folder")
    p.add_argument("--conversations", type=Path, required=True, help="a conversations .jsonl[.gz] (messages)")
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--aux", type=int, nargs="+", default=[1, 14, 26], help="aux layer ids (output of layer i)")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def stored(states: torch.Tensor, storage: str) -> torch.Tensor:
    """[T, L, H] float32 -> what the store gives back as float32: bf16, or bf16 then fp8."""
    bf16 = states.bfloat16()
    return (bf16 if storage == "bf16" else quantize_fp8(bf16).dequantize()).float()


@dataclass
class Tally:
    """One storage's perturbation, summed over answer tokens."""

    tokens: int = 0
    top1_same: int = 0
    tv_sum: float = 0.0
    kl_sum: float = 0.0
    aux_rel_err: list[float] = field(default_factory=list)
    final_rel_err: list[float] = field(default_factory=list)

    def add(self, exact_logits: torch.Tensor, fp8_logits: torch.Tensor) -> None:
        """logits [T, V] float32 from the float32 and the stored final states."""
        logp = exact_logits.log_softmax(-1)
        logq = fp8_logits.log_softmax(-1)
        p = logp.exp()  # [T, V]
        self.tokens += exact_logits.shape[0]
        self.top1_same += int((exact_logits.argmax(-1) == fp8_logits.argmax(-1)).sum())
        self.tv_sum += float(0.5 * (p - logq.exp()).abs().sum(-1).sum())
        self.kl_sum += float((p * (logp - logq)).sum(-1).sum())

    def summary(self) -> dict:
        n = max(self.tokens, 1)
        return {
            "answer_tokens": self.tokens,
            "top1_agreement": round(self.top1_same / n, 5),
            "total_variation_mean": round(self.tv_sum / n, 5),
            "kl_mean": round(self.kl_sum / n, 5),
            "final_row_rel_err_mean": round(sum(self.final_rel_err) / max(len(self.final_rel_err), 1), 5),
            "aux_row_rel_err_mean": round(sum(self.aux_rel_err) / max(len(self.aux_rel_err), 1), 5),
        }


def answer_start(tokenizer, messages: list[dict]) -> int:
    """Token count of the conversation up to the last answer (the prompt the answer follows)."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    lm_head = model.get_output_embeddings().weight.detach()  # [V, H]
    tallies = {"bf16": Tally(), "fp8": Tally()}
    stored_bytes, raw_bytes = dict.fromkeys(STORAGE_MODES, 0), 0
    opener = gzip.open if args.conversations.suffix == ".gz" else open
    with opener(args.conversations, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line_no > args.records:
                break
            messages = json.loads(line)["messages"]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, : args.max_len]
            start = answer_start(tokenizer, messages)
            if start >= ids.shape[1] - 1:
                continue
            out = model(ids, output_hidden_states=True)
            # hidden_states[i + 1] = output of layer i; the last one is after the final norm in HF
            aux = torch.stack([out.hidden_states[i + 1][0] for i in args.aux], dim=1)  # [T, 3, H]
            final = out.hidden_states[-1][0][:, None, :]  # [T, 1, H]
            exact_logits = final[start:, 0] @ lm_head.T  # [A, V]: the states at the answer's positions
            for storage, tally in tallies.items():
                stored_final = stored(final, storage)  # [T, 1, H]
                for states, back, errs in ((aux, stored(aux, storage), tally.aux_rel_err),
                                           (final, stored_final, tally.final_rel_err)):  # fmt: skip
                    err = (back - states).norm(dim=-1) / states.norm(dim=-1)  # [T, L]
                    errs.append(float(err[start:].mean()))
                tally.add(exact_logits, stored_final[start:, 0] @ lm_head.T)
            captured = torch.cat([aux, final], dim=1).bfloat16()  # [T, aux + 1, H] as extraction captures it
            raw_bytes += captured.numel() * 2 + 9 * captured.shape[0]  # states, int64 ids, uint8 mask
            token_ids, mask = ids[0].numpy(), np.ones(ids.shape[1], np.uint8)
            for mode in STORAGE_MODES:
                stored_bytes[mode] += len(encode_sample(token_ids, mask, captured, storage=mode))
    print(json.dumps({"model": str(args.model), "conversations": str(args.conversations), "records": args.records,
                      **{storage: tally.summary() for storage, tally in tallies.items()},
                      "stored_over_raw": {mode: round(n / raw_bytes, 4) for mode, n in stored_bytes.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
