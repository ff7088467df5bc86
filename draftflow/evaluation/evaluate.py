"""`draftflow evaluate`: the drafter's acceptance length, simulated and real (DESIGN.md §3).

* **Simulated** (teacher forced): the training-time-test unroll of `draftflow.drafters.ttt` on the eval
  split's stored hidden states. Each row j anchors a chain: step k reads the data token
  x_{j+1+k} and the drafter's own hidden state and must hit the target's argmax z_{j+1+k};
  a step counts where the token it predicts is a loss (assistant) token. α_k = P(step k hits |
  steps < k hit), τ_sim = 1 + Σ_k Π_{j≤k} α_j for K = max(draft_tokens). Where the data is
  the target's own greedy output this is exactly what real decoding would accept from each
  anchor; real decoding just visits fewer anchors (one per verify step).
* **DFlash drafters** (`draftflow.drafters.dflash`): simulated over blocks anchored at every loss
  position of the eval split (`simulate_dflash`); real decoding drafts a block per verify step
  and is measured at each K in draft_tokens and at the full block (K = block_size - 1, as served).
  At temperatures > 0 (hf engine) the block's drafts are sampled, each from its own row's
  distribution, and verified as any chain; the simulated τ is then the expected acceptance
  Σ min(p, q) of each block row, chained over the block (`dflash_overlaps`).
* **Real**: greedy chain speculative decoding (`draftflow.evaluation.speculative`) with the HF target,
  for each K in draft_tokens, on every prompt set of `evaluate.prompt_sets`
  (`draftflow.evaluation.prompt_sets`: the eval split's prompts, HumanEval, MT-bench, GSM8K, any
  JSONL). The same prompts through the same verify loop with a prompt-lookup (n-gram) drafter
  give the model-free baseline, and plain greedy decoding the reference output and the speed.
* **Temperatures > 0** (`evaluate.temperatures`, hf engine): chain speculative sampling (drafts
  sampled from the drafter, accepted with min(1, p/q), a rejection resampled from max(0, p - q):
  the output keeps the target's distribution) for real τ, plain sampling as the speed reference,
  and the expected acceptance Σ min(p, q) per teacher-forced step for simulated τ.
* **Served** (`engine: sglang | vllm`, `draftflow.evaluation.served`): the engine serves the
  exported drafter; τ and per-position acceptance come from its own counters.

Writes acceptance.json (`method`: eagle3 | dflash, whose per-K results sit under that name beside
"ngram"; `acceptance_length` = real τ at the largest K over all prompts at the first
temperature; `temperatures` = the same figures per temperature; `per_set` = one row per prompt set,
method, K and temperature, real and simulated), acceptance.csv, and outputs.jsonl (every
decoded output with its per-step counts). Finished prompt sets are kept in the state folder, so
a rerun resumes per set; nothing is written to the output folder before every set is measured.
"""

from __future__ import annotations

import argparse
import csv
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch

from draftflow.drafters.dflash import DFlashConfig
from draftflow.engines.layer_ids import ENGINES
from draftflow.errors import DraftflowError, reject_unknown_keys
from draftflow.evaluation.engine_counters import check_version
from draftflow.evaluation.prompt_sets import Prompt, PromptSet, load_prompt_set, specs_from_settings
from draftflow.evaluation.state import UnitState, folder_digest, settings_key
from draftflow.jsonl import atomic_path, write_json, write_jsonl
from draftflow.progress import Progress
from draftflow.threads import default_threads
from draftflow.evaluation.speculative import (
    AcceptanceStats,
    DecodeResult,
    DFlashProposer,
    Eagle3Proposer,
    NgramProposer,
    Proposer,
    Target,
    greedy_decode,
    sample_decode,
    speculative_decode,
    speculative_sample,
)
from draftflow.drafters.ttt import TargetHead, acceptance_length, unroll

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- settings


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EvaluateSettings:
    """config `evaluate` (config.schema.yaml) plus `aux_layer_ids` (what extraction captured),
    `trust_remote_code` (config `target`) and `engine_version` (the export's release for the
    served engine)."""

    draft_tokens: tuple[int, ...] = (3, 7)
    max_prompts: int = 16
    max_new_tokens: int = 64
    prompts_file: str | None = None
    ngram_max: int = 3
    prompt_lookup: bool = True  # hf engine: also decode with the n-gram baseline (~40% of a job's decoding)
    batch_size: int = 1  # hf engine: requests per forward of the reference and every method (`batched`)
    device: str = "auto"
    dtype: str = "auto"  # hf engine: auto = float32 on a CPU, the target's stored dtype on a GPU
    engine: str = "hf"
    temperatures: tuple[float, ...] = (0.0,)  # 0: greedy; > 0: speculative sampling at that temperature
    seed: int = 0  # hf engine, temperatures > 0: base of the per-request sampling generators
    prompt_sets: dict = field(default_factory=lambda: {"eval": {"kind": "eval"}})
    server: dict = field(default_factory=dict)
    on_bad_sample: str = "fail"  # a missing or damaged stored eval sample: stop, or leave it out and count
    aux_layer_ids: tuple[int, ...] | None = None
    trust_remote_code: bool = False
    engine_version: str | None = None

    @classmethod
    def from_dict(cls, settings: dict) -> "EvaluateSettings":
        known = {f.name for f in fields(cls)}
        reject_unknown_keys(settings, known, "evaluate --settings")
        values = dict(settings)
        for key in ("draft_tokens", "aux_layer_ids"):
            if values.get(key) is not None:
                values[key] = tuple(int(v) for v in values[key])
        if values.get("temperatures") is not None:
            values["temperatures"] = tuple(float(t) for t in values["temperatures"])
        s = cls(**values)
        if s.on_bad_sample not in ("fail", "skip"):
            raise DraftflowError(f"evaluate.on_bad_sample must be fail or skip, got {s.on_bad_sample!r}")
        if not s.draft_tokens or min(s.draft_tokens) < 1:
            raise DraftflowError(f"evaluate.draft_tokens must be positive integers, got {list(s.draft_tokens)}")
        if s.engine not in ENGINES:
            raise DraftflowError(f"evaluate.engine: {s.engine!r} is not one of {', '.join(ENGINES)}")
        if s.dtype not in DTYPES:
            raise DraftflowError(f"evaluate.dtype: {s.dtype!r} is not one of {', '.join(DTYPES)}")
        if not s.temperatures or min(s.temperatures) < 0 or len(set(s.temperatures)) != len(s.temperatures):
            raise DraftflowError(
                f"evaluate.temperatures must be distinct numbers >= 0 (0 = greedy), got {list(s.temperatures)}"
            )
        if s.engine != "hf":
            check_version(s.engine, s.engine_version, f"export.{s.engine}_version")
        return s

    @property
    def k_max(self) -> int:
        return max(self.draft_tokens)


# ---------------------------------------------------------------- simulated acceptance


