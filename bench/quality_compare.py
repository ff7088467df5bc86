#!/usr/bin/env python3
"""Drafter quality side by side: draftflow's trainer and speculators 0.9's, same data, same evaluation.

From one finished workflow run (`results/`: target, hidden states, draft vocab, eval split):

* **ours**: `draftflow train` with the workflow's `train` settings (config/config.yaml, plus
  `--set train.KEY=VALUE` overrides), the command the `train` rule runs;
* **speculators**: the train split converted with `draftflow convert --from draftflow --to
  speculators --target TARGET` (its last slot is the pre-norm state; its trainer re-applies the
  target's final norm), our draft vocabulary as its `d2t-N.npy` / `t2d-N.npy`, trained by its own
  CLI (`python -m speculators.train …`, its EAGLE-3 recipe) with our TTT steps, step-loss decay,
  epochs, tokens per step, learning rate, warmup and schedule, then brought back with
  `draftflow import-drafter --from speculators`;
* **ours, DFlash** (`--dflash JSON`, trainer ours): our DFlash drafter instead of our EAGLE-3, with
  the config's `train.dflash` updated by the JSON object (a recipe variant: layers, block size,
  loss weighting), reading the stored aux layers; its folders are named `dflash-<label>-s<seed>`;
* both evaluated by the same `draftflow evaluate` (real chain speculative decoding and
  simulated τ, per K and per position, at every `--temperatures`), on the same prompts.

Differences that remain (speculators' own, kept unless `--spec-recipe ours-arch`):
  - its EAGLE-3 recipe: norm_before_fc (RMSNorm over cat(aux)), norm_before_residual and
    norm_output (fed-back states are post-norm); `ours-arch` turns the three off;
  - its draft LM head is frozen (rows of the target's head); ours trains it;
  - loss kl_div (same gradient as our soft CE); grad clip 1.0 (ours 0.5; on SmolLM2 both bind wherever
    the norms were logged, at 1-2.7, and where both bind AdamW's update is the same for
    either: its moments scale with the clip and cancel; BENCHMARKS.md, session 15);
  - it packs samples into one row of `batch_tokens` (ours: rows as wide as the longest sample,
    `drafters.packing`): about the same tokens per step and steps per epoch; epochs, LR, warmup
    share and schedule shape are the same;
  - its loss mask is the *input* token's (ours: the predicted token's), one position apart;
  - its validation split cannot be empty: the last training sample is held out from it;
  - on CPU it runs with `--hidden-states-dtype float32` (bf16 autocast on CPU is its GPU recipe's
    precision on slow kernels), sdpa attention and its eager loss; on CUDA its defaults (bf16,
    flex attention, fused Triton loss: through `bench/speculators_gpu_train.py`, which splits its
    fused loss kernels' shared autotune configs, without which its first step fails under torch
    2.11's dynamo), or with `--spec-kernels eager` bf16 with the CPU's kernels and torch.compile
    off (no minutes-long first step), or with `--spec-kernels compiled` its compiled forward and
    flex attention with its eager loss.

Prints one JSON line: per trainer and seed, τ real (K = each draft_tokens) and simulated at each
temperature, n-gram baseline, training seconds and tokens; plus mean and spread over seeds.

    # CPU, the embedded default (after `snakemake`), speculators in its own venv:
    .venv/bin/python bench/quality_compare.py --spec-python .venv-spec/bin/python --seeds 0 1 2
    # H200 (bench wheels in /tmp/site, see BENCHMARKS.md):
    PYTHONPATH=/tmp/site:. python3 bench/quality_compare.py --results .qc/results --device cuda
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from draftflow.threads import thread_env  # noqa: E402 (after the path insert)

log = logging.getLogger("quality_compare")


def run(cmd: list[str], log_path: Path, env: dict | None = None) -> float:
    """Run a command with its output in log_path; seconds of wall time. Raises with the log's tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    seconds = time.perf_counter() - t0
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}\n--- {log_path} ---\n{tail}")
    return seconds


