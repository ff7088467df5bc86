"""Benchmark: build sample_lengths.json for a full-size extraction from its range indexes only.

The user's hand-run pipeline loaded 3.5 TB of tensors to learn sequence lengths.
Here: fabricate the index files of a 37,312-sample extraction in 19 ranges
(`rows_0-2000`, …, `rows_36000-37312`) with realistic lengths (87.8M tokens,
max_seq_len 8192), then time reading them and writing sample_lengths.json.

    .venv/bin/python bench/sample_lengths.py [--workdir DIR] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from draftflow.jsonl import write_json
from draftflow.hidden_states.storage import IndexEntry, find_range_dirs, sample_lengths, write_range_index

SAMPLES, RANGE_SIZE, TOTAL_TOKENS, MAX_SEQ_LEN = 37_312, 2000, 87_793_206, 8192
HIDDEN, LAYERS = 7168, 4  # Kimi-K2.5: what the raw sizes in the index describe


def fake_lengths(rng: np.random.Generator) -> np.ndarray:
    """Long-tailed lengths clipped at max_seq_len, scaled to the user's 87.8M tokens."""
    lengths = np.clip(rng.lognormal(mean=7.4, sigma=0.9, size=SAMPLES), 16, MAX_SEQ_LEN)
    lengths *= TOTAL_TOKENS / lengths.sum()
    return np.clip(lengths.round(), 16, MAX_SEQ_LEN).astype(np.int64)


def fabricate(root: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = fake_lengths(rng)
    digest = hashlib.sha256(b"bench settings").hexdigest()
    meta = {"settings_digest": digest, "store_root": str(root / "store"), "num_layers_captured": LAYERS,
            "hidden_size": HIDDEN, "aux_layer_ids": [2, 30, 58], "dtype": "bfloat16", "split": "train"}  # fmt: skip
    for start in range(0, SAMPLES, RANGE_SIZE):
        end = min(start + RANGE_SIZE, SAMPLES)
        entries = []
        for i in range(start, end):
            T = int(lengths[i])
            raw = T * (8 + 1 + LAYERS * HIDDEN * 2)
            key = hashlib.sha256(f"{digest}{i}".encode()).hexdigest()
            entries.append(IndexEntry(f"A2_kimik25-{key[:16]}", key, T, int(T * 0.6),
                                      f"xxh3_128:{key[:32]}", int(raw * 0.69), raw))  # fmt: skip
        write_range_index(root / "train" / f"rows_{start}-{end}", entries, dict(meta, start=start, end=end))


def build(root: Path) -> dict:
    doc = sample_lengths(find_range_dirs(root))
    write_json(root / "sample_lengths.json", doc)
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to fabricate the indexes (default: a temp folder)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        fabricate(root)
        index_bytes = sum(p.stat().st_size for p in root.glob("train/rows_*/index.json"))
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            doc = build(root)
            times.append(time.perf_counter() - t0)
        result = {
            "ranges": len(find_range_dirs(root)),
            "samples": doc["total_samples"],
            "tokens": doc["total_tokens"],
            "index_bytes_total": index_bytes,
            "seconds_median": round(statistics.median(times), 3),
            "seconds_max": round(max(times), 3),
        }
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