@dataclass
class SimulatedAcceptance:
    """Chain counts over anchors: trials[k] anchors whose steps < k hit and whose step k counts,
    hits[k] those whose step k hit too (the `chain_trials` / `chain_hits` of draftflow.drafters.ttt)."""

    steps: int
    trials: list[int] = None  # type: ignore[assignment]
    hits: list[int] = None  # type: ignore[assignment]
    samples: int = 0
    skipped: list[dict] = None  # type: ignore[assignment]  # unreadable samples left out (on_bad_sample: skip)

    def __post_init__(self):
        self.trials = self.trials or [0] * self.steps
        self.hits = self.hits or [0] * self.steps
        self.skipped = self.skipped or []

    def add(self, chain: torch.Tensor, counts: torch.Tensor) -> None:
        """chain [T] leading hits per anchor; counts [steps, T] whether step k counts for it."""
        for k in range(self.steps):
            self.trials[k] += int(((chain >= k) & counts[k]).sum())
            self.hits[k] += int((chain >= k + 1).sum())
        self.samples += 1

    def add_expected(self, accept: torch.Tensor, counts: torch.Tensor) -> None:
        """Sampling: accept [steps, T] the probability that step k of anchor j is accepted
        (Σ min(p, q)), counts as in `add`. Trials and hits become expected counts: the chain
        reaches step k with probability Π_{i<k} accept_i."""
        reach = torch.ones_like(accept[0], dtype=torch.float64)
        for k in range(self.steps):
            a = accept[k].double() * counts[k]
            self.trials[k] += float((reach * counts[k]).sum())
            reach = reach * a
            self.hits[k] += float(reach.sum())
        self.samples += 1

    @property
    def alpha(self) -> list[float]:
        return [h / t if t else 0.0 for h, t in zip(self.hits, self.trials)]

    @property
    def tau(self) -> float:
        return acceptance_length(self.alpha)

    def as_json(self) -> dict:
        return {
            "draft_tokens": self.steps,
            "acceptance_length": self.tau,
            "alpha": self.alpha,
            "hits": self.hits,
            "trials": self.trials,
            "samples": self.samples,
            "skipped_samples": len(self.skipped),
            "skipped": self.skipped,
        }