def draftflow_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "draftflow.cli", *args]


def child_env(threads: int, extra_path: str | None = None) -> dict:
    # thread_env's DRAFTFLOW_THREADS is what sizes a draftflow child's torch pools; the OpenMP
    # variables alone left `draftflow train` at every CPU of the machine
    env = dict(os.environ, **thread_env(threads), TQDM_DISABLE="1")
    paths = [p for p in (extra_path, str(REPO), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(":".join(paths).split(os.pathsep)))
    return env


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# ---------------------------------------------------------------- inputs


class Inputs:
    def __init__(self, a):
        from draftflow.config import load_config

        self.results = a.results.resolve()
        config = load_config(a.config)
        # one EAGLE-3 job's settings, as rules/common.smk:train_settings builds them
        self.train = {k: v for k, v in config["train"].items() if k not in ("methods", "dflash")}
        if getattr(a, "dflash", None) is not None:  # our DFlash: EAGLE-3's own keys are not its settings
            from draftflow.drafters.eagle3 import VARIANT_FLAGS

            dflash = {k: v for k, v in config["train"]["dflash"].items() if k != "target_layer_ids"}
            self.train = {k: v for k, v in self.train.items() if k not in (*VARIANT_FLAGS, "loss", "batching")}
            self.train.update(method="dflash", dflash={**dflash, **json.loads(a.dflash)})
        self.evaluate = {k: v for k, v in config["evaluate"].items() if k not in ("temperatures",)}
        for item in a.set:
            key, _, value = item.partition("=")
            section, _, name = key.partition(".")
            if section not in ("train", "evaluate") or not name:
                raise SystemExit(f"--set {item}: expected train.KEY=VALUE or evaluate.KEY=VALUE")
            (self.train if section == "train" else self.evaluate)[name] = parse_value(value)
        self.evaluate.update(temperatures=a.temperatures, device=a.device)
        hs = self.results / "hidden_states"
        self.train_ranges = sorted((hs / "train").glob("rows_*"), key=lambda p: int(p.name.split("_")[1].split("-")[0]))
        self.eval_ranges = sorted((hs / "eval").glob("rows_*"), key=lambda p: int(p.name.split("_")[1].split("-")[0]))
        from draftflow.hidden_states.storage import read_range_index

        self.target = self.results / "target"
        self.vocab = self.results / "vocab" / "draft_vocab.safetensors"
        self.eval_data = self.results / "merged" / "eval.jsonl"
        # evaluation reads the eval split only: a results folder without the train split's states
        # (a GPU-trained drafter evaluated on a CPU, bench/README.md §6) evaluates; training needs them
        for p in (self.target, self.vocab, self.eval_data):
            if not p.exists():
                raise SystemExit(f"{p}: missing; run the workflow first (snakemake) or pass --results")
        if not self.eval_ranges:
            raise SystemExit(f"{hs / 'eval'}: no extracted eval ranges; run the workflow first (snakemake) or pass --results")
        self.aux = [int(i) for i in read_range_index(self.eval_ranges[0])[0]["aux_layer_ids"]]
        self.evaluate["aux_layer_ids"] = self.aux
        size = int(self.train["draft_vocab_size"])
        if size != int(config["train"]["draft_vocab_size"]):  # a sweep point: its own draft vocabulary
            self.vocab = a.work / f"vocab-{size}.safetensors"
            if not self.vocab.is_file():
                a.work.mkdir(parents=True, exist_ok=True)
                run(draftflow_cmd("vocab", "--input", str(self.results / "merged" / "train.jsonl"),
                                  "--target", str(self.target), "--settings", json.dumps({"draft_vocab_size": size}),
                                  "--output", str(self.vocab)), a.work / f"vocab-{size}.log", child_env(a.threads))  # fmt: skip


# ---------------------------------------------------------------- the two trainers


def require_train_split(inp: Inputs) -> None:
    if not inp.train_ranges:
        raise SystemExit(f"{inp.results / 'hidden_states' / 'train'}: no extracted train ranges; training needs them "
                         "(run the workflow's extract stage first)")


def train_ours(inp: Inputs, work: Path, seed: int, a) -> dict:
    require_train_split(inp)
    out = work / "drafter"
    settings = {**inp.train, "aux_layer_ids": inp.aux, "seed": seed, "gpus": 1 if a.device == "cuda" else 0,
                "num_workers": 0 if a.device == "cpu" else inp.train.get("num_workers", 2)}  # fmt: skip
    if not a.resume:  # --resume: a killed run goes on from its last checkpoint (train.save_every_steps)
        shutil.rmtree(work / "state", ignore_errors=True)
    seconds = run(
        draftflow_cmd(
            "train", "--train-ranges", *map(str, inp.train_ranges), "--eval-ranges", *map(str, inp.eval_ranges),
            "--target", str(inp.target), "--vocab", str(inp.vocab), "--settings", json.dumps(settings),
            "--state-dir", str(work / "state"), "--output", str(out),
        ),
        work / "train.log", child_env(a.threads),
    )  # fmt: skip
    summary = json.loads((out / "eval.json").read_text())
    return {"drafter": out, "train_seconds": seconds, "train_tokens": summary["train_tokens"],
            "optimizer_steps": summary["steps"], "settings": settings}  # fmt: skip


def prepare_speculators_data(inp: Inputs, work: Path, a) -> tuple[Path, int]:
    import numpy as np

    from draftflow.drafters.vocab import load_vocab
    from draftflow.hidden_states.interop import SIDECAR

    data = work / "speculators_data"
    if not (data / SIDECAR).is_file():
        require_train_split(inp)
        shutil.rmtree(data, ignore_errors=True)
        staging = work / "train_split"  # convert reads every rows_* under its input: the train split only
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for d in inp.train_ranges:
            (staging / d.name).symlink_to(d)
        run(draftflow_cmd("convert", "--from", "draftflow", "--to", "speculators", "--input", str(staging),
                          "--output", str(data), "--target", str(inp.target)),
            work / "convert.log", child_env(a.threads))  # fmt: skip
    vocab = load_vocab(inp.vocab)
    for name, array in ((f"d2t-{vocab.size}.npy", vocab.d2t.astype(np.int64)), (f"t2d-{vocab.size}.npy", vocab.t2d.astype(bool))):
        # each seed's process writes them (several side by side): a whole file or none, never a half one
        tmp = data / f".{name}.{os.getpid()}.npy"
        np.save(tmp, array)
        os.replace(tmp, data / name)
    samples = len(json.loads((data / SIDECAR).read_text())["samples"])
    return data, samples


SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "none"}


