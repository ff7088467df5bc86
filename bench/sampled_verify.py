"""Host cost of speculative sampling's verification per batched step (issue 32, 2026-12-05).

A verify step at T = 1 draws each row's acceptance tests from float64 distributions on the CPU
(exact arithmetic, the row's own generator). Before: every row's whole [n+1, V] block of target
probabilities and its [n, V] draft distributions over the target vocabulary were built; now rows
are built as `verify_sampled` reads them (`LazyProbs`, `TargetVocabRows`): up to the first
rejection. This times both on the same random step, SmolLM2's shapes (V 49,152, draft vocabulary
32,000), and checks that they draw the same tokens.

    .venv/bin/python bench/sampled_verify.py [--batch 80 --k 7 --noise 1.0]

--noise: logit noise between target and drafter (smaller: more drafts accepted, more rows read).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftflow.evaluation.speculative import LazyProbs, TargetVocabRows, target_probs, verify_sampled  # noqa: E402


def step_inputs(batch: int, k: int, V: int, Vd: int, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(V, generator=g)[:Vd].sort().values  # [Vd]
    logits = torch.randn(batch, k + 1, V, generator=g) * 3  # [B, k+1, V] target
    draft_logits = logits[:, :k, target_ids] + noise * torch.randn(batch, k, Vd, generator=g)  # [B, k, Vd]
    q = torch.softmax(draft_logits.double(), -1)
    drafts = target_ids[torch.multinomial(q.view(-1, Vd), 1, generator=g).view(batch, k)]  # [B, k] target ids
    return logits, q, drafts, target_ids


def run(mode: str, logits, q, drafts, target_ids, V: int, seed: int) -> tuple[float, list]:
    out = []
    start = time.perf_counter()
    for b in range(logits.shape[0]):
        generator = torch.Generator().manual_seed(seed + b)
        if mode == "whole":  # as before: the block and the draft rows built up front
            p = target_probs(logits[b], 1.0)
            q_rows = torch.zeros(q.shape[1], V, dtype=torch.float64)
            q_rows[:, target_ids] = q[b]
        else:
            p = LazyProbs(logits[b], 1.0)
            q_rows = TargetVocabRows(list(q[b]), target_ids, V)
        out.append(verify_sampled(p, drafts[b].tolist(), q_rows, generator))
    return time.perf_counter() - start, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=80)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--noise", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    logits, q, drafts, target_ids = step_inputs(a.batch, a.k, a.vocab, a.draft_vocab, a.noise, 0)
    seconds = {"whole": [], "lazy": []}
    results = {}
    for _ in range(a.repeats):  # alternating, the same step each time
        for mode in seconds:
            s, results[mode] = run(mode, logits, q, drafts, target_ids, a.vocab, 100)
            seconds[mode].append(s)
    if results["whole"] != results["lazy"]:
        raise SystemExit("the two verifications drew different tokens")
    accepted = [acc for acc, _ in results["lazy"]]
    print(json.dumps({
        "batch": a.batch, "k": a.k, "vocab": a.vocab, "draft_vocab": a.draft_vocab, "noise": a.noise,
        "mean_accepted": round(sum(accepted) / len(accepted), 3), "same_tokens": True,
        "whole_s_per_step": round(min(seconds["whole"]), 4), "lazy_s_per_step": round(min(seconds["lazy"]), 4),
        "ratio": round(min(seconds["whole"]) / min(seconds["lazy"]), 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
