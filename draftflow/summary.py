"""`draftflow summary`: the report's first page, the run's headline figures and tables as text.

Snakemake's report opens on the workflow description; the Snakefile points it at the file
this stage writes (reStructuredText, `results/report/summary.rst`) once it exists. The page
reads the run's outputs only (never tensors) and shows what a reader wants first: the
acceptance length τ (real and simulated), the n-gram baseline, the speedups, the data
totals and per-dataset statistics, storage and training figures, and where the exports are.

Each table is one function `section_<name>(run) -> Section | None` (None: its inputs are
missing, e.g. a partial run); `SECTIONS` lists them in page order. To add a table, write
such a function and put it in `SECTIONS`. Drafter methods (train.methods) each have their own
drafter/<method>/, eval/<method>/ and export/<method>/ folders: the sections in `PER_METHOD`
appear once per method (titled with its name), the headline has rows for each.
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from draftflow.jsonl import atomic_path
from draftflow.hidden_states.plan import format_bytes

DESCRIPTION = Path(__file__).resolve().parent.parent / "report" / "workflow.rst"


@dataclass(frozen=True)
class Section:
    title: str
    lines: list[str]  # reStructuredText body
    note: str = ""  # a sentence under the title: what was measured, how


METHOD_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


@dataclass
class RunFiles:
    """A run's outputs under `results`, each read on first use (None when absent). `method`:
    the drafter method whose drafter/eval/export sub-folders this reads (None: the folders
    themselves, a run from before methods existed); `methods`: the run's methods (None: the
    method folders found)."""

    results: Path
    methods: Sequence[str] | None = None
    method: str | None = None

    def _per_method(self, kind: str, *rest: str) -> dict | None:
        return self._json(kind, *([self.method] if self.method else []), *rest)

    @property
    def label(self) -> str:
        """The method's name as shown ("" for a run without method folders)."""
        return METHOD_NAMES.get(self.method, self.method) if self.method else ""

    def titled(self, title: str) -> str:
        return f"{title} — {self.label}" if self.method else title

    def method_runs(self) -> list["RunFiles"]:
        """One RunFiles per drafter method (this one when the run has no method folders)."""
        names = self.methods
        if names is None:
            names = [m for m in METHOD_NAMES if any((self.results / d / m).is_dir() for d in ("drafter", "eval"))]
        return [RunFiles(self.results, names, m) for m in names] or [self]

    def _json(self, *parts: str) -> dict | None:
        path = self.results.joinpath(*parts)
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    @cached_property
    def acceptance(self) -> dict | None:
        return self._per_method("eval", "acceptance.json")

    @cached_property
    def drafter_eval(self) -> dict | None:
        return self._per_method("drafter", "eval.json")

    @cached_property
    def manifest(self) -> dict | None:
        return self._json("merged", "manifest.json")

    @cached_property
    def storage_plan(self) -> dict | None:
        return self._json("merged", "storage_plan.json")

    @cached_property
    def data_config(self) -> dict | None:
        return self._json("hidden_states", "data_config.json")

    @cached_property
    def export(self) -> dict | None:
        return self._per_method("export", "export.json")

    @cached_property
    def serve_check(self) -> dict | None:
        return self._per_method("export", "serve_check.json")

    @cached_property
    def stats_rows(self) -> list[dict] | None:
        try:
            with open(self.results / "merged" / "stats.csv", newline="") as f:
                return list(csv.DictReader(f))
        except OSError:
            return None


# ---------------------------------------------------------------- formatting


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers for people: 2.3456 -> '2.35', 1234567 -> '1,234,567', None -> '–'."""
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def fixed(value: float | None, decimals: int = 3) -> str:
    """Probabilities and τ with a fixed number of decimals, so that columns line up."""
    return "–" if value is None else f"{value:.{decimals}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """An RST grid table: an HTML table in the report, and aligned columns read as plain text."""
    cells = [[_escape(str(c)) for c in header]] + [[_escape(fmt(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def rule(ch: str) -> str:
        return "+" + "+".join(ch * (w + 2) for w in widths) + "+"

    def line(row: list[str]) -> str:
        return "|" + "|".join(f" {c:<{w}} " for c, w in zip(row, widths)) + "|"

    out = [rule("-"), line(cells[0]), rule("=")]
    for row in cells[1:]:
        out += [line(row), rule("-")]
    return out


def _escape(text: str) -> str:
    """Plain cell text: RST markup at a cell's start would make a list; `|` would end the cell."""
    text = text.replace("\\", "\\\\").replace("*", "\\*").replace("`", "\\`").replace("|", "/")
    return "\\" + text if text[:1] in "-+#" and text != "–" else text


