"""Training: batch planning, one-batch overfitting, DDP == single process, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import kill_tree
from draftflow.errors import DraftflowError
from draftflow.hidden_states.storage import SampleStore, encode_sample, sample_key, write_range_index
from draftflow.drafters.batching import collate
from draftflow.drafters.checkpoint import load_drafter, save_drafter
from draftflow.drafters.train import (
    DistEnv,
    EpochPlan,
    TrainInputs,
    TrainSettings,
    build_drafter,
    make_loader,
    make_optimizer,
    plan_batches,
    plan_micro_batches,
    run_training,
    shard_eval_batches,
    train_step,
    ttt_attention,
    use_compile,
)
from draftflow.drafters.ttt import TTTObjective, ttt_loss
from draftflow.drafters.vocab import save_vocab, select_draft_vocab

AUX = [0, 1, 2]


def make_target(path: Path, hidden: int = 32, vocab: int = 128, layers: int = 4) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # a peaked next-token distribution, like a trained model's
    model.save_pretrained(path)
    return path


def make_ranges(root: Path, target: Path, n: int, seed: int, lengths=(12, 40), ranges: int = 2) -> list[Path]:
    """Range folders of real target hidden states for random token sequences (written via storage)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target).eval()
    rng = np.random.default_rng(seed)
    store = SampleStore(root / "store")
    per_range = -(-n // ranges)
    dirs = []
    for r in range(ranges):
        entries = []
        for i in range(r * per_range, min(n, (r + 1) * per_range)):
            T = int(rng.integers(*lengths))
            ids = rng.integers(0, model.config.vocab_size, T)
            mask = (np.arange(T) >= T // 3).astype(np.uint8)  # an "assistant" tail
            with torch.no_grad():
                hs = model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
            hidden = torch.stack([hs[a + 1][0] for a in AUX] + [hs[-1][0]], dim=1).to(torch.bfloat16)  # [T, 4, H]
            key = sample_key("test", ids)
            entries.append(store.put(key, encode_sample(ids, mask, hidden)).entry(f"s{seed}-{i}", key))
        d = root / f"rows_{r}"
        meta = {"settings_digest": "test", "store_root": str(root / "store"), "num_layers_captured": 4,
                "hidden_size": model.config.hidden_size, "aux_layer_ids": AUX}  # fmt: skip
        write_range_index(d, entries, meta)
        dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_target(root / "target")
    train = make_ranges(root / "hs" / "train", target, n=24, seed=1)
    evals = make_ranges(root / "hs" / "eval", target, n=6, seed=2, ranges=1)
    counts = np.bincount(np.random.default_rng(0).integers(0, 128, 2000), minlength=128)
    save_vocab(select_draft_vocab(counts, 64), root / "vocab.safetensors")
    return {"root": root, "target": target, "train": train, "eval": evals, "vocab": root / "vocab.safetensors"}


def settings(**kw) -> dict:
    base = {"aux_layer_ids": AUX, "draft_vocab_size": 64, "ttt_steps": 3, "epochs": 1, "batch_tokens": 128,
            "learning_rate": 3e-3, "warmup_ratio": 0.1, "num_workers": 0, "log_every_steps": 1,
            "save_every_steps": 2, "seed": 0}  # fmt: skip
    base.update(kw)
    return base


def test_plan_batches_is_a_deterministic_budgeted_partition():
    lengths = np.random.default_rng(0).integers(5, 60, 300)
    a = plan_batches(lengths, 200, seed=3, epoch=1)
    assert a == plan_batches(lengths, 200, seed=3, epoch=1)
    assert a != plan_batches(lengths, 200, seed=3, epoch=2)
    assert sorted(i for b in a for i in b) == list(range(300))
    assert all(len(b) * lengths[b].max() <= 200 for b in a)
    long = plan_batches(np.array([10, 500, 20]), 100, seed=0, epoch=0)
    assert [1] in long  # an over-long sample is a batch of its own
    assert shard_eval_batches([[0], [1], [2], [3], [4]], 1, 2) == ([[1], [3], [0]], [True, True, False])
    assert shard_eval_batches([[0], [1], [2], [3], [4]], 0, 2) == ([[0], [2], [4]], [True, True, True])
    plan = EpochPlan(0, a, steps=len(a) // 6)
    for step in range(plan.steps):  # 3 ranks x 2 micro-batches partition each global step
        parts = [b for r in range(3) for b in plan.rank_batches(step, r, 3, 2)]
        assert parts == a[step * 6 : (step + 1) * 6]


def test_overfitting_one_batch_drives_the_loss_down(world):
    from draftflow.hidden_states.storage import HiddenStateReader
    from draftflow.drafters.vocab import load_vocab

    s = TrainSettings.from_dict(settings(learning_rate=1e-2, warmup_ratio=0.0, schedule="constant"))
    drafter, head, _ = build_drafter(s, world["target"], load_vocab(world["vocab"]))
    reader = HiddenStateReader(world["train"])
    batch = collate([reader[i] for i in range(4)], s.ttt_steps)
    model = TTTObjective(drafter, s.ttt_steps, s.step_weight_decay)
    opt, sched = make_optimizer(drafter, s, total_steps=30, fused=False)
    losses = []
    for _ in range(30):
        stats, _ = train_step(model, head, [batch], opt, sched, DistEnv(), s.grad_clip)
        losses.append((stats[0] / stats[1]).sum().item())
    assert losses[-1] < 0.3 * losses[0], losses
    target = head(batch.final)
    final = ttt_loss(drafter, batch.input_ids, batch.loss_mask, batch.aux, target, s.ttt_steps)
    # step 0 gets (nearly) every position right whose target token is in the draft vocabulary
    reachable = ((target.argmax[:, 1:-1] >= 0) & batch.loss_mask[:, 2:]).sum().item()
    assert final.stats[2][0].item() >= 0.9 * reachable > 0


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
@pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile on CPU needs a C compiler")
def test_compiled_training_steps_match_eager_ones(world):
    """train.compile: the compiled norms, MLPs and per-step loss give the eager losses and
    statistics over several steps, on batches of two different lengths (dynamic shapes)."""
    from draftflow.hidden_states.storage import HiddenStateReader
    from draftflow.drafters.vocab import load_vocab

    s = TrainSettings.from_dict(settings(learning_rate=1e-2, warmup_ratio=0.0, schedule="constant", compile=True))
    reader = HiddenStateReader(world["train"])
    by_length = sorted(range(len(reader)), key=lambda i: reader.lengths[i])
    batches = [collate([reader[i] for i in part], s.ttt_steps) for part in (by_length[:3], by_length[-3:])]
    assert batches[0].input_ids.shape[1] != batches[1].input_ids.shape[1]
    curves = []
    for compiled in (False, True):
        drafter, head, _ = build_drafter(s, world["target"], load_vocab(world["vocab"]))
        use = use_compile(compiled, torch.device("cpu"))
        model = TTTObjective(drafter, s.ttt_steps, s.step_weight_decay, compile=use)
        opt, sched = make_optimizer(drafter, s, total_steps=4, fused=False)
        curve = []
        for step in range(4):
            stats, _ = train_step(model, head, [batches[step % 2]], opt, sched, DistEnv(), s.grad_clip)
            curve.append(stats)
        curves.append(torch.stack(curve))
    eager, compiled = curves
    assert torch.equal(eager[:, 1:], compiled[:, 1:])  # token, hit, chain and trial counts
    torch.testing.assert_close(compiled[:, 0], eager[:, 0], rtol=1e-4, atol=1e-5)  # loss sums


def test_compile_setting_is_validated():
    assert TrainSettings.from_dict(settings()).compile == "auto"
    assert not use_compile("auto", torch.device("cpu"))
    with pytest.raises(DraftflowError, match="'compile' must be auto, true or false"):
        TrainSettings.from_dict(settings(compile="sometimes"))


def test_target_temperature_setting_is_validated():
    s = TrainSettings.from_dict(settings())
    assert s.target_temperature == 1.0 and "target_temperature" not in s.fingerprint_dict()  # resume state as before
    assert TrainSettings.from_dict(settings(target_temperature=0)).fingerprint_dict()["target_temperature"] == 0
    with pytest.raises(DraftflowError, match="'target_temperature' must be >= 0"):
        TrainSettings.from_dict(settings(target_temperature=-0.5))
    with pytest.raises(DraftflowError, match="target_temperature apply to EAGLE-3 only"):
        TrainSettings.from_dict(settings(method="dflash", dflash={}, target_temperature=0.5))


def test_the_training_head_matches_the_configured_temperature(world):
    from draftflow.drafters.vocab import load_vocab
    from draftflow.hidden_states.storage import HiddenStateReader

    s = TrainSettings.from_dict(settings(target_temperature=0))
    _, head, _ = build_drafter(s, world["target"], load_vocab(world["vocab"]))
    target = head(collate([HiddenStateReader(world["train"])[0]], s.ttt_steps).final)
    in_vocab = target.argmax >= 0
    assert torch.equal(target.probs.sum(-1), in_vocab.float())  # one-hot rows: the target's greedy token
    assert torch.equal(target.probs.argmax(-1)[in_vocab], target.argmax[in_vocab])


def test_freeze_lm_head_keeps_the_target_rows_and_trains_the_rest(world, tmp_path):
    """train.freeze_lm_head (speculators' recipe): the optimizer never moves the head, which the
    saved drafter still holds as the target's rows of the draft vocabulary; the rest trains."""
    from draftflow.drafters.vocab import load_vocab

    assert "freeze_lm_head" not in TrainSettings.from_dict(settings()).fingerprint_dict()  # resume state as before
    frozen = TrainSettings.from_dict(settings(freeze_lm_head=True))
    assert frozen.fingerprint_dict()["freeze_lm_head"] is True
    with pytest.raises(DraftflowError, match="freeze_lm_head apply to EAGLE-3 only"):
        TrainSettings.from_dict(settings(method="dflash", dflash={}, freeze_lm_head=True))

    initial, _, _ = build_drafter(frozen, world["target"], load_vocab(world["vocab"]))
    run_inprocess(world, tmp_path / "out", tmp_path / "state", {"freeze_lm_head": True})
    state, latest = final_state(tmp_path / "state")  # float32, where the saved drafter is rounded to bf16
    assert latest["step"] >= 3
    assert torch.equal(state["lm_head.weight"], initial.lm_head.weight)  # the target's rows, bit for bit
    assert not torch.equal(state["fc.weight"], initial.fc.weight)
    saved, _ = load_drafter(tmp_path / "out")
    assert torch.equal(saved.lm_head.weight, initial.lm_head.weight.to(torch.bfloat16).float())


def test_lm_head_lr_scale_trains_the_head_at_its_share_of_the_rate(world):
    """train.lm_head_lr_scale: the head is an optimizer group of its own at that share of the rate,
    so Adam's first step moves it by that share of what the scale of 1 moves it; the rest moves
    the same. At its default it leaves the settings' fingerprint (resume state) as before."""
    from draftflow.hidden_states.storage import HiddenStateReader
    from draftflow.drafters.vocab import load_vocab

    assert "lm_head_lr_scale" not in TrainSettings.from_dict(settings()).fingerprint_dict()
    assert TrainSettings.from_dict(settings(lm_head_lr_scale=0.25)).fingerprint_dict()["lm_head_lr_scale"] == 0.25
    with pytest.raises(DraftflowError, match="'lm_head_lr_scale' must be > 0.*set freeze_lm_head: true"):
        TrainSettings.from_dict(settings(lm_head_lr_scale=0))
    with pytest.raises(DraftflowError, match="freeze_lm_head and lm_head_lr_scale both set"):
        TrainSettings.from_dict(settings(lm_head_lr_scale=0.5, freeze_lm_head=True))
    with pytest.raises(DraftflowError, match="lm_head_lr_scale apply to EAGLE-3 only"):
        TrainSettings.from_dict(settings(method="dflash", dflash={}, lm_head_lr_scale=0.5))

    reader = HiddenStateReader(world["train"])
    moved = {}
    for scale in (1.0, 0.25):
        s = TrainSettings.from_dict(settings(lm_head_lr_scale=scale, warmup_ratio=0.0, schedule="constant"))
        drafter, head, _ = build_drafter(s, world["target"], load_vocab(world["vocab"]))
        before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
        opt, sched = make_optimizer(drafter, s, total_steps=4, fused=False)
        grouped = [p for g in opt.param_groups for p in g["params"]]
        assert len(grouped) == len(set(map(id, grouped))) == sum(p.requires_grad for p in drafter.parameters())
        assert len(opt.param_groups) == (2 if scale == 1.0 else 3)
        model = TTTObjective(drafter, s.ttt_steps, s.step_weight_decay)
        train_step(model, head, [collate([reader[i] for i in range(4)], s.ttt_steps)], opt, sched, DistEnv(), s.grad_clip)
        moved[scale] = {n: (p.detach() - before[n]).abs().max().item() for n, p in drafter.named_parameters()}
    # Adam's first update is lr * g / (|g| + eps): the same gradient, a quarter of the step
    assert moved[0.25]["lm_head.weight"] == pytest.approx(0.25 * moved[1.0]["lm_head.weight"], rel=1e-3)
    assert moved[0.25]["fc.weight"] == pytest.approx(moved[1.0]["fc.weight"], rel=1e-6)


def test_ttt_attention_setting_is_validated():
    s = TrainSettings.from_dict(settings())
    assert s.ttt_attention == "auto" and "ttt_attention" not in s.fingerprint_dict()  # speed only: no rerun
    assert ttt_attention("auto", torch.device("cpu"), compile=False) == "chunked"
    assert ttt_attention("auto", torch.device("cuda"), compile=True) == "chunked-gqa"  # a choice, no device used
    assert ttt_attention("chunked-gqa", torch.device("cpu"), compile=False) == "chunked-gqa"
    with pytest.raises(DraftflowError, match="'ttt_attention' must be auto or one of chunked, chunked-gqa, flex"):
        TrainSettings.from_dict(settings(ttt_attention="paged"))
    with pytest.raises(DraftflowError, match="flex trains only on a CUDA device.*Set train.ttt_attention: auto"):
        ttt_attention("flex", torch.device("cpu"), compile=True)


@pytest.mark.slow  # two trainings, ~8 s
def test_grouped_kv_attention_trains_the_same_drafter_in_the_same_run(world, tmp_path):
    """train.ttt_attention reaches the objective (kv heads grouped: 4 heads over 2 here) and, being
    speed only, keeps the run's fingerprint: a changed setting resumes the same checkpoints."""
    run_inprocess(world, tmp_path / "a", tmp_path / "s1", {})
    run_inprocess(world, tmp_path / "b", tmp_path / "s2", {"ttt_attention": "chunked-gqa"})
    chunked, latest1 = final_state(tmp_path / "s1")
    grouped, latest2 = final_state(tmp_path / "s2")
    assert latest1["step"] == latest2["step"] >= 3
    assert [p.name for p in (tmp_path / "s1").glob("run-*")] == [p.name for p in (tmp_path / "s2").glob("run-*")]
    np.testing.assert_allclose([r["loss"] for r in train_rows(tmp_path / "a")],
                               [r["loss"] for r in train_rows(tmp_path / "b")], rtol=1e-5)  # fmt: skip
    for k, v in chunked.items():
        torch.testing.assert_close(grouped[k], v, rtol=1e-4, atol=1e-6, msg=k)
    kernels = [json.loads((tmp_path / d / "eval.json").read_text())["ttt_attention"] for d in ("a", "b")]
    assert kernels == ["chunked", "chunked-gqa"]


def test_save_and_load_drafter_round_trip(world, tmp_path):
    from draftflow.drafters.vocab import load_vocab

    s = TrainSettings.from_dict(settings())
    drafter, _, cfg = build_drafter(s, world["target"], load_vocab(world["vocab"]))
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    loaded, cfg2 = load_drafter(tmp_path / "d")  # embedding from the target path in config.json
    assert cfg2 == cfg
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, msg=k)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["draftflow"]["aux_layer_ids"] == AUX and saved["draftflow"]["ttt_steps"] == 3


def run_cli(world, out: Path, state: Path, extra: dict, torchrun: int = 0, wait: bool = True):
    args = ["train", "--train-ranges", *map(str, world["train"]), "--eval-ranges", *map(str, world["eval"]),
            "--target", str(world["target"]), "--vocab", str(world["vocab"]),
            "--settings", json.dumps(settings(**extra)), "--state-dir", str(state), "--output", str(out)]  # fmt: skip
    if torchrun:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
        cmd = [sys.executable, *launcher, "-m", "draftflow.cli", *args]
    else:
        cmd = [sys.executable, "-m", "draftflow.cli", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_inprocess(world, out: Path, state: Path, extra: dict) -> dict:
    """The same training as the CLI, in this process (saves a Python start-up)."""
    inputs = TrainInputs(world["train"], world["eval"], world["target"], world["vocab"], state, out)
    return run_training(inputs, TrainSettings.from_dict(settings(**extra)), DistEnv())


def final_state(state_dir: Path) -> tuple[dict, dict]:
    (run,) = state_dir.glob("run-*")
    latest = json.loads((run / "latest.json").read_text())
    return torch.load(run / latest["path"] / "state.pt", weights_only=False)["model"], latest


def train_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_ddp_two_gloo_processes_match_single_process_training(world, tmp_path):
    """Tolerance: max |param difference| < 1e-5 after all steps (fp32 CPU; only reduction order differs)."""
    run_inprocess(world, tmp_path / "single", tmp_path / "s1", {"grad_accum": 2})
    run_cli(world, tmp_path / "ddp", tmp_path / "s2", {}, torchrun=2)
    single, latest1 = final_state(tmp_path / "s1")
    ddp, latest2 = final_state(tmp_path / "s2")
    assert latest1["step"] == latest2["step"] >= 3
    diff = max((single[k].float() - ddp[k].float()).abs().max().item() for k in single)
    assert diff < 1e-5, diff
    moved = max((single[k].float() - v.float()).abs().max().item() for k, v in build_initial(world).items())
    assert moved > 1e-3  # training really changed the weights
    a, b = train_rows(tmp_path / "single"), train_rows(tmp_path / "ddp")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-5)
    summary = json.loads((tmp_path / "ddp" / "eval.json").read_text())
    assert 1.0 <= summary["simulated_acceptance_length"] <= 4.0 and summary["world_size"] == 2


def build_initial(world) -> dict:
    from draftflow.drafters.vocab import load_vocab

    drafter, _, _ = build_drafter(TrainSettings.from_dict(settings()), world["target"], load_vocab(world["vocab"]))
    return drafter.export_state_dict()


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_resume_after_sigkill_continues_the_same_loss_curve(world, tmp_path):
    # more steps and a few workers, so the run is long enough to be killed in the middle
    extra = {"epochs": 3, "save_every_steps": 3, "num_workers": 1}
    run_inprocess(world, tmp_path / "ref", tmp_path / "ref-state", extra)
    reference = train_rows(tmp_path / "ref")
    total = reference[-1]["step"]

    state = tmp_path / "state"
    proc = run_cli(world, tmp_path / "out", state, extra, wait=False)
    deadline = time.time() + 120
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        latest = list(state.glob("run-*/latest.json"))
        if latest and json.loads(latest[0].read_text())["step"] >= 3:
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = json.loads(latest[0].read_text())["step"]
            break
        time.sleep(0.01)
    proc.wait()
    assert killed_at is not None and killed_at < total, "the run finished before it could be killed"
    assert not (tmp_path / "out" / "eval.json").exists()

    proc = run_cli(world, tmp_path / "out", state, extra)
    assert "resuming from step" in proc.stderr
    resumed = train_rows(tmp_path / "out")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in reference], rtol=1e-5)


