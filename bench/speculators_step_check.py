#!/usr/bin/env python3
"""Do our trainer and speculators 0.9's compute the same loss and the same gradients from the
same weights and the same batch? For EAGLE-3 (`--method eagle3`) and DFlash (`--method dflash`).

A drafter made by our trainer's own builder (`build_drafter`, `build_dflash`) for a small random
target is loaded into speculators' own model (`Eagle3DraftModel`, `DFlashDraftModel`, sdpa
attention, float32) in the python that has speculators (`--spec-python`). Both sides then take
one training forward and backward on the same random batch (aux states, tokens, loss mask and the
target's final states); prints one JSON line: both losses and the largest gradient difference per
parameter, relative to that parameter's largest gradient. Exit 1 where they differ.

EAGLE-3: speculators' `kl_div` loss (its eager kernel) against our `losses.kl`, which has the
gradient of our default `soft_ce` (the two differ by the target's entropy, a constant), 7 TTT steps,
step decay 0.8; the drafter is written by our vLLM export (the speculators format). speculators'
rows are already shifted (row j reads token j with aux j, and its mask at j + k weighs step k),
ours pair aux j with token j + 1 and weigh step k of row j with the mask at j + 2 + k: the batch is
laid out so that both score the same rows. That offset is the one data convention that differs
(one row a turn; BENCHMARKS.md, "speculators 0.9's trainer read line by line"). speculators trains
its EAGLE-3 head frozen; here it takes a gradient too, so that the heads' gradients compare.

DFlash: speculators' `ce` loss (the target's greedy token) with its D-PACE weighting against ours
(`labels: target`, `loss_weighting: dpace`), 1 layer (`--dflash-layers`), blocks of 8; every loss position that leaves
room for a whole block is an anchor on both sides (speculators draws its anchors at random, and
takes them all when they are no more than `max_anchors`).

    .venv/bin/python bench/speculators_step_check.py --spec-python /tmp/specvenv/bin/python
    .venv/bin/python bench/speculators_step_check.py --spec-python … --recipe speculators
    .venv/bin/python bench/speculators_step_check.py --spec-python … --method dflash
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# EAGLE-3 norm flags: ours as shipped (the schema's defaults), and speculators' recipe
RECIPES = {
    "ours": {"norm_before_fc": False, "norm_before_residual": False, "norm_output": True},
    "speculators": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
}
AUX_LAYERS = (0, 1, 2)
DFLASH = {"num_hidden_layers": 1, "block_size": 8, "loss_weighting": "dpace", "labels": "target", "dpace_alpha": 0.5}

# speculators' sides, each run in its own python: argv = drafter folder, inputs file, then its own
SPEC_COMMON = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from speculators.losses import resolve_loss_config
x = load_file(sys.argv[2])
def load(model, state):
    state.update({"embed_tokens.weight": x["embed"], "verifier_lm_head.weight": x["lm_head"],
                  "verifier_norm.weight": x["final_norm"]})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"d2t", "t2d"}, (missing, unexpected)
    return model.float().train()
def finish(model, loss):
    loss.backward()
    out = {"loss": loss.detach().reshape(1)}
    out.update({"grad." + n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    save_file(out, sys.argv[2] + ".out")
"""

# argv[3:] = ttt steps, decay
SPEC_EAGLE3 = SPEC_COMMON + """
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
cfg = Eagle3SpeculatorConfig.from_pretrained(sys.argv[1])
cfg.transformer_layer_config._attn_implementation = "sdpa"
model = load(Eagle3DraftModel(cfg), load_file(sys.argv[1] + "/model.safetensors"))
model.lm_head.weight.requires_grad_(True)
_, loss, _ = model(hidden_states=x["aux"], input_ids=x["ids"], document_ids=torch.zeros_like(x["ids"]),
                   loss_mask=x["mask"], verifier_last_hidden_states=x["pre_norm"], ttt_steps=int(sys.argv[3]),
                   ttt_step_loss_decay=float(sys.argv[4]), loss_config=resolve_loss_config("kl_div", "eager"))
finish(model, loss)
"""

