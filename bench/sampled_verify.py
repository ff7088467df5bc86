"""Cost of one batched speculative-sampling step's draws and verification (issue 32).

At T = 1 a batched EAGLE-3 step draws K drafts per row from the drafter's distributions, then
verifies each row's chain against the target's (acceptance tests, then a residual or bonus token).
Two ways, on the same random step with SmolLM2's shapes (V 49,152, draft vocabulary 32,000):

  host     as the evaluator did until 2026-12-05 (ca1943e): per row and draft a copy of its [Vd]
           logits to the host, a float64 softmax and `torch.multinomial` there; per row the target rows
           up to the first rejection copied and softmaxed on the host. Other draws (multinomial), so
           only its time is compared.
  rows     the same row-at-a-time order with today's draws (`sample_rows`, `verify_sampled`): the
           probabilities where the logits are, one sync per draw.
  batched  every row at once on the logits' device (`RowSampling.sample`-style drafts through
           `sample_rows`, `verify_sampled_rows`): the host draws each row's uniforms and compares
           two [B, K] tables; a few transfers a step whatever B is.

rows and batched draw from each row's own generator in the same order, so they must return the same
tokens (checked). On a CPU both do their arithmetic on the host; `--device cuda` times what a GPU step costs.

    .venv/bin/python bench/sampled_verify.py [--batch 80 --k 7 --noise 1.0 --device cpu]

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

from draftflow.evaluation.speculative import (  # noqa: E402
    DraftDistributions,
    LazyProbs,
    TargetVocabRows,
    draw_uniform,
    sample_rows,
    target_probs,
    verify_sampled,
    verify_sampled_rows,
)


def step_inputs(batch: int, k: int, V: int, Vd: int, noise: float, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(V, generator=g)[:Vd].sort().values  # [Vd]
    logits = torch.randn(batch, k + 1, V, generator=g) * 3  # [B, k+1, V] target
    draft_logits = logits[:, :k, target_ids] + noise * torch.randn(batch, k, Vd, generator=g)  # [B, k, Vd]
    return logits.to(device), draft_logits.to(device), target_ids.to(device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def host_side_as_before(logits, draft_logits, target_ids, seed: int) -> list:
    """The pre-ca1943e evaluator's arithmetic, for its time: every row's softmaxes and draws on the host."""
    B, k, V = logits.shape[0], draft_logits.shape[1], logits.shape[2]
    host_ids = target_ids.cpu()
    out = []
    for b in range(B):
        g = torch.Generator().manual_seed(seed + b)
        qs, drafts = [], []
        for i in range(k):
            q = torch.softmax(draft_logits[b, i].double().cpu(), -1)  # [Vd]
            choice = int(torch.multinomial(q, 1, generator=g)[0])
            qs.append(q)
            drafts.append(int(host_ids[choice]))
        a = len(drafts)
        for i, d in enumerate(drafts):
            p_i = torch.softmax(logits[b, i].double().cpu(), -1)  # [V], read as the test needs it
            q_i = torch.zeros(V, dtype=torch.float64)
            q_i[host_ids] = qs[i]
            if float(torch.rand((), generator=g, dtype=torch.float64)) * float(q_i[d]) >= float(p_i[d]):
                residual = (p_i - q_i).clamp_min(0.0)
                torch.multinomial(residual / residual.sum(), 1, generator=g)
                a = i
                break
        if a == len(drafts):
            torch.multinomial(torch.softmax(logits[b, a].double().cpu(), -1), 1, generator=g)
        out.append(a)
    return out


def one_row_at_a_time(logits, draft_logits, target_ids, seed: int) -> list:
    B, k, V = logits.shape[0], draft_logits.shape[1], logits.shape[2]
    out = []
    for b in range(B):
        g = torch.Generator().manual_seed(seed + b)
        qs, drafts = [], []
        for i in range(k):  # the drafts, one softmax and one draw each
            q = target_probs(draft_logits[b, i], 1.0)  # [Vd]
            choice = int(sample_rows(q[None], torch.tensor([draw_uniform(g)], dtype=torch.float64))[0])
            qs.append(q)
            drafts.append(int(target_ids[choice]))
        out.append(verify_sampled(LazyProbs(logits[b], 1.0), drafts, TargetVocabRows(qs, target_ids, V), g))
    return out


def all_rows_at_once(logits, draft_logits, target_ids, seed: int) -> list:
    B, k = logits.shape[0], draft_logits.shape[1]
    generators = [torch.Generator().manual_seed(seed + b) for b in range(B)]
    qs, choices = [], []
    for i in range(k):
        qs.append(target_probs(draft_logits[:, i], 1.0))  # [B, Vd]
        uniforms = torch.tensor([draw_uniform(g) for g in generators], dtype=torch.float64)
        choices.append(sample_rows(qs[-1], uniforms))
    q = DraftDistributions(qs, torch.stack(choices, 1), target_ids)
    drafts = target_ids[q.index].tolist()  # [B][k] target ids
    return verify_sampled_rows(logits, drafts, q, 1.0, generators)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=80)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--noise", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    inputs = step_inputs(a.batch, a.k, a.vocab, a.draft_vocab, a.noise, 0, a.device)
    ways = {"host": host_side_as_before, "rows": one_row_at_a_time, "batched": all_rows_at_once}
    seconds = {name: [] for name in ways}
    results = {}
    for _ in range(a.repeats):  # alternating, the same step each time
        for name, way in ways.items():
            sync(a.device)
            start = time.perf_counter()
            results[name] = way(*inputs, seed=100)
            sync(a.device)
            seconds[name].append(time.perf_counter() - start)
    if results["rows"] != results["batched"]:
        raise SystemExit("the two ways drew different tokens")
    accepted = [acc for acc, _ in results["batched"]]
    print(json.dumps({
        "device": a.device, "batch": a.batch, "k": a.k, "vocab": a.vocab, "draft_vocab": a.draft_vocab,
        "noise": a.noise, "threads": a.threads, "mean_accepted": round(sum(accepted) / len(accepted), 3),
        "same_tokens": True, "host_s_per_step": round(min(seconds["host"]), 4),
        "rows_s_per_step": round(min(seconds["rows"]), 4), "batched_s_per_step": round(min(seconds["batched"]), 4),
        "host_over_batched": round(min(seconds["host"]) / min(seconds["batched"]), 2),
        "rows_over_batched": round(min(seconds["rows"]) / min(seconds["batched"]), 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
