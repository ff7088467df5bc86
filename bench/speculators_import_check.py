#!/usr/bin/env python3
"""Does a speculators EAGLE-3 checkpoint, imported by `draftflow import-drafter --from
speculators`, compute what speculators itself computes?

Runs speculators 0.9's own `Eagle3DraftModel` forward (sdpa attention, fp32, `--ttt-steps`
steps, its EAGLE-3 recipe flags as the checkpoint says) on random aux states and tokens in the
python that has speculators (`--spec-python`), and draftflow's TTT unroll of the imported
drafter on the same inputs; prints one JSON line with the largest logit difference per step.

    .venv/bin/python bench/speculators_import_check.py --checkpoint RUN/checkpoint_best \
        --target results/target --spec-python .venv-spec/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# speculators' side, run in its own python: argv = checkpoint, inputs/outputs file, ttt steps
SPEC_SIDE = """
import sys, torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
ckpt, io, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = Eagle3SpeculatorConfig.from_pretrained(ckpt)
cfg.transformer_layer_config._attn_implementation = "sdpa"
model = Eagle3DraftModel(cfg)
missing, unexpected = model.load_state_dict(load_file(ckpt + "/model.safetensors"), strict=False)
assert not unexpected and set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, (missing, unexpected)
model = model.float().eval()
x = load_file(io)
logits = []
model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().clone()))
with torch.no_grad():
    model(hidden_states=x["aux"], input_ids=x["ids"], document_ids=torch.zeros_like(x["ids"]), ttt_steps=steps)
save_file({**x, "logits": torch.stack(logits)}, io)
"""


def main(argv=None) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    from draftflow.drafters.checkpoint import load_drafter
    from draftflow.drafters.ttt import unroll
    from draftflow.export.importing import import_speculators, speculators_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="speculators epoch folder or --save-path")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--spec-python", default=sys.executable)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--ttt-steps", type=int, default=3)
    a = p.parse_args(argv)
    ckpt = speculators_checkpoint(a.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = import_speculators(ckpt, a.target, Path(tmp) / "drafter")
        g = torch.Generator().manual_seed(0)
        T, n_aux = a.tokens, len(cfg.aux_layer_ids)
        ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
        aux = torch.randn(1, T, n_aux * cfg.hidden_size, generator=g)
        io = Path(tmp) / "io.safetensors"
        save_file({"ids": ids, "aux": aux}, str(io))
        subprocess.run([a.spec_python, "-c", SPEC_SIDE, str(ckpt), str(io), str(a.ttt_steps)], check=True)
        theirs = load_file(str(io))["logits"]  # [steps, 1, T, Vd]
        drafter, _ = load_drafter(Path(tmp) / "drafter", a.target, dtype=torch.float32)
        # speculators' rows are already shifted (row j reads token j with aux j); ours pairs aux j with
        # token j+1: prepend one token and append one aux row
        ours_ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), ids], 1)
        ours_aux = torch.cat([aux, torch.zeros(1, 1, aux.shape[-1])], 1)
        with torch.no_grad():
            ours = [lg[:, :T] for lg, _ in unroll(drafter, ours_ids, ours_aux, a.ttt_steps)]
    # step k: speculators right-pads its shifted tokens with 0; compare the T - k rows with real tokens
    diffs = [float((ours[k][:, : T - k] - theirs[k][:, : T - k]).abs().max()) for k in range(a.ttt_steps)]
    scale = float(theirs.abs().max())
    print(json.dumps({"checkpoint": str(ckpt), "max_abs_logit_diff_per_step": diffs, "max_abs_logit": scale,
                      "flags": {k: getattr(cfg, k) for k in ("norm_before_fc", "norm_before_residual", "norm_output")}}))
    return 0 if max(diffs) <= 1e-4 * max(1.0, scale) else 1


if __name__ == "__main__":
    sys.exit(main())