def kill_after_checkpoint(proc, state: Path, step: int) -> int:
    """SIGKILL the run (its whole process group) once a checkpoint of >= `step` is complete."""
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        latest = list(state.glob("run-*/latest.json"))
        if latest and json.loads(latest[0].read_text())["step"] >= step:
            # the whole tree and its process groups (a DataLoader worker may be starting)
            kill_tree(proc.pid)
            proc.wait()
            return json.loads(latest[0].read_text())["step"]
        time.sleep(0.01)
    proc.wait()
    raise AssertionError("the run finished before it could be killed")


@pytest.mark.slow  # real work of 10 s or more: not in make test-fast
def test_a_two_process_run_killed_mid_run_resumes_on_one_process_with_the_same_global_batch(world, tmp_path):
    """2 processes x grad_accum 1 and 1 process x grad_accum 2 take the same optimizer steps on the same
    batches: a checkpoint of one resumes on the other and continues the uninterrupted curve (fp32 CPU,
    only the reduction order differs: rtol 1e-5)."""
    extra = {"epochs": 3, "save_every_steps": 3, "num_workers": 1}
    run_inprocess(world, tmp_path / "ref", tmp_path / "ref-state", {**extra, "grad_accum": 2})
    reference = train_rows(tmp_path / "ref")

    state = tmp_path / "state"
    proc = run_cli(world, tmp_path / "out", state, extra, torchrun=2, wait=False)
    killed_at = kill_after_checkpoint(proc, state, 3)
    assert killed_at < reference[-1]["step"]

    # Another global batch is a different run: it starts afresh and says how to resume instead.
    proc = run_cli(world, tmp_path / "other", state, {**extra, "epochs": 0.2})
    assert "keep GPUs x train.grad_accum = 2 micro-batches per step (now 1 x 1)" in proc.stderr

    proc = run_cli(world, tmp_path / "out", state, {**extra, "grad_accum": 2})
    assert f"resuming from step {killed_at}" in proc.stderr
    resumed = train_rows(tmp_path / "out")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in reference], rtol=1e-5)
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["world_size"] == 1