def _drafter(acceptance: dict) -> str:
    """The key of the drafter's per-K results in acceptance.json (its method)."""
    return acceptance.get("method", "eagle3")


def _k_max(acceptance: dict) -> str | None:
    """The largest K measured (the headline's), None when nothing was (a served engine that failed)."""
    ks = [int(k) for k in acceptance.get(_drafter(acceptance)) or {}]
    return str(max(ks)) if ks else None


# ---------------------------------------------------------------- sections (page order)


def _headline_rows(run: RunFiles) -> list[list[Any]]:
    """One method's headline rows (named "<method>: …" where the run has method folders)."""
    acc, drafter = run.acceptance, run.drafter_eval
    name = f"{run.label}: " if run.label else ""
    rows: list[list[Any]] = []
    if acc and _k_max(acc):
        k = _k_max(acc)
        mine, ngram = acc[_drafter(acc)][k], acc.get("ngram", {}).get(k, {})
        drafting = "block" if _drafter(acc) == "dflash" else "chain"
        t0 = ((acc.get("settings") or {}).get("temperatures") or [0.0])[0]
        at = "" if t0 == 0 else f", temperature {t0:g}"
        sim_k = (acc.get("simulated") or {}).get("draft_tokens", k)
        rows += [
            [f"{name}acceptance length τ, real (K = {k}{at})", fixed(acc["acceptance_length"]),
             f"greedy {drafting} speculative decoding" if t0 == 0 else f"{drafting} speculative sampling"],
            [f"{name}acceptance length τ, simulated (K = {sim_k}{at})", fixed(acc.get("acceptance_length_simulated")),
             "teacher-forced on the eval split's hidden states"],
            [f"{name}n-gram baseline τ (K = {k}{at})", fixed(ngram.get("acceptance_length")), "prompt lookup, same verify loop"],
            [f"{name}speedup over {'greedy decoding' if t0 == 0 else 'plain sampling'} (K = {k})", _speedup(mine.get("speedup")),
             f"n-gram: {_speedup(ngram.get('speedup'))}; engine {acc.get('engine', 'hf')}, "
             f"{acc.get('device', '?')}, {acc.get('dtype', '?')}"],
        ]  # fmt: skip
        for part in (acc.get("temperatures") or {}).values():  # the other temperatures (hf engine)
            if part["temperature"] == t0 or k not in part.get(_drafter(acc), {}):
                continue
            rows.append([f"{name}τ at temperature {part['temperature']:g}, real / simulated (K = {k})",
                         f"{fixed(part['acceptance_length'])} / {fixed(part.get('acceptance_length_simulated'))}",
                         f"chain speculative sampling; n-gram {fixed(part['ngram'].get(k, {}).get('acceptance_length'))}"])  # fmt: skip
    if drafter:
        rows.append([f"{name}drafter τ at the end of training (simulated)",
                     fixed(drafter.get("simulated_acceptance_length")),
                     f"{fmt(drafter.get('steps'))} steps, {fmt(drafter.get('train_tokens'))} training tokens"])  # fmt: skip
    return rows


def section_headline(run: RunFiles) -> Section | None:
    merged = run.manifest
    rows: list[list[Any]] = [row for method_run in run.method_runs() for row in _headline_rows(method_run)]
    if not (rows or merged):
        return None
    if merged:
        total = merged["total"]
        rows.append(["merged data", f"{fmt(total['all']['samples'])} samples, {fmt(total['all']['tokens'])} tokens",
                     f"train {fmt(total['train']['samples'])} / eval {fmt(total['eval']['samples'])} samples"])  # fmt: skip
    if run.data_config:
        dc = run.data_config
        rows.append(["hidden states stored", format_bytes(dc.get("bytes_stored") or 0),
                     f"{fmt(dc.get('compression_ratio'))} of raw; layers {dc.get('layer_ids')}"])  # fmt: skip
    return Section("Headline figures", table(["figure", "value", "how"], rows))


