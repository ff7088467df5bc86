"""Do batched T = 0 decodes equal plain greedy decoding, per dtype? (issue 32, 2026-12-05)

On the H100, SmolLM2-135M-Instruct's batched evaluation in bf16 found only 14-18 of 32 GSM8K
outputs equal to the greedy reference. This decodes the first --prompts MT-bench questions with
the target in each --dtypes, batched: the reference (`batched_reference`), EAGLE-3 chains
(`batched_speculative_decode`, K = --k), and each request alone (`greedy_decode`), and counts the
outputs that agree, with the first token where each chain output departs from the reference.

    make real-model      # real/: the converted target and the MT-bench questions
    .venv/bin/python bench/greedy_dtype.py --drafter DRAFTER_FOLDER [--prompts 8 --new-tokens 48]

Prints one JSON line per dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from draftflow.drafters.checkpoint import load_drafter  # noqa: E402
from draftflow.evaluation.batched import (  # noqa: E402
    BatchedEagle3Proposer, BatchedTarget, batched_reference, batched_speculative_decode,
)  # fmt: skip
from draftflow.evaluation.speculative import Target, greedy_decode  # noqa: E402
from draftflow.target import load_target  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def measure(a: argparse.Namespace, dtype: str) -> dict:
    model, tokenizer = load_target(a.target, dtype=dtype, device=a.device)
    drafter, cfg = load_drafter(a.drafter, a.target, device=a.device, dtype=getattr(torch, dtype))
    questions = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.prompts]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for q in questions]  # fmt: skip
    eos = {tokenizer.eos_token_id}
    batched = BatchedTarget(model, cfg.aux_layer_ids)
    try:
        reference = batched_reference(batched, prompts, a.new_tokens, eos)
        chains = batched_speculative_decode(batched, BatchedEagle3Proposer(drafter, len(prompts)), prompts, a.k,
                                            a.new_tokens, eos)  # fmt: skip
    finally:
        batched.close()
    lone = Target(model, cfg.aux_layer_ids)
    try:
        alone = [greedy_decode(lone, p, a.new_tokens, eos) for p in prompts]
    finally:
        lone.close()
    return {
        "dtype": dtype, "device": a.device, "prompts": len(prompts), "k": a.k,
        "chains_equal_batched_reference": sum(c.tokens == r.tokens for c, r in zip(chains, reference)),
        "batched_reference_equal_alone": sum(r.tokens == g.tokens for r, g in zip(reference, alone)),
        "chain_departs_at": [first_difference(c.tokens, r.tokens) for c, r in zip(chains, reference)],
        "tau": round(sum(len(c.tokens) for c in chains) / sum(len(c.proposed) + 1 for c in chains), 4),
    }  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", type=Path, required=True, help="an EAGLE-3 drafter folder for the target")
    p.add_argument("--target", type=Path, default=REPO / "real" / "smollm2-135m-instruct")
    p.add_argument("--questions", type=Path, default=REPO / "real" / "data" / "mtbench_question.jsonl")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    for dtype in a.dtypes:
        print(json.dumps(measure(a, dtype)), flush=True)


if __name__ == "__main__":
    main()