# ---- integrity of what training reads (issue 12) ----------------------------------------------


def private_world(world, tmp_path: Path) -> dict:
    """The world's ranges and store, copied: a test may damage them (store roots are relative)."""
    shutil.copytree(world["root"] / "hs", tmp_path / "hs")
    moved = {split: [tmp_path / "hs" / split / d.name for d in world[split]] for split in ("train", "eval")}
    return {**world, **moved}


def store_file(range_dir: Path, position: int) -> tuple[str, str, Path]:
    from draftflow.hidden_states.storage import read_range_index, store_root_of

    meta, entries = read_range_index(range_dir)
    e = entries[position]
    return e.sample_id, e.key, SampleStore(store_root_of(range_dir, meta)).path(e.key)


def test_a_flipped_byte_stops_training_naming_range_sample_key_and_repair(world, tmp_path):
    w = private_world(world, tmp_path)
    sample_id, key, path = store_file(w["train"][1], 2)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # the low mantissa plane, stored raw: decodes fine into wrong values
    path.write_bytes(bytes(data))
    with pytest.raises(DraftflowError) as err:
        run_inprocess(w, tmp_path / "out", tmp_path / "state", {})
    message = str(err.value)
    assert str(w["train"][1]) in message and sample_id in message and key in message
    assert f"draftflow verify --hidden-states {w['train'][1].parent} --repair" in message
    assert "checksum" in message
    assert not (tmp_path / "out").exists()