def speculators_argv(inp: Inputs, data: Path, samples: int, save: Path, seed: int, a) -> list[str]:
    from draftflow.drafters.vocab import load_vocab

    t = inp.train
    if float(t["epochs"]) != int(t["epochs"]):
        raise SystemExit(f"speculators trains whole epochs; train.epochs is {t['epochs']}")
    if t["schedule"] == "constant" and t.get("warmup_ratio", 0):
        log.warning("speculators' 'none' schedule has no warmup; ours warms up %.0f%%", 100 * t["warmup_ratio"])
    cuda = a.device == "cuda"
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(inp.target),
        "--data-path", str(data),
        "--save-path", str(save),
        "--log-dir", str(save / "logs"),
        "--draft-vocab-size", str(load_vocab(inp.vocab).size),
        "--num-layers", "1",
        "--target-layer-ids", *[str(i + 1) for i in inp.aux],  # its (vLLM) numbering: output of layer i-1
        "--full-attention-indices", "0",  # no 2048 sliding window: full causal attention as ours
        "--ttt-steps", str(t["ttt_steps"]),
        "--ttt-step-loss-decay", str(t["step_weight_decay"]),
        "--total-seq-len", str(t["batch_tokens"]),
        "--train-data-ratio", str((samples - 0.5) / samples),  # its validation split: the last sample
        "--num-workers", "0" if not cuda else "4",
        "--on-missing", "raise",
        "--mask-token-id", "0",
        "--optimizer", "adamw",
        "--lr", str(t["learning_rate"]),
        "--weight-decay", str(t["weight_decay"]),
        "--scheduler-type", SCHEDULES[t["schedule"]],
        "--scheduler-warmup-ratio", str(t["warmup_ratio"]),
        "--epochs", str(int(t["epochs"])),
        # --resume: a checkpoint every tenth of an epoch, which its trainer resumes mid-epoch
        "--checkpoint-freq", "0.1" if a.resume else "1",
        "--log-freq", "10",
        *([] if a.resume else ["--no-resume-from-checkpoint"]),
        "--seed", str(seed),
        "--hidden-states-dtype", "bfloat16" if cuda else "float32",
    ]  # fmt: skip
    if not cuda or a.spec_kernels == "eager":  # flex attention has no backward on the CPU
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    elif a.spec_kernels == "compiled":
        argv += ["--loss-implementation", "eager"]
    if a.spec_recipe == "ours-arch":
        argv += ["--no-norm-before-fc", "--no-norm-before-residual", "--no-norm-output"]
    return argv


