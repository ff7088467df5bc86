"""`draftflow plot`: the report's figures, as PNG files (captions in report/*.rst).

    lengths     sample lengths of the merged set, per dataset    train.jsonl [eval.jsonl] [manifest.json]
    storage     hidden-state bytes planned vs written             storage_plan.json, data_config.json
    training    TTT loss and per-step accuracy over training      the drafter's metrics.jsonl
    acceptance  per-position acceptance and τ, all prompts and per set   acceptance.json

Each figure is a plain function of already-written files, so a figure can be redrawn without
rerunning its stage; nothing here reads hidden-state tensors.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from draftflow.errors import DraftflowError, where
from draftflow.jsonl import atomic_path, read_json, read_jsonl

KINDS = ("lengths", "storage", "training", "acceptance")
COLORS = {"eagle3": "tab:blue", "ngram": "tab:orange", "simulated": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    _pyplot().close(fig)


# ---------------------------------------------------------------- lengths


def record_lengths(path: Path) -> dict[str, list[int]]:
    """dataset -> sample lengths, from a merged split (token lists only; no tensors)."""
    lengths: dict[str, list[int]] = defaultdict(list)
    for line, record in enumerate(read_jsonl(path), start=1):
        try:
            lengths[record.get("dataset", "?")].append(len(record["input_ids"]))
        except KeyError:
            raise DraftflowError(f"{where(path, line, 'input_ids')}: missing") from None
    return dict(lengths)


def plot_lengths(train: Path, output: Path, eval_data: Path | None = None, manifest: Path | None = None) -> None:
    """Stacked histogram of sample lengths (train + eval) per dataset; the truncation limit dashed."""
    plt = _pyplot()
    lengths = record_lengths(train)
    if eval_data:
        for name, values in record_lengths(eval_data).items():
            lengths.setdefault(name, []).extend(values)
    if not lengths:
        raise DraftflowError(f"{train}: no records to plot")
    info = read_json(manifest) if manifest else {"settings": {}, "datasets": {}}
    max_seq_len = info.get("settings", {}).get("max_seq_len")
    # source records prepare rejected, per dataset (shown so that they are not missed)
    rejected = {n: d.get("rejected", 0) for n, d in info.get("datasets", {}).items()}
    names = sorted(lengths)
    top = max_seq_len or max(max(v) for v in lengths.values())
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{n} ({len(lengths[n])}" + (f", {rejected[n]} rejected)" if rejected.get(n) else ")") for n in names]
    ax.hist([lengths[n] for n in names], bins=50, range=(0, top), stacked=True, label=labels)
    if max_seq_len:
        ax.axvline(max_seq_len, color="black", linestyle="--", linewidth=1, label=f"max_seq_len {max_seq_len}")
    total = sum(len(v) for v in lengths.values())
    tokens = sum(sum(v) for v in lengths.values())
    title = f"Merged set: {total:,} samples, {tokens:,} tokens"
    if sum(rejected.values()):
        title += f"; {sum(rejected.values()):,} source records rejected"
    ax.set(xlabel="sample length (tokens)", ylabel="samples", title=title)
    ax.legend(fontsize=8)
    _save(fig, output)


# ---------------------------------------------------------------- storage


def _scale(values: list[float]) -> tuple[list[float], str]:
    top = max(values) if values else 0
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if top >= size:
            return [v / size for v in values], unit
    return values, "bytes"


def plot_storage(plan: Path, data_config: Path, output: Path) -> None:
    """Bytes: planned raw and planned compressed (the plan's ratio) vs raw and stored as written."""
    plt = _pyplot()
    p, d = read_json(plan), read_json(data_config)
    try:
        bars = {
            "planned raw": p["total"]["bytes_raw"],
            f"planned stored\n(ratio {p['expected_compression_ratio']:.2f})": p["total"]["bytes_expected"],
            "written raw": d["bytes_raw"],
            f"written stored\n(ratio {d['compression_ratio'] or 0:.2f})": d["bytes_stored"],
        }
        tokens = (p["total"]["tokens"], d["total_tokens"])
    except KeyError as e:
        raise DraftflowError(f"{plan} / {data_config}: field {e.args[0]!r} missing") from None
    values, unit = _scale(list(bars.values()))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = ["#bbbbbb", "#888888", "tab:blue", "tab:green"]
    rects = ax.bar(list(bars), values, color=colors)
    ax.bar_label(rects, labels=[f"{v:.3g} {unit}" for v in values], fontsize=8)
    ax.set(ylabel=unit, title=f"Hidden-state storage: {tokens[1]:,} of {tokens[0]:,} planned tokens written")
    _save(fig, output)


# ---------------------------------------------------------------- training


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    rows = list(read_jsonl(path))
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not train and not evals:
        raise DraftflowError(f"{path}: no 'train' or 'eval' rows")
    return train, evals


def plot_training(metrics: Path, output: Path) -> None:
    """Left: TTT loss (train and held-out) per optimizer step. Right: accuracy of each TTT step
    (step k predicts the (k+1)-th token ahead), train lines and held-out markers."""
    plt = _pyplot()
    train, evals = read_metrics(metrics)
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for rows, style, label in ((train, "-", "train"), (evals, "o--", "held-out")):
        if rows:
            loss_ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, label=label)
    loss_ax.set(xlabel="optimizer step", ylabel="TTT loss (step-weighted)", title="Loss")
    loss_ax.legend()
    steps = len((train or evals)[0]["step_accuracy"])
    cmap = plt.get_cmap("viridis")
    for k in range(steps):
        color = cmap(k / max(steps - 1, 1))
        if train:
            acc_ax.plot([r["step"] for r in train], [r["step_accuracy"][k] for r in train], color=color,
                        label=f"step {k + 1}")  # fmt: skip
        if evals:
            acc_ax.plot([r["step"] for r in evals], [r["step_accuracy"][k] for r in evals], "o", color=color,
                        label=None if train else f"step {k + 1}")  # fmt: skip
    acc_ax.set(
        xlabel="optimizer step", ylabel="top-1 accuracy", ylim=(0, 1), title="Per-step accuracy (markers: held-out)"
    )
    acc_ax.legend(fontsize=8, ncol=2)
    _save(fig, output)


