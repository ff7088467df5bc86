#!/usr/bin/env python3
"""What fp8 storage does to a trained drafter's inputs: simulated τ of one EAGLE-3 drafter on the
eval split of a lossless store, read as stored and as each fp8 mode would have stored it.

`bench/fp8_targets.py` measures fp8's effect on the training targets (the final state). The other
candidate for fp8's ~2% τ loss on SmolLM2 is the error it puts on the aux states, the drafter's
inputs. This isolates that error at inference, without training: the same drafter and the same
samples, with
  * lossless: the states as the store holds them (bf16);
  * fp8_aux:  the aux states through fp8, the final state as stored (so the targets are unchanged):
              the inputs' error alone;
  * fp8:      every state through fp8 (inputs and targets both perturbed).
Each is scored teacher-forced against the target's argmax from its own final state (T = 0; with
--temperature, the expected acceptance of speculative sampling), as training's evaluation scores
the eval split. The drafter was trained on lossless states, so this says how much its proposals
depend on what fp8 rounds away; what that error does to training is a separate question, answered
only by training on an `fp8_aux` store. CPU, ~4.5 minutes a mode for 231 samples.

Prints one JSON line.

    .venv/bin/python bench/fp8_inputs.py --drafter DRAFTER_DIR --target real/smollm2-135m-instruct \
        --eval-ranges RESULTS/hidden_states/eval/rows_0-231 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftflow.drafters.batching import reader_layers  # noqa: E402
from draftflow.drafters.checkpoint import load_drafter  # noqa: E402
from draftflow.drafters.ttt import TargetHead  # noqa: E402
from draftflow.evaluation.evaluate import simulate  # noqa: E402
from draftflow.hidden_states.storage import HiddenStateReader, quantize_for_storage  # noqa: E402
from draftflow.target import load_target  # noqa: E402

MODES = ("lossless", "fp8_aux", "fp8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, required=True, help="a trained EAGLE-3 drafter folder")
    p.add_argument("--target", type=Path, required=True, help="the target's HF folder (its LM head scores)")
    p.add_argument("--eval-ranges", type=Path, nargs="+", required=True, help="lossless eval range folders")
    p.add_argument("--steps", type=int, default=7, help="draft tokens K")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0: argmax hits; > 0: expected acceptance")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


class StoredAs:
    """A HiddenStateReader whose samples come back as `storage` would have stored them."""

    def __init__(self, reader: HiddenStateReader, storage: str):
        self.reader, self.storage = reader, storage

    def __len__(self) -> int:
        return len(self.reader)

    def read(self, i: int):
        sample = self.reader.read(i)
        if self.storage == "lossless" or not hasattr(sample, "hidden"):  # a BadRead passes through
            return sample
        # [T, L, H] as an fp8 / fp8_aux file holds it (fp8_aux: its final state as stored)
        return replace(sample, hidden=quantize_for_storage(sample.hidden, self.storage).dequantize())

    __getitem__ = read  # simulate() looks both up


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    model, _ = load_target(a.target, dtype="float32", device="cpu")
    drafter, cfg = load_drafter(a.drafter, a.target, device="cpu", dtype=torch.float32)
    head = TargetHead(model.get_output_embeddings().weight, drafter.t2d)
    reader = HiddenStateReader(list(a.eval_ranges))
    layers = reader_layers(reader.range_dirs, cfg, "eval")
    modes = {}
    for storage in a.modes:
        t0 = time.monotonic()
        sim = simulate(drafter, head, StoredAs(reader, storage), a.steps, max_samples=a.max_samples, layers=layers,
                       temperature=a.temperature)  # fmt: skip
        modes[storage] = {
            "tau": round(sim.tau, 4), "alpha": [round(x, 4) for x in sim.alpha], "anchors": sim.trials[0],
            "samples": sim.samples, "seconds": round(time.monotonic() - t0, 1),
        }  # fmt: skip
        print(json.dumps({storage: modes[storage]}), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "fp8_inputs", "drafter": str(a.drafter), "steps": a.steps,
                      "temperature": a.temperature, "modes": modes}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