def train_speculators(inp: Inputs, work: Path, seed: int, data: Path, samples: int, a) -> dict:
    save = work / "run"
    if not a.resume:
        shutil.rmtree(save, ignore_errors=True)
    argv = speculators_argv(inp, data, samples, save, seed, a)
    # its CLI as released needs a GPU; on the CPU a launcher points its three device assumptions there,
    # and on the GPU its fused loss needs one (torch 2.11: bench/speculators_gpu_train.py)
    if a.device == "cpu":
        entry = [str(REPO / "bench" / "speculators_cpu_train.py")]
    elif a.spec_kernels == "own":
        entry = [str(REPO / "bench" / "speculators_gpu_train.py")]
    else:
        entry = ["-m", "speculators.train"]
    env = child_env(a.threads, a.spec_pythonpath)
    if a.spec_kernels == "eager":  # its conditional_torch_compile is a no-op with dynamo off
        env["TORCHDYNAMO_DISABLE"] = "1"
    elif a.spec_kernels == "compiled" and a.device == "cpu":  # a check that its compiled forward traces
        env["SPECULATORS_COMPILE_ON_CPU"] = "1"
    seconds = run([a.spec_python, *entry, *argv], work / "train.log", env)
    out = work / "drafter"
    shutil.rmtree(out, ignore_errors=True)
    # the last epoch, as ours ends: `checkpoint_best` (what a bare save folder imports) is chosen on a
    # one-sample validation split here
    last = max((p for p in save.iterdir() if p.name.isdigit() and (p / "config.json").is_file()),
               key=lambda p: int(p.name))  # fmt: skip
    run(draftflow_cmd("import-drafter", "--from", "speculators", "--input", str(last), "--target", str(inp.target),
                      "--output", str(out)), work / "import.log", child_env(a.threads))  # fmt: skip
    return {"drafter": out, "train_seconds": seconds, "speculators_argv": argv,
            "train_tokens_per_epoch_approx": samples}  # fmt: skip


def reuse_trained(work: Path, trainer: str) -> dict:
    """--eval-only: the drafter an earlier run of this script trained in `work`."""
    drafter = work / "drafter"
    if not (drafter / "config.json").is_file():
        raise SystemExit(f"{drafter}: no trained drafter; run without --eval-only first")
    info = json.loads((work / "train_info.json").read_text()) if (work / "train_info.json").is_file() else {}
    if trainer == "ours" and "train_tokens" not in info:
        summary = json.loads((drafter / "eval.json").read_text())
        info.update(train_tokens=summary["train_tokens"], optimizer_steps=summary["steps"])
    return {**info, "drafter": drafter, "train_seconds": info.get("train_seconds")}


