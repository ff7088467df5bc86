"""Benchmark: compression ratio and speed of the hidden-state codec (draftflow.storage).

Activations come from a randomly initialized HF LlamaForCausalLM in bf16 (no
downloads): aux layers [1, N//2-1, N-4] + the post-norm final state, i.e. the
[T, 4, H] tensor extraction stores. Reports the stored/raw ratio for plain zstd
and for the byte-plane codec, single-thread encode/decode MB/s (of raw bf16), and
encode throughput of a thread pool (zstd releases the GIL).

    .venv/bin/python bench/storage_codec.py --hidden-size 1024 --layers 8          # CPU, minutes
    python bench/storage_codec.py --hidden-size 4096 --layers 32 --device cuda       # Llama-8B-shaped
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zstandard

from draftflow.storage import CHECKSUM_ALGORITHM, byte_planes, decode_sample, encode_sample


def capture(hidden_size: int, layers: int, lengths: list[int], device: str, seed: int = 0) -> list[torch.Tensor]:
    """[T, 4, H] bf16 activations of a random-weight Llama for random token sequences."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden_size, intermediate_size=int(hidden_size * 3.5), num_hidden_layers=layers,
        num_attention_heads=max(1, hidden_size // 128), num_key_value_heads=max(1, hidden_size // 512),
        vocab_size=32_000, max_position_embeddings=max(lengths),
    )  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    aux = [1, layers // 2 - 1, layers - 4]
    out = []
    for T in lengths:
        ids = torch.randint(0, config.vocab_size, (1, T), device=device)
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
        # hs[i + 1] = output of layer i; hs[-1] = post-norm last state (HF overwrites it)
        out.append(torch.stack([hs[i + 1][0] for i in aux] + [hs[-1][0]], dim=1).cpu().contiguous())
    del model
    return out


def timed(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    t0 = time.perf_counter()
    samples = capture(args.hidden_size, args.layers, args.lengths, args.device)
    capture_s = time.perf_counter() - t0
    raw = sum(h.numel() * 2 for h in samples)
    ids = [np.arange(h.shape[0]) for h in samples]
    encoded = [encode_sample(i, i % 2, h, level=args.level) for i, h in zip(ids, samples)]
    stock = zstandard.ZstdCompressor(level=args.level)  # stock parameters, for comparison with the tuned ones
    stock_planes = sum(min(len(stock.compress(p)), p.size) for h in samples for p in byte_planes(h))
    plain = sum(len(zstandard.ZstdCompressor(level=args.level).compress(h.view(torch.int16).numpy())) for h in samples)
    for data, h in zip(encoded, samples):  # lossless, or the numbers mean nothing
        assert torch.equal(decode_sample(data, check=True).hidden.view(torch.int16), h.view(torch.int16))

    def encode_all():
        for i, h in zip(ids, samples):
            encode_sample(i, i % 2, h, level=args.level)

    def decode_all():
        for data in encoded:
            decode_sample(data)

    enc_s, dec_s = timed(encode_all, args.repeat), timed(decode_all, args.repeat)
    pool = {}
    jobs = [(i, h) for i, h in zip(ids, samples)] * 4
    for n in args.threads:
        with ThreadPoolExecutor(n) as ex:
            s = timed(lambda: list(ex.map(lambda a: encode_sample(a[0], a[0] % 2, a[1], level=args.level), jobs)), 1)
        pool[n] = round(raw * 4 / s / 1e6)
    print(json.dumps({
        "shape": f"[T, 4, {args.hidden_size}] bf16, T in {args.lengths}",
        "model": f"random Llama, {args.layers} layers, device {args.device} (capture {capture_s:.0f} s)",
        "cpus": os.cpu_count(),
        "level": args.level,
        "checksum": CHECKSUM_ALGORITHM,
        "ratio_plain_zstd": round(plain / raw, 4),
        "ratio_byte_planes_stock_zstd": round(stock_planes / raw, 4),
        "ratio_byte_planes": round(sum(map(len, encoded)) / raw, 4),
        "encode_MBps_1_thread": round(raw / enc_s / 1e6),
        "decode_MBps_1_thread": round(raw / dec_s / 1e6),
        "encode_MBps_by_threads": pool,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
