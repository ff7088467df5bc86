"""How far a lossless re-layout of stored hidden states could go (issue 34, item 3: fp8 at <= 0.35
of raw with τ unchanged), measured on a real model's states.

A re-layout that keeps every stored byte (channel-major order, per-channel entropy tables) decodes
to the same values, so τ cannot move; what it can save is bounded by the order-0 entropy of the
stored bytes given their channel. This bench captures a real target's states the way extraction
does (`HfCaptureEngine`: the default aux layers + the final post-norm state, computed in float32
and stored as bf16), on the kept SmolLM2 regenerated conversations, and reports per stored byte
stream:

* H0: order-0 entropy (bits per byte), what zstd's Huffman stage approaches on the stream as stored;
* H|channel: the mean over channels (layer × hidden index) of each channel's own order-0 entropy,
  the bound of any coder with one table per channel;
* zstd (level 1, as extraction writes) of the stream token-major (as stored) and channel-major;
* the codec's own file size (`encode_sample`), lossless and fp8, as a share of raw bf16.

    make real-model    # once: real/smollm2-135m-instruct
    .venv/bin/python bench/storage_entropy.py --conversations 32

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import torch
import zstandard

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout

from draftflow.engines.hf_capture import HfCaptureEngine  # noqa: E402
from draftflow.hidden_states.storage import byte_planes, encode_sample, quantize_fp8  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=REPO / "real" / "smollm2-135m-instruct")
    p.add_argument("--conversations", type=Path, default=REPO / "bench" / "data" / "smollm2_sharegpt_regenerated.jsonl.gz")
    p.add_argument("--count", type=int, default=32, help="conversations to capture")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per conversation at most")
    return p.parse_args(argv)


def entropy(stream: np.ndarray) -> float:
    """Order-0 entropy of a uint8 array, bits per byte."""
    counts = np.bincount(stream.ravel(), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def per_channel_entropy(rows: np.ndarray) -> float:
    """Mean over columns of each column's order-0 entropy: rows [tokens, channels] uint8."""
    return float(np.mean([entropy(rows[:, c]) for c in range(rows.shape[1])]))


def zstd_size(streams: list[np.ndarray]) -> int:
    compressor = zstandard.ZstdCompressor(level=1)
    return sum(len(compressor.compress(np.ascontiguousarray(s).tobytes())) for s in streams)


def capture(a: argparse.Namespace) -> tuple[list[torch.Tensor], list[int]]:
    """([T, L, H] bf16 per conversation, as extraction stores it (float32 compute on the CPU), aux ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.target)
    engine = HfCaptureEngine.from_settings({"dtype": "float32"}, a.target, ["cpu"])
    ids = []
    with gzip.open(a.conversations, "rt") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            ids.append(np.asarray(tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)[: a.max_tokens])
            if len(ids) == a.count:
                break
    with torch.no_grad():
        return [h.to(torch.bfloat16).clone() for h in engine.capture(ids)], engine.aux_layer_ids


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(2)
    samples, aux = capture(a)
    tokens = sum(s.shape[0] for s in samples)
    raw = sum(s.numel() * 2 for s in samples)
    planes = [byte_planes(s) for s in samples]  # per sample: [high, low] uint8 [T*L*H]
    codes = [quantize_fp8(s).codes.numpy() for s in samples]  # per sample [T, L, H] uint8

    def rows(parts: list[np.ndarray]) -> np.ndarray:  # -> [tokens, L*H]
        return np.concatenate([p.reshape(s.shape[0], -1) for p, s in zip(parts, samples)])

    def channel_major(parts: list[np.ndarray]) -> list[np.ndarray]:
        return [p.reshape(s.shape[0], -1).T for p, s in zip(parts, samples)]

    streams = {"bf16 high byte (sign, exponent)": [p[0] for p in planes], "bf16 low byte": [p[1] for p in planes],
               "fp8 codes": [c.reshape(-1) for c in codes]}  # fmt: skip
    report = {}
    for name, parts in streams.items():
        report[name] = {
            "H0_bits": round(entropy(rows(parts)), 3),
            "H_given_channel_bits": round(per_channel_entropy(rows(parts)), 3),
            "zstd_token_major_of_raw": round(zstd_size(parts) / raw, 4),
            "zstd_channel_major_of_raw": round(zstd_size(channel_major(parts)) / raw, 4),
        }
    n = [np.zeros(s.shape[0], np.int64) for s in samples]
    m = [np.zeros(s.shape[0], np.uint8) for s in samples]
    lossless = sum(len(encode_sample(i, k, s)) for i, k, s in zip(n, m, samples)) / raw
    fp8 = sum(len(encode_sample(i, k, s, storage="fp8")) for i, k, s in zip(n, m, samples)) / raw
    fp8_bound = report["fp8 codes"]["H_given_channel_bits"] / 16  # bits per value over raw bf16's 16
    print(json.dumps({
        "bench": "storage_entropy", "target": a.target.name, "conversations": len(samples), "tokens": tokens,
        "aux_layer_ids": aux, "hidden_size": samples[0].shape[2], "streams": report,
        "codec_lossless_of_raw": round(lossless, 4), "codec_fp8_of_raw": round(fp8, 4),
        "fp8_per_channel_bound_of_raw": round(fp8_bound, 4),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