# ---------------------------------------------------------------- evaluation


def evaluate(inp: Inputs, drafter: Path, out: Path, a, state_dir: Path | None = None) -> dict:
    """`draftflow evaluate` of one drafter; state_dir keeps each finished (prompt set, temperature).
    a.real_only (bench/real_target.py evaluate --real-only): no eval ranges, so no simulated τ."""
    resume = ["--state-dir", str(state_dir)] if state_dir else []
    simulate = [] if getattr(a, "real_only", False) else ["--eval-ranges", *map(str, inp.eval_ranges)]
    run(
        draftflow_cmd(
            "--threads", str(a.threads), "evaluate", "--drafter", str(drafter), "--target", str(inp.target),
            *simulate, "--eval-data", str(inp.eval_data),
            "--settings", json.dumps(inp.evaluate), "--output-dir", str(out), *resume,
        ),
        out / "evaluate.log", child_env(a.threads),
    )  # fmt: skip
    report = json.loads((out / "acceptance.json").read_text())
    figures = {}
    method = report.get("method", "eagle3")
    for temp, part in report["temperatures"].items():
        figures[temp] = {
            "real": {k: round(v["acceptance_length"], 4) for k, v in part[method].items()},
            "simulated": None if part["simulated"] is None else round(part["acceptance_length_simulated"], 4),
            "ngram": {k: round(v["acceptance_length"], 4) for k, v in part["ngram"].items()},
            "alpha_real": {k: [round(x, 3) for x in v["alpha"]] for k, v in part[method].items()},
            "alpha_simulated": None if part["simulated"] is None else [round(x, 3) for x in part["simulated"]["alpha"]],
        }
        if temp == "0":
            figures[temp]["matches_greedy"] = {k: v["matches_greedy"] for k, v in part[method].items()}
    return figures