# ---------------------------------------------------------------- acceptance


def plot_acceptance(acceptance: Path, output: Path) -> None:
    """Left: conditional acceptance α_k per draft position at the largest K (EAGLE-3, and where
    measured n-gram and simulated). Middle: acceptance length τ per K, with the K+1 ceiling.
    Right: τ per prompt set at the largest K (one bar per set and temperature)."""
    plt = _pyplot()
    report = read_json(acceptance)
    try:
        ks = sorted(int(k) for k in report["eagle3"])
        sim = report["simulated"]
    except KeyError as e:
        raise DraftflowError(f"{acceptance}: field {e.args[0]!r} missing; not a `draftflow evaluate` output") from None
    if not ks:
        raise DraftflowError(f"{acceptance}: no EAGLE-3 measurement to plot")
    k_max = str(ks[-1])
    ngram = report.get("ngram") or {}
    engine = report.get("engine", "hf")
    fig, (alpha_ax, tau_ax, set_ax) = plt.subplots(1, 3, figsize=(16, 4.2))
    curves = [("eagle3", report["eagle3"][k_max]["alpha"], "o-")]
    curves += [("ngram", ngram[k_max]["alpha"], "s-")] if k_max in ngram else []
    curves += [("simulated", sim["alpha"], "^--")] if sim else []
    for name, alpha, style in curves:
        label = {"eagle3": f"EAGLE-3 ({'real' if engine == 'hf' else engine})", "ngram": "n-gram (real)",
                 "simulated": "EAGLE-3 (simulated)"}[name]  # fmt: skip
        alpha_ax.plot(range(1, len(alpha) + 1), alpha, style, color=COLORS[name], label=label)
    alpha_ax.set(xlabel="draft position k", ylabel="α_k = P(accept k | accepted < k)", ylim=(0, 1.02),
                 title=f"Per-position acceptance, K = {k_max}")  # fmt: skip
    alpha_ax.set_xticks(range(1, int(k_max) + 1))
    alpha_ax.legend()
    width = 0.38
    x = range(len(ks))
    for offset, name in ((-width / 2, "eagle3"), (width / 2, "ngram")):
        if name == "ngram" and not ngram:
            continue
        taus = [report[name][str(k)]["acceptance_length"] for k in ks]
        rects = tau_ax.bar([i + offset for i in x], taus, width, color=COLORS[name],
                           label="EAGLE-3" if name == "eagle3" else "n-gram")  # fmt: skip
        tau_ax.bar_label(rects, labels=[f"{t:.2f}" for t in taus], fontsize=8)
    if sim and sim["draft_tokens"] in ks:  # simulated τ next to the real one at the same K
        x_sim, tau_sim = ks.index(sim["draft_tokens"]) - width / 2, sim["acceptance_length"]
        label = f"EAGLE-3 simulated ({tau_sim:.2f})"
        tau_ax.scatter([x_sim], [tau_sim], marker="^", zorder=3, color=COLORS["simulated"], label=label)
    tau_ax.scatter(list(x), [k + 1 for k in ks], marker="_", s=400, color="black", label="ceiling K+1")
    tau_ax.set_xticks(list(x), [f"K = {k}" for k in ks])
    tau_ax.set(ylabel="τ (tokens per verify step)", title=f"Acceptance length, all prompts ({engine})")
    tau_ax.legend(fontsize=8)
    _plot_sets(set_ax, report, int(k_max))
    _save(fig, output)