def test_a_missing_store_file_is_found_before_training_starts(world, tmp_path):
    w = private_world(world, tmp_path)
    sample_id, key, path = store_file(w["train"][0], 5)
    path.unlink()
    with pytest.raises(DraftflowError) as err:
        run_inprocess(w, tmp_path / "out", tmp_path / "state", {})
    message = str(err.value)
    assert f"{w['train'][0]}: sample {sample_id}" in message and "no store file" in message
    assert "--repair" in message
    assert not list((tmp_path / "state").glob("run-*/ckpt/*")), "no step may run before the check"


def test_on_bad_sample_skip_leaves_them_out_and_counts_them(world, tmp_path):
    w = private_world(world, tmp_path)
    missing_id, _, missing = store_file(w["train"][0], 5)
    damaged_id, _, damaged = store_file(w["train"][1], 2)
    eval_id, _, eval_damaged = store_file(w["eval"][0], 0)
    missing.unlink()
    for path in (damaged, eval_damaged):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    summary = run_inprocess(w, tmp_path / "out", tmp_path / "state", {"on_bad_sample": "skip"})
    bad = summary["bad_samples"]
    assert bad["policy"] == "skip"
    assert bad["train"]["skipped_samples"] == 2
    assert {s["sample_id"] for s in bad["train"]["skipped"]} == {missing_id, damaged_id}
    assert [s["sample_id"] for s in bad["eval"]["skipped"]] == [eval_id]
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["bad_samples"] == bad


