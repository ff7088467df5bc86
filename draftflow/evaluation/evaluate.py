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
* **Real**: greedy chain speculative decoding (`draftflow.evaluation.speculative`) with the HF target,
  for each K in draft_tokens, on prompts from the eval split (tokens before the first loss
  token) and from an optional prompts file (one per line, rendered with the chat template).
  The same prompts through the same verify loop with a prompt-lookup (n-gram) drafter give
  the model-free baseline, and plain greedy decoding the reference output and the speed.

Writes acceptance.json (`method`; `acceptance_length` = real τ at the largest K; per-K results
under the method's name and "ngram") and acceptance.csv.
"""

from __future__ import annotations

import argparse
import csv
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

import torch

from draftflow.errors import DraftflowError, reject_unknown_keys, where
from draftflow.jsonl import atomic_path, read_jsonl, write_json
from draftflow.drafters.dflash import DFlashConfig
from draftflow.evaluation.speculative import (
    AcceptanceStats,
    DecodeResult,
    DFlashProposer,
    Eagle3Proposer,
    NgramProposer,
    Proposer,
    Target,
    greedy_decode,
    speculative_decode,
)
from draftflow.drafters.ttt import TargetHead, acceptance_length, unroll

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class EvaluateSettings:
    """config `evaluate` (config.schema.yaml) plus `aux_layer_ids` (what extraction captured)."""

    draft_tokens: tuple[int, ...] = (3, 7)
    max_prompts: int = 16
    max_new_tokens: int = 64
    prompts_file: str | None = None
    ngram_max: int = 3
    device: str = "auto"
    aux_layer_ids: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, settings: dict) -> "EvaluateSettings":
        known = {f.name for f in fields(cls)}
        reject_unknown_keys(settings, known, "evaluate --settings")
        values = dict(settings)
        for key in ("draft_tokens", "aux_layer_ids"):
            if values.get(key) is not None:
                values[key] = tuple(int(v) for v in values[key])
        s = cls(**values)
        if not s.draft_tokens or min(s.draft_tokens) < 1:
            raise DraftflowError(f"evaluate.draft_tokens must be positive integers, got {list(s.draft_tokens)}")
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

    def __post_init__(self):
        self.trials = self.trials or [0] * self.steps
        self.hits = self.hits or [0] * self.steps

    def add(self, chain: torch.Tensor, counts: torch.Tensor) -> None:
        """chain [T] leading hits per anchor; counts [steps, T] whether step k counts for it."""
        for k in range(self.steps):
            self.trials[k] += int(((chain >= k) & counts[k]).sum())
            self.hits[k] += int((chain >= k + 1).sum())
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


def _layers_of(hidden: torch.Tensor, layers: list[int] | None) -> torch.Tensor:
    """hidden [T, L, H] -> the drafter's aux layers (indexes among the stored ones) + final."""
    return hidden if layers is None else torch.cat([hidden[:, layers], hidden[:, -1:]], dim=1)


def simulate(
    drafter, head: TargetHead, reader, steps: int, max_samples: int | None = None, layers: list[int] | None = None
) -> SimulatedAcceptance:
    """Simulated acceptance over the samples of a `storage.HiddenStateReader`; layers: where the
    drafter's aux layers sit among the stored ones (`train.reader_layers`), None: all."""
    result = SimulatedAcceptance(steps)
    n = len(reader) if max_samples is None else min(len(reader), max_samples)
    for i in range(n):
        sample = reader[i]
        chain, counts = chain_lengths(
            drafter, head, torch.from_numpy(sample.input_ids), torch.from_numpy(sample.loss_mask),
            _layers_of(sample.hidden, layers), steps,
        )  # fmt: skip
        result.add(chain, counts)
    return result


@torch.no_grad()
def simulate_dflash(drafter, reader, layers: list[int] | None = None, max_samples: int | None = None) -> SimulatedAcceptance:
    """DFlash's simulated acceptance: every loss position of each eval sample anchors a block
    (teacher-forced context, as in training); row k of a block counts when rows < k hit the
    target's greedy token (`dflash_loss`), K = block_size - 1."""
    from draftflow.drafters.dflash_loss import ArgmaxHead, DFlashObjective
    from draftflow.drafters.train import AnchorPlan, collate

    device = drafter.fc.weight.device
    objective = DFlashObjective(drafter, decay=1.0)
    head = ArgmaxHead(drafter.lm_head.weight)
    result = SimulatedAcceptance(drafter.block_size - 1)
    plan = AnchorPlan(drafter.block_size, per_sample=1 << 30)  # every anchor, no randomness
    n = len(reader) if max_samples is None else min(len(reader), max_samples)
    for i in range(n):
        batch = collate([reader[i]], 1, layers, plan).to(device, non_blocking=False)
        target = head(batch.final.to(drafter.fc.weight.dtype))
        _, stats = objective(batch.input_ids, batch.loss_mask, batch.aux, None, target.argmax, None, batch.anchors)
        for k in range(result.steps):
            result.trials[k] += int(stats[4, k])
            result.hits[k] += int(stats[3, k])
        result.samples += 1
    return result


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    source: str  # "eval:<id>" or "file:<line>"
    ids: list[int]


def eval_prompts(path: Path, limit: int) -> list[Prompt]:
    """The tokens before the first loss (assistant) token of each eval record with one."""
    prompts = []
    for line, record in enumerate(read_jsonl(path), start=1):
        if len(prompts) >= limit:
            break
        try:
            ids, mask = record["input_ids"], record["loss_mask"]
        except KeyError as e:
            raise DraftflowError(f"{where(path, line, e.args[0])}: missing") from None
        first = next((i for i, m in enumerate(mask) if m), 0)
        if first > 0:
            prompts.append(Prompt(f"eval:{record.get('id', line)}", list(ids[:first])))
    return prompts


def file_prompts(path: Path, tokenizer, limit: int) -> list[Prompt]:
    """One user message per non-empty line, rendered with the chat template's generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DraftflowError(f"{path}: the tokenizer has no chat template to render the prompts with")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if len(prompts) >= limit:
                break
            if text.strip():
                rendered = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text.strip()}], tokenize=False, add_generation_prompt=True
                )
                prompts.append(Prompt(f"file:{line}", tokenizer(rendered, add_special_tokens=False)["input_ids"]))
    return prompts


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


# ---------------------------------------------------------------- real acceptance


@dataclass
class MethodResult:
    stats: AcceptanceStats
    matches_greedy: int = 0
    prompts: int = 0

    def as_json(self, greedy_seconds: float) -> dict:
        out = self.stats.as_json()
        out["speedup"] = greedy_seconds / self.stats.seconds if self.stats.seconds else None
        out["matches_greedy"] = self.matches_greedy
        out["prompts"] = self.prompts
        return out


def run_real(
    target: Target,
    proposers: Sequence[Proposer],
    prompts: Sequence[Prompt],
    draft_tokens: Sequence[int],
    max_new_tokens: int,
    eos_ids: set[int],
) -> tuple[dict[str, dict[int, MethodResult]], AcceptanceStats]:
    """Every proposer at every K on every prompt; plain greedy once per prompt as the reference."""
    results = {p.name: {k: MethodResult(AcceptanceStats(k)) for k in draft_tokens} for p in proposers}
    greedy = AcceptanceStats(1)
    # warm-up (kernels, allocator) so that the first timed method is not penalized
    greedy_decode(target, prompts[0].ids, 4, eos_ids)
    for proposer in proposers:
        speculative_decode(target, proposer, prompts[0].ids, max(draft_tokens), 4, eos_ids)
    for n, prompt in enumerate(prompts, start=1):
        reference: DecodeResult = greedy_decode(target, prompt.ids, max_new_tokens, eos_ids)
        greedy.add(reference)
        for proposer in proposers:
            for k in draft_tokens:
                out = speculative_decode(target, proposer, prompt.ids, k, max_new_tokens, eos_ids)
                r = results[proposer.name][k]
                r.stats.add(out)
                r.prompts += 1
                if out.tokens == reference.tokens:
                    r.matches_greedy += 1
                else:  # a floating-point tie flipped between a (k+1)-token and a 1-token forward
                    log.warning("%s K=%d: output differs from greedy on prompt %s", proposer.name, k, prompt.source)
        log.info("prompt %d/%d (%s): %d tokens", n, len(prompts), prompt.source, len(reference.tokens))
    return results, greedy


# ---------------------------------------------------------------- outputs

CSV_FIELDS = ["method", "measured", "draft_tokens", "acceptance_length", "speedup", "generated_tokens", "verify_steps"]


def csv_rows(report: dict) -> list[dict]:
    """One row per (method, K) and one for the simulated τ; α_i in columns alpha_1..alpha_K."""
    rows = []
    sim, drafter = report["simulated"], report.get("method", "eagle3")
    rows.append({"method": drafter, "measured": "simulated", "draft_tokens": sim["draft_tokens"],
                 "acceptance_length": sim["acceptance_length"], "alpha": sim["alpha"]})  # fmt: skip
    for method in (drafter, "ngram"):
        for k, r in report[method].items():
            rows.append({
                "method": method, "measured": "real", "draft_tokens": int(k),
                "acceptance_length": r["acceptance_length"], "speedup": r["speedup"],
                "generated_tokens": r["generated_tokens"], "verify_steps": r["verify_steps"], "alpha": r["alpha"],
            })  # fmt: skip
    return rows


def write_csv(path: Path, rows: list[dict], k_max: int) -> None:
    alpha_fields = [f"alpha_{i}" for i in range(1, k_max + 1)]
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS + alpha_fields, restval="")
        writer.writeheader()
        for row in rows:
            row = dict(row)
            alphas = row.pop("alpha")
            row.update({f"alpha_{i}": f"{a:.4f}" for i, a in enumerate(alphas, start=1)})
            row.update({k: f"{v:.4f}" for k, v in row.items() if isinstance(v, float)})
            writer.writerow(row)


# ---------------------------------------------------------------- the stage


@dataclass(frozen=True)
class EvaluateInputs:
    drafter: Path
    target: Path
    eval_ranges: tuple[Path, ...]
    eval_data: Path | None
    output_dir: Path


def _check_layers(cfg, settings: EvaluateSettings, drafter_dir: Path) -> None:
    if settings.aux_layer_ids is not None and list(settings.aux_layer_ids) != list(cfg.aux_layer_ids):
        raise DraftflowError(
            f"{drafter_dir}: the drafter reads aux layers {list(cfg.aux_layer_ids)} but the hidden states "
            f"were extracted for {list(settings.aux_layer_ids)}; evaluate a drafter trained on these layers"
        )


def run_evaluate(inputs: EvaluateInputs, settings: EvaluateSettings) -> dict:
    from draftflow.hidden_states.storage import HiddenStateReader
    from draftflow.target import load_target, resolve_device
    from draftflow.drafters.train import load_drafter, reader_layers

    device = resolve_device(settings.device)
    dtype = torch.float32 if device.type == "cpu" else "auto"  # CPU half-precision matmuls are slow
    model, tokenizer = load_target(inputs.target, dtype=dtype, device=str(device))
    drafter, cfg = load_drafter(inputs.drafter, inputs.target, device=device, dtype=next(model.parameters()).dtype)
    _check_layers(cfg, settings, inputs.drafter)
    # EAGLE-3 drafts a chain of K tokens; DFlash a block of B - 1, of which K are verified: it is
    # also evaluated at its full block, as served.
    method = "dflash" if isinstance(cfg, DFlashConfig) else "eagle3"
    draft_tokens = sorted(set(settings.draft_tokens) | ({cfg.block_size - 1} if method == "dflash" else set()))
    k_max = max(draft_tokens)

    simulated = SimulatedAcceptance(drafter.block_size - 1 if method == "dflash" else k_max)
    if inputs.eval_ranges:
        reader = HiddenStateReader(list(inputs.eval_ranges))
        layers = reader_layers(reader.range_dirs, cfg, "eval")
        if method == "dflash":
            simulated = simulate_dflash(drafter, reader, layers)
        else:
            head = TargetHead(model.get_output_embeddings().weight, drafter.t2d).to(device)
            simulated = simulate(drafter, head, reader, k_max, layers=layers)
    log.info("simulated τ (K=%d) %.3f over %d samples", simulated.steps, simulated.tau, simulated.samples)

    prompts: list[Prompt] = []
    if settings.prompts_file:
        prompts += file_prompts(Path(settings.prompts_file), tokenizer, settings.max_prompts)
    if inputs.eval_data:
        prompts += eval_prompts(inputs.eval_data, settings.max_prompts - len(prompts))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit:
        too_long = [p.source for p in prompts if len(p.ids) + settings.max_new_tokens > limit]
        if too_long:
            log.warning("skipping %d prompts longer than %d - max_new_tokens: %s", len(too_long), limit, too_long[:5])
        prompts = [p for p in prompts if len(p.ids) + settings.max_new_tokens <= limit]
    if not prompts:
        raise DraftflowError("evaluate: no prompts (give --eval-data with assistant turns, or evaluate.prompts_file)")

    target = Target(model, cfg.aux_layer_ids)
    try:
        proposer = DFlashProposer(drafter) if method == "dflash" else Eagle3Proposer(drafter)
        proposers = [proposer, NgramProposer(settings.ngram_max)]
        real, greedy = run_real(
            target, proposers, prompts, draft_tokens, settings.max_new_tokens, eos_token_ids(model, tokenizer),
        )  # fmt: skip
    finally:
        target.close()

    drafting = "block drafting (DFlash)" if method == "dflash" else "chain"
    report = {
        "method": method,
        "acceptance_length": real[method][k_max].stats.tau,
        "acceptance_length_measured": f"real: greedy {drafting} speculative decoding against the target, "
        f"K={k_max}, tokens per verify step",
        "acceptance_length_simulated": simulated.tau,
        "simulated": simulated.as_json(),
        method: {str(k): r.as_json(greedy.seconds) for k, r in real[method].items()},
        "ngram": {str(k): r.as_json(greedy.seconds) for k, r in real["ngram"].items()},
        "greedy": {"generated_tokens": greedy.generated, "seconds": greedy.seconds,
                   "tokens_per_second": greedy.generated / greedy.seconds if greedy.seconds else None},  # fmt: skip
        "prompts": {"count": len(prompts), "from_file": sum(p.source.startswith("file:") for p in prompts),
                    "from_eval": sum(p.source.startswith("eval:") for p in prompts)},  # fmt: skip
        "settings": {**asdict(settings), "draft_tokens": list(settings.draft_tokens)},
        "draft_tokens": list(draft_tokens),  # measured (DFlash: also its full block)
        "drafter": str(inputs.drafter),
        "target": str(inputs.target),
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    inputs.output_dir.mkdir(parents=True, exist_ok=True)
    write_json(inputs.output_dir / "acceptance.json", report)
    write_csv(inputs.output_dir / "acceptance.csv", csv_rows(report), k_max)
    return report


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument("--drafter", type=Path, required=True, help="drafter folder (config.json + model.safetensors)")
    parser.add_argument("--target", type=Path, required=True, help="target model folder")
    parser.add_argument("--eval-ranges", type=Path, nargs="*", default=[], metavar="RANGE_DIR",
                        help="eval split range folders (index.json) for the simulated acceptance")  # fmt: skip
    parser.add_argument(
        "--eval-data", type=Path, help="merged eval.jsonl: prompts = tokens before the first assistant token"
    )
    parser.add_argument("--settings", type=settings_arg, default={}, help="config `evaluate` + aux_layer_ids, as JSON")
    parser.add_argument("--output-dir", type=Path, required=True, help="writes acceptance.json and acceptance.csv")


def main(args: argparse.Namespace) -> int:
    settings = EvaluateSettings.from_dict(args.settings)
    inputs = EvaluateInputs(args.drafter, args.target, tuple(args.eval_ranges), args.eval_data, args.output_dir)
    report = run_evaluate(inputs, settings)
    k_max = max(report["draft_tokens"])
    log.info(
        "%s acceptance length: real %.3f (K=%d), simulated %.3f; n-gram baseline %.3f", report["method"],
        report["acceptance_length"], k_max, report["acceptance_length_simulated"],
        report["ngram"][str(k_max)]["acceptance_length"],
    )  # fmt: skip
    return 0
