#!/usr/bin/env python3
"""Do our trainer and speculators 0.9's compute the same loss and the same gradients from the
same weights and the same batch?

One EAGLE-3 drafter, made by our trainer's own `build_drafter` for a small random Llama target
and written by our vLLM export (the speculators format), is loaded into speculators' own
`Eagle3DraftModel` in the python that has speculators (`--spec-python`). Both sides then take one
training forward and backward on the same random batch (aux states, tokens, loss mask and the
target's final states), in float32, with the KL loss speculators trains with (`kl_div`, its
eager kernel) and the same per-step decay: speculators' `model(..., verifier_last_hidden_states)`
and our `ttt_loss` with `losses.kl` (the same gradient as our default `soft_ce`, which differs
from KL by the target's entropy, a constant). Prints one JSON line: both losses and the largest
gradient difference per parameter, relative to that parameter's largest gradient.

The batch is laid out so that both sides score the same rows: speculators' rows are already
shifted (row j reads token j with aux j, and its mask at j + k weighs step k), ours pair aux j
with token j + 1 and weigh step k of row j with the mask at j + 2 + k. That offset is the one
data convention that differs between the two (one row a turn; BENCHMARKS.md, "speculators 0.9's
trainer read line by line"); this check compares what each computes on the rows both score.

    .venv/bin/python bench/speculators_step_check.py --spec-python /tmp/specvenv/bin/python
    .venv/bin/python bench/speculators_step_check.py --spec-python … --recipe speculators

speculators trains with its LM head frozen; here its head takes a gradient too, so that the two
heads' gradients can be compared (our default trains it).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# EAGLE-3 norm flags: ours as shipped (the schema's defaults), and speculators' recipe
RECIPES = {
    "ours": {"norm_before_fc": False, "norm_before_residual": False, "norm_output": True},
    "speculators": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
}

# speculators' side, run in its own python: argv = export folder, inputs file, ttt steps, decay
SPEC_SIDE = """
import sys, torch
from safetensors.torch import load_file, save_file
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
ckpt, io, steps, decay = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
cfg = Eagle3SpeculatorConfig.from_pretrained(ckpt)
cfg.transformer_layer_config._attn_implementation = "sdpa"
model = Eagle3DraftModel(cfg)
x = load_file(io)
state = load_file(ckpt + "/model.safetensors")
state.update({"embed_tokens.weight": x["embed"], "verifier_lm_head.weight": x["lm_head"],
              "verifier_norm.weight": x["final_norm"]})
missing, unexpected = model.load_state_dict(state, strict=False)
assert not unexpected and set(missing) <= {"d2t", "t2d"}, (missing, unexpected)
model = model.float().train()
model.lm_head.weight.requires_grad_(True)
_, loss, _ = model(hidden_states=x["aux"], input_ids=x["ids"], document_ids=torch.zeros_like(x["ids"]),
                   loss_mask=x["mask"], verifier_last_hidden_states=x["pre_norm"], ttt_steps=steps,
                   ttt_step_loss_decay=decay, loss_config=resolve_loss_config("kl_div", "eager"))
loss.backward()
out = {"loss": loss.detach().reshape(1)}
out.update({"grad." + n: p.grad for n, p in model.named_parameters() if p.grad is not None})
save_file(out, io + ".out")
"""


def make_target(folder: Path, vocab: int, hidden: int, seed: int) -> None:
    """A small random Llama (untied head, GQA) saved as an HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)