def test_resume_key_is_the_samples_not_the_index_files(world, tmp_path):
    """An extraction rerun that stores the same samples rewrites index.json (counts, timings):
    training must resume its finished run, not start again."""
    from draftflow.hidden_states.storage import read_range_index

    w = private_world(world, tmp_path)
    first = run_inprocess(w, tmp_path / "out", tmp_path / "state", {})
    for d in w["train"] + w["eval"]:
        meta, entries = read_range_index(d)
        meta["counts"] = {"samples": len(entries), "computed": 0, "reused": len(entries)}
        meta["timings"] = {"wall_s": 12.5}
        write_range_index(d, entries, meta)
    again = run_inprocess(w, tmp_path / "out2", tmp_path / "state", {})
    assert again["fingerprint"] == first["fingerprint"]
    assert len(list((tmp_path / "state").glob("run-*"))) == 1
    assert train_rows(tmp_path / "out2") == train_rows(tmp_path / "out")  # resumed at the end: no new step


def test_the_loader_packs_eagle3_rows_one_width_wide_and_pads_dflash_one_sample_a_row(world):
    from draftflow.hidden_states.storage import HiddenStateReader

    reader = HiddenStateReader(world["train"])
    s = TrainSettings.from_dict(settings(batch_tokens=100))
    width = int(reader.lengths.max())
    plan = plan_micro_batches(reader.lengths, s, 0)
    batches = list(make_loader(reader, plan, s, torch.device("cpu"), epoch=0))
    assert len(batches) == len(plan)
    for rows, batch in zip(plan, batches):
        assert batch.input_ids.shape == (len(rows), width)  # one shape for every packed step
        assert batch.tokens == int(reader.lengths[[i for row in rows for i in row]].sum())
        if any(len(row) > 1 for row in rows):
            assert batch.doc.max().item() >= 1
    assert any(b.doc is not None for b in batches)
    padded = next(iter(make_loader(reader, [[[0], [1]]], s, torch.device("cpu"), packed=False)))
    assert padded.doc is None and padded.input_ids.shape == (2, int(reader.lengths[:2].max()))


