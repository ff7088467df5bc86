#!/usr/bin/env python3
"""Run `python -m speculators.train ARGS` (speculators 0.9) on a machine without a GPU.

Its CLI cannot train on CPU as released, for three device assumptions of
`speculators.train.trainer.Trainer`, none of them in the model or the loss:
  1. it moves the model and every batch to `get_local_rank()`, an int, i.e. CUDA device 0
     ("Cannot access accelerator device when none is available");
  2. it autocasts on `torch.accelerator.current_accelerator().type`, "cuda" when there is none;
  3. its step profiler calls `torch.accelerator.synchronize()`.
This launcher points the three at the CPU (device "cpu", autocast "cpu", profiler off) and then
runs its CLI entry unchanged: same argument parsing, model, data loader, loss, optimizer,
scheduler and checkpoints. With `--hidden-states-dtype float32` CPU autocast stays off (bf16
autocast on CPU exists but is its GPU precision on slow kernels). On a GPU, run its own
`python -m speculators.train` instead.

With SPECULATORS_COMPILE_ON_CPU=1 its `conditional_torch_compile` compiles here too (it compiles
only where CUDA is available): a CPU check that its compiled forward traces with its eager loss,
as `bench/quality_compare.py --spec-kernels compiled` runs it on a GPU.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import os

    import torch

    if os.environ.get("SPECULATORS_COMPILE_ON_CPU") == "1":
        # its model classes decide at import whether to compile their forward: say CUDA is there then
        cuda_is_available = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        import speculators.models  # noqa: F401
        torch.cuda.is_available = cuda_is_available
    import speculators.train.trainer as trainer
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    cpu = torch.device("cpu")
    trainer.get_local_rank = lambda: cpu  # 1. model and batches on the CPU
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"  # 2. autocast on the CPU

    trainer.Trainer.__init__ = cpu_init
    reset = trainer._StepTimer.reset
    trainer._StepTimer.reset = lambda self, enabled: reset(self, False)  # 3. no accelerator syncs
    spec_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
