"""The recipe floor's measurements: simulated τ of the default `train` recipe over seeds, and of variants.

Uses the fixed tiny data of `tests/test_recipe_floor.py` (the same target, samples, draft vocabulary
and default train settings; made once per run) and trains one drafter per (variant, seed) in this
process. For each it reports the training's own simulated τ (K = ttt_steps, teacher forced on the
held-out split, greedy) and the simulated τ of `draftflow evaluate` (`evaluation.evaluate.simulate`)
at temperature 0 and at temperature 1 (expected acceptance of speculative sampling, Σ min(p, q)).
The default's spread over seeds sets the test's floors (`TAU_FLOOR_T1`, `TAU_FLOOR_T0`); the variants
show what a recipe change scores on the same data (BENCHMARKS.md "The recipe floor").

    OMP_NUM_THREADS=1 .venv/bin/python bench/recipe_floor.py --seeds 0 1 2 3 4 5 6 7 8 9 --variants default
    OMP_NUM_THREADS=1 .venv/bin/python bench/recipe_floor.py --seeds 0 1 2 --variants tv lk lk_alpha lr_x0.1 epochs_1
    OMP_NUM_THREADS=1 .venv/bin/python bench/recipe_floor.py --seeds 0 1 2 --variants default sweep  # the defaults' sweep
    OMP_NUM_THREADS=1 .venv/bin/python bench/recipe_floor.py --seeds 0 1 2 --variants default --set learning_rate=0.003

`--set key=value` (repeatable; the value is read as YAML) overrides a `train` setting in every variant;
a `draft_vocab_size` other than the test's gets its own vocabulary file (the top tokens of the same
loss-masked counts). `sweep` stands for the variants of `SWEEP`.

Prints one JSON line: per variant, per seed and mean / sd / min / max of each τ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import test_recipe_floor as floor  # noqa: E402  (the test owns the data; this script only measures)

# name -> overrides of the default train settings
VARIANTS: dict[str, dict] = {
    "default": {},  # soft_ce
    "tv": {"loss": "tv"},
    "lk": {"loss": "lk"},
    "lk_alpha": {"loss": "lk_alpha"},
    "lr_x0.1": {"learning_rate": 4e-4},  # a regression: a tenth of the default learning rate
    "epochs_1": {"epochs": 1},  # a regression: a quarter of the default budget
    "speculators_norms": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    # the sweep of the defaults before packing (issue 13 item 4), one setting changed at a time from the
    # then default learning_rate 2e-3, cosine schedule, 4 epochs and the test's draft vocab 64 of 96
    # (run them with --set learning_rate=0.002 to repeat it)
    "lr_5e-4": {"learning_rate": 5e-4},
    "lr_1e-3": {"learning_rate": 1e-3},
    "lr_4e-3": {"learning_rate": 4e-3},
    "lr_8e-3": {"learning_rate": 8e-3},
    "schedule_linear": {"schedule": "linear"},
    "schedule_constant": {"schedule": "constant"},
    "epochs_2": {"epochs": 2},
    "epochs_8": {"epochs": 8},
    "dvocab_32": {"draft_vocab_size": 32},
    "dvocab_48": {"draft_vocab_size": 48},
    "dvocab_96": {"draft_vocab_size": 96},  # the whole target vocabulary
}
SWEEP = ["lr_5e-4", "lr_1e-3", "lr_4e-3", "lr_8e-3", "schedule_linear", "schedule_constant", "epochs_2", "epochs_8",
         "dvocab_32", "dvocab_48", "dvocab_96"]  # fmt: skip


def parse_sets(items: list[str]) -> dict:
    """`key=value` pairs (value read as YAML: numbers, booleans, strings) into train overrides."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected key=value, e.g. --set learning_rate=0.001")
        out[key.removeprefix("train.")] = yaml.safe_load(value)
    return out


def world_for(world: dict, draft_vocab_size: int | None) -> dict:
    """The world with a vocabulary file of `draft_vocab_size` (top loss-masked tokens of the same counts)."""
    from draftflow.drafters.vocab import save_vocab, select_draft_vocab

    if draft_vocab_size is None or draft_vocab_size == floor.DRAFT_VOCAB:
        return world
    path = world["root"] / f"vocab-{draft_vocab_size}.safetensors"
    if not path.exists():
        save_vocab(select_draft_vocab(world["counts"], draft_vocab_size), path)
    return {**world, "vocab": path}


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4),
            "sd": round(statistics.stdev(values), 4) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS) + ["sweep"])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a train setting")
    p.add_argument("--output", type=Path, help="also append the JSON line to this file")
    a = p.parse_args(argv)
    sets = parse_sets(a.set)
    names = [n for v in a.variants for n in (SWEEP if v == "sweep" else [v])]
    torch.set_num_threads(1)
    floors = {"T0": floor.TAU_FLOOR_T0, "T1": floor.TAU_FLOOR_T1}
    result: dict = {"bench": "recipe_floor", "tau_floor": floors, "seeds": a.seeds, "set": sets, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        world = floor.make_world(Path(tmp) / "world")
        masked = world["counts"] > 0
        result["data"] = {"vocab": floor.VOCAB, "distinct_masked_tokens": int(masked.sum()),
                          "draft_vocab": floor.DRAFT_VOCAB}  # fmt: skip
        for name in names:
            overrides = {**VARIANTS[name], **sets}
            vworld = world_for(world, overrides.get("draft_vocab_size"))
            runs = []
            for seed in a.seeds:
                out = Path(tmp) / f"{name}-s{seed}"
                start = time.perf_counter()
                summary = floor.train_tau(vworld, out, seed=seed, **overrides)
                seconds = time.perf_counter() - start
                steps = len(summary["step_alpha"])
                run = {"seed": seed, "train_tau": round(summary["tau"], 4), "optimizer_steps": summary["steps"],
                       "train_seconds": round(seconds, 1),
                       "T0": floor.simulated_tau(world, out / "drafter", steps, 0.0),
                       "T1": floor.simulated_tau(world, out / "drafter", steps, 1.0)}  # fmt: skip
                print(f"{name} seed {seed}: {json.dumps(run)}", file=sys.stderr, flush=True)
                runs.append(run)
            result["variants"][name] = {
                "overrides": overrides, "runs": runs,
                "train_tau": spread([r["train_tau"] for r in runs]),
                "T0": spread([r["T0"]["tau"] for r in runs]), "T1": spread([r["T1"]["tau"] for r in runs]),
            }  # fmt: skip
    line = json.dumps(result)
    print(line)
    if a.output:
        with a.output.open("a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