def test_padded_batching_trains_eagle3_one_sample_a_row_under_its_own_fingerprint(world, tmp_path):
    """`batching: padded` (the recipe before packing, kept to measure packing against) plans one
    sample a row and is a run of its own; unset, the settings fingerprint is as before the key."""
    from draftflow.hidden_states.storage import HiddenStateReader

    lengths = HiddenStateReader(world["train"]).lengths
    padded = TrainSettings.from_dict(settings(batching="padded"))
    assert all(len(row) == 1 for batch in plan_micro_batches(lengths, padded, 0) for row in batch)
    assert "batching" not in TrainSettings.from_dict(settings()).fingerprint_dict()

    packed_run = run_inprocess(world, tmp_path / "packed", tmp_path / "state", {})
    padded_run = run_inprocess(world, tmp_path / "padded", tmp_path / "state", {"batching": "padded"})
    assert padded_run["fingerprint"] != packed_run["fingerprint"]
    assert len(list((tmp_path / "state").glob("run-*"))) == 2  # no resume across batchings
    assert len(train_rows(tmp_path / "padded")) == padded_run["steps"] == len(plan_micro_batches(lengths, padded, 0))
    assert np.isfinite(padded_run["loss"])


def test_batching_is_validated_and_eagle3_only():
    with pytest.raises(DraftflowError, match="'batching' must be packed or padded"):
        TrainSettings.from_dict(settings(batching="sorted"))
    with pytest.raises(DraftflowError, match="batching apply to EAGLE-3 only"):
        TrainSettings.from_dict(settings(batching="padded", method="dflash", dflash={}))