def _plot_sets(ax, report: dict, k: int) -> None:
    """τ per prompt set at K (EAGLE-3, n-gram where measured), labelled with the set's size."""
    rows = [r for r in report.get("per_set") or [] if r["draft_tokens"] == k and r["method"] in ("eagle3", "ngram")]
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    temperatures = sorted({r["temperature"] for r in rows})
    series = [(m, t) for m in ("eagle3", "ngram") for t in temperatures if any(r["method"] == m for r in rows)]
    width = 0.8 / max(len(series), 1)
    for j, (method, t) in enumerate(series):
        taus = [next((r["acceptance_length"] for r in rows if r["prompt_set"] == s and r["method"] == method
                      and r["temperature"] == t), 0.0) for s in sets]  # fmt: skip
        label = ("EAGLE-3" if method == "eagle3" else "n-gram") + (f", T = {t:g}" if len(temperatures) > 1 else "")
        rects = ax.bar([i - 0.4 + width * (j + 0.5) for i in range(len(sets))], taus, width,
                       color=COLORS[method], alpha=1.0 - 0.35 * temperatures.index(t), label=label)  # fmt: skip
        ax.bar_label(rects, labels=[f"{v:.2f}" for v in taus], fontsize=7)
    counts = {name: info.get("requests") for name, info in (report.get("prompt_sets") or {}).items()}
    ax.set_xticks(range(len(sets)), [f"{s}\n({counts.get(s)} req.)" for s in sets], fontsize=8)
    ax.axhline(k + 1, color="black", lw=0.8, ls=":", label="ceiling K+1")
    ax.set(ylabel="τ (tokens per verify step)", title=f"Acceptance length per prompt set, K = {k}")
    ax.legend(fontsize=8)


# ---------------------------------------------------------------- CLI

REQUIRED = {
    "lengths": ("train_data",),
    "storage": ("plan", "data_config"),
    "training": ("metrics",),
    "acceptance": ("acceptance",),
}


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--output", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--train-data", type=Path, help="lengths: merged train.jsonl")
    parser.add_argument("--eval-data", type=Path, help="lengths: merged eval.jsonl (optional)")
    parser.add_argument("--manifest", type=Path, help="lengths: merge manifest.json, for max_seq_len (optional)")
    parser.add_argument("--plan", type=Path, help="storage: storage_plan.json")
    parser.add_argument("--data-config", type=Path, help="storage: hidden-state data_config.json")
    parser.add_argument("--metrics", type=Path, help="training: the drafter's metrics.jsonl")
    parser.add_argument("--acceptance", type=Path, help="acceptance: acceptance.json")


def main(args: argparse.Namespace) -> int:
    missing = [f"--{a.replace('_', '-')}" for a in REQUIRED[args.kind] if getattr(args, a) is None]
    if missing:
        raise DraftflowError(f"plot --kind {args.kind} needs {' '.join(missing)}")
    if args.kind == "lengths":
        plot_lengths(args.train_data, args.output, args.eval_data, args.manifest)
    elif args.kind == "storage":
        plot_storage(args.plan, args.data_config, args.output)
    elif args.kind == "training":
        plot_training(args.metrics, args.output)
    else:
        plot_acceptance(args.acceptance, args.output)
    return 0
