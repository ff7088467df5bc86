#!/usr/bin/env python3
"""Reconstruction error of fp8 hidden states in a real store: every sample stored in both modes.

A workflow run extracted once with `extract.storage: lossless` and once with `fp8` keeps both
sets of files in its content-keyed store (`results/hidden_states/store`; the keys differ by
mode). This pairs them by token ids and reports, per captured state (aux layers in config
order, then the final post-norm state), the row-wise relative L2 error
||fp8 - lossless|| / ||lossless|| (mean and max over rows, one row = one token of one state),
the largest absolute difference, and the stored size of each mode over raw bytes. No model,
no GPU: it only reads files (each read checked against its header's checksums).

Prints one JSON line.

    .venv/bin/python bench/fp8_store_error.py --hidden-states results/hidden_states
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftflow.hidden_states.storage import SUFFIX, decode_sample, read_header  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-states", type=Path, required=True, help="a run's hidden_states folder (holds store/)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    files: dict[str, dict[bytes, Path]] = {"lossless": {}, "fp8": {}}
    sizes = {"lossless": [0, 0], "fp8": [0, 0]}  # stored, raw (decoded) bytes
    for path in sorted((args.hidden_states / "store").glob(f"*/*/*{SUFFIX}")):
        if path.name.startswith("."):
            continue
        data = path.read_bytes()
        header = read_header(data)
        ids = decode_sample(data, check=True).input_ids.tobytes()
        files[header.storage][ids] = path
        sizes[header.storage][0] += len(data)
        sizes[header.storage][1] += header.raw_nbytes
    pairs = sorted(set(files["lossless"]) & set(files["fp8"]))
    if not pairs:
        raise SystemExit(f"{args.hidden_states}/store holds no sample in both modes: extract once with each")
    rows, max_abs = [], 0.0
    for ids in pairs:
        exact = decode_sample(files["lossless"][ids].read_bytes(), check=True).hidden.double()  # [T, L, H]
        approx = decode_sample(files["fp8"][ids].read_bytes(), check=True).hidden.double()
        rows.append((approx - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-300))  # [T, L]
        max_abs = max(max_abs, float((approx - exact).abs().max()))
    err = torch.cat(rows)  # [sum T, L]
    data_config = args.hidden_states / "data_config.json"
    aux = json.loads(data_config.read_text())["aux_layer_ids"] if data_config.is_file() else None
    names = [f"aux_layer_{i}" for i in aux] + ["final"] if aux else [f"state_{k}" for k in range(err.shape[1])]
    out = {
        "bench": "fp8_store_error",
        "samples": len(pairs),
        "tokens": int(err.shape[0]),
        "row_relative_l2_error": [
            {"state": names[k], "mean": round(float(err[:, k].mean()), 5), "max": round(float(err[:, k].max()), 5)}
            for k in range(err.shape[1])
        ],
        "max_abs_diff": max_abs,
        "stored_over_raw": {m: round(s / r, 4) for m, (s, r) in sizes.items() if r},
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
