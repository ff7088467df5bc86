"""Acceptance-length evaluation: simulated (teacher forced) against real speculative decoding,
and the `draftflow evaluate` stage end to end on a tiny target saved to disk."""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest
import torch

from draftflow.cli import main as cli_main
from draftflow.evaluation.evaluate import SimulatedAcceptance, chain_lengths, simulate
from draftflow.evaluation.speculative import AcceptanceStats, Eagle3Proposer, Target, greedy_decode, speculative_decode
from draftflow.drafters.ttt import TargetHead, summarize, ttt_loss
from test_speculative import AUX, one_thread, random_prompts, tiny_drafter, tiny_target  # noqa: F401 (fixture)

NEW = 40  # generated tokens per prompt
K = 4


def capture(model, ids: list[int]) -> torch.Tensor:
    """[T, L, H]: the aux layers' outputs and the final post-norm state, as extraction stores them."""
    target = Target(model, AUX)
    try:
        _, aux = target.forward(ids, capture=True)
    finally:
        target.close()
    with torch.no_grad():
        final = model.model.norm(model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0])
    return torch.cat([aux, final[:, None]], dim=1)


def train_briefly(drafter, model, steps: int = 150, seed: int = 5) -> None:
    """A short TTT run on random token sequences (the target's own states and argmax as labels):
    enough for non-trivial acceptance on this mostly-bigram target."""
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, model.config.vocab_size, (48,), generator=g) for _ in range(64)]
    states = [capture(model, x.tolist()) for x in data]
    head = TargetHead(model.lm_head.weight, drafter.t2d)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-2)
    drafter.train()
    for step in range(steps):
        i = (step * 4) % len(data)
        ids, h = torch.stack(data[i : i + 4]), torch.stack(states[i : i + 4])
        result = ttt_loss(drafter, ids, torch.ones_like(ids), h[:, :, :-1], head(h[:, :, -1]), K)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
    drafter.eval()


@pytest.fixture(scope="module")
def trained():
    """A mostly-bigram float64 target, a briefly trained drafter, and eval samples that are the
    target's own greedy continuations of random prompts (loss mask on the continuation)."""
    model = tiny_target(attn_scale=0.02)
    drafter = tiny_drafter(model, std=0.02)
    start = time.perf_counter()
    train_briefly(drafter, model)
    print(f"training: {time.perf_counter() - start:.1f} s")
    target = Target(model, AUX)
    prompts = random_prompts(12, model.config.vocab_size, seed=7)
    references = [greedy_decode(target, p, NEW, set()) for p in prompts]
    samples = []
    for p, ref in zip(prompts, references):
        ids = p + ref.tokens
        samples.append((torch.tensor(ids), torch.tensor([0] * len(p) + [1] * len(ref.tokens)), capture(model, ids)))
    head = TargetHead(model.lm_head.weight, drafter.t2d)
    yield model, drafter, target, head, prompts, references, samples
    target.close()


def test_simulated_chains_replay_real_decoding_exactly(trained):
    """On greedy data, the teacher-forced chain of every anchor the real decoder visits is exactly
    the number of drafts the real verify step accepts (capped by K and the token budget)."""
    model, drafter, target, head, prompts, references, samples = trained
    proposer = Eagle3Proposer(drafter)
    checked = 0
    for prompt, ref, (ids, mask, hidden) in zip(prompts, references, samples):
        chain, _ = chain_lengths(drafter, head, ids, mask, hidden, K)
        out = speculative_decode(target, proposer, prompt, K, NEW, set())
        assert out.tokens == ref.tokens
        anchor, emitted = len(prompt) - 1, 1  # row of the state before the first generated token
        for proposed, accepted in zip(out.proposed, out.accepted):
            assert proposed == min(K, NEW - emitted - 1)
            assert accepted == min(int(chain[anchor]), proposed)
            anchor, emitted = anchor + accepted + 1, emitted + accepted + 1
            checked += 1
    assert checked > 3 * len(prompts)