@torch.no_grad()
def chain_lengths(
    drafter, head: TargetHead, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced chains of one sample.

    input_ids, loss_mask [T]; hidden [T, L, H] (aux layers, then the final post-norm state).
    Returns (chain [T]: leading steps of the chain anchored at row j that hit the target's
    argmax, counts [steps, T] bool: step k of anchor j counts, i.e. token j+2+k exists and is
    a loss token).
    """
    T = input_ids.shape[0]
    device = drafter.fc.weight.device
    ids = torch.as_tensor(input_ids, device=device).long()[None]  # [1, T]
    mask = torch.as_tensor(loss_mask, device=device).bool()
    hidden = hidden.to(device)
    target = head(hidden[None, :, -1]).argmax[0]  # [T]: draft id of argmax z_t, -1 if outside
    counts = torch.zeros(steps, T, dtype=torch.bool, device=device)
    hit = torch.zeros(steps, T, dtype=torch.bool, device=device)
    for k, (logits, _) in enumerate(unroll(drafter, ids, hidden[None, :, :-1], steps)):
        R = max(T - 2 - k, 0)  # anchors j with a token j+2+k
        counts[k, :R] = mask[2 + k :]
        hit[k, :R] = (logits[0, :R].argmax(-1) == target[1 + k : 1 + k + R]) & counts[k, :R]
    chain = hit.int().cumprod(dim=0).sum(dim=0)  # [T]
    return chain.cpu(), counts.cpu()


@torch.no_grad()
def chain_overlaps(
    drafter, head: TargetHead, input_ids, loss_mask, hidden: torch.Tensor, steps: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced acceptance probabilities under speculative sampling at `temperature` > 0.

    Same inputs as `chain_lengths`. Returns (accept [steps, T]: Σ_v min(p_v, q_v) for step k of
    anchor j, with p the target's softmax(z / temperature) over its whole vocabulary (tokens
    outside the draft vocabulary can never be drafted) and q the drafter's, counts [steps, T]).
    The chain is teacher forced on the data tokens: an approximation of sampling, where the
    accepted tokens are themselves random.
    """
    T = input_ids.shape[0]
    device = drafter.fc.weight.device
    ids = torch.as_tensor(input_ids, device=device).long()[None]
    mask = torch.as_tensor(loss_mask, device=device).bool()
    hidden = hidden.to(device)
    z = hidden[:, -1].to(head.weight.dtype) @ head.weight.T  # [T, V] target logits
    p = torch.softmax(z.double() / temperature, -1)[:, head.draft_ids]  # [T, Vd], not renormalized
    counts = torch.zeros(steps, T, dtype=torch.bool, device=device)
    accept = torch.zeros(steps, T, dtype=torch.float64, device=device)
    for k, (logits, _) in enumerate(unroll(drafter, ids, hidden[None, :, :-1], steps)):
        R = max(T - 2 - k, 0)
        counts[k, :R] = mask[2 + k :]
        q = torch.softmax(logits[0, :R].double() / temperature, -1)  # [R, Vd]
        accept[k, :R] = torch.minimum(p[1 + k : 1 + k + R], q).sum(-1)
    return accept.cpu(), counts.cpu()


def _layers_of(hidden: torch.Tensor, layers: list[int] | None) -> torch.Tensor:
    """hidden [T, L, H] -> the drafter's aux layers (indexes among the stored ones) + final."""
    return hidden if layers is None else torch.cat([hidden[:, layers], hidden[:, -1:]], dim=1)


def _readable_samples(reader, result: "SimulatedAcceptance", max_samples: int | None, on_bad_sample: str):
    """The reader's samples, checksummed; an unreadable one stops (fail) or is left out and
    counted in `result.skipped` (skip)."""
    from draftflow.hidden_states.storage import BadRead, check_present

    n = len(reader) if max_samples is None else min(len(reader), max_samples)
    read = getattr(reader, "read", reader.__getitem__)
    if hasattr(reader, "missing"):
        check_present(reader, "evaluation (--eval-ranges)", on_bad_sample)  # stat only, before any work
    for i in range(n):
        sample = read(i)
        if isinstance(sample, BadRead):
            if on_bad_sample == "fail":
                raise DraftflowError(
                    f"evaluate: a stored sample cannot be read: {sample.message()}; "
                    "or set evaluate.on_bad_sample: skip to leave such samples out and count them"
                )
            log.warning("evaluate: skipping %s", sample.message())
            result.skipped.append({"range": sample.range_dir, "sample_id": sample.sample_id, "reason": sample.reason})
            continue
        yield sample


def simulate(
    drafter, head: TargetHead, reader, steps: int, max_samples: int | None = None, temperature: float = 0.0,
    on_bad_sample: str = "fail", layers: list[int] | None = None,
) -> SimulatedAcceptance:
    """Simulated acceptance over the samples of a `storage.HiddenStateReader`: hits of the
    target's argmax (temperature 0) or expected acceptance of speculative sampling (> 0). Every
    read is checksummed; an unreadable sample stops it (fail) or is left out and counted (skip).
    layers: where the drafter's aux layers sit among the stored ones (`batching.reader_layers`), None: all."""
    result = SimulatedAcceptance(steps)
    for sample in _readable_samples(reader, result, max_samples, on_bad_sample):
        args = (torch.from_numpy(sample.input_ids), torch.from_numpy(sample.loss_mask),
                _layers_of(sample.hidden, layers), steps)  # fmt: skip
        if temperature > 0:
            result.add_expected(*chain_overlaps(drafter, head, *args, temperature))
        else:
            result.add(*chain_lengths(drafter, head, *args))
    return result


@torch.no_grad()
def dflash_overlaps(objective, final: torch.Tensor, input_ids, loss_mask, aux, anchors, temperature: float,
                    chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Teacher-forced acceptance probabilities of DFlash blocks under speculative sampling.

    One sample: final [1, T, H] the target's post-norm states, input_ids, loss_mask [1, T], aux
    [1, T, n*H], anchors [1, n]. Returns (accept [K, n]: Σ_v min(p_v, q_v) for row k of the block
    at anchor j, p = softmax(z_{a+k-1} / temperature) the target's, q the drafter's row
    distribution at that temperature, both over the whole vocabulary; counts [K, n] bool: row k
    has a label). As in `chain_overlaps`, the context is the data's tokens, not sampled ones.
    """
    from draftflow.drafters.dflash_loss import _logits, block_label_positions, label_weights

    weight = objective.drafter.lm_head.weight  # the target's LM head (DFlash drafts in its vocabulary)
    hidden = objective.block_hidden(input_ids, aux, anchors)[0]  # [n, K, H]
    pos, _ = block_label_positions(anchors, objective.drafter.block_size, input_ids.shape[1])
    counts = label_weights(loss_mask, anchors, objective.drafter.block_size)[0]  # [n, K]
    rows = counts.nonzero(as_tuple=True)
    # z_{a+k-1} predicts row k's token; blocks overlap, so each position's p is computed once
    p = torch.cat([torch.softmax(_logits(f, weight).double() / temperature, -1)
                   for f in final[0].to(weight.dtype).split(chunk)])  # [T, V]  # fmt: skip
    context = (pos[0] - 1).clamp(min=0)[rows]  # [R]
    accept = torch.zeros(counts.shape, dtype=torch.float64, device=hidden.device)
    parts = []
    for d, t in zip(hidden[rows].split(chunk), context.split(chunk)):
        q = torch.softmax(_logits(d, weight).double() / temperature, -1)  # [c, V]
        parts.append(torch.minimum(p[t], q).sum(-1))
    if parts:
        accept[rows] = torch.cat(parts)
    return accept.T.cpu(), counts.T.cpu()


@torch.no_grad()
def simulate_dflash(
    drafter, reader, layers: list[int] | None = None, max_samples: int | None = None, on_bad_sample: str = "fail",
    temperature: float = 0.0,
) -> SimulatedAcceptance:
    """DFlash's simulated acceptance: every loss position of each eval sample anchors a block
    (teacher-forced context, as in training), K = block_size - 1. Temperature 0: row k counts
    when rows < k hit the target's greedy token (`dflash_loss`); > 0: expected acceptance of
    speculative sampling, Σ min(p, q) per row (`dflash_overlaps`), chained as for EAGLE-3."""
    from draftflow.drafters.dflash_loss import ArgmaxHead, DFlashObjective
    from draftflow.drafters.batching import AnchorPlan, collate

    device = drafter.fc.weight.device
    objective = DFlashObjective(drafter, decay=1.0)
    head = ArgmaxHead(drafter.lm_head.weight) if temperature == 0 else None  # greedy labels only
    result = SimulatedAcceptance(drafter.block_size - 1)
    plan = AnchorPlan(drafter.block_size, per_sample=1 << 30)  # every anchor, no randomness
    for sample in _readable_samples(reader, result, max_samples, on_bad_sample):
        batch = collate([sample], 1, layers=layers, anchors=plan).to(device, non_blocking=False)
        final = batch.final.to(drafter.fc.weight.dtype)
        if temperature > 0:
            result.add_expected(*dflash_overlaps(objective, final, batch.input_ids, batch.loss_mask, batch.aux,
                                                 batch.anchors.to(device), temperature))  # fmt: skip
            continue
        _, stats = objective(batch.input_ids, batch.loss_mask, batch.aux, None, head(final).argmax, None, batch.anchors)
        for k in range(result.steps):
            result.trials[k] += int(stats[4, k])
            result.hits[k] += int(stats[3, k])
        result.samples += 1
    return result


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


# ---------------------------------------------------------------- real acceptance (HF engine)


@dataclass
class MethodResult:
    stats: AcceptanceStats
    matches_greedy: int | None = 0  # None when sampling (temperature > 0): no single reference output
    prompts: int = 0  # requests (an MT-bench question with two turns counts twice)

    def as_json(self, greedy_seconds: float) -> dict:
        out = self.stats.as_json()
        out["speedup"] = greedy_seconds / self.stats.seconds if self.stats.seconds else None
        out["matches_greedy"] = self.matches_greedy
        out["prompts"] = self.prompts
        return out

    def state(self) -> dict:
        return {"stats": asdict(self.stats), "matches_greedy": self.matches_greedy, "prompts": self.prompts}

    @classmethod
    def from_state(cls, d: dict) -> "MethodResult":
        return cls(AcceptanceStats(**d["stats"]), d["matches_greedy"], d["prompts"])

    def __add__(self, other: "MethodResult") -> "MethodResult":
        a, b = self.stats, other.stats
        stats = AcceptanceStats(
            a.k, a.steps + b.steps, a.emitted + b.emitted, a.generated + b.generated, a.seconds + b.seconds,
            [x + y for x, y in zip(a.reached, b.reached)], [x + y for x, y in zip(a.accepted, b.accepted)],
        )  # fmt: skip
        matches = None if None in (self.matches_greedy, other.matches_greedy) else self.matches_greedy + other.matches_greedy
        return MethodResult(stats, matches, self.prompts + other.prompts)


def request_generator(seed: int, *key: int) -> torch.Generator:
    """The sampling generator of one request (prompt, turn, method, K): reruns and resumed sets
    draw the same numbers, whatever else was measured before."""
    mixed = seed & 0xFFFF_FFFF
    for part in key:  # FNV-style mixing of small ints (Python's hash of ints is not a mixer)
        mixed = ((mixed ^ (part & 0xFFFF_FFFF)) * 0x0100_0193 + 0x9E37_79B9) & 0xFFFF_FFFF_FFFF
    return torch.Generator().manual_seed(mixed)


def run_real(
    target: Target,
    proposers: Sequence[Proposer],
    prompts: Sequence[Prompt],
    draft_tokens: Sequence[int],
    max_new_tokens: int,
    eos_ids: set[int],
    tokenizer=None,
    outputs: list[dict] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 1,
) -> tuple[dict[str, dict[int, MethodResult]], AcceptanceStats]:
    """Every proposer at every K on every turn of every prompt; plain decoding once per turn as the
    reference (later turns of a multi-turn prompt follow the reference answer). Decoded tokens and
    per-step proposed/accepted counts go to `outputs` when given.

    temperature 0: greedy chain speculative decoding, which must reproduce greedy decoding.
    temperature > 0: chain speculative sampling (`speculative_sample`): its output is distributed as
    the target's own sampling, so there is no single output to match (`matches_greedy` None); the
    reference is plain sampling (the speed baseline). Every request draws from its own generator
    (`request_generator(seed, prompt, turn, method, K)`).

    batch_size > 1: `_run_real_batched`."""
    if batch_size > 1:
        return _run_real_batched(target, proposers, prompts, draft_tokens, max_new_tokens, eos_ids, tokenizer,
                                 outputs, temperature, seed, batch_size)  # fmt: skip
    results = {p.name: {k: MethodResult(AcceptanceStats(k)) for k in draft_tokens} for p in proposers}
    greedy = AcceptanceStats(1)
    sampling = temperature > 0
    _warm_up(target, proposers, prompts, draft_tokens, eos_ids)
    record = outputs.append if outputs is not None else (lambda r: None)
    progress = Progress(len(prompts), "prompts", every_s=10.0, logger=log)
    for n, prompt in enumerate(prompts, start=1):
        ids, answers = prompt.ids, []
        for turn in range(1, prompt.turns + 1):
            if sampling:
                g = request_generator(seed, n, turn, 0, 0)
                reference: DecodeResult = sample_decode(target, ids, max_new_tokens, eos_ids, temperature, g)
            else:
                reference = greedy_decode(target, ids, max_new_tokens, eos_ids)
            greedy.add(reference)
            record(_reference_record(prompt, turn, ids, reference, sampling))
            for m, proposer in enumerate(proposers, start=1):
                for k in draft_tokens:
                    _decode_request(target, proposer, (n, prompt, turn, ids, reference), m, k, max_new_tokens,
                                    eos_ids, temperature, seed, results[proposer.name][k], record)  # fmt: skip
            if turn < prompt.turns:
                answers.append(tokenizer.decode(reference.tokens, skip_special_tokens=True))
                ids = prompt.next_turn(tokenizer, answers)
        progress.update(n, extra=f"{prompt.source}: {len(reference.tokens)} tokens")
    return results, greedy


def _warm_up(target: Target, proposers, prompts, draft_tokens, eos_ids) -> None:
    """Kernels and allocator, so that the first timed method is not penalized."""
    greedy_decode(target, prompts[0].ids, 4, eos_ids)
    for proposer in proposers:
        speculative_decode(target, proposer, prompts[0].ids, max(draft_tokens), 4, eos_ids)


def _reference_record(prompt: Prompt, turn: int, ids, reference: DecodeResult, sampling: bool) -> dict:
    return {"source": prompt.source, "turn": turn, "method": "sampled" if sampling else "greedy",
            "prompt_tokens": len(ids), "tokens": reference.tokens}  # fmt: skip


def _count(r: MethodResult, proposer_name: str, request: tuple, k: int, out: DecodeResult, sampling: bool,
           record) -> None:  # fmt: skip
    """One decoded request into its method's figures and outputs.jsonl."""
    _, prompt, turn, _, reference = request
    r.prompts += 1
    if sampling:
        r.matches_greedy = None
    elif out.tokens == reference.tokens:
        r.matches_greedy += 1
    else:  # a floating-point tie flipped between a (k+1)-token (or batched) and a 1-token forward
        log.warning("%s K=%d: output differs from greedy on %s", proposer_name, k, prompt.source)
    r.stats.add(out)
    record({"source": prompt.source, "turn": turn, "method": proposer_name, "draft_tokens": k,
            "tokens": out.tokens, "proposed": out.proposed, "accepted": out.accepted})  # fmt: skip


def _decode_request(target: Target, proposer: Proposer, request: tuple, m: int, k: int, max_new_tokens: int,
                    eos_ids: set[int], temperature: float, seed: int, r: MethodResult, record) -> None:  # fmt: skip
    """One request (n, prompt, turn, ids, reference) with proposer number m at K = k, alone."""
    n, _, turn, ids, _ = request
    if temperature > 0:
        g = request_generator(seed, n, turn, m, k)
        out = speculative_sample(target, proposer, ids, k, max_new_tokens, eos_ids, temperature, g)
    else:
        out = speculative_decode(target, proposer, ids, k, max_new_tokens, eos_ids)
    _count(r, proposer.name, request, k, out, temperature > 0, record)


def _run_real_batched(target: Target, proposers: Sequence[Proposer], prompts: Sequence[Prompt],
                      draft_tokens: Sequence[int], max_new_tokens: int, eos_ids: set[int], tokenizer,
                      outputs: list[dict] | None, temperature: float, seed: int,
                      batch_size: int) -> tuple[dict[str, dict[int, MethodResult]], AcceptanceStats]:  # fmt: skip
    """`run_real` with batch_size requests per forward (`batched`) for the references, turn by turn
    (a later turn's input holds the earlier reference answer), then for each method (EAGLE-3, DFlash,
    prompt lookup). Every request's tokens, acceptance and (sampling) draws
    are those of batch 1; seconds are each batch's time shared among its requests, so speedup
    compares batched decoding with batched plain decoding."""
    from draftflow.evaluation.batched import BatchedTarget, RowSampling, batched_reference

    results = {p.name: {k: MethodResult(AcceptanceStats(k)) for k in draft_tokens} for p in proposers}
    greedy = AcceptanceStats(1)
    sampling = temperature > 0
    _warm_up(target, proposers, prompts, draft_tokens, eos_ids)
    record = outputs.append if outputs is not None else (lambda r: None)
    requests: list[tuple[int, Prompt, int, list[int], DecodeResult]] = []  # (n, prompt, turn, ids, reference)
    batched_target = BatchedTarget(target.model, target.aux_layer_ids)
    try:
        inputs = {n: (list(p.ids), []) for n, p in enumerate(prompts, start=1)}  # n -> (ids, answers so far)
        for turn in range(1, max(p.turns for p in prompts) + 1):
            due = [n for n, p in enumerate(prompts, start=1) if p.turns >= turn]
            for start in range(0, len(due), batch_size):
                chunk = due[start : start + batch_size]
                rows = RowSampling(temperature, [request_generator(seed, n, turn, 0, 0) for n in chunk]) if sampling else None
                refs = batched_reference(batched_target, [inputs[n][0] for n in chunk], max_new_tokens, eos_ids, rows)
                for n, reference in zip(chunk, refs):
                    prompt, ids = prompts[n - 1], inputs[n][0]
                    greedy.add(reference)
                    record(_reference_record(prompt, turn, ids, reference, sampling))
                    requests.append((n, prompt, turn, ids, reference))
                    if turn < prompt.turns:
                        answers = inputs[n][1] + [tokenizer.decode(reference.tokens, skip_special_tokens=True)]
                        inputs[n] = (prompt.next_turn(tokenizer, answers), answers)
            log.info("references of turn %d: %d requests decoded %d at a time", turn, len(due), batch_size)
        for m, proposer in enumerate(proposers, start=1):
            _run_batched(batched_target, proposer, m, requests, draft_tokens, max_new_tokens, eos_ids, batch_size,
                         results[proposer.name], record, temperature, seed)  # fmt: skip
    finally:
        batched_target.close()
    return results, greedy


def _run_batched(batched_target, proposer: Proposer, m: int, requests: list,
                 draft_tokens: Sequence[int], max_new_tokens: int, eos_ids: set[int], batch_size: int,
                 results: dict[int, MethodResult], record, temperature: float, seed: int) -> None:  # fmt: skip
    """One method on every request (n, prompt, turn, ids, reference) at every K, batch_size at a
    time; sampling, each with the generator `run_real` would give it alone (proposer number m)."""
    from draftflow.evaluation.batched import (
        BatchedDFlashProposer,
        BatchedEagle3Proposer,
        BatchedNgramProposer,
        RowSampling,
        batched_speculative_decode,
    )

    def batched_proposer(rows: int):
        if isinstance(proposer, NgramProposer):
            return BatchedNgramProposer(proposer)
        if isinstance(proposer, DFlashProposer):
            return BatchedDFlashProposer(proposer.drafter, rows)
        return BatchedEagle3Proposer(proposer.drafter, rows)

    for k in draft_tokens:
        for start in range(0, len(requests), batch_size):
            chunk = requests[start : start + batch_size]
            drafting = batched_proposer(len(chunk))
            prompts = [ids for _, _, _, ids, _ in chunk]
            rows = None
            if temperature > 0:
                rows = RowSampling(temperature, [request_generator(seed, n, turn, m, k) for n, _, turn, _, _ in chunk])
            outs = batched_speculative_decode(batched_target, drafting, prompts, k, max_new_tokens, eos_ids, rows)
            for request, out in zip(chunk, outs):
                _count(results[k], proposer.name, request, k, out, temperature > 0, record)
        log.info("%s K=%d: %d requests decoded %d at a time", proposer.name, k, len(requests), batch_size)


# ---------------------------------------------------------------- the per-set table


def table_row(prompt_set: str, engine: str, method: str, k: int, temperature: float, **values) -> dict:
    """One row of acceptance.json's `per_set` table (the same columns for every engine)."""
    row = {"prompt_set": prompt_set, "engine": engine, "method": method, "draft_tokens": k,
           "temperature": temperature}  # fmt: skip
    row.update(values)
    steps, generated, seconds = row.get("verify_steps"), row.get("generated_tokens"), row.get("seconds")
    # SpecForge's bench_eagle3 and SGLang's per-request spec_accept_length: completion tokens
    # (the prefill's first token included) per verify step; τ above excludes that first token.
    row["acceptance_length_specforge"] = generated / steps if steps else None
    row["tokens_per_second"] = generated / seconds if generated is not None and seconds else None
    return row


def hf_rows(
    name: str, real: dict[str, dict[int, MethodResult]], greedy: AcceptanceStats, temperature: float = 0.0
) -> list[dict]:
    requests = next(iter(next(iter(real.values())).values())).prompts
    rows = [table_row(name, "hf", "baseline", 0, temperature, measured="real", requests=requests,
                      generated_tokens=greedy.generated, seconds=greedy.seconds)]  # fmt: skip
    for method, per_k in real.items():
        for k, r in sorted(per_k.items()):
            s = r.stats
            rows.append(table_row(
                name, "hf", method, k, temperature, measured="real", acceptance_length=s.tau, alpha=s.alpha,
                acceptance_rate_per_position=[a / s.steps if s.steps else 0.0 for a in s.accepted],
                accepted=s.accepted, reached=s.reached, verify_steps=s.steps, generated_tokens=s.generated,
                seconds=s.seconds, speedup=greedy.seconds / s.seconds if s.seconds else None,
                matches_greedy=r.matches_greedy, requests=r.prompts,
            ))  # fmt: skip
    return rows


def simulated_row(simulated: "SimulatedAcceptance", temperature: float, method: str = "eagle3") -> dict:
    """The simulated τ as a row of the per-set table: teacher forced on the eval split's stored
    hidden states (prompt set `eval`), K = the largest draft_tokens; at temperature > 0 the
    expected acceptance of speculative sampling (Σ min(p, q) per step)."""
    return table_row("eval", "hf", method, simulated.steps, temperature, measured="simulated",
                     acceptance_length=simulated.tau, alpha=simulated.alpha, samples=simulated.samples)  # fmt: skip


# ---------------------------------------------------------------- outputs

CSV_FIELDS = ["prompt_set", "engine", "method", "measured", "draft_tokens", "temperature", "acceptance_length",
              "acceptance_length_specforge", "speedup", "tokens_per_second", "generated_tokens", "verify_steps"]  # fmt: skip


def csv_rows(report: dict) -> list[dict]:
    """Per temperature: the simulated τ (prompt_set `eval`), then one row per (method, K) over all
    prompts (prompt_set `all`); then the per-set table's real rows; α_i in columns alpha_1..alpha_K."""
    engine = report.get("engine", "hf")
    parts = report.get("temperatures") or {"first": {**report, "temperature": report["settings"]["temperatures"][0]}}
    rows = []
    drafter = report.get("method", "eagle3")
    for part in parts.values():
        t = part["temperature"]
        sim = part.get("simulated")
        if sim:
            rows.append({"prompt_set": "eval", "engine": engine, "method": drafter, "measured": "simulated",
                         "draft_tokens": sim["draft_tokens"], "temperature": t, "acceptance_length": sim["acceptance_length"],
                         "alpha": sim["alpha"]})  # fmt: skip
        for method in (drafter, "ngram"):
            for k, r in (part.get(method) or {}).items():
                rows.append({
                    "prompt_set": "all", "engine": engine, "method": method, "measured": "real", "draft_tokens": int(k),
                    "temperature": t, "acceptance_length": r["acceptance_length"], "speedup": r["speedup"],
                    "tokens_per_second": r.get("tokens_per_second"), "generated_tokens": r["generated_tokens"],
                    "verify_steps": r["verify_steps"], "alpha": r["alpha"],
                })  # fmt: skip
    for row in report["per_set"]:
        if row.get("measured", "real") == "real":
            rows.append({**{k: row.get(k) for k in CSV_FIELDS if k in row}, "measured": "real",
                         "alpha": row.get("alpha", [])})  # fmt: skip
    return rows


def write_csv(path: Path, rows: list[dict], k_max: int) -> None:
    alpha_fields = [f"alpha_{i}" for i in range(1, k_max + 1)]
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS + alpha_fields, restval="", extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            row = dict(row)
            alphas = row.pop("alpha") or []
            row.update({f"alpha_{i}": f"{a:.4f}" for i, a in enumerate(alphas, start=1)})
            row.update({k: f"{v:.4f}" for k, v in row.items() if isinstance(v, float)})
            row.update({k: "" for k, v in row.items() if v is None})
            writer.writerow(row)


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class EvaluateInputs:
    drafter: Path
    target: Path
    eval_ranges: tuple[Path, ...]
    eval_data: Path | None
    output_dir: Path
    state_dir: Path | None = None
    served_drafter: Path | None = None  # export/<engine>: what a served engine loads


def _check_layers(cfg, settings: EvaluateSettings, drafter_dir: Path) -> None:
    if settings.aux_layer_ids is not None and list(settings.aux_layer_ids) != list(cfg.aux_layer_ids):
        raise DraftflowError(
            f"{drafter_dir}: the drafter reads aux layers {list(cfg.aux_layer_ids)} but the hidden states "
            f"were extracted for {list(settings.aux_layer_ids)}; evaluate a drafter trained on these layers"
        )


def prompt_sets_summary(sets: list[PromptSet]) -> dict:
    """The report's `prompt_sets` (per set) and `prompts` (totals) entries."""
    return {
        "prompt_sets": {ps.name: {"kind": ps.kind, "prompts": len(ps.prompts), "requests": ps.requests,
                                  "skipped_too_long": ps.skipped} for ps in sets},  # fmt: skip
        "prompts": {"count": sum(len(ps.prompts) for ps in sets),
                    "from_file": sum(len(ps.prompts) for ps in sets if ps.kind == "lines"),
                    "from_eval": sum(len(ps.prompts) for ps in sets if ps.kind == "eval")},  # fmt: skip
    }


def load_sets(settings: EvaluateSettings, tokenizer, eval_data: Path | None, max_tokens: int | None) -> list[PromptSet]:
    sets = []
    for spec in specs_from_settings(settings.prompt_sets, settings.prompts_file):
        ps = load_prompt_set(spec, tokenizer, eval_data, spec.max_prompts or settings.max_prompts, max_tokens)
        if ps.skipped:
            log.warning("prompt set %s: skipped %d prompts longer than %s tokens", ps.name, ps.skipped, max_tokens)
        if not ps.prompts:
            log.warning("prompt set %s: no prompts", ps.name)
        sets.append(ps)
    if not any(ps.prompts for ps in sets):
        raise DraftflowError(
            "evaluate: no prompts in any prompt set (give --eval-data with assistant turns, or a non-empty "
            "set in evaluate.prompt_sets)"
        )
    return [ps for ps in sets if ps.prompts]


def _target_identity(path: Path) -> str:
    from draftflow.target import target_identity

    return target_identity(path) if (path / "config.json").is_file() else str(path)


def run_hf(inputs: EvaluateInputs, settings: EvaluateSettings) -> tuple[dict, list[dict]]:
    from draftflow.hidden_states.storage import HiddenStateReader, check_present
    from draftflow.target import load_target, resolve_device
    from draftflow.drafters.batching import reader_layers
    from draftflow.drafters.checkpoint import load_drafter

    reader = HiddenStateReader(list(inputs.eval_ranges)) if inputs.eval_ranges else None
    if reader is not None:  # every stored sample it will read is there (stat only), before loading models
        check_present(reader, "evaluation (--eval-ranges)", settings.on_bad_sample)
    device = resolve_device(settings.device)
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "float32" if device.type == "cpu" else "auto"  # CPU half-precision matmuls are slow
    model, tokenizer = load_target(inputs.target, dtype=dtype, device=str(device),
                                   trust_remote_code=settings.trust_remote_code)  # fmt: skip
    drafter, cfg = load_drafter(inputs.drafter, inputs.target, device=device, dtype=next(model.parameters()).dtype)
    _check_layers(cfg, settings, inputs.drafter)
    # EAGLE-3 drafts a chain of K tokens; DFlash a block of B - 1, of which K are verified: it is
    # also evaluated at its full block, as served.
    method = "dflash" if isinstance(cfg, DFlashConfig) else "eagle3"
    ks = sorted(set(settings.draft_tokens) | ({cfg.block_size - 1} if method == "dflash" else set()))
    k_max = max(ks)
    layers = reader_layers(reader.range_dirs, cfg, "eval") if reader is not None else None
    head = None if method == "dflash" else TargetHead(model.get_output_embeddings().weight, drafter.t2d).to(device)

    limit = getattr(model.config, "max_position_embeddings", None)
    sets = load_sets(settings, tokenizer, inputs.eval_data, limit - settings.max_new_tokens if limit else None)
    state = UnitState(inputs.state_dir, settings_key({
        "engine": "hf", "drafter": folder_digest(inputs.drafter), "target": _target_identity(inputs.target),
        "draft_tokens": ks, "max_new_tokens": settings.max_new_tokens,
        "ngram_max": settings.ngram_max, "device": str(device),
        # only when off: the resume state of runs that measured the baseline keeps its key
        **({} if settings.prompt_lookup else {"prompt_lookup": False}),
        **({"batch_size": settings.batch_size} if settings.batch_size > 1 else {}),
    }))  # fmt: skip

    names = [method, "ngram"] if settings.prompt_lookup else [method]
    by_temperature: dict[str, dict] = {}
    rows: list[dict] = []
    outputs: list[dict] = []
    for temperature in settings.temperatures:
        simulated = SimulatedAcceptance(drafter.block_size - 1 if method == "dflash" else k_max)
        simulating = reader is not None
        if simulating and method == "dflash":
            simulated = simulate_dflash(drafter, reader, layers, on_bad_sample=settings.on_bad_sample,
                                        temperature=temperature)  # fmt: skip
        elif simulating:
            simulated = simulate(drafter, head, reader, k_max, temperature=temperature,
                                 on_bad_sample=settings.on_bad_sample, layers=layers)  # fmt: skip
        log.info("T=%g: simulated τ (K=%d) %.3f over %d samples", temperature, simulated.steps, simulated.tau,
                 simulated.samples)  # fmt: skip
        per_set = _measure_sets(model, tokenizer, drafter, cfg, sets, settings, state, temperature, method, ks)
        # all prompts together: the figures of this temperature (as before prompt sets existed)
        pooled = {m: {k: sum((per_set[s][0][m][k] for s in per_set), MethodResult(AcceptanceStats(k))) for k in ks}
                  for m in names}  # fmt: skip
        reference = AcceptanceStats(1)
        for _, g, _ in per_set.values():
            reference = AcceptanceStats(1, reference.steps + g.steps, reference.emitted + g.emitted,
                                        reference.generated + g.generated, reference.seconds + g.seconds)  # fmt: skip
        drafting = "block drafting (DFlash)" if method == "dflash" else "chain"
        how = f"greedy {drafting} speculative decoding" if temperature == 0 else \
            f"chain speculative sampling at temperature {temperature:g}"  # fmt: skip
        by_temperature[f"{temperature:g}"] = {
            "temperature": temperature,
            "acceptance_length": pooled[method][k_max].stats.tau,
            "acceptance_length_measured": f"real: {how} against the target, K={k_max}, tokens per verify "
            "step, all prompt sets",
            "acceptance_length_simulated": simulated.tau if simulating else None,
            "simulated": simulated.as_json() if simulating else None,
            method: {str(k): r.as_json(reference.seconds) for k, r in pooled[method].items()},
            "ngram": {str(k): r.as_json(reference.seconds) for k, r in pooled.get("ngram", {}).items()},
            "greedy" if temperature == 0 else "reference": {
                "generated_tokens": reference.generated, "seconds": reference.seconds,
                "tokens_per_second": reference.generated / reference.seconds if reference.seconds else None},
        }  # fmt: skip
        for ps in sets:
            rows += hf_rows(ps.name, per_set[ps.name][0], per_set[ps.name][1], temperature)
        if simulating:
            rows.append(simulated_row(simulated, temperature, method))
        outputs += [{"prompt_set": ps.name, "temperature": temperature, **o} for ps in sets for o in per_set[ps.name][2]]

    first = by_temperature[f"{settings.temperatures[0]:g}"]  # the headline: the first temperature (default 0)
    report = {
        "engine": "hf",
        "method": method,
        **{k: v for k, v in first.items() if k != "temperature"},
        "temperatures": by_temperature,
        "per_set": rows,
        **prompt_sets_summary(sets),
        "draft_tokens": ks,  # measured (DFlash: also its full block)
        "drafter": str(inputs.drafter),
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    return report, outputs


def _measure_sets(model, tokenizer, drafter, cfg, sets: list[PromptSet], settings: EvaluateSettings,
                  state: UnitState, temperature: float, method: str = "eagle3",
                  ks: Sequence[int] | None = None) -> dict[str, tuple[dict, AcceptanceStats, list[dict]]]:  # fmt: skip
    """Real decoding of every prompt set at one temperature; finished sets come from the state
    folder. Sampled units are keyed by evaluate.seed too (greedy ones do not depend on it)."""
    unit = "hf" if temperature == 0 else f"hf-seed{settings.seed}"
    ks = sorted(ks or settings.draft_tokens)
    per_set: dict[str, tuple[dict[str, dict[int, MethodResult]], AcceptanceStats, list[dict]]] = {}
    target = Target(model, cfg.aux_layer_ids)
    try:
        proposer = DFlashProposer(drafter) if method == "dflash" else Eagle3Proposer(drafter)
        proposers = [proposer, NgramProposer(settings.ngram_max)] if settings.prompt_lookup else [proposer]
        for ps in sets:
            saved = state.load(ps, unit, temperature)
            if saved is not None:
                log.info("prompt set %s, T=%g: already measured (state %s)", ps.name, temperature, state.folder)
                real = {m: {int(k): MethodResult.from_state(r) for k, r in per_k.items()} for m, per_k in saved["real"].items()}
                per_set[ps.name] = (real, AcceptanceStats(**saved["greedy"]), saved["outputs"])
                continue
            log.info("prompt set %s, T=%g: %d prompts, %d requests", ps.name, temperature, len(ps.prompts), ps.requests)
            outputs: list[dict] = []
            real, reference = run_real(target, proposers, ps.prompts, ks, settings.max_new_tokens,
                                       eos_token_ids(model, tokenizer), tokenizer, outputs, temperature,
                                       settings.seed, settings.batch_size)  # fmt: skip
            state.save(ps, unit, temperature, {
                "real": {m: {str(k): r.state() for k, r in per_k.items()} for m, per_k in real.items()},
                "greedy": asdict(reference), "outputs": outputs})  # fmt: skip
            per_set[ps.name] = (real, reference, outputs)
    finally:
        target.close()
    return per_set


def drafter_method_of(drafter_dir: Path) -> str:
    """eagle3 | dflash, from the drafter folder's config.json (eagle3 when there is none)."""
    from draftflow.drafters.checkpoint import drafter_method
    from draftflow.jsonl import read_json

    path = Path(drafter_dir) / "config.json"
    return drafter_method(read_json(path)) if path.is_file() else "eagle3"


def run_served_engine(inputs: EvaluateInputs, settings: EvaluateSettings) -> tuple[dict, list[dict]]:
    from transformers import AutoTokenizer

    from draftflow.evaluation.served import ServedRun, ServerSettings

    method = drafter_method_of(inputs.drafter)
    draft_tokens = settings.draft_tokens
    if method == "dflash":
        if settings.engine != "vllm":
            raise DraftflowError(
                f"{inputs.drafter}: a DFlash drafter; evaluate.engine {settings.engine} measures EAGLE-3 drafters "
                "only. Evaluate DFlash with engine hf or vllm (its export has the SGLang launch command)"
            )
        if any(t != 0 for t in settings.temperatures):
            raise DraftflowError(
                f"{inputs.drafter}: a DFlash drafter served by vLLM is evaluated greedily (temperature 0) only; "
                f"evaluate.temperatures is {list(settings.temperatures)}: set it to [0], or evaluate.engine: hf"
            )
        draft_tokens = (dflash_block_size(inputs.drafter) - 1,)  # served at its full block, as exported
    server = ServerSettings.from_dict(settings.server)
    if not server.endpoint and (inputs.served_drafter is None or not inputs.served_drafter.is_dir()):
        raise DraftflowError(
            f"evaluate.engine {settings.engine} serves the exported drafter: give --served-drafter "
            f"(results/export/{settings.engine}), or a running server in evaluate.server.endpoint"
        )
    tokenizer = AutoTokenizer.from_pretrained(inputs.target, local_files_only=True,
                                              trust_remote_code=settings.trust_remote_code)  # fmt: skip
    sets = load_sets(settings, tokenizer, inputs.eval_data, None)
    state = UnitState(inputs.state_dir, settings_key({
        "engine": settings.engine, "target": _target_identity(inputs.target),
        "drafter": folder_digest(inputs.served_drafter) if inputs.served_drafter and not server.endpoint else None,
        # operational keys (timeouts, port, concurrency) do not change what is measured
        "server": {k: v for k, v in asdict(server).items() if k not in ("startup_timeout_s", "request_timeout_s",
                   "check_gpus", "concurrency", "host", "port")},  # fmt: skip
        "max_new_tokens": settings.max_new_tokens,
    }))  # fmt: skip
    run = ServedRun(settings.engine, server, inputs.target, inputs.served_drafter, settings.trust_remote_code,
                    str(settings.engine_version), draft_tokens, settings.temperatures, settings.max_new_tokens,
                    state, (inputs.state_dir or inputs.output_dir) / "logs", method, default_threads())  # fmt: skip
    units = run.run(sets, tokenizer)
    return served_report(units, sets, settings, inputs, method), served_outputs(units, method)


def dflash_block_size(drafter_dir: Path) -> int:
    from draftflow.jsonl import read_json

    return DFlashConfig.from_dict(read_json(Path(drafter_dir) / "config.json")).block_size


def served_report(
    units, sets: list[PromptSet], settings: EvaluateSettings, inputs: EvaluateInputs, method: str = "eagle3"
) -> dict:
    """The same report as the HF engine's, from served units (no simulated τ, no n-gram)."""
    from draftflow.evaluation.engine_counters import SpecCounts

    engine, t0 = settings.engine, settings.temperatures[0]
    baseline = {(u.prompt_set, u.temperature): u for u in units if not u.k}
    rows = []
    for u in units:
        base = baseline.get((u.prompt_set, u.temperature))
        tps = u.generated_tokens / u.seconds if u.seconds else None
        base_tps = base.generated_tokens / base.seconds if base and base.seconds else None
        values = dict(generated_tokens=u.generated_tokens, seconds=u.seconds, requests=u.requests,
                      server=u.server_info)  # fmt: skip
        if u.counts is not None:
            values.update(u.counts.as_json())
            values["speedup"] = tps / base_tps if tps and base_tps else None
        rows.append(table_row(u.prompt_set, engine, method if u.k else "baseline", u.k, u.temperature, **values))
    measured = [u for u in units if u.k and u.temperature == t0]
    ks = sorted({u.k for u in measured})
    per_k = {}
    for k in ks:
        mine = [u for u in measured if u.k == k]
        counts = sum((u.counts for u in mine), SpecCounts(k))
        generated, seconds = sum(u.generated_tokens for u in mine), sum(u.seconds for u in mine)
        base = [baseline[(u.prompt_set, t0)] for u in mine if (u.prompt_set, t0) in baseline]
        base_tps = sum(b.generated_tokens for b in base) / sum(b.seconds for b in base) if base else None
        per_k[str(k)] = {**counts.as_json(), "draft_tokens": k, "generated_tokens": generated, "seconds": seconds,
                         "tokens_per_second": generated / seconds if seconds else None,
                         "speedup": (generated / seconds) / base_tps if seconds and base_tps else None,
                         "prompts": sum(u.requests for u in mine)}  # fmt: skip
        if t0 == 0 and len(base) == len(mine):  # greedy: the drafter must not change a single token
            per_k[str(k)]["matches_greedy"] = sum(_same_tokens(u, baseline[(u.prompt_set, t0)]) for u in mine)
    base_units = [u for u in units if not u.k and u.temperature == t0]
    b_gen, b_sec = sum(u.generated_tokens for u in base_units), sum(u.seconds for u in base_units)
    k_max = str(ks[-1]) if ks else None
    return {
        "engine": engine,
        "method": method,
        "acceptance_length": per_k[k_max]["acceptance_length"] if k_max else None,
        "acceptance_length_measured": f"served: {engine} counters, K={k_max}, temperature {t0:g}, tokens per verify "
        "step (completion tokens less each request's first), all prompt sets; the engine's own count is "
        "engine_acceptance_length",
        "acceptance_length_simulated": None,
        "simulated": None,
        method: per_k,
        "ngram": {},
        "greedy": {"generated_tokens": b_gen, "seconds": b_sec, "tokens_per_second": b_gen / b_sec if b_sec else None}
        if base_units else None,
        "per_set": rows,
        **prompt_sets_summary(sets),
        "drafter": str(inputs.served_drafter or settings.server.get("endpoint")),
        "aux_layer_ids": list(settings.aux_layer_ids) if settings.aux_layer_ids else None,
    }


def _same_tokens(unit, baseline) -> int:
    """Requests of `unit` whose tokens equal the baseline server's for the same prompt and turn."""
    reference = {(o["source"], o["turn"]): o["tokens"] for o in baseline.outputs}
    return sum(reference.get((o["source"], o["turn"])) == o["tokens"] for o in unit.outputs)


def served_outputs(units, method: str = "eagle3") -> list[dict]:
    return [{"prompt_set": u.prompt_set, "method": method if u.k else "baseline", "draft_tokens": u.k,
             "temperature": u.temperature, **o} for u in units for o in u.outputs]  # fmt: skip


def run_evaluate(inputs: EvaluateInputs, settings: EvaluateSettings) -> dict:
    """Measure everything first, then write: a failed run leaves no acceptance.json."""
    if settings.engine == "hf":
        report, outputs = run_hf(inputs, settings)
    else:
        report, outputs = run_served_engine(inputs, settings)
    report["settings"] = {**asdict(settings), "draft_tokens": list(settings.draft_tokens),
                          "temperatures": list(settings.temperatures)}  # fmt: skip
    report["target"] = str(inputs.target)
    inputs.output_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(inputs.output_dir / "outputs.jsonl", outputs)
    k_max = max([settings.k_max] + [int(k) for k in report[report["method"]]])
    write_csv(inputs.output_dir / "acceptance.csv", csv_rows(report), k_max)
    write_json(inputs.output_dir / "acceptance.json", report)
    return report


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument("--drafter", type=Path, required=True, help="drafter folder (config.json + model.safetensors)")
    parser.add_argument("--target", type=Path, required=True, help="target model folder (served engines: its tokenizer)")
    parser.add_argument("--eval-ranges", type=Path, nargs="*", default=[], metavar="RANGE_DIR",
                        help="eval split range folders (index.json) for the simulated acceptance")  # fmt: skip
    parser.add_argument(
        "--eval-data", type=Path, help="merged eval.jsonl: prompts = tokens before the first assistant token"
    )
    parser.add_argument("--settings", type=settings_arg, default={}, help="config `evaluate` + aux_layer_ids, as JSON")
    parser.add_argument("--output-dir", type=Path, required=True,
                        help="writes acceptance.json, acceptance.csv and outputs.jsonl")  # fmt: skip
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="finished prompt sets, kept across reruns (resume); none: no resume")  # fmt: skip
    parser.add_argument("--served-drafter", type=Path, default=None,
                        help="engine sglang / vllm: the exported drafter folder the engine loads")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    settings = EvaluateSettings.from_dict(args.settings)
    inputs = EvaluateInputs(args.drafter, args.target, tuple(args.eval_ranges), args.eval_data, args.output_dir,
                            args.state_dir, args.served_drafter)  # fmt: skip
    report = run_evaluate(inputs, settings)
    method = report["method"]
    k = str(max(int(k) for k in report[method])) if report[method] else None
    log.info("%s acceptance length (%s, K=%s): %s", method, report["engine"], k, report["acceptance_length"])
    if report["ngram"]:
        log.info("simulated %s; n-gram baseline %.3f", report["acceptance_length_simulated"],
                 report["ngram"][k]["acceptance_length"])  # fmt: skip
    for name in report["prompt_sets"]:
        taus = [f"K={r['draft_tokens']} t={r['temperature']:g}: {r['acceptance_length']:.3f}" for r in report["per_set"]
                if r["prompt_set"] == name and r["method"] == method]  # fmt: skip
        log.info("  %s: %s", name, ", ".join(taus))
    return 0
