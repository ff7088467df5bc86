"""Peak memory of an EAGLE-3 drafter's first draft over a batch of prompts: the head over every
fed position against the head at each row's last one (`step(..., only_at=...)`).

Batched evaluation feeds each row's whole prompt to the drafter at once. The first draft needs
the logits of the last fed position only; the head over all of them is B x S x Vd floats, which
at 80 prompts of ~1,000 tokens and Vd 32,000 is ~10 GB (an H100 ran out of memory at six
evaluations side by side). Each mode runs in a child process of its own, one after the other,
on the same random drafter shaped like SmolLM2-135M's (hidden 576, vocabulary 49,152, draft
vocabulary 32,000) and the same batch, and reports the child's peak resident memory above what
it held before the call, and whether the two modes' first drafts agree.

    .venv/bin/python bench/draft_head_memory.py                     # 16 prompts x 1,024 tokens
    .venv/bin/python bench/draft_head_memory.py --batch 8 --tokens 512 --threads 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

TARGET = {  # SmolLM2-135M-Instruct's config, as the converted folder has it
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
}  # fmt: skip
DRAFT_VOCAB = 32000


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(mode: str, batch: int, tokens: int, threads: int) -> dict:
    """One first draft in this process: the head everywhere ('all') or at the last position ('last')."""
    import torch

    from draftflow.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Eagle3Config.from_target(TARGET, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=[1, 14, 26])
    drafter = Eagle3Drafter(config).eval()
    ids = torch.randint(0, TARGET["vocab_size"], (batch, tokens))  # [B, S]
    aux = torch.randn(batch, tokens, 3 * TARGET["hidden_size"])  # [B, S, 3H]
    positions = torch.arange(tokens)[None].expand(batch, tokens)  # [B, S]
    last = torch.full((batch,), tokens - 1)
    with torch.inference_mode():
        hidden = drafter.fuse(aux)  # [B, S, H]
        before = peak_rss_mb()
        logits, _, _ = drafter.step(ids, hidden, positions, only_at=last if mode == "last" else None)
        first = logits[:, -1].argmax(-1) if mode == "last" else logits[torch.arange(batch), last].argmax(-1)
    return {"mode": mode, "peak_above_mb": round(peak_rss_mb() - before, 1), "logits_shape": list(logits.shape),
            "first_drafts": first.tolist()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=["all", "last"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.batch, a.tokens, a.threads)))
        return
    runs = {}
    for mode in ("all", "last"):
        cmd = [sys.executable, __file__, "--child", mode, "--batch", str(a.batch), "--tokens", str(a.tokens),
               "--threads", str(a.threads)]  # fmt: skip
        runs[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(json.dumps({
        "batch": a.batch, "tokens": a.tokens, "draft_vocab": DRAFT_VOCAB,
        "head_everywhere_peak_mb": runs["all"]["peak_above_mb"], "head_at_last_peak_mb": runs["last"]["peak_above_mb"],
        "logits_shapes": [runs["all"]["logits_shape"], runs["last"]["logits_shape"]],
        "same_first_drafts": runs["all"]["first_drafts"] == runs["last"]["first_drafts"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