@pytest.mark.parametrize("k", [1, K, 7])
def test_batched_decoding_is_each_request_decoded_alone(trained, k):
    """evaluate.batch_size: the 12 prompts (lengths 3-11: padded rows) decoded in one batch give
    every request's tokens, drafts proposed and accepted per verify step exactly as decoding it alone;
    an EOS ends one row while the others go on."""
    from draftflow.evaluation.batched import BatchedEagle3Proposer, BatchedTarget, batched_speculative_decode

    model, drafter, target, _, prompts, references, _ = trained
    eos = {references[0].tokens[len(references[0].tokens) // 2]}  # a token that ends some requests early
    alone = [speculative_decode(target, Eagle3Proposer(drafter), p, k, NEW, eos) for p in prompts]
    batched_target = BatchedTarget(model, AUX)
    try:
        together = batched_speculative_decode(batched_target, BatchedEagle3Proposer(drafter, len(prompts)), prompts,
                                              k, NEW, eos)  # fmt: skip
    finally:
        batched_target.close()
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert [(o.proposed, o.accepted) for o in together] == [(o.proposed, o.accepted) for o in alone]
    assert len({len(o.tokens) for o in alone}) > 1  # rows ended at different steps
    assert sum(map(sum, (o.accepted for o in alone))) > 2 * len(prompts)  # the drafter's chains were used


def _accepted_draft(out) -> tuple[int, int] | None:
    """(index, token) of the first token of `out` that a verify step accepted as its second or a
    later draft (so an EOS there keeps two or more of the step's tokens and drops the rest) and that
    does not occur earlier in the output."""
    pos = 1  # tokens[0] comes from the prefill
    for proposed, accepted in zip(out.proposed, out.accepted):
        for i in range(pos + 1, pos + accepted):
            if out.tokens[i] not in out.tokens[:i]:
                return i, out.tokens[i]
        pos += accepted + 1
    return None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_decoding_ends_a_row_on_an_accepted_draft(trained, temperature):
    """An EOS accepted as a draft ends its row mid-chain (the tokens after it are dropped) while the
    other rows go on: each request still decodes as it does alone (2026-12-05, H100: this case
    stopped every MT-bench evaluation with a shape error in the proposer)."""
    from draftflow.evaluation.batched import BatchedEagle3Proposer, BatchedTarget, RowSampling, batched_speculative_decode
    from draftflow.evaluation.speculative import speculative_sample

    model, drafter, target, _, prompts, _, _ = trained
    generators = lambda: [torch.Generator().manual_seed(500 + i) for i in range(len(prompts))]  # noqa: E731

    def alone(eos: set[int]):
        if temperature == 0:
            return [speculative_decode(target, Eagle3Proposer(drafter), p, K, NEW, eos) for p in prompts]
        return [speculative_sample(target, Eagle3Proposer(drafter), p, K, NEW, eos, temperature, g)
                for p, g in zip(prompts, generators())]  # fmt: skip

    row, (index, eos_token) = next((r, found) for r, o in enumerate(alone(set())) if (found := _accepted_draft(o)))
    eos = {eos_token}
    expected = alone(eos)
    assert len(expected[row].tokens) == index + 1  # the row ends on that draft, the rest of its chain cut
    assert max(len(o.proposed) for o in expected) > len(expected[row].proposed)  # other rows go on after it
    batched_target = BatchedTarget(model, AUX)
    try:
        rows = None if temperature == 0 else RowSampling(temperature, generators())
        together = batched_speculative_decode(batched_target, BatchedEagle3Proposer(drafter, len(prompts)), prompts,
                                              K, NEW, eos, rows)  # fmt: skip
    finally:
        batched_target.close()
    assert [o.tokens for o in together] == [o.tokens for o in expected]
    assert [(o.proposed, o.accepted) for o in together] == [(o.proposed, o.accepted) for o in expected]


@pytest.mark.parametrize("k", [1, K])
def test_batched_sampling_is_each_request_sampled_alone(trained, k):
    """Speculative sampling at T = 1, batched: each row draws from its own generator in the order a
    lone request draws, so every request's tokens and acceptance equal `speculative_sample`'s."""
    from draftflow.evaluation.batched import BatchedEagle3Proposer, BatchedTarget, RowSampling, batched_speculative_decode
    from draftflow.evaluation.speculative import speculative_sample

    model, drafter, target, _, prompts, _, _ = trained
    generators = lambda: [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]  # noqa: E731
    alone = [speculative_sample(target, Eagle3Proposer(drafter), p, k, NEW, set(), 1.0, g)
             for p, g in zip(prompts, generators())]  # fmt: skip
    batched_target = BatchedTarget(model, AUX)
    try:
        together = batched_speculative_decode(batched_target, BatchedEagle3Proposer(drafter, len(prompts)), prompts,
                                              k, NEW, set(), RowSampling(1.0, generators()))  # fmt: skip
    finally:
        batched_target.close()
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert [(o.proposed, o.accepted) for o in together] == [(o.proposed, o.accepted) for o in alone]
    assert sum(map(sum, (o.accepted for o in alone))) > len(prompts)  # drafts were accepted, and rejected:
    assert any(a < p for o in alone for p, a in zip(o.proposed, o.accepted))  # both branches of the test ran


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_prompt_lookup_is_each_request_decoded_alone(trained, temperature):
    """Prompt lookup, batched: rows propose different numbers of drafts (none where no n-gram
    recurs), and each request's tokens and acceptance equal decoding it alone, greedy and sampled."""
    from draftflow.evaluation.batched import BatchedNgramProposer, BatchedTarget, RowSampling, batched_speculative_decode
    from draftflow.evaluation.speculative import NgramProposer, speculative_sample

    model, _, target, _, prompts, references, _ = trained
    eos = {references[0].tokens[len(references[0].tokens) // 2]}
    generators = lambda: [torch.Generator().manual_seed(300 + i) for i in range(len(prompts))]  # noqa: E731
    if temperature == 0:
        alone = [speculative_decode(target, NgramProposer(), p, K, NEW, eos) for p in prompts]
        rows = None
    else:
        alone = [speculative_sample(target, NgramProposer(), p, K, NEW, eos, temperature, g)
                 for p, g in zip(prompts, generators())]  # fmt: skip
        rows = RowSampling(temperature, generators())
    batched_target = BatchedTarget(model, AUX)
    try:
        together = batched_speculative_decode(batched_target, BatchedNgramProposer(NgramProposer()), prompts, K, NEW,
                                              eos, rows)  # fmt: skip
    finally:
        batched_target.close()
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert [(o.proposed, o.accepted) for o in together] == [(o.proposed, o.accepted) for o in alone]
    proposed = {n for o in alone for n in o.proposed}
    assert 0 in proposed and len(proposed) > 2, proposed  # rows of one step verify different numbers of drafts
    assert sum(map(sum, (o.accepted for o in alone))) > 0


def test_batched_reference_is_each_request_decoded_alone(trained):
    """The plain reference decode, batched: greedy rows equal `greedy_decode` (an EOS ends some rows
    early), sampled rows equal `sample_decode` with the same generators."""
    from draftflow.evaluation.batched import BatchedTarget, RowSampling, batched_reference
    from draftflow.evaluation.speculative import sample_decode

    model, _, target, _, prompts, references, _ = trained
    eos = {references[0].tokens[len(references[0].tokens) // 2]}
    generators = lambda: [torch.Generator().manual_seed(200 + i) for i in range(len(prompts))]  # noqa: E731
    greedy_alone = [greedy_decode(target, p, NEW, eos).tokens for p in prompts]
    sampled_alone = [sample_decode(target, p, NEW, eos, 1.0, g).tokens for p, g in zip(prompts, generators())]
    batched_target = BatchedTarget(model, AUX)
    try:
        greedy_together = [o.tokens for o in batched_reference(batched_target, prompts, NEW, eos)]
        sampled_together = [o.tokens for o in batched_reference(batched_target, prompts, NEW, eos,
                                                                RowSampling(1.0, generators()))]  # fmt: skip
    finally:
        batched_target.close()
    assert greedy_together == greedy_alone and sampled_together == sampled_alone
    assert len({len(t) for t in greedy_alone}) > 1 and sampled_alone != greedy_alone


def test_simulated_acceptance_is_what_training_reports(trained):
    """`simulate` counts chains as draftflow.drafters.ttt does: same α per step on the same samples."""
    model, drafter, target, head, prompts, references, samples = trained

    class Reader(list):  # the HiddenStateReader interface simulate() uses: len and samples
        pass

    from draftflow.hidden_states.storage import Sample

    reader = Reader(Sample(ids.numpy(), mask.numpy().astype(np.uint8), h) for ids, mask, h in samples)
    sim = simulate(drafter, head, reader, K)
    stats = None
    with torch.no_grad():
        for ids, mask, h in samples:
            r = ttt_loss(drafter, ids[None], mask[None], h[None, :, :-1], head(h[None, :, -1]), K)
            stats = r.stats if stats is None else stats + r.stats
    expected = summarize(stats, 0.8)
    assert sim.alpha == pytest.approx(expected["step_alpha"], abs=1e-12)
    assert sim.tau == pytest.approx(expected["tau"], abs=1e-12)


def test_simulated_and_real_acceptance_length_agree(trained):
    """Simulated τ counts every anchor, real τ only the anchors the decoder visits; on greedy
    data each visited anchor accepts exactly its simulated chain (test above), so the two differ
    only by which anchors are sampled. With 12 prompts × 40 tokens that sampling difference
    stays within 0.2 tokens here (and 12% relative); a drafter that is worse at inference than
    in teacher forcing (e.g. a cache bug) falls outside it."""
    model, drafter, target, head, prompts, references, samples = trained
    sim = SimulatedAcceptance(K)
    for ids, mask, h in samples:
        sim.add(*chain_lengths(drafter, head, ids, mask, h, K))
    real = AcceptanceStats(K)
    for prompt in prompts:
        real.add(speculative_decode(target, Eagle3Proposer(drafter), prompt, K, NEW, set()))
    print(f"τ simulated {sim.tau:.3f} α {sim.alpha}; real {real.tau:.3f} α {real.alpha}")
    assert sim.alpha[0] > 0.3 and real.alpha[0] > 0.3  # non-trivial acceptance
    assert 1.0 <= real.tau <= K + 1
    assert abs(sim.tau - real.tau) <= 0.2
    assert abs(sim.tau - real.tau) <= 0.12 * real.tau


# ---------------------------------------------------------------- the stage, end to end


def write_eval_split(tmp_path, model, records: list[tuple[list[int], list[int]]]):
    """eval.jsonl plus one extracted range folder holding the records' hidden states."""
    from draftflow.jsonl import write_jsonl
    from draftflow.hidden_states.storage import SampleStore, encode_sample, sample_key, write_range_index

    rows = [
        {"id": f"s{i}", "dataset": "d", "input_ids": ids, "loss_mask": mask} for i, (ids, mask) in enumerate(records)
    ]
    write_jsonl(tmp_path / "merged" / "eval.jsonl", rows)
    store = SampleStore(tmp_path / "hs" / "store")
    entries = []
    for i, (ids, mask) in enumerate(records):
        key = sample_key("test", ids)
        put = store.put(key, encode_sample(ids, mask, capture(model, ids).to(torch.bfloat16)))
        entries.append(put.entry(f"s{i}", key))
    range_dir = tmp_path / "hs" / "eval" / f"rows_0-{len(records)}"
    meta = {"settings_digest": "test", "store_root": str(tmp_path / "hs" / "store"), "num_layers_captured": 4,
            "hidden_size": model.config.hidden_size, "aux_layer_ids": AUX}  # fmt: skip
    write_range_index(range_dir, entries, meta)
    return range_dir


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory):
    """A saved tiny target with a Llama-3-style tokenizer, a saved drafter, an eval split."""
    from helpers_tokenizers import build_fast_tokenizer

    from draftflow.drafters.checkpoint import save_drafter

    tmp = tmp_path_factory.mktemp("evaluate")
    tokenizer = build_fast_tokenizer("llama3")
    model = tiny_target(vocab=len(tokenizer), attn_scale=0.02, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    model.save_pretrained(tmp / "target")
    tokenizer.save_pretrained(tmp / "target")
    save_drafter(tiny_drafter(model, dtype=torch.float32), tmp / "drafter", dtype=torch.float32)
    records = []
    for i, prompt in enumerate(["Hello there!", "What is the weather in Paris?", "Get the weather in a city."]):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
        answer = random_prompts(1, len(tokenizer), seed=i, min_len=10, max_len=20)[0]
        records.append((ids + answer, [0] * len(ids) + [1] * len(answer)))
    range_dir = write_eval_split(tmp, model, records)
    (tmp / "prompts.txt").write_text("The quick brown fox\n\nHow can I help you today?\n")
    return tmp, range_dir, records


def run_stage(tmp, range_dir, state_dir=None, **overrides) -> int:
    settings = {
        "draft_tokens": [3, 2], "max_prompts": 4, "max_new_tokens": 12, "prompts_file": str(tmp / "prompts.txt"),
        "ngram_max": 3, "device": "cpu", "aux_layer_ids": AUX, **overrides,
    }  # fmt: skip
    state = ["--state-dir", str(state_dir)] if state_dir else []
    return cli_main([
        "evaluate", "--drafter", str(tmp / "drafter"), "--target", str(tmp / "target"),
        "--eval-ranges", str(range_dir), "--eval-data", str(tmp / "merged" / "eval.jsonl"),
        "--settings", json.dumps(settings), "--output-dir", str(tmp / "eval"), *state,
    ])  # fmt: skip


def test_evaluate_stage_writes_acceptance_json_and_csv(stage_inputs):
    tmp, range_dir, records = stage_inputs
    assert run_stage(tmp, range_dir) == 0
    report = json.loads((tmp / "eval" / "acceptance.json").read_text())
    # prompt sets: the prompts file (a set named `file`, first), then the eval split, max_prompts each
    assert report["prompts"] == {"count": 5, "from_file": 2, "from_eval": 3}
    assert set(report["prompt_sets"]) == {"file", "eval"}
    assert report["acceptance_length"] == report["eagle3"]["3"]["acceptance_length"]
    assert 1.0 <= report["acceptance_length_simulated"] <= 4.0
    assert report["simulated"]["draft_tokens"] == 3 and report["simulated"]["samples"] == len(records)
    for method in ("eagle3", "ngram"):
        for k in (2, 3):
            r = report[method][str(k)]
            assert 1.0 <= r["acceptance_length"] <= k + 1
            assert len(r["alpha"]) == k and r["prompts"] == 5
            assert r["matches_greedy"] == 5  # float32 here: no argmax ties on this model
            assert r["generated_tokens"] == report["greedy"]["generated_tokens"]
            assert r["speedup"] > 0
    assert report["settings"]["draft_tokens"] == [3, 2] and report["aux_layer_ids"] == AUX
    # the per-set table adds up to the pooled figures
    rows = [r for r in report["per_set"] if r["method"] == "eagle3" and r["draft_tokens"] == 3 and r["measured"] == "real"]
    assert [r["prompt_set"] for r in rows] == ["file", "eval"]
    sim = [r for r in report["per_set"] if r["measured"] == "simulated"]
    assert [(r["prompt_set"], r["draft_tokens"], r["temperature"]) for r in sim] == [("eval", 3, 0.0)]
    assert sim[0]["acceptance_length"] == report["acceptance_length_simulated"]
    steps = sum(r["verify_steps"] for r in rows)
    assert steps == report["eagle3"]["3"]["verify_steps"]
    assert sum(r["acceptance_length"] * r["verify_steps"] for r in rows) / steps == pytest.approx(
        report["acceptance_length"], abs=1e-12)  # fmt: skip
    with open(tmp / "eval" / "acceptance.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["prompt_set"], r["method"], r["measured"], r["draft_tokens"]) for r in rows[:5]] == [
        ("eval", "eagle3", "simulated", "3"), ("all", "eagle3", "real", "2"), ("all", "eagle3", "real", "3"),
        ("all", "ngram", "real", "2"), ("all", "ngram", "real", "3"),
    ]  # fmt: skip
    assert float(rows[2]["acceptance_length"]) == pytest.approx(report["acceptance_length"], abs=1e-4)
    assert rows[1]["alpha_3"] == "" and rows[2]["alpha_3"] != ""
    assert {(r["prompt_set"], r["method"]) for r in rows[5:]} == {
        (s, m) for s in ("file", "eval") for m in ("baseline", "eagle3", "ngram")}  # fmt: skip


def test_evaluate_without_prompt_lookup_decodes_the_drafter_alone(stage_inputs, tmp_path):
    """evaluate.prompt_lookup false: no n-gram decoding (no rows, no outputs, an empty report entry),
    and the drafter's figures are those of a run that measured the baseline too."""
    tmp, range_dir, _ = stage_inputs
    assert run_stage(tmp, range_dir, draft_tokens=[2]) == 0
    both = json.loads((tmp / "eval" / "acceptance.json").read_text())
    assert run_stage(tmp, range_dir, tmp_path / "state", draft_tokens=[2], prompt_lookup=False) == 0
    alone = json.loads((tmp / "eval" / "acceptance.json").read_text())
    outputs = [json.loads(line) for line in (tmp / "eval" / "outputs.jsonl").read_text().splitlines()]
    assert both["ngram"] and alone["ngram"] == {}
    assert {r["method"] for r in alone["per_set"]} == {"baseline", "eagle3"}
    assert {o["method"] for o in outputs} == {"greedy", "eagle3"}

    def drafter_figures(report):
        return {k: {f: v[f] for f in ("acceptance_length", "alpha", "verify_steps", "matches_greedy")}
                for k, v in report["eagle3"].items()}  # fmt: skip

    assert drafter_figures(alone) == drafter_figures(both)
    assert alone["acceptance_length_simulated"] == both["acceptance_length_simulated"]


def test_evaluate_batched_reports_what_one_at_a_time_does(stage_inputs, tmp_path):
    """evaluate.batch_size 4 on the stage, greedy and sampled: the same τ, α, verify steps and greedy
    matches per K, prompt set and temperature as batch 1; outputs.jsonl recounts to its rows."""
    tmp, range_dir, _ = stage_inputs
    both = {"prompt_lookup": False, "temperatures": [0.0, 1.0]}
    assert run_stage(tmp, range_dir, **both) == 0
    alone = json.loads((tmp / "eval" / "acceptance.json").read_text())
    assert run_stage(tmp, range_dir, tmp_path / "state", batch_size=4, **both) == 0
    batched = json.loads((tmp / "eval" / "acceptance.json").read_text())
    outputs = [json.loads(line) for line in (tmp / "eval" / "outputs.jsonl").read_text().splitlines()]

    def figures(report):
        return [(r["prompt_set"], r["temperature"], r["draft_tokens"], r["acceptance_length"], r["alpha"], r["verify_steps"],
                 r.get("matches_greedy")) for r in report["per_set"] if r["method"] == "eagle3" and r["measured"] == "real"]  # fmt: skip

    assert figures(batched) == figures(alone)
    assert batched["settings"]["batch_size"] == 4 and alone["eagle3"]["3"]["prompts"] == 5
    assert len(figures(alone)) == 8  # 2 sets x 2 K x 2 temperatures
    assert check_against_outputs(batched, outputs) == 4 and check_against_outputs(batched, outputs, 1.0) == 4


def recount(outputs: list[dict], prompt_set: str, method: str, k: int) -> tuple[float, list[float], int]:
    """τ, α and verify steps counted by hand from the decoded outputs: tokens emitted by verify
    steps (all but the prefill's first) per verify step; α_i over steps that reached draft i."""
    mine = [o for o in outputs if o["prompt_set"] == prompt_set and o["method"] == method and o["draft_tokens"] == k]
    steps = sum(len(o["accepted"]) for o in mine)
    emitted = sum(len(o["tokens"]) - 1 for o in mine)
    reached, accepted = [0] * k, [0] * k
    for o in mine:
        for p, a in zip(o["proposed"], o["accepted"]):
            for i in range(min(p, a + 1)):
                reached[i] += 1
                accepted[i] += i < a
    return emitted / steps, [a / r if r else 0.0 for a, r in zip(accepted, reached)], steps


def check_against_outputs(report: dict, outputs: list[dict], temperature: float = 0.0) -> int:
    """Every drafter (eagle3 / dflash) and n-gram row of the per-set table equals a recount from
    outputs.jsonl, and (greedy) every decoded output equals the greedy reference of the same request."""
    report = {**report, "per_set": [r for r in report["per_set"] if r["temperature"] == temperature]}
    outputs = [o for o in outputs if o["temperature"] == temperature]
    checked = 0
    for row in report["per_set"]:
        if row["method"] in ("eagle3", "dflash", "ngram") and row["measured"] == "real":
            tau, alpha, steps = recount(outputs, row["prompt_set"], row["method"], row["draft_tokens"])
            assert row["verify_steps"] == steps
            assert row["acceptance_length"] == pytest.approx(tau, abs=1e-12)
            assert row["alpha"] == pytest.approx(alpha, abs=1e-12)
            checked += 1
    greedy = {(o["prompt_set"], o["source"], o["turn"]): o["tokens"] for o in outputs if o["method"] == "greedy"}
    for o in outputs:
        if o["method"] not in ("greedy", "sampled"):
            if temperature == 0:
                assert o["tokens"] == greedy[(o["prompt_set"], o["source"], o["turn"])]
            assert sum(o["accepted"]) + len(o["accepted"]) == len(o["tokens"]) - 1
    return checked


def test_per_set_table_recounts_from_decoded_outputs_and_resumes_per_set(stage_inputs, tmp_path):
    """Benchmark sets (HumanEval from the package, MT-bench with both turns, GSM8K few-shot, any
    JSONL): the per-set τ equals a recount from outputs.jsonl, and a rerun with the same state
    folder measures nothing again (one set's state removed: only that set is measured)."""
    tmp, range_dir, _ = stage_inputs
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": 81 + i, "category": "writing", "turns": [a, b]}) + "\n"
                                 for i, (a, b) in enumerate([("Write a haiku.", "Now make it rhyme."),
                                                             ("Name a city.", "Why that one?")])))  # fmt: skip
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}. #### {2 * i}"})
                           + "\n" for i in range(4)))  # fmt: skip
    anything = tmp_path / "mine.jsonl"
    anything.write_text(json.dumps({"text": "Hello"}) + "\n" + json.dumps(
        {"text": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}) + "\n")  # fmt: skip
    sets = {
        "eval": {"kind": "eval", "max_prompts": 2},
        "humaneval": {"kind": "humaneval", "max_prompts": 2},
        "mtbench": {"kind": "mtbench", "path": str(questions), "turns": 2},
        "gsm8k": {"kind": "gsm8k", "path": str(gsm), "few_shot": 2},
        "mine": {"kind": "jsonl", "path": str(anything), "field": "text"},
    }
    state = tmp_path / "state"
    assert run_stage(tmp, range_dir, state, prompts_file=None, prompt_sets=sets, draft_tokens=[2]) == 0
    report = json.loads((tmp / "eval" / "acceptance.json").read_text())
    outputs = [json.loads(line) for line in (tmp / "eval" / "outputs.jsonl").read_text().splitlines()]
    assert report["prompt_sets"]["mtbench"] == {"kind": "mtbench", "prompts": 2, "requests": 4, "skipped_too_long": 0}
    assert report["prompt_sets"]["gsm8k"]["prompts"] == 2  # 4 records, 2 used as shots
    assert report["prompt_sets"]["humaneval"]["prompts"] == 2
    assert {o["turn"] for o in outputs if o["prompt_set"] == "mtbench"} == {1, 2}
    assert check_against_outputs(report, outputs) == 2 * len(sets)
    assert [o["source"] for o in outputs if o["prompt_set"] == "humaneval" and o["method"] == "greedy"] == [
        "humaneval:HumanEval/0", "humaneval:HumanEval/1"]  # fmt: skip

    files = sorted(state.rglob("*.json"))
    assert len(files) == len(sets)
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    gsm_state = next(f for f in files if f.name.startswith("gsm8k."))
    gsm_state.unlink()
    (tmp / "eval" / "acceptance.json").unlink()
    assert run_stage(tmp, range_dir, state, prompts_file=None, prompt_sets=sets, draft_tokens=[2]) == 0
    assert {f: f.stat().st_mtime_ns for f in files if f != gsm_state} == {f: t for f, t in mtimes.items() if f != gsm_state}
    again = json.loads((tmp / "eval" / "acceptance.json").read_text())
    kept = [r for r in again["per_set"] if r["prompt_set"] != "gsm8k"]
    assert kept == [r for r in report["per_set"] if r["prompt_set"] != "gsm8k"]  # reloaded, not re-measured
    assert gsm_state.is_file()


def test_evaluate_measures_speculative_sampling_at_each_temperature(stage_inputs, tmp_path, capsys):
    """evaluate.temperatures [0, 1] on the hf engine: per temperature, real τ by speculative
    sampling (recounted from outputs.jsonl) and the expected simulated τ, in the per-set table;
    the same seed draws the same outputs, another seed others; greedy rows do not depend on it."""
    tmp, range_dir, records = stage_inputs
    sets = {"eval": {"kind": "eval", "max_prompts": 2}}
    common = dict(prompts_file=None, prompt_sets=sets, draft_tokens=[2], temperatures=[0.0, 1.0])

    def measure(seed: int) -> tuple[dict, list[dict]]:
        assert run_stage(tmp, range_dir, tmp_path / f"state{seed}", seed=seed, **common) == 0
        report = json.loads((tmp / "eval" / "acceptance.json").read_text())
        outputs = [json.loads(line) for line in (tmp / "eval" / "outputs.jsonl").read_text().splitlines()]
        return report, outputs

    report, outputs = measure(3)
    assert set(report["temperatures"]) == {"0", "1"}
    assert report["acceptance_length"] == report["temperatures"]["0"]["acceptance_length"]  # headline: the first
    hot = report["temperatures"]["1"]
    assert 1.0 <= hot["acceptance_length"] <= 3.0 and 1.0 <= hot["acceptance_length_simulated"] <= 3.0
    assert hot["simulated"]["samples"] == len(records) and hot["reference"]["generated_tokens"] > 0
    assert hot["eagle3"]["2"]["matches_greedy"] is None
    # the simulated τ at T = 1 is an expectation (fractional counts), not the greedy chain count
    assert hot["acceptance_length_simulated"] != report["acceptance_length_simulated"]
    rows = {(r["measured"], r["method"], r["temperature"]) for r in report["per_set"]}
    assert rows == {(m, meth, t) for t in (0.0, 1.0) for m, meth in
                    [("real", "baseline"), ("real", "eagle3"), ("real", "ngram"), ("simulated", "eagle3")]}  # fmt: skip
    sim1 = next(r for r in report["per_set"] if r["measured"] == "simulated" and r["temperature"] == 1.0)
    assert sim1["acceptance_length"] == hot["acceptance_length_simulated"]
    assert check_against_outputs(report, outputs, 1.0) == 2 and check_against_outputs(report, outputs, 0.0) == 2
    assert {o["method"] for o in outputs if o["temperature"] == 1.0} == {"sampled", "eagle3", "ngram"}
    with open(tmp / "eval" / "acceptance.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [(r["measured"], r["temperature"]) for r in csv_rows if r["prompt_set"] == "eval" and r["method"] == "eagle3"
            and r["measured"] == "simulated"] == [("simulated", "0.0000"), ("simulated", "1.0000")]  # fmt: skip

    def sampled(outs):
        return [o["tokens"] for o in outs if o["temperature"] == 1.0]

    def greedy_rows(rep):
        return [{k: v for k, v in r.items() if k not in ("seconds", "speedup", "tokens_per_second")}
                for r in rep["per_set"] if r["temperature"] == 0.0]  # fmt: skip

    again, again_out = measure(3)  # a fresh state folder: measured again, same draws
    assert sampled(again_out) == sampled(outputs)
    other, other_out = measure(4)
    assert sampled(other_out) != sampled(outputs)
    assert greedy_rows(other) == greedy_rows(report)
    assert run_stage(tmp, range_dir, temperatures=[1.0, 1.0]) == 1
    assert "must be distinct" in capsys.readouterr().err


def test_evaluate_stage_with_a_dflash_drafter(stage_inputs, tmp_path):
    """A DFlash drafter reading a subset of the stored layers: block decoding equals greedy on
    every prompt; K = the settings' plus the full block; simulated over the eval split."""
    from draftflow.drafters.dflash import DFlashConfig, DFlashDrafter
    from draftflow.drafters.checkpoint import save_drafter

    tmp, range_dir, records = stage_inputs
    config = json.loads((tmp / "target" / "config.json").read_text())
    cfg = DFlashConfig.from_target(config, num_hidden_layers=2, target_layer_ids=[0, 1], block_size=5, mask_token_id=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.3)
    save_drafter(drafter, tmp / "dflash", dtype=torch.float32)
    settings = {"draft_tokens": [3, 2], "max_prompts": 4, "max_new_tokens": 12, "device": "cpu",
                "aux_layer_ids": [0, 1], "temperatures": [0, 1]}  # fmt: skip
    assert cli_main([
        "evaluate", "--drafter", str(tmp / "dflash"), "--target", str(tmp / "target"),
        "--eval-ranges", str(range_dir), "--eval-data", str(tmp / "merged" / "eval.jsonl"),
        "--settings", json.dumps(settings), "--output-dir", str(tmp_path / "eval"),
    ]) == 0  # fmt: skip
    report = json.loads((tmp_path / "eval" / "acceptance.json").read_text())
    assert report["method"] == "dflash" and "eagle3" not in report
    assert report["draft_tokens"] == [2, 3, 4] and report["settings"]["draft_tokens"] == [3, 2]
    assert report["acceptance_length"] == report["dflash"]["4"]["acceptance_length"]
    for k in (2, 3, 4):
        r = report["dflash"][str(k)]
        assert r["matches_greedy"] == r["prompts"] == len(records)  # the eval split's 3 prompts
        assert 1.0 <= r["acceptance_length"] <= k + 1 and len(r["alpha"]) == k
    sim = report["simulated"]
    assert sim["draft_tokens"] == 4 and sim["samples"] == len(records) and sum(sim["trials"]) > 0
    with open(tmp_path / "eval" / "acceptance.csv") as f:
        rows = [(r["method"], r["measured"], r["draft_tokens"]) for r in csv.DictReader(f)]
    assert rows[0] == ("dflash", "simulated", "4") and ("ngram", "real", "4") in rows
    # batched (evaluate.batch_size): the same per-set figures at both temperatures
    assert cli_main([
        "evaluate", "--drafter", str(tmp / "dflash"), "--target", str(tmp / "target"),
        "--eval-ranges", str(range_dir), "--eval-data", str(tmp / "merged" / "eval.jsonl"),
        "--settings", json.dumps({**settings, "batch_size": 2}), "--output-dir", str(tmp_path / "batched"),
    ]) == 0  # fmt: skip
    batched = json.loads((tmp_path / "batched" / "acceptance.json").read_text())

    def figures(rep):
        return [(r["prompt_set"], r["method"], r["temperature"], r["draft_tokens"], r["acceptance_length"], r["alpha"],
                 r.get("verify_steps"), r.get("matches_greedy")) for r in rep["per_set"] if r["method"] != "baseline"]  # fmt: skip

    assert figures(batched) == figures(report)
    # T = 1: speculative sampling with sampled blocks; simulated: the expected acceptance per row
    sampled = report["temperatures"]["1"]
    assert sampled["simulated"]["samples"] == len(records)
    assert sampled["simulated"]["trials"][0] == sim["trials"][0]  # row 1 is a trial at every anchor either way
    assert 1.0 < sampled["acceptance_length_simulated"] < 1.0 + 4
    for k in (2, 3, 4):
        r = sampled["dflash"][str(k)]
        assert r["matches_greedy"] is None and r["prompts"] == len(records)
        assert 1.0 <= r["acceptance_length"] <= k + 1
    simulated_rows = [r for r in report["per_set"] if r.get("measured") == "simulated"]
    assert [r["temperature"] for r in simulated_rows] == [0, 1]


def test_evaluate_refuses_a_drafter_trained_on_other_layers(stage_inputs, capsys):
    tmp, range_dir, _ = stage_inputs
    assert run_stage(tmp, range_dir, aux_layer_ids=[0, 1, 2]) == 1
    assert "reads aux layers [0, 1, 3]" in capsys.readouterr().err


def test_evaluate_dtype_decodes_in_the_dtype_asked(stage_inputs, tmp_path, capsys):
    """evaluate.dtype: auto is float32 on the CPU, bfloat16 is taken as asked (the report says
    which), and a dtype it does not know stops before any model loads, naming the key."""
    tmp, range_dir, _ = stage_inputs
    assert run_stage(tmp, range_dir, tmp_path / "a", draft_tokens=[2], max_prompts=1) == 0
    assert json.loads((tmp / "eval" / "acceptance.json").read_text())["dtype"] == "float32"
    assert run_stage(tmp, range_dir, tmp_path / "b", draft_tokens=[2], max_prompts=1, dtype="bfloat16") == 0
    assert json.loads((tmp / "eval" / "acceptance.json").read_text())["dtype"] == "bfloat16"
    assert run_stage(tmp, range_dir, tmp_path / "c", dtype="fp8") == 1
    assert "evaluate.dtype: 'fp8' is not one of auto, float32, bfloat16, float16" in capsys.readouterr().err


# ---------------------------------------------------------------- report figures


def plot_cli(**kwargs) -> int:
    """`draftflow plot …` through the plots module's own parser (cli.py registers the stage)."""
    import argparse

    from draftflow import plots

    parser = argparse.ArgumentParser()
    plots.configure_parser(parser, "plot")
    argv = [x for k, v in kwargs.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return plots.main(parser.parse_args(argv))


def assert_png(path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)  # [h, w, 4] floats
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # something is drawn on the white canvas


def test_plots_render_from_small_inputs(tmp_path, stage_inputs):
    from draftflow.jsonl import write_json, write_jsonl

    g = np.random.default_rng(0)
    lengths = g.integers(5, 500, 200).tolist()
    records = [
        {"id": str(i), "dataset": f"d{i % 3}", "input_ids": [1] * n, "loss_mask": [1] * n}
        for i, n in enumerate(lengths)
    ]
    write_jsonl(tmp_path / "train.jsonl", records)
    write_json(tmp_path / "manifest.json", {"settings": {"max_seq_len": 512}})
    assert plot_cli(kind="lengths", train_data=tmp_path / "train.jsonl", manifest=tmp_path / "manifest.json",
                    output=tmp_path / "lengths.png") == 0  # fmt: skip
    assert_png(tmp_path / "lengths.png")

    write_json(tmp_path / "plan.json", {"total": {"tokens": 21_000_000, "bytes_raw": 1_344_000_000_000,
               "bytes_expected": 967_680_000_000}, "expected_compression_ratio": 0.72})  # fmt: skip
    write_json(tmp_path / "data_config.json", {"total_tokens": 20_500_000, "bytes_raw": 1_312_000_000_000,
               "bytes_stored": 905_280_000_000, "compression_ratio": 0.69})  # fmt: skip
    assert plot_cli(kind="storage", plan=tmp_path / "plan.json", data_config=tmp_path / "data_config.json",
                    output=tmp_path / "storage.png") == 0  # fmt: skip
    assert_png(tmp_path / "storage.png")

    accuracy = [[min(0.9, s / 400 / (k + 1)) for k in range(7)] for s in range(0, 400, 10)]
    rows = [
        {"kind": "train", "step": s, "loss": 5 / (1 + s / 50), "step_accuracy": a}
        for s, a in zip(range(0, 400, 10), accuracy)
    ]
    rows += [{"kind": "eval", "step": s, "loss": 5 / (1 + s / 60), "step_accuracy": [0.3 / (k + 1) for k in range(7)]}
             for s in (100, 200, 300)]  # fmt: skip
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    assert plot_cli(kind="training", metrics=tmp_path / "metrics.jsonl", output=tmp_path / "training.png") == 0
    assert_png(tmp_path / "training.png")

    # acceptance.json as `draftflow evaluate` writes it (from the stage test above, or run it now)
    tmp, range_dir, _ = stage_inputs
    if not (tmp / "eval" / "acceptance.json").exists():
        assert run_stage(tmp, range_dir) == 0
    assert plot_cli(kind="acceptance", acceptance=tmp / "eval" / "acceptance.json", output=tmp_path / "acc.png") == 0
    assert_png(tmp_path / "acc.png")


def test_plot_reports_missing_inputs(tmp_path):
    from draftflow.errors import DraftflowError

    with pytest.raises(DraftflowError, match="--plan --data-config"):
        plot_cli(kind="storage", output=tmp_path / "x.png")


def test_simulated_acceptance_reads_are_checked(tmp_path):
    """A damaged or missing eval sample stops evaluation naming range, sample and key, or under
    on_bad_sample: skip is left out and counted (no sample here is readable: no model runs)."""
    from draftflow.errors import DraftflowError
    from draftflow.hidden_states.storage import HiddenStateReader, SampleStore
    from test_storage import build_ranges

    hs, samples = build_ranges(tmp_path)
    store = SampleStore(hs / "store")
    for _, key, *_ in samples[:3]:
        data = bytearray(store.get(key))
        data[-2] ^= 0x08
        store.path(key).write_bytes(bytes(data))
    for _, key, *_ in samples[3:]:
        store.delete(key)
    reader = HiddenStateReader([hs / "train" / "rows_0-3", hs / "train" / "rows_3-5"])
    with pytest.raises(DraftflowError, match="have no store file") as err:  # stat before any read
        simulate(None, None, reader, K)
    assert f"{hs / 'train' / 'rows_3-5'}: sample {samples[3][0]}" in str(err.value)
    first = HiddenStateReader([hs / "train" / "rows_0-3"])
    with pytest.raises(DraftflowError) as err:
        simulate(None, None, first, K)
    assert samples[0][0] in str(err.value) and samples[0][1] in str(err.value) and "--repair" in str(err.value)
    result = simulate(None, None, reader, K, on_bad_sample="skip").as_json()
    assert result["samples"] == 0 and result["skipped_samples"] == 5
    assert {s["sample_id"] for s in result["skipped"]} == {s[0] for s in samples}