def spread(runs: list[dict]) -> dict:
    """Mean, sample standard deviation and range over seeds of every τ figure."""
    out = {}
    for temp in runs[0]["tau"]:
        keys = [("simulated", None)] + [("real", k) for k in runs[0]["tau"][temp]["real"]]
        for kind, k in keys:
            vals = [r["tau"][temp][kind] if k is None else r["tau"][temp][kind][k] for r in runs]
            name = f"T{temp}_{kind}" + (f"_K{k}" if k else "")
            out[name] = {"mean": round(statistics.fmean(vals), 4),
                         "sd": round(statistics.stdev(vals), 4) if len(vals) > 1 else None,
                         "min": min(vals), "max": max(vals)}  # fmt: skip
    seconds = [r["train_seconds"] for r in runs if r["train_seconds"] is not None]
    out["train_seconds_mean"] = round(statistics.fmean(seconds), 1) if seconds else None
    return out


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=REPO / "results", help="a finished workflow run")
    p.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml", help="its config (train, evaluate)")
    p.add_argument("--work", type=Path, default=Path("/tmp/draftflow-quality"), help="scratch folder")
    p.add_argument("--trainers", nargs="+", default=["ours", "speculators"], choices=["ours", "speculators"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--dflash", metavar="JSON", default=None,
                   help="trainer ours trains our DFlash drafter, train.dflash updated with this JSON object "
                   "(e.g. '{\"num_hidden_layers\": 5, \"loss_weighting\": \"dpace\"}')")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a train or evaluate key (JSON value)")  # fmt: skip
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--spec-python", default=sys.executable, help="python with speculators 0.9 installed")
    p.add_argument("--spec-pythonpath", default=None, help="extra PYTHONPATH for it (e.g. /tmp/site)")
    p.add_argument("--spec-recipe", choices=["own", "ours-arch"], default="own",
                   help="own: speculators' EAGLE-3 defaults; ours-arch: without its three extra norms")  # fmt: skip
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--spec-kernels", choices=["own", "compiled", "eager"], default="own",
                   help="CUDA: own = its compiled forward, flex attention and fused Triton loss (the first step "
                   "compiles for minutes; bench/speculators_gpu_train.py); compiled = the same with its eager "
                   "loss; eager = sdpa attention, its eager loss, torch.compile off (the same math: what it runs "
                   "on the CPU)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each child process")
    p.add_argument("--label", default="", help="a name for this configuration in the output")
    p.add_argument("--sim-only", action="store_true",
                   help="ours only: no `draftflow evaluate`; τ = the training's own simulated τ on the eval split "
                   "(eval.json, K = ttt_steps; what a sweep needs)")  # fmt: skip
    p.add_argument("--train-only", action="store_true",
                   help="no `draftflow evaluate`: train (and import) only; evaluate later, e.g. one process per "
                   "temperature (bench/real_target.py evaluate)")  # fmt: skip
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the drafters an earlier run trained in --work (same trainers, label, seeds) again, "
                   "e.g. with other --set evaluate.KEY=VALUE")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="go on from what an earlier, killed run of the same command left in --work: a trained "
                   "drafter is kept, a killed training resumes from its last checkpoint (ours: "
                   "train.save_every_steps; speculators: every tenth of an epoch)")  # fmt: skip
    p.add_argument("--output", type=Path, help="also append the JSON line to this file")
    a = p.parse_args(argv)
    if a.dflash is not None and a.trainers != ["ours"]:
        p.error("--dflash trains our DFlash: pass --trainers ours")
    inp = Inputs(a)
    a.work.mkdir(parents=True, exist_ok=True)
    result = {"label": a.label, "results": str(inp.results), "train": inp.train, "evaluate": inp.evaluate,
              "spec_recipe": a.spec_recipe, "device": a.device, "trainers": {}}  # fmt: skip
    for trainer in a.trainers:
        runs = []
        if trainer == "speculators" and not a.eval_only:
            data, samples = prepare_speculators_data(inp, a.work, a)
        for seed in a.seeds:
            name = "dflash" if a.dflash is not None else trainer
            tag = f"{name}{'-' + a.spec_recipe if trainer == 'speculators' else ''}-{a.label or 'default'}-s{seed}"
            work = a.work / tag
            log.info("training %s", tag)
            reused = a.eval_only or (a.resume and (work / "train_info.json").is_file())
            if reused:
                info = reuse_trained(work, trainer)
            elif trainer == "ours":
                info = train_ours(inp, work, seed, a)
            else:
                info = train_speculators(inp, work, seed, data, samples, a)
            if not reused:
                (work / "train_info.json").write_text(json.dumps({k: v for k, v in info.items() if k != "settings"},
                                                                 default=str))  # fmt: skip
            log.info("evaluating %s (trained in %s s)", tag, info["train_seconds"])
            if a.train_only:
                tau = {}
            elif a.sim_only:
                summary = json.loads((info["drafter"] / "eval.json").read_text())
                tau = {"0": {"simulated": round(summary["tau"], 4), "real": {},
                             "alpha_simulated": [round(x, 3) for x in summary["step_alpha"]]}}  # fmt: skip
            else:
                tau = evaluate(inp, info["drafter"], work / ("eval-again" if a.eval_only else "eval"), a)
            runs.append({"seed": seed, "tau": tau,
                         "train_seconds": round(info["train_seconds"], 1) if info["train_seconds"] else None,
                         **{k: v for k, v in info.items() if k in ("train_tokens", "optimizer_steps")}})  # fmt: skip
            log.info("%s: %s", tag, json.dumps(tau))
        result["trainers"][trainer] = {"runs": runs, "summary": spread(runs) if not a.train_only else {}}
    line = json.dumps(result)
    print(line, flush=True)
    if a.output:
        with open(a.output, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