def main(argv=None) -> int:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from draftflow.drafters import losses
    from draftflow.drafters.checkpoint import save_drafter
    from draftflow.drafters.train import TrainSettings, build_drafter
    from draftflow.drafters.ttt import TargetHead, step_terms, ttt_loss
    from draftflow.drafters.vocab import DraftVocab
    from draftflow.export.common import ExportSettings
    from draftflow.export.eagle3 import export_eagle3, tensors_from_vllm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec-python", required=True, help="a python with speculators 0.9 installed")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="ours", help="the drafter's norm flags")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--decay", type=float, default=0.8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_target(tmp / "target", a.vocab, a.hidden, a.seed)
        # the whole target vocabulary as the draft vocabulary: every target argmax is draftable, so
        # ours' rule (rows whose argmax is outside the draft vocabulary carry no loss) is idle
        full = DraftVocab(np.zeros(a.vocab, dtype=np.int64), np.ones(a.vocab, dtype=bool))
        settings = TrainSettings(aux_layer_ids=(0, 1, 2), draft_vocab_size=a.vocab, ttt_steps=a.ttt_steps,
                                 seed=a.seed, **RECIPES[a.recipe])  # fmt: skip
        drafter, head, cfg = build_drafter(settings, tmp / "target", full)
        with torch.no_grad():  # a trained drafter's scale, not the near-zero logits of a fresh one
            for param in drafter.parameters():
                if param.requires_grad and param.dim() >= 2:
                    param.normal_(0.0, 0.1)
        save_drafter(drafter, tmp / "drafter", dtype=torch.float32)
        export_eagle3(tmp / "drafter", tmp / "target", ExportSettings(dtype="float32"), tmp / "export")

        # one batch in speculators' layout; T rows, the last one unmasked (see the docstring)
        g = torch.Generator().manual_seed(a.seed + 1)
        T, H = a.tokens, a.hidden
        ids = torch.randint(0, a.vocab, (1, T), generator=g)
        aux = torch.randn(1, T, 3 * H, generator=g)
        pre_norm = 4.0 * torch.randn(1, T, H, generator=g)  # the target's last state before its final norm
        mask = torch.rand(1, T, generator=g) < 0.75
        mask[:, -1] = False
        target = load_file(str(next((tmp / "target").glob("*.safetensors"))))
        final_norm = target["model.norm.weight"].float()
        io = tmp / "io.safetensors"
        save_file({"ids": ids, "aux": aux, "pre_norm": pre_norm, "mask": mask, "final_norm": final_norm,
                   "embed": target["model.embed_tokens.weight"].float(),
                   "lm_head": target["lm_head.weight"].float()}, str(io))  # fmt: skip
        subprocess.run([a.spec_python, "-c", SPEC_SIDE, str(tmp / "export" / "vllm"), str(io), str(a.ttt_steps),
                        str(a.decay)], check=True)  # fmt: skip
        theirs = load_file(str(io) + ".out")

        # ours: the same rows one position later (a leading token, a trailing aux row), post-norm final states
        post = pre_norm * torch.rsqrt(pre_norm.pow(2).mean(-1, keepdim=True) + 1e-6) * final_norm
        ours_ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), ids], 1)  # [1, T+1]
        ours_aux = torch.cat([aux, torch.zeros(1, 1, 3 * H)], 1)
        ours_final = torch.cat([torch.zeros(1, 1, H), post], 1)
        ours_mask = torch.cat([torch.zeros(1, 2, dtype=torch.bool), mask[:, : T - 1]], 1)  # m_o[j+2+k] = m_s[j+k]
        drafter = drafter.float().train()
        info = TargetHead(target["lm_head.weight"].float(), torch.from_numpy(full.t2d))(ours_final)
        kl_terms = functools.partial(step_terms, loss=losses.kl)
        result = ttt_loss(drafter, ours_ids, ours_mask, ours_aux, info, a.ttt_steps, a.decay, terms=kl_terms)
        result.loss.backward()

    ours_grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    their_grads = tensors_from_vllm({n.removeprefix("grad."): t for n, t in theirs.items() if n != "loss"})
    rel = {}
    for name, grad in ours_grads.items():
        other = their_grads.get(name)
        if other is None:
            rel[name] = None
            continue
        rel[name] = float((grad - other).abs().max() / grad.abs().max().clamp_min(1e-30))
    only_theirs = sorted(set(their_grads) - set(ours_grads))
    report = {"recipe": a.recipe, "flags": RECIPES[a.recipe], "ttt_steps": a.ttt_steps, "tokens": T,
              "loss_ours": float(result.loss.detach()), "loss_speculators": float(theirs["loss"]),
              "max_rel_grad_diff": max(v for v in rel.values() if v is not None), "rel_grad_diff": rel,
              "gradients_only_speculators_has": only_theirs}  # fmt: skip
    print(json.dumps(report))
    same = abs(report["loss_ours"] - report["loss_speculators"]) <= 1e-4 * abs(report["loss_speculators"])
    return 0 if same and None not in rel.values() and report["max_rel_grad_diff"] <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
