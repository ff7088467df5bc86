#!/usr/bin/env python3
"""Run `python -m speculators.train ARGS` (speculators 0.9) on a GPU, its fused loss kept.

Under torch 2.11 (the device image) its compiled first step fails in dynamo ("ListVariable
... is already tracked for mutation"): its forward and backward fused-loss kernels share one
`triton.autotune` config list. This launcher first gives the backward kernel an autotuner of its
own with the same configs, key and pruning (`bench/speculators_compare.py`'s
`unshare_fused_loss_autotuner`, with which that bench trains on the H200), then runs its CLI entry
unchanged. `bench/quality_compare.py --spec-kernels own` trains through it on CUDA.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from speculators_compare import unshare_fused_loss_autotuner  # bench/, this script's folder

    unshare_fused_loss_autotuner()
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    spec_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