# argv[3:] = target folder, D-PACE alpha; our DFlash config.json (Qwen3 fields + dflash_config) describes it
SPEC_DFLASH = SPEC_COMMON + """
from transformers import Qwen3Config
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
ours = json.load(open(sys.argv[1] + "/config.json"))
layer = Qwen3Config(**{k: ours[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings", "vocab_size")},
    rope_parameters={"rope_type": "default", "rope_theta": ours["rope_theta"]}, attention_bias=False)
layer._attn_implementation = "sdpa"
block = ours["dflash_config"]["block_size"]
cfg = DFlashSpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=ours["vocab_size"], block_size=block,
    aux_hidden_state_layer_ids=ours["dflash_config"]["target_layer_ids"],
    mask_token_id=ours["dflash_config"]["mask_token_id"],
    speculators_config=SpeculatorsConfig(algorithm="dflash", default_proposal_method="greedy",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
        verifier=VerifierConfig.from_pretrained(sys.argv[3])))
state = load_file(sys.argv[1] + "/model.safetensors")
state["lm_head.weight"] = x["lm_head"]
model = load(DFlashDraftModel(cfg), state)
anchors = int((x["mask"][0, :-block]).sum())
_, loss, _ = model(hidden_states=x["aux"], input_ids=x["ids"], loss_mask=x["mask"],
                   verifier_last_hidden_states=x["pre_norm"], document_ids=torch.zeros_like(x["ids"]),
                   loss_config=resolve_loss_config("ce", "eager"), max_anchors=anchors,
                   per_position_loss_weight="dpace", dpace_alpha=float(sys.argv[4]))
finish(model, loss)
"""


def make_target(folder: Path, vocab: int, hidden: int, seed: int) -> None:
    """A small random Llama (untied head, GQA) saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)


def trained_scale(drafter: torch.nn.Module) -> None:
    """Draw the trainable matrices at N(0, 0.1): logits at a trained drafter's scale, not the
    near-zero ones of a fresh drafter, so that every term of the gradient is exercised."""
    with torch.no_grad():
        for param in drafter.parameters():
            if param.requires_grad and param.dim() >= 2:
                param.normal_(0.0, 0.1)


def make_batch(a, target_dir: Path, tail_unmasked: int) -> dict[str, torch.Tensor]:
    """One sample in speculators' layout: ids [1, T], aux [1, T, 3H], the target's pre-norm final
    states [1, T, H], a 75% loss mask whose last `tail_unmasked` positions are 0; plus the target's
    embedding, LM head and final norm weight."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(a.seed + 1)
    T, H = a.tokens, a.hidden
    mask = torch.rand(1, T, generator=g) < 0.75
    mask[:, T - tail_unmasked :] = False
    target = load_file(str(next(target_dir.glob("*.safetensors"))))
    return {
        "ids": torch.randint(0, a.vocab, (1, T), generator=g),
        "aux": torch.randn(1, T, len(AUX_LAYERS) * H, generator=g),
        "pre_norm": 4.0 * torch.randn(1, T, H, generator=g),
        "mask": mask,
        "final_norm": target["model.norm.weight"].float(),
        "embed": target["model.embed_tokens.weight"].float(),
        "lm_head": target["lm_head.weight"].float(),
    }


def post_norm(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target's final states as our store keeps them: after its final RMSNorm."""
    pre = x["pre_norm"]
    return pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + 1e-6) * x["final_norm"]


def run_speculators(a, script: str, drafter_dir: Path, x: dict[str, torch.Tensor], tmp: Path, *args) -> dict:
    from safetensors.torch import load_file, save_file

    io = tmp / "io.safetensors"
    save_file(x, str(io))
    subprocess.run([a.spec_python, "-c", script, str(drafter_dir), str(io), *map(str, args)], check=True)
    return load_file(str(io) + ".out")


def check_eagle3(a, tmp: Path) -> tuple[torch.Tensor, dict, dict]:
    """(our loss, our gradients, speculators' output) for one EAGLE-3 step."""
    import numpy as np

    from draftflow.drafters import losses
    from draftflow.drafters.checkpoint import save_drafter
    from draftflow.drafters.train import TrainSettings, build_drafter
    from draftflow.drafters.ttt import TargetHead, step_terms, ttt_loss
    from draftflow.drafters.vocab import DraftVocab
    from draftflow.export.common import ExportSettings
    from draftflow.export.eagle3 import export_eagle3, tensors_from_vllm

    # the whole target vocabulary as the draft vocabulary: every target argmax is draftable, so
    # ours' rule (rows whose argmax is outside the draft vocabulary carry no loss) is idle
    full = DraftVocab(np.zeros(a.vocab, dtype=np.int64), np.ones(a.vocab, dtype=bool))
    settings = TrainSettings(aux_layer_ids=AUX_LAYERS, draft_vocab_size=a.vocab, ttt_steps=a.ttt_steps,
                             seed=a.seed, **RECIPES[a.recipe])  # fmt: skip
    drafter, _, _ = build_drafter(settings, tmp / "target", full)
    trained_scale(drafter)
    save_drafter(drafter, tmp / "drafter", dtype=torch.float32)
    export_eagle3(tmp / "drafter", tmp / "target", ExportSettings(dtype="float32"), tmp / "export")
    x = make_batch(a, tmp / "target", tail_unmasked=1)
    theirs = run_speculators(a, SPEC_EAGLE3, tmp / "export" / "vllm", x, tmp, a.ttt_steps, a.decay)

    # ours: the same rows one position later (a leading token, a trailing aux row)
    T, H = a.tokens, a.hidden
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), x["ids"]], 1)  # [1, T+1]
    aux = torch.cat([x["aux"], torch.zeros(1, 1, x["aux"].shape[-1])], 1)
    final = torch.cat([torch.zeros(1, 1, H), post_norm(x)], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.bool), x["mask"][:, : T - 1]], 1)  # m_o[j+2+k] = m_s[j+k]
    drafter = drafter.float().train()
    info = TargetHead(x["lm_head"], torch.from_numpy(full.t2d))(final)
    kl_terms = functools.partial(step_terms, loss=losses.kl)
    loss = ttt_loss(drafter, ids, mask, aux, info, a.ttt_steps, a.decay, terms=kl_terms).loss
    loss.backward()
    ours = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    grads = tensors_from_vllm({n.removeprefix("grad."): t for n, t in theirs.items() if n != "loss"})
    return loss.detach(), ours, {"loss": theirs["loss"], "grads": grads}


