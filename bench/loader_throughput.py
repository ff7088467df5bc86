"""The training data loader alone: tokens/s that `make_loader` delivers for EAGLE-3 and DFlash,
with no model, so the loader's own cost is seen apart from the step it feeds (issue 34: DFlash
waited on data for half of each step on the H200, EAGLE-3 1%).

The same fabricated store as `bench/train_throughput.py` (random bf16 hidden states of an
8B-shaped target, written through the storage API, read back compressed from disk); each method
reads the layers it trains on (EAGLE-3: 3 aux + final; DFlash: 5 target layers + final) at its
micro-batch size (EAGLE-3 16,384 tokens packed; DFlash 8,192, one sample a row, anchors drawn in
collate). Reported per method: tokens/s and decoded MB/s through the DataLoader with --workers
processes (the first batch, worker start-up, untimed), and with --profile the top functions of
collate run in this process (cProfile), which say where a batch's time goes.

    python bench/loader_throughput.py --workers 2                 # both methods, side by side
    python bench/loader_throughput.py --workers 2 --profile       # plus where collate spends it
    python bench/loader_throughput.py --tiny                      # seconds, any machine

Prints one JSON line per method.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import LLAMA_31_8B, TINY, fabricate, sample_lengths  # noqa: E402

from draftflow.drafters.dflash import spread_target_layer_ids  # noqa: E402
from draftflow.drafters.train import TrainSettings, make_loader, plan_micro_batches  # noqa: E402
from draftflow.hidden_states.storage import HiddenStateReader  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a quick check")
    p.add_argument("--methods", nargs="+", choices=["eagle3", "dflash"], default=["eagle3", "dflash"])
    p.add_argument("--samples", type=int, help="samples on disk (default 24; tiny 16)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 2048; tiny 128)")
    p.add_argument("--batches", type=int, help="timed batches per method (default 8; tiny 4)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--profile", action="store_true", help="cProfile collate in this process (workers 0)")
    p.add_argument("--data-dir", type=Path, help="where to write the store (default: a temp folder)")
    a = p.parse_args(argv)
    a.samples = a.samples or (16 if a.tiny else 24)
    a.seq_len = a.seq_len or (128 if a.tiny else 2048)
    a.batches = a.batches or (4 if a.tiny else 8)
    return a


def settings_for(method: str, shape: dict, tiny: bool, workers: int) -> TrainSettings:
    """The bench's training settings of `method` (as bench/train_throughput.py trains it)."""
    if method == "dflash":
        layers = 2 if tiny else 5
        ids = tuple(spread_target_layer_ids(shape["num_hidden_layers"], layers))
        dflash = {"num_hidden_layers": layers, "block_size": 8 if tiny else 16, "mask_token_id": 0,
                  "anchors_per_sample": 32 if tiny else 512}  # fmt: skip
        return TrainSettings(aux_layer_ids=ids, batch_tokens=512 if tiny else 8192, num_workers=workers,
                             method="dflash", dflash=dflash)  # fmt: skip
    return TrainSettings(aux_layer_ids=(1, 15, 28), batch_tokens=512 if tiny else 16384, num_workers=workers)


def time_loader(reader, s: TrainSettings, batches: int) -> dict:
    plan = plan_micro_batches(reader.lengths, s, 0)
    plan = (plan * (1 + (batches + 1) // max(1, len(plan))))[: batches + 1]
    loader = iter(make_loader(reader, plan, s, torch.device("cpu"), epoch=0))
    next(loader)  # untimed: worker start-up
    tokens = nbytes = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = next(loader)
        tokens += batch.tokens
        nbytes += batch.aux.numel() * batch.aux.element_size() + batch.final.numel() * batch.final.element_size()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": round(tokens / seconds, 1), "decoded_mb_per_s": round(nbytes / seconds / 1e6, 1),
            "batch_s": round(seconds / batches, 4), "tokens_per_batch": tokens // batches}  # fmt: skip


def profile_collate(reader, s: TrainSettings, batches: int) -> str:
    """The top functions of `batches` batches read and collated in this process."""
    s0 = dataclasses.replace(s, num_workers=0)
    plan = plan_micro_batches(reader.lengths, s0, 0)[:batches]
    prof = cProfile.Profile()
    prof.enable()
    for _ in make_loader(reader, plan, s0, torch.device("cpu"), epoch=0):
        pass
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
    return out.getvalue()


def main(argv=None) -> None:
    a = parse_args(argv)
    shape = TINY if a.tiny else LLAMA_31_8B
    torch.set_num_threads(1)  # the loop only collects batches; the workers do the work
    lengths = sample_lengths(a.samples, a.seq_len, False)
    for method in a.methods:
        s = settings_for(method, shape, a.tiny, a.workers)
        root = Path(tempfile.mkdtemp(prefix="draftflow-loader-bench-", dir=a.data_dir))
        try:
            layers = len(s.aux_layer_ids) + 1
            range_dir, ratio = fabricate(root, lengths, shape["hidden_size"], shape["vocab_size"], L=layers)
            reader = HiddenStateReader([range_dir], verify=True)
            result = {"bench": "loader_throughput", "method": method, "shape": "tiny" if a.tiny else "llama-3.1-8b",
                      "layers_read": layers, "batch_tokens": s.batch_tokens, "workers": a.workers,
                      "stored_over_raw": round(ratio, 3), **time_loader(reader, s, a.batches)}  # fmt: skip
            print(json.dumps(result), flush=True)
            if a.profile:
                print(profile_collate(reader, s, min(a.batches, 3)), file=sys.stderr)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
