#!/usr/bin/env python3
"""Helpers of `bench/smollm2_call.sh`: the workflow on SmolLM2-135M-Instruct and real chat data
(issue 32), on the H200 or, shrunk, on the CPU.

    configs  write W/config.yaml: config/examples/smollm2-135m.yaml with the call's paths and sizes
    ppl      the target's perplexity on the merged eval split's loss tokens, per dataset
    heldout  the target's perplexity on ShareGPT answers that the example config never trains on
    neighbours  mean cosine of each aux layer's output with its neighbours' (MT-bench prompts)
    mix      one conversations file with another's answers where the other has the same prompt (id)
    followups  the kept conversations continued by ShareGPT's second user turn, answered by the target
    lookup   prompt lookup's teacher-forced τ on conversation files' last answers (how loop-like they are)
    vocab-coverage  the share of the eval split's loss tokens inside the draft vocabulary, per size
    evalqueue  evaluate each drafter as soon as its training has finished, most wanted figures first
    collect  every figure of a call's work folder into one JSON (figures.json)
    table    markdown rows from one or more figures.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def set_path(config: dict, key: str, value) -> None:
    node = config
    *parents, last = key.split(".")
    for k in parents:
        node = node.setdefault(k, {})
    node[last] = value


def configs(a) -> None:
    """The example config with this call's folders; --tiny shrinks it for a CPU smoke test."""
    import yaml

    config = yaml.safe_load((REPO / "config" / "examples" / "smollm2-135m.yaml").read_text())
    w, data = a.work.resolve(), a.data.resolve()
    config["results"] = str(w / "results")
    config["target"]["model"] = str(a.model.resolve())
    config["datasets"]["sharegpt_regen"].update(path=str(data / "sharegpt_prompts.jsonl.gz"))
    if a.regenerated:  # the target's answers from an earlier call: no regenerate stage (~15 minutes of H200)
        config["datasets"]["sharegpt_regen"].update(path=str(a.regenerated.resolve()), regenerate=False)
    # the last 3,000 records of the shipped file, cut off as it is (it does not fit a device call whole)
    config["datasets"]["sharegpt"].update(path=str(data / "sharegpt_tail.json.gz"), shards=1, max_samples=1500)
    config["regenerate"].update(batch_size=256, max_new_tokens=256)
    # 1024: the speculators copy of the store is uncompressed; both must fit the 64 GB disk.
    # One train range: each extract job cost ~20 s on the H100 before its first sample (7 jobs, 177 s for
    # 4.2 M tokens, 2026-12-05); ranges only partition the same merged order, so training is unchanged
    config["merge"].update(max_seq_len=1024, min_eval_samples=64, samples_per_range=16384)
    config["extract"].update(writer_threads=6)
    config["train"].update(num_workers=4, log_every_steps=20)
    # 80 prompts (the floor) in one batch: a set's requests share every forward (the GPU is
    # launch-bound at batch 1); float32: T = 0 outputs equal greedy (in bf16 14-18 of 32 did, 2026-12-05)
    config["evaluate"].update(max_prompts=80, max_new_tokens=128, batch_size=80, dtype="float32")
    sets = config["evaluate"]["prompt_sets"]
    sets["mtbench"]["path"] = str(data / "mtbench_question.jsonl")
    sets["gsm8k"].update(path=str(data / "gsm8k_test.jsonl"), max_prompts=None)
    sets["humaneval"].update(path=str(data / "HumanEval.jsonl.gz"), max_prompts=None)
    if a.tiny:
        for dataset in config["datasets"].values():
            dataset.update(shards=1, max_samples=12)
        config["regenerate"].update(batch_size=12, max_new_tokens=24)
        config["merge"].update(max_seq_len=192, min_eval_samples=4, samples_per_range=64)
        config["extract"].update(gpus_per_job=0, batch_tokens=4096, writer_threads=1)
        config["train"].update(gpus=0, epochs=1, batch_tokens=1024, draft_vocab_size=2048, num_workers=0)
        config["train"].setdefault("dflash", {}).update(anchors_per_sample=16)
        config["evaluate"].update(draft_tokens=[3], max_prompts=2, max_new_tokens=12)
    for item in a.override:  # KEY.PATH=JSON
        key, _, value = item.partition("=")
        set_path(config, key, json.loads(value))
    (w / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def ppl(a) -> None:
    """exp(mean NLL) of the target on the eval split's loss-masked tokens (the answers), per dataset."""
    import torch

    from draftflow.target import load_target

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_target(a.results / "target", dtype=torch.bfloat16, device=device)
    nll: dict[str, float] = {}
    count: dict[str, int] = {}
    with torch.no_grad(), open(a.results / "merged" / "eval.jsonl") as f:
        for line in f:
            record = json.loads(line)
            ids = torch.tensor([record["input_ids"]], device=device)
            mask = torch.tensor(record["loss_mask"][1:], device=device, dtype=torch.bool)
            logits = model(input_ids=ids).logits[0, :-1].float()
            losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")[mask]
            name = record.get("dataset", "all")
            nll[name] = nll.get(name, 0.0) + float(losses.sum())
            count[name] = count.get(name, 0) + int(mask.sum())
    out = {name: {"perplexity": round(math.exp(nll[name] / count[name]), 3), "tokens": count[name]} for name in nll}
    total = sum(count.values())
    out["all"] = {"perplexity": round(math.exp(sum(nll.values()) / total), 3), "tokens": total}
    print(json.dumps(out))


def heldout(a) -> None:
    """Perplexity (exp of the mean NLL over assistant tokens, the tokenize stage's loss mask, first
    --max-len tokens) of the target on ShareGPT's last --records complete conversations as shipped
    (ChatGPT's answers; the example config's `sharegpt` dataset takes the first 1,500)."""
    import torch

    from draftflow.data.prepare import RecordError, normalize_record, open_source
    from draftflow.data.tokenization import ChatTemplateError, load_tokenizer, tokenize_conversation
    from draftflow.target import load_target

    records = [r.raw for r in open_source(a.sharegpt).records if r.error is None]
    model, _ = load_target(a.model, dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(a.model)
    nll, tokens, used = 0.0, 0, 0
    with torch.no_grad():
        for raw in records[-a.records:]:
            try:
                sample = tokenize_conversation(tokenizer, normalize_record(raw, "sharegpt").messages)
            except (RecordError, ChatTemplateError):
                continue
            ids = torch.tensor([sample.input_ids[: a.max_len]])
            mask = torch.tensor(sample.loss_mask[1 : a.max_len], dtype=torch.bool)
            if not mask.any():
                continue
            logits = model(input_ids=ids).logits[0, :-1]
            nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")[mask].sum())
            tokens += int(mask.sum())
            used += 1
    print(json.dumps({"perplexity": round(math.exp(nll / tokens), 3), "answer_tokens": tokens, "conversations": used,
                      "records": a.records, "max_len": a.max_len}))


def neighbours(a) -> None:
    """Mean cosine, over the tokens of the first --prompts MT-bench questions, between decoder layer
    i's output and layers i - 1's and i + 1's (float32): how visible a one-layer shift of aux ids is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    questions = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.prompts]
    sums = {i: [0.0, 0.0] for i in a.aux}
    with torch.no_grad():
        for question in questions:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                return_dict=True, return_tensors="pt")["input_ids"]
            states = model(input_ids=ids, output_hidden_states=True).hidden_states  # [i + 1]: layer i's output
            for i in a.aux:
                for side, j in enumerate((i - 1, i + 1)):
                    cosine = torch.nn.functional.cosine_similarity(states[i + 1][0], states[j + 1][0], dim=-1)
                    sums[i][side] += float(cosine.mean()) / len(questions)
    print(json.dumps({i: {"previous": round(p, 3), "next": round(n, 3)} for i, (p, n) in sums.items()}))


def read_conversations(path: Path) -> dict[str, dict]:
    """id -> record of a conversations file (.jsonl or .jsonl.gz), in file order."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return {r["id"]: r for r in map(json.loads, f)}


def mix(a) -> None:
    """--base's records in its order, the first --share of them replaced by --answers' record of the same
    id where that has one (the same prompt answered another way, e.g. greedily): one regeneration's
    answers for a share of another's prompts."""
    import gzip

    base, answers = read_conversations(a.base), read_conversations(a.answers)
    limit = round(a.share * len(base))
    records, replaced = [], 0
    for index, (record_id, record) in enumerate(base.items()):  # checked whole before --out is written
        other = answers.get(record_id) if index < limit else None
        if other is not None:
            if other["messages"][:-1] != record["messages"][:-1]:
                raise SystemExit(f"{a.answers}: id {record_id} has another prompt than in {a.base}")
            record = other
            replaced += 1
        records.append(record)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(a.out, "wt", encoding="utf-8", compresslevel=9) as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    print(json.dumps({"records": len(base), "replaced": replaced, "out": str(a.out)}))


def followups(a) -> None:
    """The kept one-turn conversations, each continued by its ShareGPT conversation's second user turn
    and the target's answer to it (through a served OpenAI-compatible endpoint, e.g. vLLM's CPU build):
    two-turn conversations whose every answer is the target's. The workflow's `regenerate` would
    answer the first turn again; this keeps it. Appends to --out (.jsonl) and skips ids already there,
    so an interrupted run resumes. --merged: --base with each answered conversation in place of its
    one-turn record (a file to train on, as REGENERATED)."""
    from draftflow.data.prepare import open_source
    from draftflow.engines.generation import make_generation_engine

    second_turn: dict[str, str] = {}  # first user turn's text -> the second user turn's
    for record in open_source(a.sharegpt).records:
        turns = record.raw.get("conversations") if record.error is None else None
        if not turns or len(turns) < 3 or [t.get("from") for t in turns[:3]] != ["human", "gpt", "human"]:
            continue
        text = turns[2].get("value")
        if isinstance(text, str) and text.strip() and len(text) <= a.max_chars:
            second_turn.setdefault(turns[0].get("value"), text)
    todo = []
    for record_id, record in read_conversations(a.base).items():
        messages = record["messages"]
        if len(messages) == 2 and messages[0]["content"] in second_turn and messages[1]["content"].strip():
            todo.append((record_id, [*messages, {"role": "user", "content": second_turn[messages[0]["content"]]}]))
    done = set(read_conversations(a.out)) if a.out.exists() else set()
    with_second_turn = len(todo)
    todo = [item for item in todo if item[0] not in done][: max(0, a.limit - len(done))]
    print(json.dumps({"with_a_second_turn": with_second_turn, "done": len(done), "to_answer": len(todo)}), flush=True)
    # each request seeded by its id: on vLLM's CPU build start the server with chunked prefill off (README,
    # "A real pretrained model": its CPU worker cannot rewind a seeded request's generator)
    settings = {"engine": "openai", "openai": {"endpoints": [a.endpoint], "model": a.served_model,
                                               "concurrency": a.concurrency}}
    if todo:
        engine = make_generation_engine(settings, a.model)
        answer_followups(todo, engine, a.out, a.chunk, a.max_new_tokens, a.temperature)
    if a.merged:
        write_merged(a.base, read_conversations(a.out), a.merged)


def answer_followups(todo: list[tuple[str, list[dict]]], engine, out_path: Path, chunk_size: int,
                     max_new_tokens: int, temperature: float) -> None:
    """Each (id, messages) answered by `engine`, appended to out_path chunk_size at a time; closes engine."""
    from draftflow.data.regenerate import turn_seed
    from draftflow.engines.generation import GenerationRequest

    empty = 0
    try:
        with out_path.open("a", encoding="utf-8") as out:
            for start in range(0, len(todo), chunk_size):
                chunk = todo[start : start + chunk_size]
                requests = [GenerationRequest(messages=messages, max_new_tokens=max_new_tokens,
                                              temperature=temperature, seed=turn_seed(0, record_id, 1))
                            for record_id, messages in chunk]
                for (record_id, messages), result in zip(chunk, engine.generate(requests)):
                    if not result.content.strip():  # prepare refuses an empty answer
                        empty += 1
                        continue
                    answer = {"role": "assistant", "content": result.content}
                    record = {"id": record_id, "messages": [*messages, answer]}
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                print(json.dumps({"answered": start + len(chunk), "of": len(todo), "empty": empty}), flush=True)
    finally:
        engine.close()


def write_merged(base: Path, followups: dict[str, dict], merged: Path) -> None:
    """--base's records in its order, each replaced by its two-turn continuation where there is one."""
    import gzip

    records = [followups.get(record_id, record) for record_id, record in read_conversations(base).items()]
    merged.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(merged, "wt", encoding="utf-8", compresslevel=9) as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    print(json.dumps({"records": len(records), "two_turn": sum(len(r["messages"]) == 4 for r in records),
                      "merged": str(merged)}))


def lookup_tau(tokens: list[int], start: int, k: int, proposer) -> tuple[int, int]:
    """(tokens, verify steps) of chain drafting at K = k over tokens[start:], teacher-forced: each step
    proposes from the tokens so far and accepts the proposal's prefix that the path itself continues with."""
    steps, t = 0, start
    while t < len(tokens):
        proposal = proposer.propose(tokens[:t], None, k)
        accepted = 0
        while accepted < len(proposal) and t + accepted < len(tokens) and proposal[accepted] == tokens[t + accepted]:
            accepted += 1
        t += accepted + 1  # the accepted drafts and the target's own next token
        steps += 1
    return len(tokens) - start, steps


def lookup(a) -> None:
    """Prompt lookup (n <= 3, as `evaluate`) teacher-forced on each record's last answer: τ = answer tokens
    / verify steps at each K, per file, over the records whose ids all files share (the same prompts)."""
    from draftflow.data.tokenization import load_tokenizer, tokenize_conversation
    from draftflow.evaluation.speculative import NgramProposer

    files = {str(path): read_conversations(path) for path in a.conversations}
    ids = sorted(set.intersection(*(set(r) for r in files.values())))[: a.records]
    tokenizer = load_tokenizer(a.model)
    proposer = NgramProposer(3)
    out = {"records": len(ids), "files": {}}
    for name, by_id in files.items():
        totals = {k: [0, 0] for k in a.k}
        answer_tokens, at_cap, looping = 0, 0, 0
        for record_id in ids:
            sample = tokenize_conversation(tokenizer, by_id[record_id]["messages"])
            mask = sample.loss_mask
            end = max(i for i, m in enumerate(mask) if m) + 1  # the last answer's run of loss tokens
            start = end - mask[:end][::-1].index(0) if 0 in mask[:end] else 0
            tokens = sample.input_ids[: min(end, start + a.max_answer)]  # the evaluation's max_new_tokens
            answer = tokens[start:]
            answer_tokens += len(answer)
            at_cap += len(answer) >= a.cap
            windows = [tuple(answer[i : i + a.loop]) for i in range(len(answer) - a.loop + 1)]
            looping += len(set(windows)) < len(windows)  # some run of --loop tokens comes back
            for k in a.k:
                n, steps = lookup_tau(tokens, start, k, proposer)
                totals[k][0] += n
                totals[k][1] += steps
        out["files"][name] = {"tau": {k: round(n / steps, 3) for k, (n, steps) in totals.items()},
                              "mean_answer_tokens": round(answer_tokens / len(ids), 1),
                              "share_at_cap": round(at_cap / len(ids), 3),
                              f"share_repeating_{a.loop}_tokens": round(looping / len(ids), 3)}
    print(json.dumps(out))


def vocab_coverage(a) -> None:
    """For each draft vocabulary size: the vocabulary the workflow's `vocab` stage would pick from the
    merged train split, and the share of the eval split's loss tokens it holds, per dataset. A token
    outside it can never be drafted: the ceiling that the size sets on acceptance."""
    from collections import defaultdict

    import numpy as np

    from draftflow.drafters.vocab import count_loss_tokens, select_draft_vocab, target_vocab_size
    from draftflow.jsonl import read_jsonl

    V = target_vocab_size(a.target)
    train = count_loss_tokens(a.results / "merged" / "train.jsonl", V)  # [V]

    def loss_token_counts(input_ids: list[int], loss_mask: list) -> np.ndarray:  # [V]
        return np.bincount(np.asarray(input_ids, dtype=np.int64)[np.asarray(loss_mask, dtype=bool)], minlength=V)

    held_out: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(V, dtype=np.int64))  # dataset -> [V]
    eval_ids = set()
    for record in read_jsonl(a.results / "merged" / "eval.jsonl"):
        held_out[record["dataset"]] += loss_token_counts(record["input_ids"], record["loss_mask"])
        eval_ids.add(record["id"])
    held_out["all"] = sum(held_out.values())
    if a.answers:  # the same eval prompts answered another way (e.g. greedily): what greedy serving emits
        from draftflow.data.prepare import sample_id
        from draftflow.data.tokenization import load_tokenizer, tokenize_conversation

        # `prepare` names a record by its dataset and content: the ids that --base and --answers share
        # are the regeneration's, so the eval split's records are found through --base
        answers = read_conversations(a.answers)
        tokenizer = load_tokenizer(a.target)
        counts = np.zeros(V, dtype=np.int64)
        for record_id, record in read_conversations(a.base).items():
            if sample_id(a.dataset, record["messages"]) in eval_ids and record_id in answers:
                sample = tokenize_conversation(tokenizer, answers[record_id]["messages"])
                counts += loss_token_counts(sample.input_ids, sample.loss_mask)
        if not counts.any():
            raise SystemExit(f"vocab-coverage: no record of {a.base} named {a.dataset!r} is in the eval split with an "
                             f"answer in {a.answers}: pass the file and dataset name the run was given")
        held_out[a.answers.name] = counts
    out = {"target_vocab_size": V, "train_loss_tokens": int(train.sum()),
           "train_distinct": int((train > 0).sum()),
           "eval_loss_tokens": {name: int(c.sum()) for name, c in held_out.items()}, "coverage": {}}
    for size in sorted({min(size, V) for size in a.sizes}):
        chosen = select_draft_vocab(train, size).t2d  # [V] bool
        shares = {name: c[chosen].sum() / c.sum() for name, c in {"train": train, **held_out}.items()}
        out["coverage"][size] = {name: round(float(share), 5) for name, share in shares.items()}
    print(json.dumps(out))


def collect(a) -> None:
    """acceptance.json tables (without the raw per-step lists), training summaries and run facts."""
    w = a.work
    figures: dict[str, dict] = {}
    for path in sorted(w.rglob("acceptance.json")):
        if "state" in path.parts or "eval-state" in path.parts:
            continue
        report = json.loads(path.read_text())
        figures[str(path.relative_to(w))] = {
            "per_set": [{k: v for k, v in row.items() if k not in ("accepted", "reached")} for row in report["per_set"]],
            "settings": report.get("settings"),
        }
    for path in sorted(w.rglob("eval.json")):
        if "drafter" in path.parts:
            report = json.loads(path.read_text())
            figures[str(path.relative_to(w))] = {k: report.get(k) for k in (
                "simulated_acceptance_length", "tau", "step_alpha", "train_tokens", "steps", "tokens_per_s",
                "train_seconds", "loss")}
    for path in sorted((w / "evals").glob("*/*/figures.json")):  # each evaluation's seconds
        figures[str(path.relative_to(w))] = {"seconds": json.loads(path.read_text()).get("seconds")}
    for path in sorted(w.rglob("train_info.json")):
        figures[str(path.relative_to(w))] = json.loads(path.read_text())
    for name in ("manifest.json", "data_config.json", "ppl.json", "conversion.json"):
        for path in sorted(w.rglob(name)):
            if "state" not in path.parts and "store" not in path.parts:
                figures[str(path.relative_to(w))] = json.loads(path.read_text())
    (a.out / "figures.json").write_text(json.dumps(figures, indent=1, default=str))


# ---------------------------------------------------------------- drafters across sessions
# A device session keeps nothing for the next: a trained drafter comes back in pieces (a returned
# file's limit is 16 MiB) and a later session carries them in to evaluate it without retraining.

DRAFTER_FILES = ("config.json", "eval.json", "model.safetensors")
PIECE_BYTES = 15 * 2**20


def pack_drafter(a) -> None:
    """The drafter labelled --label as <out>/drafter-<label>.tar.part.NN, 15 MiB each."""
    import io
    import tarfile

    folder = trained_drafters(a.work).get(a.label)
    if folder is None:
        raise SystemExit(f"pack-drafter: no trained drafter {a.label!r} in {a.work} (have: {sorted(trained_drafters(a.work))})")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in DRAFTER_FILES:
            if (folder / name).is_file():
                tar.add(folder / name, arcname=name)
    data = buffer.getvalue()
    for i in range(0, len(data), PIECE_BYTES):
        (a.out / f"drafter-{a.label}.tar.part.{i // PIECE_BYTES:02d}").write_bytes(data[i : i + PIECE_BYTES])
    print(f"pack-drafter: {a.label} from {folder}: {len(data)} bytes", file=sys.stderr)


def import_drafters(a) -> None:
    """Every drafter-<label>.tar.part.* set in --source unpacked where `trained_drafters` finds it
    under that label (`qc/<trainer>-imported[-v-<variant>]-s<seed>/drafter`; a DFlash label is its
    own folder)."""
    import io
    import tarfile

    pieces: dict[str, list[Path]] = {}
    for path in sorted(a.source.glob("drafter-*.tar.part.*")):
        pieces.setdefault(re.sub(r"^drafter-|\.tar\.part\.\d+$", "", path.name), []).append(path)
    for label, parts in pieces.items():
        name, _, seed = label.rpartition("-s")
        if not name or not seed.isdigit():
            raise SystemExit(f"import-drafters: {parts[0]}: the label {label!r} is not <trainer>[-<variant>]-s<seed>")
        trainer, _, variant = name.partition("-")
        folder_name = label if trainer == "dflash" else f"{trainer}-imported{'-v-' + variant if variant else ''}-s{seed}"
        run = a.work / "qc" / folder_name
        folder = run / "drafter"
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
            tar.extractall(folder, filter="data")
        (run / "train_info.json").write_text(json.dumps({"drafter": str(folder), "imported": [p.name for p in parts],
                                                          "train_seconds": None}))  # fmt: skip
        print(f"import-drafters: {label} -> {folder}", file=sys.stderr)


# ---------------------------------------------------------------- evaluation queue

# DFlash recipe variants (issue 32 item 6: layers, block size, loss), each trained by
# bench/quality_compare.py --dflash over the example config's train.dflash; every variant names its
# layers, block and weighting, so it means the same whatever the example holds (the target's greedy
# labels and the stored aux layers unless it says otherwise); smollm2_call.sh's DFLASH_VARIANTS names them.
# l1-dpace is the schema's default since session 13 (l1-decay before); the example config trains l5-dpace (BENCHMARKS.md)
_L1_DECAY = {"num_hidden_layers": 1, "block_size": 16, "loss_weighting": "decay"}
DFLASH_VARIANTS = {
    "l1-decay": _L1_DECAY,
    "l1-dpace": {**_L1_DECAY, "loss_weighting": "dpace"},
    "l5-decay": {**_L1_DECAY, "num_hidden_layers": 5},
    "l5-dpace": {**_L1_DECAY, "num_hidden_layers": 5, "loss_weighting": "dpace"},
    "l1-b8": {**_L1_DECAY, "block_size": 8},
    "l1-data": {**_L1_DECAY, "labels": "data"},
    # the target's whole distribution (train.dflash.labels: soft), as EAGLE-3 trains: its argmax alone
    # cost EAGLE-3 0.07 of simulated τ on this model (`t0`), and DFlash trains on the argmax
    "l1-soft": {**_L1_DECAY, "loss_weighting": "dpace", "labels": "soft"},
    "l5-soft": {**_L1_DECAY, "num_hidden_layers": 5, "loss_weighting": "dpace", "labels": "soft"},
}

# EAGLE-3 recipe variants: what differs between the two trainers (speculators' two extra norms and
# frozen head, its norms off), what may raise greedy acceptance (the target temperature) and issue 32
# item 6's remeasures, each trained by bench/quality_compare.py with the session's recipe plus these
# arguments (trainer first), under the label `v-<name>` (its folder `<trainer>-…-v-<name>-s<seed>`,
# evaluated as `<trainer>-<name>-s<seed>`); smollm2_call.sh's EAGLE3_VARIANTS names them
SPECULATORS_NORMS = ["--set", "train.norm_before_fc=true", "--set", "train.norm_before_residual=true"]
EAGLE3_VARIANTS = {
    "norms": ["ours", *SPECULATORS_NORMS],
    # the draft head kept at the target's rows (train.freeze_lm_head), alone and with the norms:
    # speculators' recipe in our trainer
    "frozen-head": ["ours", "--set", "train.freeze_lm_head=true"],
    "spec-recipe": ["ours", "--set", "train.freeze_lm_head=true", *SPECULATORS_NORMS],
    # speculators' gradient clip (ours 0.5): idle where both bind, as on SmolLM2 (AdamW's update does
    # not depend on a clip that binds every step; BENCHMARKS.md, session 15); kept for a run where they do not
    "clip1": ["ours", "--set", "train.grad_clip=1.0"],
    "nbfc": ["ours", "--set", "train.norm_before_fc=true"],
    # the head trained at a quarter of the rate: between the frozen head (0.09 below in simulated tau)
    # and ours' trained one, which fits its training data far better than the eval split (session 17:
    # 0.05 below too; BENCHMARKS.md)
    "head25": ["ours", "--set", "train.lm_head_lr_scale=0.25"],
    "lk": ["ours", "--set", "train.loss=lk"],
    "no-norm-output": ["ours", "--set", "train.norm_output=false"],
    # the target distribution the loss matches (train.target_temperature): its argmax alone (what greedy
    # serving accepts), or sharpened half-way
    "t0": ["ours", "--set", "train.target_temperature=0"],
    "t05": ["ours", "--set", "train.target_temperature=0.5"],
    "arch": ["speculators", "--spec-recipe", "ours-arch"],
    # item 6's learning-rate remeasure around the recipe's 4e-3 (the code model's pick, at 424 steps)
    "lr2e3": ["ours", "--set", "train.learning_rate=0.002"],
    "lr8e3": ["ours", "--set", "train.learning_rate=0.008"],
}

# most wanted first: the done-when's cells (K = 7 on MT-bench and GSM8K at both temperatures), then HumanEval
EVAL_ORDER = [("mtbench", 0), ("gsm8k", 0), ("mtbench", 1), ("gsm8k", 1), ("humaneval", 0), ("humaneval", 1)]


def drafter_label_of(folder: str) -> str:
    """A bench/quality_compare.py folder's evaluation label: `<trainer>-…-s<seed>` -> `<trainer>-s<seed>`;
    an EAGLE-3 variant's `<trainer>-…-v-<name>-s<seed>` -> `<trainer>-<name>-s<seed>`; a DFlash
    variant keeps its whole name, `dflash-<variant>-s<seed>`."""
    trainer = folder.split("-", 1)[0]
    if trainer == "dflash":
        return folder
    middle, _, seed = folder.partition("-")[2].rpartition("-s")
    variant = re.search(r"(?:^|-)v-(.+)$", middle)
    return f"{trainer}-{variant[1]}-s{seed}" if variant else f"{trainer}-s{seed}"


def trained_drafters(w: Path) -> dict[str, Path]:
    """label (`drafter_label_of`) -> drafter folder, for every drafter whose training has finished:
    the workflow's DFlash, and bench/quality_compare.py's folders once train_info.json is written."""
    found = {}
    dflash = w / "results" / "drafter" / "dflash"
    if (dflash / "config.json").is_file() and (dflash / "eval.json").is_file():
        found["dflash-s0"] = dflash
    for info in sorted((w / "qc").glob("*-s*/train_info.json")):
        folder = info.parent
        if (folder / "drafter" / "config.json").is_file():
            found[drafter_label_of(folder.name)] = folder / "drafter"
    return found


def evalqueue(a) -> None:
    """Run `bench/real_target.py evaluate` (one drafter, one prompt set, one temperature) for every
    trained drafter, at most --jobs at a time (--jobs-training while the flag file exists), until
    nothing is left and training has ended, or until --seconds: then the running ones are killed.
    A job whose acceptance.json exists is done (a later call skips it)."""
    import os
    import signal
    import subprocess
    import time

    w = a.work
    end = time.monotonic() + a.seconds
    running: dict[tuple, subprocess.Popen] = {}
    done: set[tuple] = set()

    # the done-when's temperatures in EVAL_ORDER, then any other (e.g. 0.7, the regeneration's) per set
    cells = [(ps, t) for ps, t in EVAL_ORDER if ps in a.sets and t in a.temps]
    sets = [ps for ps in dict.fromkeys(ps for ps, _ in EVAL_ORDER) if ps in a.sets]
    cells += [(ps, t) for t in a.temps if t not in (0, 1) for ps in sets]

    def pending() -> list[tuple]:
        drafters = {label: d for label, d in trained_drafters(w).items() if not a.only or label in a.only}
        jobs = [(label, ps, t) for ps, t in cells for label in drafters]
        return [(j, drafters[j[0]]) for j in jobs if j not in done and j not in running
                and not (eval_dir(w, j) / "acceptance.json").is_file()]

    cap = a.jobs  # lowered when the device runs out of memory: that job runs again, fewer beside it
    while time.monotonic() < end:
        for job, proc in list(running.items()):
            if proc.poll() is not None:
                del running[job]
                print(f"[evalqueue] {'/'.join(map(str, job))}: exit {proc.returncode}", file=sys.stderr, flush=True)
                alone = cap == 1 and not running  # out of memory alone: it never fits, give up on it
                if proc.returncode != 0 and not alone and out_of_memory(eval_log(w, job)):
                    cap = max(1, len(running))
                    print(f"[evalqueue] out of device memory: again, at most {cap} at a time", file=sys.stderr, flush=True)
                else:
                    done.add(job)
        training = a.training_flag is not None and a.training_flag.exists()
        limit = min(cap, a.jobs_training if training else a.jobs)
        todo = pending()
        for job, drafter in todo[: max(0, limit - len(running))]:
            label, ps, t = job
            out = eval_dir(w, job)
            # prompt lookup is the same for every drafter: measured once per cell, with the drafter
            # named by --prompt-lookup-with (DFlash by default: its full block's K too)
            lookup = [] if label == a.prompt_lookup_with else ["--set", "evaluate.prompt_lookup=false"]
            with open(eval_log(w, job), "w") as log:
                running[job] = subprocess.Popen(
                    [sys.executable, str(REPO / "bench" / "real_target.py"), "evaluate", "--results", str(w / "results"),
                     "--config", str(w / "config.yaml"), "--drafter", str(drafter), "--prompt-set", ps,
                     "--temperature", f"{t:g}", "--device", a.device, "--threads", "1", "--out", str(out), *lookup],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        if not running and not todo and not training:
            return
        time.sleep(3)
    for proc in running.values():  # the deadline: what is still running is lost, what finished is kept
        os.killpg(proc.pid, signal.SIGKILL)
    print(f"[evalqueue] deadline: killed {len(running)} running evaluations", file=sys.stderr, flush=True)


def eval_dir(work: Path, job: tuple) -> Path:
    """The output folder of one evaluation job (label, prompt set, temperature)."""
    label, prompt_set, temperature = job
    return work / "evals" / label / f"{prompt_set}-T{temperature:g}"


def eval_log(work: Path, job: tuple) -> Path:
    """The log of one evaluation job (label, prompt set, temperature)."""
    label, prompt_set, temperature = job
    return work / f"eval-{label}-{prompt_set}-{temperature:g}.log"


def out_of_memory(log: Path) -> bool:
    """Whether an evaluation's log ends in torch's CUDA out-of-memory error."""
    return log.is_file() and "OutOfMemoryError" in log.read_text(errors="replace")[-20000:]


def drafter_label(path: str) -> str:
    """evals/<label>/<set>-T<t>/acceptance.json -> <label>"""
    parts = Path(path).parts
    return parts[parts.index("evals") + 1] if "evals" in parts else parts[0]


def table(a) -> None:
    """| drafter | set | K | T | τ real | n-gram | simulated | prompts |, then the mean over seeds
    of each trainer (labels `<trainer>-s<seed>`)."""
    rows: dict[tuple, float] = {}
    for figures_path in a.figures:
        figures = json.loads(Path(figures_path).read_text())
        for path, fig in figures.items():
            if not path.endswith("acceptance.json") or "evals" not in path:
                continue
            label = drafter_label(path)
            for r in fig["per_set"]:
                if r.get("measured") == "simulated" or r["method"] in ("baseline",):
                    continue
                key = (label if r["method"] != "ngram" else "ngram", r["prompt_set"], r["draft_tokens"],
                       float(r["temperature"]))
                rows[key] = r["acceptance_length"]
                print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:g} | {r['acceptance_length']:.3f} | "
                      f"{r.get('requests')} |")
    trainers: dict[tuple, list[float]] = {}
    for (label, ps, k, t), tau in rows.items():
        trainer = label.rsplit("-s", 1)[0]
        trainers.setdefault((trainer, ps, k, t), []).append(tau)
    print()
    for (trainer, ps, k, t), taus in sorted(trainers.items()):
        spread = f" ± {statistics.stdev(taus):.3f}" if len(taus) > 1 else ""
        print(f"| {trainer} | {ps} | {k} | {t:g} | {statistics.mean(taus):.3f}{spread} | n={len(taus)} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("dflash-variant", help="print a DFlash variant's train.dflash overrides (JSON)")
    v.add_argument("name", choices=sorted(DFLASH_VARIANTS))
    ev = sub.add_parser("eagle3-variant", help="print an EAGLE-3 variant's trainer and quality_compare arguments")
    ev.add_argument("name", choices=sorted(EAGLE3_VARIANTS))
    c = sub.add_parser("configs")
    c.add_argument("--work", type=Path, required=True)
    c.add_argument("--model", type=Path, required=True, help="the converted HF folder")
    c.add_argument("--data", type=Path, required=True, help="the carried data files")
    c.add_argument("--tiny", action="store_true")
    c.add_argument("--regenerated", type=Path,
                   help="conversations an earlier call regenerated (regenerated.jsonl.gz): train on them as they are")
    c.add_argument("--override", action="append", default=[], metavar="KEY.PATH=JSON")
    q = sub.add_parser("ppl")
    q.add_argument("--results", type=Path, required=True)
    h = sub.add_parser("heldout")
    h.add_argument("--model", type=Path, default=REPO / "real" / "smollm2-135m-instruct")
    h.add_argument("--sharegpt", type=Path, default=REPO / "real" / "data" / "sharegpt.json")
    h.add_argument("--records", type=int, default=100)
    h.add_argument("--max-len", type=int, default=1024)
    n = sub.add_parser("neighbours")
    n.add_argument("--model", type=Path, default=REPO / "real" / "smollm2-135m-instruct")
    n.add_argument("--questions", type=Path, default=REPO / "real" / "data" / "mtbench_question.jsonl")
    n.add_argument("--aux", type=int, nargs="+", default=[1, 14, 26])
    n.add_argument("--prompts", type=int, default=8)
    lk = sub.add_parser("lookup", help="prompt lookup's teacher-forced τ on conversation files' last answers")
    lk.add_argument("conversations", type=Path, nargs="+", help="conversation .jsonl[.gz] files (the same ids)")
    lk.add_argument("--model", type=Path, default=REPO / "real" / "smollm2-135m-instruct")
    lk.add_argument("--k", type=int, nargs="+", default=[3, 5, 7])
    lk.add_argument("--records", type=int, default=1000, help="the first N shared ids, sorted")
    lk.add_argument("--cap", type=int, default=250, help="answers at least this long count as cut at max_new_tokens")
    lk.add_argument("--max-answer", type=int, default=10**9, help="only each answer's first this many tokens")
    lk.add_argument("--loop", type=int, default=16, help="an answer loops if a run of this many tokens comes back")
    fu = sub.add_parser("followups", help="kept one-turn conversations continued by ShareGPT's second user turn, "
                        "answered by the target through a served endpoint")
    fu.add_argument("--base", type=Path, default=REPO / "bench" / "data" / "smollm2_sharegpt_regenerated.jsonl.gz")
    fu.add_argument("--sharegpt", type=Path, default=REPO / "real" / "data" / "sharegpt.json")
    fu.add_argument("--model", type=Path, default=REPO / "real" / "smollm2-135m-instruct")
    fu.add_argument("--endpoint", default="http://127.0.0.1:8123/v1")
    fu.add_argument("--served-model", default="smol")
    fu.add_argument("--out", type=Path, required=True, help="a .jsonl, appended to")
    fu.add_argument("--max-chars", type=int, default=4000, help="the longest second turn kept (as the first turns)")
    fu.add_argument("--max-new-tokens", type=int, default=256, help="as the kept first answers")
    fu.add_argument("--temperature", type=float, default=0.7, help="as the kept first answers")
    fu.add_argument("--concurrency", type=int, default=256, help="requests in flight")
    fu.add_argument("--chunk", type=int, default=1024, help="requests written together (a chunk's last ones run "
                    "with few beside them, so make it several times --concurrency)")
    fu.add_argument("--limit", type=int, default=10**9, help="answer at most this many in all")
    fu.add_argument("--merged", type=Path,
                    help="also write --base with the answered conversations in place (.jsonl.gz)")
    mx = sub.add_parser("mix", help="one conversations file with another's answers for the ids both hold")
    mx.add_argument("--base", type=Path, required=True)
    mx.add_argument("--answers", type=Path, required=True)
    mx.add_argument("--share", type=float, default=1.0, help="replace among the first this share of --base's records")
    mx.add_argument("--out", type=Path, required=True, help="a .jsonl.gz")
    vc = sub.add_parser("vocab-coverage", help="the eval split's loss tokens inside the draft vocabulary, per size")
    vc.add_argument("--results", type=Path, required=True, help="a run's results/ (merged/train.jsonl, eval.jsonl)")
    vc.add_argument("--target", type=Path, default=REPO / "real" / "smollm2-135m-instruct")
    vc.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 24576, 32000, 49152])
    vc.add_argument("--answers", type=Path, help="--base's prompts answered another way (the same ids): one more row")
    vc.add_argument("--base", type=Path, default=REPO / "bench" / "data" / "smollm2_sharegpt_regenerated.jsonl.gz",
                    help="the conversations the run was given as --dataset (REGENERATED)")
    vc.add_argument("--dataset", default="sharegpt_regen", help="--base's dataset name in the config")
    e = sub.add_parser("evalqueue")
    e.add_argument("--work", type=Path, required=True)
    e.add_argument("--seconds", type=float, required=True, help="kill what still runs after this long")
    e.add_argument("--jobs", type=int, default=14)
    e.add_argument("--jobs-training", type=int, default=4, help="at most this many while --training-flag exists")
    e.add_argument("--training-flag", type=Path)
    e.add_argument("--sets", nargs="+", default=["mtbench", "gsm8k", "humaneval"])
    e.add_argument("--temps", nargs="+", type=float, default=[0, 1])
    e.add_argument("--device", default="cuda")
    e.add_argument("--prompt-lookup-with", default="dflash-s0", help="the one drafter label whose jobs measure prompt lookup")
    e.add_argument("--only", nargs="*", default=[], help="evaluate only these drafter labels (default: every trained one)")
    o = sub.add_parser("collect")
    o.add_argument("--work", type=Path, required=True)
    o.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table")
    t.add_argument("figures", nargs="+")
    k = sub.add_parser("pack-drafter", help="a trained drafter as 15 MiB pieces, to return from a device call")
    k.add_argument("--work", type=Path, required=True)
    k.add_argument("--label", required=True, help="as `table` names it: ours-s0, dflash-s0, dflash-l5-dpace-s0, …")
    k.add_argument("--out", type=Path, required=True)
    m = sub.add_parser("import-drafters", help="unpack carried drafter pieces where evalqueue finds them")
    m.add_argument("--work", type=Path, required=True)
    m.add_argument("--source", type=Path, required=True)
    a = p.parse_args(argv)
    {"configs": configs, "ppl": ppl, "heldout": heldout, "neighbours": neighbours, "lookup": lookup, "mix": mix,
     "followups": followups,
     "vocab-coverage": vocab_coverage, "collect": collect, "table": table,
     "evalqueue": evalqueue, "dflash-variant": lambda a: print(json.dumps(DFLASH_VARIANTS[a.name])),
     "eagle3-variant": lambda a: print(" ".join(EAGLE3_VARIANTS[a.name])),
     "pack-drafter": pack_drafter, "import-drafters": import_drafters}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