def check_dflash(a, tmp: Path) -> tuple[torch.Tensor, dict, dict]:
    """(our loss, our gradients, speculators' output) for one DFlash step."""
    from draftflow.drafters.checkpoint import save_drafter
    from draftflow.drafters.dflash_loss import DFlashObjective
    from draftflow.drafters.train import TrainSettings, build_dflash

    block = DFLASH["block_size"]
    settings = TrainSettings(aux_layer_ids=AUX_LAYERS, method="dflash", seed=a.seed,
                             dflash={**DFLASH, "num_hidden_layers": a.dflash_layers, "mask_token_id": a.vocab - 1})  # fmt: skip
    drafter, argmax_head, _ = build_dflash(settings, tmp / "target")
    trained_scale(drafter)
    save_drafter(drafter, tmp / "drafter", dtype=torch.float32)
    # the last `block` positions unmasked: no anchor there on either side, and every block fits
    x = make_batch(a, tmp / "target", tail_unmasked=block)
    theirs = run_speculators(a, SPEC_DFLASH, tmp / "drafter", x, tmp, tmp / "target", DFLASH["dpace_alpha"])

    final = post_norm(x)
    anchors = x["mask"][0].nonzero().view(1, -1)  # [1, n]: every loss position with room for a block
    drafter = drafter.float().train()
    objective = DFlashObjective(drafter, decay=1.0, labels=DFLASH["labels"], weighting=DFLASH["loss_weighting"],
                                dpace_alpha=DFLASH["dpace_alpha"])  # fmt: skip
    loss, _ = objective(x["ids"], x["mask"], x["aux"], final, argmax_head(final).argmax, anchors=anchors)
    loss.backward()
    ours = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    grads = {n.removeprefix("grad."): t for n, t in theirs.items() if n != "loss"}
    return loss.detach(), ours, {"loss": theirs["loss"], "grads": grads}


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """Per parameter of ours: max |difference| / max |our gradient| (None: speculators has none)."""
    rel: dict[str, float | None] = {}
    for name, grad in ours.items():
        other = theirs.get(name)
        rel[name] = None if other is None else float((grad - other).abs().max() / grad.abs().max().clamp_min(1e-30))
    return rel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec-python", required=True, help="a python with speculators 0.9 installed")
    p.add_argument("--method", choices=("eagle3", "dflash"), default="eagle3")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="ours", help="EAGLE-3: the drafter's norm flags")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3")
    p.add_argument("--decay", type=float, default=0.8, help="EAGLE-3: the TTT step loss decay")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dflash-layers", type=int, default=1, help="DFlash: draft layers (speculators defaults to 5)")
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_target(tmp / "target", a.vocab, a.hidden, a.seed)
        check = check_eagle3 if a.method == "eagle3" else check_dflash
        loss, ours, theirs = check(a, tmp)
    rel = compare(ours, theirs["grads"])
    report = {"method": a.method, "tokens": a.tokens, "seed": a.seed,
              **({"recipe": a.recipe, "ttt_steps": a.ttt_steps} if a.method == "eagle3"
                 else {"dflash": {**DFLASH, "num_hidden_layers": a.dflash_layers}}),
              "loss_ours": float(loss), "loss_speculators": float(theirs["loss"]),
              "max_rel_grad_diff": max((v for v in rel.values() if v is not None), default=None),
              "rel_grad_diff": rel, "gradients_only_speculators_has": sorted(set(theirs["grads"]) - set(ours))}  # fmt: skip
    print(json.dumps(report))
    same_loss = abs(report["loss_ours"] - report["loss_speculators"]) <= 1e-4 * abs(report["loss_speculators"])
    return 0 if same_loss and None not in rel.values() and report["max_rel_grad_diff"] <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
