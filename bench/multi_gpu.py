"""Several GPUs through the workflow itself: concurrent range jobs, DDP/FSDP training, resume.

Everything runs through the real Snakefile (`python -m snakemake` in this checkout) on a
config written here, against a target folder and a dataset made here (no downloads):

  target      Llama-3.1-8B-shaped model with random bf16 weights (or `--layers` fewer
              decoder layers of the same shapes), the builtin tokenizer (BPE trained on the
              shipped samples) and its chat template;
  dataset     synthetic two-turn conversations, long enough that every merged sample is cut
              to exactly `--seq-len` tokens.

Scenarios (each prints one JSON line; `all` runs them in order):

  extract   one range job alone, then two range jobs at once (`--resources gpu=2`,
            `extract.gpus_per_job: 1`), then one job with `gpus_per_job: 2`. Reports each
            job's GPU (from its log), tokens/s (capture to last fsync, from index.json) and
            the aggregate of the concurrent pair over the union of their extraction windows.
  train     the train rule with 1 GPU x grad_accum 2, 2 GPUs DDP, 2 GPUs FSDP (same global
            batch, train.compile on): tokens/s after the first log window, peak GPU memory,
            and the loss curves compared step by step.
  resume    the 2-GPU DDP run killed (SIGKILL of Snakemake, torchrun and every worker) after
            a checkpoint, rerun on 2 GPUs; killed again and rerun on 1 GPU x grad_accum 2:
            both continue the uninterrupted curve.

    python3 bench/multi_gpu.py all --work /tmp/mg               # 2 GPUs (H200 x2)
    python3 bench/multi_gpu.py all --work /tmp/mg --tiny        # CPU smoke test, minutes

With --tiny the same code runs on a tiny model on the CPU (`DRAFTFLOW_FAKE_GPU_COUNT=2`
makes two range jobs claim distinct fake GPUs; training uses 0 GPUs), to check the
orchestration before spending GPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout

LLAMA_31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip
TINY = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip
SAVE_EVERY = 4  # training checkpoints: often, so that the resume scenario can kill after one
WORDS = (
    "the model reads every token once and writes the hidden states of three layers plus the "
    "final state to a store on local disk so that training never waits for the target again "
    "while the drafter learns to predict what the target would say next in many short steps"
).split()


def log(msg: str) -> None:
    print(f"[multi_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- target and data


def build_target(out: Path, shape: dict, device: str) -> None:
    """Random-weight Llama of `shape` in bf16 + the builtin tokenizer, as an HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftflow.target import make_tokenizer_config_portable, read_corpus, train_tokenizer

    if (out / "config.json").exists():
        log(f"target {out} exists")
        return
    t0 = time.perf_counter()
    conversations, _ = read_corpus(None)
    tokenizer = train_tokenizer(conversations, 4096)
    torch.manual_seed(0)
    config = LlamaConfig(
        **shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    make_tokenizer_config_portable(tmp)
    os.replace(tmp, out)
    log(f"target {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f} s")


def write_dataset(path: Path, samples: int, words: int, seed: int = 0) -> None:
    """OpenAI-messages JSONL: a user turn and a long assistant turn of shuffled words."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(samples):
            user = " ".join(rng.choice(WORDS, size=40))
            answer = " ".join(rng.choice(WORDS, size=words))
            messages = [{"role": "user", "content": f"{i}: {user}"}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")


# ---------------------------------------------------------------- the workflow


@dataclass
class Setup:
    work: Path
    tiny: bool
    samples_per_range: int
    seq_len: int
    writer_threads: int
    resume_on_one: bool = True

    @property
    def target(self) -> Path:
        return self.work / "target"

    @property
    def results(self) -> Path:
        return self.work / "results"

    def config(self, name: str, extract: dict | None = None, train: dict | None = None) -> Path:
        """A config file for this scenario (every one shares the results folder)."""
        layers = json.loads((self.target / "config.json").read_text())["num_hidden_layers"]
        config = {
            "results": str(self.results),
            "target": {"model": str(self.target)},
            "datasets": {"synthetic": {"path": str(self.work / "data.jsonl"), "shards": 1}},
            "merge": {"seed": 0, "max_seq_len": self.seq_len, "eval_fraction": 0.02, "min_eval_samples": 8,
                      "samples_per_range": self.samples_per_range},
            "extract": {"engine": "hf", "dtype": "bfloat16", "gpus_per_job": 1,
                        "batch_tokens": 8 * self.seq_len, "writer_threads": self.writer_threads,
                        "aux_layer_ids": [1, layers // 2 - 1, layers - 2] if layers >= 8 else [0, 1, 2],
                        **(extract or {})},
            "train": {"gpus": 0 if self.tiny else 1, "draft_vocab_size": 512 if self.tiny else 32000,
                      "batch_tokens": 8 * self.seq_len, "epochs": 4 if self.tiny else 1, "learning_rate": 3e-4,
                      "warmup_ratio": 0.1, "num_workers": 2 if self.tiny else 8, "log_every_steps": 2,
                      "save_every_steps": SAVE_EVERY, "compile": "auto", **(train or {})},
            "evaluate": {"draft_tokens": [3], "max_prompts": 2, "max_new_tokens": 8},
        }  # fmt: skip
        path = self.work / f"config-{name}.yaml"
        import yaml

        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path


def snakemake_cmd(config: Path, targets: list[str], gpus: int, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--configfile", str(config), "--cores", "all",
            "--resources", f"gpu={gpus}", "--rerun-incomplete", *extra, *targets]  # fmt: skip


def env_for(setup: Setup) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if setup.tiny:
        env["DRAFTFLOW_FAKE_GPU_COUNT"] = "2"
        env["DRAFTFLOW_GPU_LOCK_DIR"] = str(setup.work / "gpu-locks")
    return env


def run_snakemake(setup: Setup, config: Path, targets: list[str], gpus: int = 2, extra: list[str] = ()) -> float:
    cmd = snakemake_cmd(config, targets, gpus, extra)
    log(" ".join(cmd[2:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env_for(setup), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RunFailed(f"snakemake {' '.join(targets)} failed ({proc.returncode})")
    return wall


class RunFailed(Exception):
    """A Snakemake run of a scenario failed: reported, and the next run still tried."""


def train_log_tail(setup: Setup, lines: int = 25) -> list[str]:
    path = setup.results / "logs" / "train.log"
    return path.read_text().splitlines()[-lines:] if path.exists() else []


def manifest_ranges(setup: Setup) -> list[dict]:
    return json.loads((setup.results / "merged" / "manifest.json").read_text())["ranges"]["train"]


def range_target(setup: Setup, entry: dict) -> str:
    return str(setup.results / "hidden_states" / "train" / entry["name"])


def forget_samples(setup: Setup, entries: list[dict]) -> None:
    """Remove these ranges and their stored samples, so that the next run computes every one."""
    from draftflow.hidden_states.storage import SampleStore, read_range_index

    store = SampleStore(setup.results / "hidden_states" / "store")
    for entry in entries:
        folder = Path(range_target(setup, entry))
        if (folder / "index.json").exists():
            for sample in read_range_index(folder)[1]:
                store.delete(sample.key)
        shutil.rmtree(folder, ignore_errors=True)


def range_report(setup: Setup, entry: dict) -> dict:
    folder = Path(range_target(setup, entry))
    meta = json.loads((folder / "index.json").read_text())["meta"]
    end = (folder / "index.json").stat().st_mtime
    timings = meta["timings"]
    log_text = (setup.results / "logs" / "extract" / "train" / f"{entry['name']}.log").read_text()
    claimed = re.findall(r"claimed physical GPU\(s\) (\S+)", log_text)
    return {
        "range": entry["name"], "gpus": claimed[0] if claimed else "none",
        "tokens": timings["tokens_computed"], "wall_s": timings["wall_s"],
        "tokens_per_s": timings["tokens_per_s"], "start": end - timings["wall_s"], "end": end,
        "computed": meta["counts"]["computed"],
    }  # fmt: skip


def scenario_extract(setup: Setup) -> dict:
    config1 = setup.config("extract-1gpu")
    run_snakemake(setup, config1, [str(setup.results / "merged" / "storage_plan.json")])
    ranges = manifest_ranges(setup)
    if len(ranges) < 3:
        raise SystemExit(f"need 3 train ranges, the plan has {len(ranges)}: add --samples")
    solo, pair = ranges[0], ranges[1:3]
    forget_samples(setup, ranges[:3])

    # One job alone before and after the pair: the first job on a fresh machine runs cold
    # (page cache, allocator, kernels), so the pair is held against the faster of the two.
    wall_solo = run_snakemake(setup, config1, [range_target(setup, solo)], gpus=2)
    alone_first = range_report(setup, solo)
    wall_pair = run_snakemake(setup, config1, [range_target(setup, e) for e in pair], gpus=2)
    both = [range_report(setup, e) for e in pair]
    window = max(r["end"] for r in both) - min(r["start"] for r in both)
    overlap = min(r["end"] for r in both) - max(r["start"] for r in both)
    aggregate = sum(r["tokens"] for r in both) / window
    forget_samples(setup, [solo])
    run_snakemake(setup, config1, [range_target(setup, solo)], gpus=2)
    alone_again = range_report(setup, solo)
    alone = max(alone_first, alone_again, key=lambda r: r["tokens_per_s"])

    config2 = setup.config("extract-2gpu", extract={"gpus_per_job": 2})
    forget_samples(setup, [solo])
    wall_two = run_snakemake(setup, config2, [range_target(setup, solo)], gpus=2)
    two = range_report(setup, solo)
    result = {
        "scenario": "extract", "alone_first": alone_first, "alone_again": alone_again, "concurrent": both,
        "concurrent_overlap_s": round(overlap, 2), "concurrent_window_s": round(window, 2),
        "aggregate_tokens_per_s": round(aggregate, 1),
        "aggregate_vs_2x_alone": round(aggregate / (2 * alone["tokens_per_s"]), 4),
        "sum_of_job_rates_vs_2x_alone": round(sum(r["tokens_per_s"] for r in both) / (2 * alone["tokens_per_s"]), 4),
        "distinct_gpus": len({r["gpus"] for r in both}) == 2,
        "one_job_two_gpus": two, "two_gpus_vs_one": round(two["tokens_per_s"] / alone["tokens_per_s"], 4),
        "snakemake_wall_s": {"alone": round(wall_solo, 1), "pair": round(wall_pair, 1), "one_job_two_gpus": round(wall_two, 1)},
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


# ---------------------------------------------------------------- training


def train_rows(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def throughput(rows: list[dict], save_every: int) -> float:
    """Tokens/s over the log windows of training steps alone: not the first (compilation,
    warm-up) and not one that follows a checkpoint (its save is timed in the next window)."""
    steady = [r for prev, r in zip(rows, rows[1:]) if prev["step"] % save_every != 0] or rows
    return sum(r["tokens"] for r in steady) / sum(r["tokens"] / r["tokens_per_s"] for r in steady)


def curve_difference(a: list[dict], b: list[dict]) -> dict:
    steps = [r["step"] for r in a]
    if steps != [r["step"] for r in b]:
        return {"same_steps": False, "steps_a": steps, "steps_b": [r["step"] for r in b]}
    la, lb = np.array([r["loss"] for r in a]), np.array([r["loss"] for r in b])
    return {"same_steps": True, "max_rel_loss_diff": float(np.max(np.abs(la - lb) / np.abs(la))),
            "final_loss": [float(la[-1]), float(lb[-1])]}  # fmt: skip


def drafter_dir(setup: Setup) -> Path:
    return setup.results / "drafter"


def train_once(setup: Setup, name: str, train: dict, gpus: int) -> dict:
    """One training run from scratch through the train rule; its drafter folder is kept as <name>."""
    shutil.rmtree(setup.results / "state" / "train", ignore_errors=True)
    config = setup.config(name, train=train)
    wall = run_snakemake(setup, config, [str(drafter_dir(setup))], gpus=gpus, extra=["--forcerun", "train"])
    kept = setup.work / f"drafter-{name}"
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(drafter_dir(setup), kept)
    shutil.copy(setup.results / "logs" / "train.log", kept / "train.log")
    summary = json.loads((kept / "eval.json").read_text())
    rows = train_rows(kept)
    return {"name": name, "tokens_per_s": round(throughput(rows, SAVE_EVERY), 1), "steps": summary["steps"],
            "world_size": summary["world_size"], "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"),
            "simulated_tau": summary["simulated_acceptance_length"], "rule_wall_s": round(wall, 1), "rows": rows}  # fmt: skip


def training_runs(setup: Setup) -> dict[str, dict]:
    g = 0 if setup.tiny else 1
    return {
        "1gpu_accum2": ({"gpus": g, "grad_accum": 2}, 1),
        "2gpu_ddp": ({"gpus": 2 * g, "grad_accum": 1 if g else 2}, 2),
        "2gpu_fsdp": ({"gpus": 2 * g, "grad_accum": 1 if g else 2, "fsdp": True}, 2),
    }


def scenario_train(setup: Setup) -> dict:
    runs = {}
    for name, (train, gpus) in training_runs(setup).items():
        try:
            runs[name] = train_once(setup, name, train, gpus)
        except RunFailed as e:
            runs[name] = {"name": name, "error": str(e), "log_tail": train_log_tail(setup)}
    result = {"scenario": "train", "runs": {k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in runs.items()}}
    one = runs["1gpu_accum2"]
    for name in ("2gpu_ddp", "2gpu_fsdp"):
        other = runs[name]
        if "error" in one or "error" in other:
            continue
        # 1 GPU x grad_accum 2 runs the same per-GPU micro-batch as each rank of the 2-GPU runs
        result[f"{name}_vs_2x_one"] = round(other["tokens_per_s"] / (2 * one["tokens_per_s"]), 4)
        result[f"{name}_vs_one_curve"] = curve_difference(one["rows"], other["rows"])
    print(json.dumps(result), flush=True)
    return result


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun starts workers in their own sessions)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=60)


def kill_after_checkpoint(setup: Setup, config: Path, gpus: int, step: int) -> int:
    """Start the train rule, SIGKILL everything once a checkpoint of >= `step` is complete."""
    cmd = snakemake_cmd(config, [str(drafter_dir(setup))], gpus, ["--forcerun", "train"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_for(setup), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    state = setup.results / "state" / "train"
    deadline = time.time() + 480
    while time.time() < deadline and proc.poll() is None:
        latest = list(state.glob("run-*/latest.json"))
        if latest:
            done = json.loads(latest[0].read_text())["step"]
            if done >= step:
                kill_tree(proc.pid)
                proc.wait()
                log(f"killed the run after its checkpoint at step {done}")
                subprocess.run([sys.executable, "-m", "snakemake", "--configfile", str(config), "--unlock"],
                               cwd=REPO, env=env_for(setup), capture_output=True)  # fmt: skip
                return done
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("the training run ended before a checkpoint could be killed")


def resume_once(setup: Setup, name: str, train: dict, gpus: int) -> dict:
    config = setup.config(name, train=train)
    run_snakemake(setup, config, [str(drafter_dir(setup))], gpus=gpus)
    log_text = (setup.results / "logs" / "train.log").read_text()
    resumed = re.findall(r"resuming from step (\d+)", log_text)
    rows = train_rows(drafter_dir(setup))
    return {"name": name, "resumed_from": int(resumed[0]) if resumed else None, "rows": rows}


def scenario_resume(setup: Setup) -> dict:
    runs = training_runs(setup)
    ddp_train, ddp_gpus = runs["2gpu_ddp"]
    one_train, one_gpus = runs["1gpu_accum2"]
    reference = setup.work / "drafter-2gpu_ddp"
    if not reference.exists():
        train_once(setup, "2gpu_ddp", ddp_train, ddp_gpus)
    ref_rows = train_rows(reference)
    total = ref_rows[-1]["step"]
    kill_step = max(4, total // 2 // 4 * 4)
    out = {"scenario": "resume", "total_steps": total}
    targets = {"on_2gpu": (ddp_train, ddp_gpus), "on_1gpu_accum2": (one_train, one_gpus)}
    if not setup.resume_on_one:
        del targets["on_1gpu_accum2"]
    for name, (train, gpus) in targets.items():
        shutil.rmtree(setup.results / "state" / "train", ignore_errors=True)
        try:
            killed = kill_after_checkpoint(setup, setup.config("kill", train=ddp_train), ddp_gpus, kill_step)
            run = resume_once(setup, f"resume-{name}", train, gpus)
        except (RunFailed, SystemExit) as e:
            out[name] = {"error": str(e), "log_tail": train_log_tail(setup)}
            continue
        out[name] = {"killed_after_step": killed, "resumed_from": run["resumed_from"],
                     **curve_difference(ref_rows, run["rows"])}  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=["setup", "extract", "train", "resume", "all"])
    p.add_argument("--work", type=Path, required=True, help="folder for the target, data, config and results")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU: check the orchestration")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; tiny 8)")
    p.add_argument("--samples", type=int, default=None, help="conversations (default 620; tiny 40)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per merged sample (default 2048; tiny 128)")
    p.add_argument("--samples-per-range", type=int, default=None, help="default 200; tiny 12")
    p.add_argument("--writer-threads", type=int, default=12)
    p.add_argument("--skip-resume-on-one", action="store_true", help="resume: only on 2 GPUs (1 GPU is tested on CPU)")
    args = p.parse_args(argv)
    tiny = args.tiny
    seq_len = args.seq_len or (128 if tiny else 2048)
    setup = Setup(args.work.resolve(), tiny, args.samples_per_range or (12 if tiny else 200), seq_len,
                  2 if tiny else args.writer_threads, not args.skip_resume_on_one)  # fmt: skip
    setup.work.mkdir(parents=True, exist_ok=True)
    shape = dict(TINY if tiny else LLAMA_31_8B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    import torch

    build_target(setup.target, shape, "cuda" if torch.cuda.is_available() and not tiny else "cpu")
    data = setup.work / "data.jsonl"
    if not data.exists():
        # ~1.3 tokens per word with the builtin tokenizer: every sample is cut to seq_len
        write_dataset(data, args.samples or (40 if tiny else 620), words=int(seq_len * 1.2))
    scenarios = ["extract", "train", "resume"] if args.scenario == "all" else [args.scenario]
    if args.scenario == "setup":
        return 0
    for name in scenarios:
        t0 = time.perf_counter()
        {"extract": scenario_extract, "train": scenario_train, "resume": scenario_resume}[name](setup)
        log(f"{name}: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