def _speedup(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def section_acceptance(run: RunFiles) -> Section | None:
    acc = run.acceptance
    if not acc:
        return None
    rows = []
    for method in (_drafter(acc), "ngram"):
        for k, r in sorted(acc.get(method, {}).items(), key=lambda kv: int(kv[0])):
            rows.append([method, int(k), fixed(r.get("acceptance_length")), _speedup(r.get("speedup")),
                         r.get("generated_tokens"), r.get("prompts"), r.get("matches_greedy")])  # fmt: skip
    note = (
        f"Real decoding on {fmt(acc.get('prompts', {}).get('count'))} prompts; τ = tokens per target "
        "verify step (1 ≤ τ ≤ K + 1); speedup = greedy decoding time / speculative decoding time."
    )
    header = ["method", "K", "τ", "speedup", "tokens generated", "prompts", "same output as greedy"]
    return Section(run.titled("Acceptance length by draft tokens K"), table(header, rows), note)


def section_alpha(run: RunFiles) -> Section | None:
    """Per-position conditional acceptance α_k: real decoding against teacher-forced."""
    acc = run.acceptance
    k = _k_max(acc) if acc else None
    if k is None:
        return None
    real = acc[_drafter(acc)][k].get("alpha") or []
    simulated = (acc.get("simulated") or {}).get("alpha") or []
    ngram = acc.get("ngram", {}).get(k, {}).get("alpha") or []
    n = max(len(real), len(simulated), len(ngram))
    if not n:
        return None
    rows = [[i + 1, *(fixed(_at(v, i)) for v in (real, simulated, ngram))] for i in range(n)]
    note = "α_k: probability that draft token k is accepted given that the ones before it were."
    name = METHOD_NAMES.get(_drafter(acc), _drafter(acc))
    header = ["k", f"{name} real", f"{name} simulated", "n-gram"]
    return Section(run.titled(f"Acceptance per draft position (K = {k})"), table(header, rows), note)


def _at(values: Sequence[Any], i: int) -> Any:
    return values[i] if i < len(values) else None


def section_prompt_sets(run: RunFiles) -> Section | None:
    """acceptance.json `per_set`: one row per prompt set, method, K and temperature."""
    rows = (run.acceptance or {}).get("per_set") or []
    if not rows:
        return None
    body = [[r.get("prompt_set"), r.get("method"), r.get("measured", "real"), r.get("draft_tokens") or "–",
             r.get("temperature"), fixed(r.get("acceptance_length")), _speedup(r.get("speedup")),
             r.get("tokens_per_second"), r.get("requests", r.get("samples"))] for r in rows]  # fmt: skip
    note = (
        "The baseline row is decoding without a drafter; speedup = its time / the method's time. "
        "Simulated rows: teacher forced on the eval split's hidden states (at temperature > 0 the "
        "expected acceptance of speculative sampling); their last column counts samples."
    )
    header = ["prompt set", "method", "measured", "K", "temperature", "τ", "speedup", "tokens/s", "requests"]
    return Section(run.titled("Acceptance length per prompt set"), table(header, body), note)


def section_datasets(run: RunFiles) -> Section | None:
    """stats.csv, inline: one row per dataset and split."""
    rows = run.stats_rows
    if not rows:
        return None
    header = list(rows[0].keys())
    body = [[_number(row[h]) for h in header] for row in rows]
    return Section("Datasets (merged/stats.csv)", table(header, body))


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


def section_storage(run: RunFiles) -> Section | None:
    plan, dc = run.storage_plan, run.data_config
    if not (plan or dc):
        return None
    rows = []
    if plan:
        total = plan["total"]
        rows.append(["planned", fmt(total.get("tokens")), format_bytes(total["bytes_raw"]),
                     format_bytes(total["bytes_expected"]), plan.get("expected_compression_ratio")])  # fmt: skip
    if dc:
        rows.append(["written", fmt(dc.get("total_tokens")), format_bytes(dc.get("bytes_raw") or 0),
                     format_bytes(dc.get("bytes_stored") or 0), dc.get("compression_ratio")])  # fmt: skip
    return Section("Hidden-state storage", table(["", "tokens", "raw", "stored", "stored / raw"], rows))


def section_training(run: RunFiles) -> Section | None:
    ev = run.drafter_eval
    if not ev:
        return None
    rows = [
        ["steps", ev.get("steps")],
        ["training tokens", ev.get("train_tokens")],
        ["processes", ev.get("world_size")],
        ["eval loss (last / best)", f"{fmt(ev.get('loss'))} / {fmt(ev.get('best_eval_loss'))}"],
        ["simulated τ on the eval split", ev.get("simulated_acceptance_length")],
        ["top-1 accuracy per TTT step / block row", ", ".join(fmt(a, 2) for a in ev.get("step_accuracy") or []) or None],
    ]
    where = f"drafter/{run.method}/eval.json" if run.method else "drafter/eval.json"
    return Section(run.titled(f"Drafter training ({where})"), table(["", "value"], rows))


def section_export(run: RunFiles) -> Section | None:
    ex = run.export
    if not ex:
        return None
    rows = []
    folder = f"export/{run.method}" if run.method else "export"
    for engine in ("sglang", "vllm"):
        if engine in ex:
            info = ex[engine]
            ids = info.get("eagle_aux_hidden_state_layer_ids", info.get("target_layer_ids"))
            rows.append([engine, f"{folder}/{engine}/launch.sh", info.get("version"), ids,
                         ex.get("aux_layer_ids")])  # fmt: skip
    if not rows:
        return None
    note = f"Serve with ``bash <results>/{folder}/<engine>/launch.sh [TARGET_DIR] [server arguments]``."
    note += " " + serve_check_note(run.serve_check, folder)
    header = ["engine", "launch", "version", "engine layer ids", "our layer ids"]
    return Section(run.titled("Servable drafters"), table(header, rows), note)


def serve_check_note(check: dict | None, folder: str) -> str:
    """The export gate's verdict (export/<method>/serve_check.json), one sentence."""
    if not check:
        return "The serve check did not run (export.check: off)."
    served = check.get("served") or {}
    if served.get("served"):
        return (f"Serve check ({folder}/serve_check.json): static check passed; vLLM {served['version']} served τ "
                f"{served['tau_served']:.3f} against {served['tau_in_process']:.3f} in-process (K = {served['k']}, "
                f"{served['prompts']} prompts, {served['outputs_equal_target']}/{served['prompts']} outputs equal the "
                "target's). SGLang was checked statically only, not served.")  # fmt: skip
    return (f"Serve check ({folder}/serve_check.json): static check passed; not served "
            f"({served.get('reason', 'unknown')}). SGLang was checked statically only, not served.")  # fmt: skip


SECTIONS: list[Callable[[RunFiles], Section | None]] = [
    section_headline,
    section_acceptance,
    section_alpha,
    section_prompt_sets,
    section_datasets,
    section_storage,
    section_training,
    section_export,
]
# sections of one drafter method's files: once per method (the headline has rows of each)
PER_METHOD = {section_acceptance, section_alpha, section_prompt_sets, section_training, section_export}


# ---------------------------------------------------------------- page


# Snakemake's report (9.x) centres its first page in a window-sized box, so a page larger
# than the window lost its top and left edge; and its text column is 32rem wide. A <style> in the
# description applies while the page is shown (an unknown class name just does nothing).
REPORT_STYLE = """.. raw:: html

   <style>
   div.h-screen.items-center { align-items: flex-start; justify-content: flex-start; }
   .prose.max-w-lg { max-width: 56rem; }
   </style>
"""


def render_page(run: RunFiles, description: str = "") -> str:
    """The summary page as reStructuredText, wrapped so that the report's Jinja pass leaves it be."""
    out = ["Run summary", "===========", "", REPORT_STYLE]
    if description:
        out += [description.strip(), ""]
    for make in SECTIONS:
        for section in [make(r) for r in run.method_runs()] if make in PER_METHOD else [make(run)]:
            if section is None:
                continue
            out += [section.title, "-" * len(section.title), ""]
            if section.note:
                out += [section.note, ""]
            out += [*section.lines, ""]
    body = "\n".join(out)
    # Snakemake renders the report description with Jinja: keep our text verbatim.
    return "{% raw %}\n" + body + "\n{% endraw %}\n"


def write_summary(results: Path, output: Path, methods: Sequence[str] | None = None) -> str:
    description = DESCRIPTION.read_text(encoding="utf-8") if DESCRIPTION.is_file() else ""
    page = render_page(RunFiles(Path(results), methods), description)
    with atomic_path(output) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return page


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.add_argument("--results", type=Path, required=True, help="the run's results folder")
    parser.add_argument("--output", type=Path, required=True, help="summary page to write (.rst)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="drafter methods (train.methods) whose drafter/eval/export/<method> folders to show; "
                        "default: those found")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    write_summary(args.results, args.output, args.methods)
    return 0
