"""`draftflow <stage> …`: the command every Snakemake rule runs, and that a user can run by hand.

Each stage module defines `configure_parser(parser, stage)` and `main(args)`; modules are
imported only when their subcommand runs, so light stages do not pay for torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from draftflow.errors import DraftflowError

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
    "export": ("draftflow.engines.export", "export the drafter for SGLang and vLLM"),
    "import-drafter": ("draftflow.engines.export", "import a SpecForge / SGLang-format EAGLE-3 drafter"),
    "plot": ("draftflow.plots", "render a report figure (PNG)"),
}


def settings_arg(text: str) -> dict:
    """Parse the `--settings` JSON that rules pass (the config subtree a stage depends on)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--settings is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--settings must be a JSON object")
    return value


def build_parser(stage: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftflow", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, (module_name, help_text) in STAGES.items():
        stage_parser = sub.add_parser(name, help=help_text)
        if name == stage:  # only the chosen stage's module is imported
            module = importlib.import_module(module_name)
            module.configure_parser(stage_parser, name)
            stage_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stage = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(stage if stage in STAGES else None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        result = args._module.main(args)
    except DraftflowError as e:
        # Errors meant for people: the message, not a traceback.
        if args.verbose:
            raise
        print(f"draftflow {args.stage}: error: {e}", file=sys.stderr)
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
