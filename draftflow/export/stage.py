"""Stages `draftflow export` and `draftflow import-drafter` (the CLI both rules run).

Export reads the drafter's method from its config.json and hands it to `eagle3.export_eagle3` or
`dflash.export_dflash`, which write sglang/, vllm/ (each with its launch.sh) and export.json
under --output-dir; import-drafter is `importing.import_drafter`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from draftflow.drafters.checkpoint import drafter_method
from draftflow.errors import DraftflowError
from draftflow.export.common import DEFAULT_SGLANG_VERSION, ExportSettings
from draftflow.export.dflash import export_dflash
from draftflow.export.eagle3 import export_eagle3
from draftflow.export.importing import import_drafter
from draftflow.jsonl import read_json

log = logging.getLogger(__name__)


def _is_dflash(drafter_dir: Path) -> bool:
    try:
        return drafter_method(read_json(drafter_dir / "config.json")) == "dflash"
    except FileNotFoundError:
        raise DraftflowError(f"{drafter_dir}: no config.json; not a drafter folder") from None


def export_drafter(drafter_dir: Path, target: Path, settings: ExportSettings, output_dir: Path) -> dict:
    if _is_dflash(drafter_dir):  # the other drafter method: its own layout (dflash.py)
        return export_dflash(drafter_dir, target, settings, output_dir)
    return export_eagle3(drafter_dir, target, settings, output_dir)


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    if stage == "export":
        parser.add_argument(
            "--drafter", type=Path, required=True, help="drafter folder (config.json + model.safetensors)"
        )
        parser.add_argument("--target", type=Path, required=True, help="target model folder")
        parser.add_argument(
            "--settings", type=settings_arg, default={},
            help="config `export` + aux_layer_ids (+ engine_versions, num_speculative_tokens, dtype), as JSON",
        )  # fmt: skip
        parser.add_argument("--output-dir", type=Path, required=True, help="writes sglang/, vllm/ and export.json")
    else:
        parser.add_argument("--from", dest="source", choices=["sglang", "specforge", "speculators"], required=True)
        parser.add_argument(
            "--input", type=Path, required=True,
            help="checkpoint folder (config.json + weights); speculators: an epoch folder or its --save-path "
            "(checkpoint_best, else the latest epoch)",
        )  # fmt: skip
        parser.add_argument("--target", type=Path, required=True, help="target model folder (embedding, layer count)")
        parser.add_argument("--output", type=Path, required=True, help="drafter folder to write")
        parser.add_argument("--sglang-version", default=DEFAULT_SGLANG_VERSION,
                            help="SGLang version an SGLang-format config's aux layer ids were written for")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.stage == "export":
        manifest = export_drafter(args.drafter, args.target, ExportSettings.from_dict(args.settings), args.output_dir)
        if manifest.get("method") != "dflash":
            log.info("exported: sglang ids %s, vllm ids %s -> %s", manifest["sglang"]["eagle_aux_hidden_state_layer_ids"],
                     manifest["vllm"]["eagle_aux_hidden_state_layer_ids"], args.output_dir)  # fmt: skip
    else:
        import_drafter(args.source, args.input, args.target, args.output, args.sglang_version)
    return 0
