"""Hidden-state storage: a compressed, crash-safe, content-keyed sample store plus range indexes.

LAYOUT: a sample's hidden tensor is [T, L, H] with L = number of aux layers + 1;
hidden[:, :-1] are the aux layers in config order and hidden[:, -1] is the final
post-norm state (the slot layout of speculators' `hidden_states [T, 4, H]`, whose
last slot is the pre-norm state though: `draftflow.hidden_states.interop` converts it).

Three pieces (DESIGN.md §4):

* **Sample files** (`encode_sample` / `decode_sample`), one per sample, lossless:

      b"DFHS" | u16 format version | u32 header length | header JSON | sections…

  The header records T, L, H, dtype, loss_tokens, and for each section its codec
  and byte sizes, plus a checksum of the raw (uncompressed) payload. Sections are
  `input_ids` (int64), `loss_mask` (uint8) and the hidden tensor split into byte
  planes, most significant byte first (bf16/fp16: all high bytes, then all low
  bytes; fp32: 4 planes). Sign and exponent bits live in the high byte and are very
  compressible; the low mantissa bytes are nearly random, so each plane is
  compressed on its own with zstd and kept raw when zstd does not shrink it.

* **fp8 sample files** (`extract.storage: fp8`, format version 2): the hidden tensor is
  stored as float8_e4m3fn with a power-of-two scale per row (token × state), about 0.39
  of raw bf16 on disk instead of 0.70; see `quantize_fp8`. Same container, checksums and
  store; `decode_sample` returns the capture dtype either way. `extract.storage: fp8_aux`
  writes the same file with the final state kept lossless (its fp8 slot holds zero codes
  and its values are byte-plane sections of their own): the trainer's targets come from
  the final state, and fp8's error there moves them (BENCHMARKS.md, "fp8 storage against
  lossless at the recipe").

* **The store** (`SampleStore`): `root/ab/cd/<key>.dfhs`, keyed by
  `sample_key(settings_digest, input_ids)`, so a sample is reused whenever the
  capture settings and tokens are unchanged, whatever range it falls in. Files are
  written to a temp name, fsynced and renamed: a file under its final name is
  always complete. The store lives outside Snakemake's declared outputs.

* **Range indexes** (`range_dir/index.json`): the per-range list of samples with
  length, loss tokens, key, file checksum and sizes. Lengths, totals and reader
  metadata come from these small files only, never from tensor data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from draftflow.errors import DraftflowError
from draftflow.jsonl import atomic_path, fsync_dir

MAGIC = b"DFHS"
FORMAT_VERSION = 1  # lossless sample files
FP8_FORMAT_VERSION = 2  # fp8 sample files (older draftflow refuses them instead of misreading them)
STORAGE_MODES = ("lossless", "fp8", "fp8_aux")  # extract.storage
FP8_MODES = ("fp8", "fp8_aux")  # the modes written as fp8 (version 2) files
INDEX_FORMAT_VERSION = 1
SUFFIX = ".dfhs"
INDEX_NAME = "index.json"
TEMP_MARK = ".tmp-"
_PREAMBLE = struct.Struct("<4sHI")  # magic, format version, header length

# torch dtype <- name; numpy integer view of the same width (numpy has no bfloat16)
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_INT_VIEW: dict[int, tuple[torch.dtype, np.dtype]] = {
    2: (torch.int16, np.dtype("<i2")),
    4: (torch.int32, np.dtype("<i4")),
}

if sys.byteorder != "little":  # byte planes and np.frombuffer assume little-endian memory
    raise ImportError("draftflow.hidden_states.storage needs a little-endian machine")


# ---------------------------------------------------------------- checksums

try:  # xxh3 is ~10x faster than blake2b; both are far faster than disk
    import xxhash

    CHECKSUM_ALGORITHM = "xxh3_128"
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None
    CHECKSUM_ALGORITHM = "blake2b128"


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        if xxhash is None:
            raise DraftflowError("checksum uses xxh3_128 but the 'xxhash' package is not installed")
        return xxhash.xxh3_128()
    if algorithm == "blake2b128":
        return hashlib.blake2b(digest_size=16)
    raise DraftflowError(f"unknown checksum algorithm {algorithm!r}")


def checksum(*chunks: bytes | memoryview | np.ndarray, algorithm: str | None = None) -> str:
    """Self-describing checksum `"<algorithm>:<hex>"` of the concatenated chunks."""
    algorithm = algorithm or CHECKSUM_ALGORITHM
    h = _hasher(algorithm)
    for chunk in chunks:
        h.update(chunk)
    return f"{algorithm}:{h.hexdigest()}"


def verify_checksum(expected: str, *chunks: bytes | memoryview | np.ndarray) -> bool:
    """True when the chunks hash to `expected` (using the algorithm it names)."""
    algorithm, _, _ = expected.partition(":")
    return checksum(*chunks, algorithm=algorithm) == expected


# ---------------------------------------------------------------- samples


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T] uint8
    hidden: torch.Tensor  # [T, L, H], dtype as stored
    fp8: Fp8Hidden | None = None  # fp8 files: the stored codes and scales `hidden` decodes from

    @property
    def aux(self) -> torch.Tensor:
        return self.hidden[:, :-1]  # [T, L-1, H]

    @property
    def final(self) -> torch.Tensor:
        return self.hidden[:, -1]  # [T, H]


@dataclass(frozen=True)
class SampleHeader:
    """The decoded header of a sample file: everything but the tensor data."""

    length: int  # T
    num_layers: int  # L (aux layers + final)
    hidden_size: int  # H
    dtype: str
    loss_tokens: int
    level: int
    raw_checksum: str  # of input_ids, loss_mask and hidden bytes, uncompressed
    sections: tuple[dict, ...]  # {"name", "codec": "zstd"|"raw", "nbytes", "raw_nbytes"}
    data_offset: int  # where the first section starts
    storage: str = "lossless"  # lossless | fp8 | fp8_aux
    payload_checksum: str | None = None  # of the stored section bytes (files written before it: None)

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the sample as the reader returns it: input_ids + loss_mask + hidden in `dtype`."""
        if self.storage in FP8_MODES:  # its sections hold 1 byte per value: count what it decodes to
            return 9 * self.length + math.prod(self.shape) * DTYPES[self.dtype].itemsize
        return sum(s["raw_nbytes"] for s in self.sections)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.length, self.num_layers, self.hidden_size)


_local = threading.local()


def compression_params(level: int) -> zstandard.ZstdCompressionParameters:
    """zstd parameters for byte planes at `level`.

    Exponent planes are low-entropy but hold almost no long repeats, so for the fast
    strategy (levels 1-2) a small hash table and 7-byte minimum matches leave the work
    to the entropy coder: on Llama-8B-shaped activations ~2.5x faster than stock level 1
    and smaller (high plane 0.35 vs 0.37 of raw). The output is ordinary zstd.
    """
    params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True)
    if level >= 1 and params.strategy == zstandard.STRATEGY_FAST:
        params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True, hash_log=8, min_match=7)
    return params


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # Compressor objects are not thread-safe; one per thread and level.
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(compression_params=compression_params(level))
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


_PROBE_BYTES = 1 << 18  # sections larger than 4x this are probed before compressing in full
_PROBE_MIN_SAVING = 0.01  # a probe that saves less than 1% means "store raw"


def _pack(name: str, raw: np.ndarray, level: int) -> tuple[dict, bytes | memoryview]:
    """Compress one section; keep it raw when zstd does not make it smaller."""
    raw_bytes = memoryview(np.ascontiguousarray(raw)).cast("B")
    n = len(raw_bytes)
    # Low mantissa planes are near-random: a probe of the middle skips a futile full pass (~20% of encode time).
    if n > 4 * _PROBE_BYTES:
        probe = raw_bytes[n // 2 : n // 2 + _PROBE_BYTES]
        if len(_compressor(level).compress(probe)) > (1 - _PROBE_MIN_SAVING) * _PROBE_BYTES:
            return {"name": name, "codec": "raw", "nbytes": n, "raw_nbytes": n}, raw_bytes
    packed = _compressor(level).compress(raw_bytes)
    if len(packed) < n:
        return {"name": name, "codec": "zstd", "nbytes": len(packed), "raw_nbytes": n}, packed
    return {"name": name, "codec": "raw", "nbytes": n, "raw_nbytes": n}, raw_bytes


def byte_planes(hidden: torch.Tensor) -> list[np.ndarray]:
    """Split a tensor's bytes into planes, most significant byte first: itemsize × [numel] uint8.

    One pass per plane, no other copy. Byte j of every element is the low byte of the
    itemsize-wide unsigned ints that start j bytes in (an unaligned view), so each plane
    is a truncating cast: ~2x faster than copying the stride-itemsize byte column, and
    numpy releases the GIL for it.
    """
    itemsize = hidden.element_size()
    flat = hidden.detach().contiguous().view(_INT_VIEW[itemsize][0]).numpy().reshape(-1)  # a view
    unsigned = flat.view(np.dtype(f"<u{itemsize}"))  # [numel]
    raw = unsigned.view(np.uint8)  # [numel * itemsize], little-endian
    n = unsigned.size
    planes = []
    for k in range(itemsize):
        j = itemsize - 1 - k  # byte j of each element, most significant first
        plane = np.empty(n, dtype=np.uint8)
        if j == 0:
            np.copyto(plane, unsigned, casting="unsafe")
        elif n:
            shifted = np.frombuffer(raw, dtype=unsigned.dtype, count=n - 1, offset=j)  # [numel - 1], unaligned
            np.copyto(plane[:-1], shifted, casting="unsafe")
            plane[-1] = raw[-itemsize + j]
        planes.append(plane)
    return planes


Buffer = bytes | bytearray | memoryview  # one piece of a sample file


def encode_sample_parts(
    input_ids, loss_mask, hidden: torch.Tensor | Fp8Hidden, level: int = 1, storage: str = "lossless"
) -> list[Buffer]:
    """Serialize one sample as a list of buffers: preamble + header, then sections.

    `b"".join(parts)` is the file (`encode_sample`), but `SampleStore.put` writes the parts
    as they are, with os.writev: joining tens of MB of compressed and raw planes would hold
    the GIL for the whole copy (bytes.join keeps it whenever a part is not `bytes`) and cap a
    writer thread pool, whatever its size. Raw sections are views of fresh arrays, never of
    `hidden`, so the caller may reuse hidden's memory as soon as this returns.

    `storage="fp8"` / `"fp8_aux"` (or an `Fp8Hidden` as `hidden`, already quantized): an fp8
    file, see `encode_fp8_parts`.
    """
    if storage not in STORAGE_MODES:
        raise ValueError(f"unknown storage {storage!r}; use one of {', '.join(STORAGE_MODES)}")
    if storage in FP8_MODES or isinstance(hidden, Fp8Hidden):
        if not isinstance(hidden, Fp8Hidden):
            hidden = quantize_for_storage(hidden.detach(), storage)
        elif storage in FP8_MODES and (hidden.final is not None) != (storage == "fp8_aux"):
            hidden = convert_fp8(hidden, storage)  # e.g. an interop conversion between the two modes
        return encode_fp8_parts(input_ids, loss_mask, hidden, level)
    ids = np.array(input_ids, dtype=np.int64).reshape(-1)  # [T], a copy: raw sections may view it
    mask = np.array(loss_mask, dtype=np.uint8).reshape(-1)  # [T], a copy
    hidden = hidden.detach().to("cpu").contiguous()
    dtype = _dtype_name(hidden.dtype)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [T, L, H], got shape {tuple(hidden.shape)}")
    T, L, H = hidden.shape
    if ids.shape[0] != T or mask.shape[0] != T:
        raise ValueError(
            f"input_ids [{ids.shape[0]}], loss_mask [{mask.shape[0]}] and hidden [{T}, …] differ in length"
        )
    if mask.size and mask.max() > 1:
        raise ValueError("loss_mask must contain only 0 and 1")

    raw_hidden = hidden.view(_INT_VIEW[hidden.element_size()][0]).numpy()  # a view
    raw_sum = checksum(ids, mask, raw_hidden)
    sections = [_pack("input_ids", ids, level), _pack("loss_mask", mask, level)]
    sections += [_pack(f"hidden.plane{k}", plane, level) for k, plane in enumerate(byte_planes(hidden))]

    header = {
        "T": T, "L": L, "H": H, "dtype": dtype, "loss_tokens": int(mask.sum()),
        "codec": "zstd-byteplanes", "level": level, "raw_checksum": raw_sum,
        "sections": [meta for meta, _ in sections],
        # What the file holds after its header: lets a reader check a file without an index
        # entry (a reused sample being re-indexed) by hashing, not decoding.
        "payload_checksum": checksum(*(data for _, data in sections)),
    }  # fmt: skip
    header_bytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    parts: list[Buffer] = [_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header_bytes)) + header_bytes]
    return parts + [data for _, data in sections]


def encode_sample(
    input_ids, loss_mask, hidden: torch.Tensor | Fp8Hidden, level: int = 1, storage: str = "lossless"
) -> bytes:
    """Serialize one sample into one bytes object. hidden: [T, L, H] bf16/fp16/fp32 on any device.

    Writers should prefer `encode_sample_parts` + `SampleStore.put`, which skip this join.
    """
    return b"".join(encode_sample_parts(input_ids, loss_mask, hidden, level, storage))


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported hidden-state dtype {dtype}; use one of {sorted(DTYPES)}")


def read_header(data: bytes | memoryview, size: int | None = None) -> SampleHeader:
    """Parse a sample file's header (no decompression). Raises ValueError on a malformed file.

    `size`: the whole file's size when `data` is only its beginning (at least the header).
    """
    data = memoryview(data)
    size = len(data) if size is None else size
    if min(size, len(data)) < _PREAMBLE.size:
        raise ValueError(f"file too short ({size} bytes) for a sample header")
    magic, version, header_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a draftflow sample file (magic {bytes(magic)!r})")
    if version not in (FORMAT_VERSION, FP8_FORMAT_VERSION):
        raise ValueError(
            f"sample format version {version} is not supported (this draftflow reads {FORMAT_VERSION} and {FP8_FORMAT_VERSION})"
        )
    start = _PREAMBLE.size
    if min(size, len(data)) < start + header_len:
        raise ValueError("file truncated inside the header")
    try:
        h = json.loads(bytes(data[start : start + header_len]))
        header = SampleHeader(
            length=int(h["T"]), num_layers=int(h["L"]), hidden_size=int(h["H"]), dtype=str(h["dtype"]),
            loss_tokens=int(h["loss_tokens"]), level=int(h["level"]), raw_checksum=str(h["raw_checksum"]),
            sections=tuple(h["sections"]), data_offset=start + header_len, storage=str(h.get("storage", "lossless")),
            payload_checksum=h.get("payload_checksum"),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt sample header: {e}") from None
    if header.dtype not in DTYPES:
        raise ValueError(f"corrupt sample header: unknown dtype {header.dtype!r}")
    if (header.storage in FP8_MODES) != (version == FP8_FORMAT_VERSION) or header.storage not in STORAGE_MODES:
        raise ValueError(f"corrupt sample header: storage {header.storage!r} in a version {version} file")
    expected = header.data_offset + sum(s["nbytes"] for s in header.sections)
    if expected != size:
        raise ValueError(f"file size {size} does not match its header ({expected} bytes)")
    return header


def _byte_views(data: Buffer | list[Buffer] | tuple[Buffer, ...]) -> list[memoryview]:
    """A sample file given as one buffer or as a list (tuple) of buffers -> flat byte views of its non-empty parts."""
    parts = data if isinstance(data, (list, tuple)) else [data]
    views = [memoryview(p) for p in parts]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views if v.nbytes]


def _leading_bytes(views: list[memoryview], n: int) -> bytes | memoryview:
    """The first n bytes of the concatenated views (fewer if they are shorter), copying only when split."""
    if views and len(views[0]) >= n:
        return views[0][:n]
    out = bytearray()
    for v in views:
        out += v[: n - len(out)]
        if len(out) >= n:
            break
    return bytes(out)


def _header_of_parts(views: list[memoryview]) -> SampleHeader:
    size = sum(len(v) for v in views)
    preamble = _leading_bytes(views, _PREAMBLE.size)
    header_len = _PREAMBLE.unpack_from(preamble)[2] if len(preamble) == _PREAMBLE.size else 0
    return read_header(_leading_bytes(views, _PREAMBLE.size + header_len), size)


_IOV_MAX = 1024  # buffers per writev call (Linux's limit); a sample file has ~6


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write every view to fd in order: os.writev (no joining copy, no GIL), looping on partial writes."""
    pending = list(views)
    if not hasattr(os, "writev"):  # pragma: no cover - Windows
        for v in pending:
            while len(v):
                v = v[os.write(fd, v) :]
        return
    i = 0
    while i < len(pending):
        written = os.writev(fd, pending[i : i + _IOV_MAX])
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        while written:  # drop what was written; the partly written buffer keeps its tail
            n = len(pending[i])
            if written >= n:
                written -= n
                i += 1
            else:
                pending[i] = pending[i][written:]
                written = 0


def _unpack(section: dict, payload: memoryview) -> memoryview | bytes:
    if section["codec"] == "raw":
        return payload
    if section["codec"] == "zstd":
        try:
            out = _decompressor().decompress(payload, max_output_size=section["raw_nbytes"])
        except zstandard.ZstdError as e:
            raise ValueError(f"section {section['name']}: {e}") from None
        if len(out) != section["raw_nbytes"]:
            raise ValueError(
                f"section {section['name']}: decompressed to {len(out)} bytes, expected {section['raw_nbytes']}"
            )
        return out
    raise ValueError(f"section {section['name']}: unknown codec {section['codec']!r}")


def _join_planes(planes: list[np.ndarray]) -> np.ndarray:
    """Inverse of byte_planes: itemsize × [numel] uint8, most significant first -> [numel] signed ints."""
    itemsize = len(planes)
    if itemsize == 2:  # shift-or runs on whole vectors: ~30% faster than two strided byte scatters
        out = np.empty(planes[0].size, dtype=np.uint16)
        out[:] = planes[0]
        out <<= 8
        out |= planes[1]
        return out.view(_INT_VIEW[2][1])
    cols = np.empty((planes[0].size, itemsize), dtype=np.uint8)  # [numel, itemsize], little-endian bytes
    for k, plane in enumerate(planes):
        cols[:, itemsize - 1 - k] = plane
    return cols.reshape(-1).view(_INT_VIEW[itemsize][1])


def decode_sample(data: bytes, check: bool = False, fp8_codes: bool = False) -> Sample:
    """Inverse of `encode_sample`. With check=True also verify the raw-payload checksum.

    fp8 files decode to the capture dtype; fp8_codes=True also returns the stored codes and
    scales (`Sample.fp8`), for checks and exact conversions.
    """
    view = memoryview(data)
    header = read_header(view)
    T, L, H = header.shape
    offset = header.data_offset
    raw: dict[str, memoryview | bytes] = {}
    for section in header.sections:
        raw[section["name"]] = _unpack(section, view[offset : offset + section["nbytes"]])
        offset += section["nbytes"]

    if header.storage in FP8_MODES:
        return _decode_fp8(header, raw, check, fp8_codes)
    torch_dtype = DTYPES[header.dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    numel = T * L * H
    as_int = _join_planes([np.frombuffer(raw[f"hidden.plane{k}"], np.uint8, count=numel) for k in range(itemsize)])
    ids = np.frombuffer(raw["input_ids"], dtype="<i8", count=T).copy()  # small: copy to own writable memory
    mask = np.frombuffer(raw["loss_mask"], dtype=np.uint8, count=T).copy()
    if check and not verify_checksum(header.raw_checksum, ids, mask, as_int):
        raise ValueError("raw-payload checksum mismatch")
    hidden = torch.from_numpy(as_int).view(torch_dtype).reshape(T, L, H)
    return Sample(input_ids=ids, loss_mask=mask, hidden=hidden)


# ---------------------------------------------------------------- fp8 storage
#
# A row is one token's vector of one captured state: hidden[t, l] ([H] values). It is stored
# as float8_e4m3fn codes c (1 byte each) and one scale exponent k (int8): value = c × 2^k.
#
# * Power-of-two scales: dividing by 2^k is exact, so the only rounding is the cast to e4m3
#   (3 mantissa bits: relative error <= 2^-4 in the normal range), and c × 2^k is exactly a
#   bf16 (or fp32) number: every reader, speculators' `fp8.to(bf16) * scale.to(bf16)`
#   included, decodes the same bits.
# * k is the larger of (a) the smallest k that fits the row's max into e4m3 (<= 448) and
#   (b) the k that puts the row's RMS in [2^-4, 2^-3). (b) spends e4m3's many small
#   binades on nothing: values under RMS/8 land on e4m3's subnormal grid (absolute step
#   RMS/64 or finer, far below the ~RMS/4 steps of the largest values), which leaves the
#   row's relative L2 error at ~2.7% and cuts the stored size by ~5%. Rows with outliers
#   (max >> RMS) are governed by (a), as with a plain absmax scale.
# * On disk the codes of state l > 0 carry their sign XOR the sign of state l-1 at the same
#   token and channel: consecutive residual-stream states mostly agree in sign, so zstd's
#   entropy coder sees a skewed sign bit (~2% smaller); the transform is undone on read.
# * An all-zero row has k = 0 and decodes to exact zeros; k is clamped to
#   [FP8_MIN_EXP, FP8_MAX_EXP] so that c × 2^k is always a finite, normal bf16 number.

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_RMS_EXPONENT = -4  # (b) above: a row's RMS lands in [2^-4, 2^-3) of the e4m3 grid
FP8_MIN_EXP, FP8_MAX_EXP = -117, 119  # 2^-9 (smallest code) × 2^-117 = 2^-126; 448 × 2^119 < bf16 max
_FP8_NAN = (0x7F, 0xFF)  # the only non-finite e4m3fn codes (no infinities)


@dataclass(frozen=True)
class Fp8Hidden:
    """A [T, L, H] hidden tensor as fp8 codes and a power-of-two scale per row (see above);
    with `final` (fp8_aux), the last state kept as it was captured and its code slot all zeros."""

    codes: torch.Tensor  # [T, L, H] uint8: float8_e4m3fn bit patterns
    exps: torch.Tensor  # [T, L] int8: row (t, l) is codes[t, l] × 2^exps[t, l]
    dtype: torch.dtype  # what it decodes to: the capture dtype
    final: torch.Tensor | None = None  # [T, H] in `dtype`: fp8_aux's lossless final state

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.codes.shape)

    def cpu(self) -> Fp8Hidden:
        if not self.codes.is_cuda:
            return self
        final = None if self.final is None else self.final.cpu()
        return Fp8Hidden(self.codes.cpu(), self.exps.cpu(), self.dtype, final)

    def dequantize(self) -> torch.Tensor:
        """[T, L, H] in `dtype` (on the CPU)."""
        hidden = dequantize_fp8(self.codes.cpu().numpy(), self.exps.cpu().numpy(), self.dtype)
        if self.final is not None:
            hidden[:, -1] = self.final.cpu()
        return hidden


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """int32 tensor e in [-126, 127] -> float32 2^e, exactly (built from its bit pattern)."""
    return ((e + 127) << 23).view(torch.float32)


def quantize_fp8(hidden: torch.Tensor, check: bool = True) -> Fp8Hidden:
    """[T, L, H] float on any device -> `Fp8Hidden` on the same device (torch ops only: runs on the GPU).

    check: refuse non-finite values (ValueError); the extraction driver checks them itself
    (per layer, without a GPU sync) and passes check=False.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [T, L, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in DTYPES.values():
        raise ValueError(f"unsupported hidden-state dtype {hidden.dtype}; use one of {sorted(DTYPES)}")
    if check and not bool(torch.isfinite(hidden).all()):
        bad = (~torch.isfinite(hidden)).nonzero()[0].tolist()
        raise ValueError(f"hidden[{bad[0]}, {bad[1]}, {bad[2]}] is not finite: NaN/inf cannot be stored as fp8")
    amax = hidden.abs().amax(dim=-1).float()  # [T, L]
    mant, exp = torch.frexp(amax)  # amax = mant × 2^exp, mant in [0.5, 1)
    k_max = (exp - 9 + (mant > FP8_MAX / 512).int()).clamp_(FP8_MIN_EXP, FP8_MAX_EXP)  # least k: amax / 2^k <= 448
    scaled = hidden.float() * _pow2(-k_max)[..., None]  # exact; max |.| <= 448 (unless k hit FP8_MAX_EXP)
    # The RMS of the scaled row, not of the row: its squares neither underflow nor overflow fp32.
    rms = torch.linalg.vector_norm(scaled, dim=-1) / math.sqrt(hidden.shape[-1])  # [T, L]
    shift = (torch.frexp(rms)[1] - 1 - FP8_RMS_EXPONENT).clamp_(min=0)  # floor(log2 rms) - target, <= 12
    k = torch.minimum(k_max + shift, torch.full_like(k_max, FP8_MAX_EXP))
    k = torch.where(amax > 0, k, torch.zeros_like(k))  # all-zero rows: scale 1, codes 0
    scaled.mul_(_pow2(k_max - k)[..., None]).clamp_(-FP8_MAX, FP8_MAX)  # tiny values may underflow: they round to 0
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return Fp8Hidden(codes, k.to(torch.int8), hidden.dtype)


def quantize_for_storage(hidden: torch.Tensor, storage: str, check: bool = True) -> Fp8Hidden:
    """[T, L, H] -> the `Fp8Hidden` an fp8 (`fp8`) or fp8-aux (`fp8_aux`) file stores."""
    q = quantize_fp8(hidden, check)  # fp8_aux too: `check` then covers the final state as well
    if storage == "fp8":
        return q
    q.codes[:, -1], q.exps[:, -1] = 0, 0  # fresh tensors: the final state's slot, all-zero rows at scale 2^0
    return Fp8Hidden(q.codes, q.exps, q.dtype, hidden[:, -1].clone())


def convert_fp8(q: Fp8Hidden, storage: str, final: torch.Tensor | None = None) -> Fp8Hidden:
    """q as the other fp8 mode stores it. fp8 -> fp8_aux keeps `final` ([T, H]; default: the
    decoded fp8 final state, whose error cannot be undone); fp8_aux -> fp8 quantizes its final."""
    if storage == "fp8":
        if q.final is None:
            return q
        last = quantize_fp8(q.final[:, None, :].to(q.codes.device))
        codes, exps = q.codes.clone(), q.exps.clone()
        codes[:, -1:], exps[:, -1:] = last.codes, last.exps
        return Fp8Hidden(codes, exps, q.dtype)
    if final is None:
        final = q.final if q.final is not None else q.dequantize()[:, -1]
    codes, exps = q.codes.clone(), q.exps.clone()
    codes[:, -1], exps[:, -1] = 0, 0  # the final state's slot: all-zero rows, scale 2^0
    return Fp8Hidden(codes, exps, q.dtype, final.detach().to(q.dtype).clone())


def _fp8_values() -> torch.Tensor:
    """[256] float32: the value of every e4m3fn code (NaN for 0x7F, 0xFF)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def dequantize_fp8(codes: np.ndarray, exps: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """codes [T, L, H] uint8 and exps [T, L] int8 -> [T, L, H] `dtype` (CPU), exactly codes × 2^exps.

    bf16 / fp32: one table lookup per code (its value's bit pattern), then 2^k is added to
    the exponent field as an integer (exact: the result stays a normal number for k within
    [FP8_MIN_EXP, FP8_MAX_EXP]), and zero codes get their bits back. Other dtypes, or
    exponents out of range (a damaged file): a (code, exponent) table, saturating at the
    dtype's largest finite value.
    """
    mantissa_bits = {torch.bfloat16: 7, torch.float32: 23}.get(dtype)
    int_dtype, np_int = _INT_VIEW[dtype.itemsize]
    in_range = not exps.size or (exps.min() >= FP8_MIN_EXP and exps.max() <= FP8_MAX_EXP)
    if mantissa_bits is None or not in_range:
        distinct = np.unique(exps)  # sorted, usually a handful
        scales = torch.from_numpy(np.ldexp(1.0, distinct.astype(np.int32)))  # [n] float64, exact
        values = _fp8_values().double()[None, :] * scales[:, None]  # [n, 256], exact: <= 4 significant bits
        finite = torch.finfo(dtype).max
        table = values.clamp(-finite, finite).to(dtype).view(int_dtype).reshape(-1).numpy()
        index = codes.astype(np.uint16)  # [T, L, H]
        index |= (np.searchsorted(distinct, exps).astype(np.uint16) << 8)[..., None]
        return torch.from_numpy(np.take(table, index)).view(dtype)
    table = _fp8_values().to(dtype).view(int_dtype).numpy()  # [256] bit patterns
    out = np.take(table, codes)  # [T, L, H]
    out += (exps.astype(np_int) << mantissa_bits)[..., None]  # × 2^k
    zero = (codes & 0x7F) == 0  # ±0 must stay ±0
    if zero.any():
        where = np.flatnonzero(zero)
        out.reshape(-1)[where] = np.take(table, codes.reshape(-1)[where])
    return torch.from_numpy(out).view(dtype)


def fp8_sign_chain(codes: np.ndarray) -> np.ndarray:
    """[T, L, H] codes -> a fresh array whose state l > 0 has its sign XOR state l-1's (on-disk form)."""
    out = np.empty_like(codes)
    out[:, :1] = codes[:, :1]
    np.bitwise_and(codes[:, :-1], 0x80, out=out[:, 1:])
    np.bitwise_xor(out[:, 1:], codes[:, 1:], out=out[:, 1:])
    return out


def fp8_sign_unchain(chained: np.ndarray) -> np.ndarray:
    """Inverse of fp8_sign_chain, in place on a writable array: state by state, in order."""
    for layer in range(1, chained.shape[1]):
        chained[:, layer] ^= chained[:, layer - 1] & 0x80
    return chained


def fp8_problem(q: Fp8Hidden) -> str | None:
    """Why stored fp8 data is implausible (NaN codes, scale exponents out of range or
    inconsistent with their rows), or None. For `verify --decode`."""
    codes, exps = q.codes.cpu().numpy(), q.exps.cpu().numpy()
    nan = np.isin(codes, _FP8_NAN)
    if nan.any():
        t, layer, h = np.argwhere(nan)[0]
        return f"NaN fp8 code at [{t}, {layer}, {h}]"
    if exps.size and (exps.min() < FP8_MIN_EXP or exps.max() > FP8_MAX_EXP):
        return f"scale exponent {int(exps.min())}..{int(exps.max())} outside [{FP8_MIN_EXP}, {FP8_MAX_EXP}]"
    top = (codes & 0x7F).max(axis=-1)  # [T, L]: magnitude codes are monotone in the value
    zero_scaled = (top == 0) & (exps != 0)
    if zero_scaled.any():
        t, layer = np.argwhere(zero_scaled)[0]
        return f"all-zero row [{t}, {layer}] has scale 2^{int(exps[t, layer])}, expected 2^0"
    floor_code = int(torch.tensor(2.0**FP8_RMS_EXPONENT).to(torch.float8_e4m3fn).view(torch.uint8))
    too_small = (top > 0) & (top < floor_code) & (exps != FP8_MIN_EXP)
    if too_small.any():  # the scale was not chosen by quantize_fp8: precision would be lost
        t, layer = np.argwhere(too_small)[0]
        return f"row [{t}, {layer}] uses only codes below 2^{FP8_RMS_EXPONENT} at scale 2^{int(exps[t, layer])}"
    return None


def encode_fp8_parts(input_ids, loss_mask, hidden: torch.Tensor | Fp8Hidden, level: int = 1) -> list[Buffer]:
    """An fp8 sample file (format version 2) as a list of buffers, like `encode_sample_parts`.

    hidden: a float tensor (quantized here; NaN/inf refused) or an `Fp8Hidden` quantized
    by the caller (the extraction driver does it on the GPU). Sections: input_ids,
    loss_mask, `hidden.fp8` ([T·L·H] codes, sign-chained) and `hidden.exp` ([T·L] int8);
    with a lossless final state (fp8_aux) also its byte planes, `hidden.final.plane{k}`.
    The raw checksum covers ids, mask, the plain codes, the exponents and the final state's bytes.
    """
    q = hidden if isinstance(hidden, Fp8Hidden) else quantize_fp8(hidden.detach())
    ids = np.array(input_ids, dtype=np.int64).reshape(-1)  # [T], a copy: raw sections may view it
    mask = np.array(loss_mask, dtype=np.uint8).reshape(-1)  # [T], a copy
    dtype = _dtype_name(q.dtype)
    T, L, H = q.shape
    if ids.shape[0] != T or mask.shape[0] != T or tuple(q.exps.shape) != (T, L):
        raise ValueError(
            f"input_ids [{ids.shape[0]}], loss_mask [{mask.shape[0]}], codes {list(q.shape)} and "
            f"scales {list(q.exps.shape)} do not fit together"
        )
    if mask.size and mask.max() > 1:
        raise ValueError("loss_mask must contain only 0 and 1")
    codes = q.codes.cpu().contiguous().numpy()  # [T, L, H] uint8 (a view when already on the CPU)
    exps = np.array(q.exps.cpu().numpy(), dtype=np.int8)  # [T, L], a copy
    final = _final_planes(q, T, H)  # fp8_aux: the lossless final state's byte planes
    raw_sum = checksum(ids, mask, codes, exps, *final)
    sections = [
        _pack("input_ids", ids, level),
        _pack("loss_mask", mask, level),
        _pack("hidden.fp8", fp8_sign_chain(codes), level),  # a fresh array: never a view of `hidden`
        _pack("hidden.exp", exps, level),
    ]
    sections += [_pack(f"hidden.final.plane{k}", plane, level) for k, plane in enumerate(final)]
    header = {
        "T": T, "L": L, "H": H, "dtype": dtype, "loss_tokens": int(mask.sum()),
        "codec": "zstd-fp8", "storage": "fp8" if q.final is None else "fp8_aux",
        "fp8": "float8_e4m3fn, 2^k per row, sign chained over states"
        + ("" if q.final is None else "; the final state lossless in hidden.final.plane*"),
        "level": level, "raw_checksum": raw_sum, "sections": [meta for meta, _ in sections],
        "payload_checksum": checksum(*(data for _, data in sections)),  # as in lossless files: `self_check`
    }  # fmt: skip
    header_bytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    parts: list[Buffer] = [_PREAMBLE.pack(MAGIC, FP8_FORMAT_VERSION, len(header_bytes)) + header_bytes]
    return parts + [data for _, data in sections]


def _final_planes(q: Fp8Hidden, T: int, H: int) -> list[np.ndarray]:
    """fp8_aux: the byte planes of q.final ([T, H]); plain fp8: none."""
    if q.final is None:
        return []
    final = q.final.detach().to("cpu").contiguous()
    if tuple(final.shape) != (T, H) or final.dtype != q.dtype:
        raise ValueError(f"final state {list(final.shape)} {final.dtype} does not fit codes [{T}, …, {H}] of {q.dtype}")
    if not bool(torch.isfinite(final).all()):
        raise ValueError("the final state holds NaN/inf: it cannot be stored")
    return byte_planes(final)


def storage_of_file(path: Path) -> str | None:
    """`lossless`, `fp8` or `fp8_aux` from a sample file's header, None if it is none."""
    try:
        with open(path, "rb") as f:
            preamble = f.read(_PREAMBLE.size)
            if len(preamble) < _PREAMBLE.size:
                return None
            magic, version, header_len = _PREAMBLE.unpack(preamble)
            if magic != MAGIC or version not in (FORMAT_VERSION, FP8_FORMAT_VERSION):
                return None
            if version == FORMAT_VERSION:
                return "lossless"
            header = json.loads(f.read(header_len))  # fp8 files: the header says which mode
    except (OSError, ValueError):
        return None
    return header.get("storage") if header.get("storage") in FP8_MODES else None


def _decode_fp8(header: SampleHeader, raw: dict[str, memoryview | bytes], check: bool, keep_codes: bool) -> Sample:
    T, L, H = header.shape
    try:
        chained = np.frombuffer(raw["hidden.fp8"], np.uint8, count=T * L * H).reshape(T, L, H)
        exps = np.frombuffer(raw["hidden.exp"], np.int8, count=T * L).reshape(T, L).copy()
    except (KeyError, ValueError) as e:
        raise ValueError(f"fp8 sections missing or short: {e}") from None
    codes = fp8_sign_unchain(chained.copy())  # [T, L, H]
    ids = np.frombuffer(raw["input_ids"], dtype="<i8", count=T).copy()
    mask = np.frombuffer(raw["loss_mask"], dtype=np.uint8, count=T).copy()
    dtype = DTYPES[header.dtype]
    planes = []  # fp8_aux: the lossless final state's byte planes, itemsize × [T·H] uint8
    if header.storage == "fp8_aux":
        try:
            planes = [np.frombuffer(raw[f"hidden.final.plane{k}"], np.uint8, count=T * H) for k in range(dtype.itemsize)]
        except (KeyError, ValueError) as e:
            raise ValueError(f"fp8_aux final-state sections missing or short: {e}") from None
    if check and not verify_checksum(header.raw_checksum, ids, mask, codes, exps, *planes):
        raise ValueError("raw-payload checksum mismatch")
    final = torch.from_numpy(_join_planes(planes)).view(dtype).reshape(T, H) if planes else None
    hidden = dequantize_fp8(codes, exps, dtype)
    if final is not None:
        hidden[:, -1] = final
    q = Fp8Hidden(torch.from_numpy(codes), torch.from_numpy(exps), dtype, final) if keep_codes else None
    return Sample(input_ids=ids, loss_mask=mask, hidden=hidden, fp8=q)



def self_check(data: bytes | memoryview) -> SampleHeader:
    """Check a sample file on its own (no index entry): its header and its payload checksum.

    Files written before the header carried `payload_checksum` are decoded and checked against
    the raw checksum instead (slower). Raises ValueError naming what is wrong.
    """
    header = read_header(data)
    payload = memoryview(data)[header.data_offset :]
    if header.payload_checksum is None:
        decode_sample(data, check=True)
    elif not verify_checksum(header.payload_checksum, payload):
        raise ValueError("payload checksum mismatch")
    return header


# ---------------------------------------------------------------- keys


def settings_digest(settings: dict) -> str:
    """Stable sha256 of the capture settings (canonical JSON: sorted keys, no spaces)."""
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def sample_key(settings_digest: str, input_ids) -> str:
    """Content key of a sample: sha256(settings digest + input ids as little-endian int64) in hex."""
    ids = np.ascontiguousarray(np.asarray(input_ids, dtype="<i8").reshape(-1))
    return hashlib.sha256(settings_digest.encode() + ids.tobytes()).hexdigest()


# ---------------------------------------------------------------- the store


@dataclass(frozen=True)
class IndexEntry:
    sample_id: str
    key: str
    length: int  # T
    loss_tokens: int
    checksum: str  # of the whole stored file, "<algorithm>:<hex>"
    nbytes: int  # stored (compressed) file size
    raw_nbytes: int  # uncompressed payload: input_ids + loss_mask + hidden


@dataclass(frozen=True)
class PutResult:
    checksum: str
    nbytes: int
    length: int
    loss_tokens: int
    raw_nbytes: int

    def entry(self, sample_id: str, key: str) -> IndexEntry:
        """The index entry for the file just written."""
        return IndexEntry(sample_id, key, self.length, self.loss_tokens, self.checksum, self.nbytes, self.raw_nbytes)


class SampleStore:
    """Content-keyed sample files under `root/ab/cd/<key>.dfhs`; files survive Snakemake reruns."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        if len(key) < 5 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a sample key: {key!r}")
        return self.root / key[:2] / key[2:4] / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        # Files appear under their final name only by an atomic rename, so existence means complete.
        return self.path(key).is_file()

    def put(self, key: str, data: Buffer | list[Buffer] | tuple[Buffer, ...]) -> PutResult:
        """Write a sample file atomically: temp file, fsync, rename, fsync the folder.

        `data`: the file as bytes (`encode_sample`) or as a list of buffers whose concatenation
        is the file (`encode_sample_parts`); the parts are written and hashed one by one, never
        joined, and the checksum equals that of the joined bytes.
        """
        views = _byte_views(data)
        header = _header_of_parts(views)  # refuse to store something that is not a sample file
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        # Unique per process and thread, so concurrent writers of one key never share a temp file;
        # the owner part lets `cleanup_temp` tell a dead writer's leftovers from a live one's.
        tmp = final.with_name(f".{final.name}{TEMP_MARK}{writer_tag()}-{uuid.uuid4().hex[:8]}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o666)
            try:
                _write_all(fd, views)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                tmp.unlink()
        fsync_dir(final.parent)
        nbytes = sum(len(v) for v in views)
        return PutResult(checksum(*views), nbytes, header.length, header.loss_tokens, header.raw_nbytes)

    def get(self, key: str) -> bytes:
        path = self.path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise DraftflowError(
                f"{path}: stored sample {key} is missing; run `draftflow verify` and re-extract"
            ) from None

    def entry_for(self, key: str, sample_id: str) -> IndexEntry:
        """Rebuild an index entry for a stored file after checking it (`self_check`: a hash, no decoding),
        so a damaged file is never re-indexed with its damage's checksum."""
        data = self.get(key)
        try:
            header = self_check(data)
        except ValueError as e:
            raise DraftflowError(
                f"{self.path(key)} (sample {sample_id}): {e}; the stored file is damaged: delete it "
                "(`draftflow verify --repair` does) so that it is extracted again"
            ) from None
        return IndexEntry(
            sample_id, key, header.length, header.loss_tokens, checksum(data), len(data), header.raw_nbytes
        )

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def cleanup_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove temp files whose writer is gone; returns the count.

        A temp name carries its writer's host, boot id, pid and process start time
        (`writer_tag`): on this host, a writer is gone when the machine rebooted since or no
        process with that pid and start time runs. Temps of other hosts are left alone (their
        writer cannot be checked from here). Only temps named before writers were tagged fall
        back to age (`older_than_s`).
        """
        if not self.root.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for tmp in self.root.glob(f"*/*/.*{SUFFIX}{TEMP_MARK}*"):
            try:
                owner = tmp.name.split(TEMP_MARK, 1)[1]
                gone = writer_gone(owner)
                if gone is None:  # an untagged (older) temp name: no owner to check
                    gone = tmp.stat().st_mtime <= cutoff
                if gone:
                    tmp.unlink()
                    removed += 1
            except FileNotFoundError:  # another cleaner or the writer itself got there first
                pass
        return removed

    def keys(self) -> Iterable[str]:
        """Keys of all complete files (temp files are never listed)."""
        for path in self.root.glob(f"*/*/*{SUFFIX}"):
            if not path.name.startswith("."):
                yield path.name[: -len(SUFFIX)]


def cleanup_temp(store_root: Path, older_than_s: float = 3600.0) -> int:
    return SampleStore(store_root).cleanup_temp(older_than_s)


# ---------------------------------------------------------------- temp-file owners

_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def _boot_id() -> str:
    try:
        return _BOOT_ID_FILE.read_text().strip().replace("-", "")[:12]
    except OSError:  # not Linux: no boot id; pid + start time still identify the writer
        return "noboot"


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), or None when unknown."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces, so count from its closing ')'.
    return stat_line.rsplit(")", 1)[1].split()[19]


_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"


def writer_tag() -> str:
    """`host~bootid~pid~start`: who writes a temp file (see `SampleStore.cleanup_temp`)."""
    pid = os.getpid()
    return f"{_HOST}~{_boot_id()}~{pid}~{_process_start(pid) or 0}"


def writer_gone(owner: str) -> bool | None:
    """Is the writer named in a temp-file suffix `tag-rand` certainly gone?

    True: it ran on this host and the host rebooted since, or its process no longer runs
    (checked by pid and start time, so a reused pid is not mistaken for it). False: it may
    still run (alive, or on another host). None: an untagged name, nothing to check.
    """
    parts = owner.rsplit("-", 1)[0].split("~")
    if len(parts) != 4:
        return None
    host, boot, pid, start = parts
    if host != _HOST:
        return False
    if boot != _boot_id():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):  # another user's live process, or a garbled name
        return False
    now = _process_start(int(pid))
    return now is not None and start != "0" and now != start


# ---------------------------------------------------------------- range indexes

REQUIRED_META = ("settings_digest", "store_root", "num_layers_captured", "hidden_size")
INDEX_COLUMNS = tuple(f.name for f in dataclasses.fields(IndexEntry))


def write_range_index(range_dir: Path, entries: list[IndexEntry], meta: dict) -> None:
    """Atomically write range_dir/index.json.

    `meta` must contain `settings_digest`, `store_root` (any path; stored relative to
    range_dir when possible), `num_layers_captured` (L) and `hidden_size` (H); any other
    keys the extraction driver passes (layer ids, engine, dtype …) are kept as given.
    """
    range_dir = Path(range_dir)
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"range index meta for {range_dir} lacks {missing}")
    ids = [e.sample_id for e in entries]
    if len(set(ids)) != len(ids):
        raise ValueError(f"range index for {range_dir} has duplicate sample ids")
    meta = dict(meta, format_version=INDEX_FORMAT_VERSION, store_root=_relative_root(range_dir, meta["store_root"]))
    # Column-major and compact: a 2,000-entry index parses in ~10 ms and lengths need no per-row work.
    columns = {name: [getattr(e, name) for e in entries] for name in INDEX_COLUMNS}
    text = json.dumps({"meta": meta, "entries": columns}, sort_keys=True, separators=(",", ":"), default=str)
    with atomic_path(range_dir / INDEX_NAME) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")


def _relative_root(range_dir: Path, store_root: str | Path) -> str:
    store_root = Path(store_root)
    if not store_root.is_absolute():
        return store_root.as_posix()  # already relative to range_dir
    try:
        return Path(os.path.relpath(store_root, range_dir.resolve())).as_posix()
    except ValueError:  # another drive (Windows): keep it absolute
        return store_root.as_posix()


def read_index_columns(range_dir: Path) -> tuple[dict, dict[str, list]]:
    """(meta, {column: values}) of a range index: the fast path for lengths and totals."""
    path = Path(range_dir) / INDEX_NAME
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise DraftflowError(f"{path}: range index missing; run extraction for this range") from None
    except json.JSONDecodeError as e:
        raise DraftflowError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
    meta = doc.get("meta", {})
    if meta.get("format_version") != INDEX_FORMAT_VERSION:
        version = meta.get("format_version")
        raise DraftflowError(f"{path}: field 'meta.format_version' is {version!r}, expected {INDEX_FORMAT_VERSION}")
    columns = doc.get("entries", {})
    missing = [c for c in INDEX_COLUMNS if c not in columns]
    if missing or len({len(columns[c]) for c in INDEX_COLUMNS}) != 1:
        raise DraftflowError(f"{path}: field 'entries': missing or unequal columns {missing or sorted(columns)}")
    return meta, columns


def read_range_index(range_dir: Path) -> tuple[dict, list[IndexEntry]]:
    meta, columns = read_index_columns(range_dir)
    return meta, [IndexEntry(*row) for row in zip(*(columns[c] for c in INDEX_COLUMNS))]


def store_root_of(range_dir: Path, meta: dict) -> Path:
    """The store folder a range index points to."""
    return (Path(range_dir) / meta["store_root"]).resolve()


def find_range_dirs(hidden_states_dir: Path) -> list[Path]:
    """Range folders with an index: DIR/rows_*/ and DIR/<split>/rows_*/, sorted by split then start row."""
    root = Path(hidden_states_dir)
    found = {p.parent for pattern in (f"rows_*/{INDEX_NAME}", f"*/rows_*/{INDEX_NAME}") for p in root.glob(pattern)}
    return sorted(found, key=_range_sort_key)


def _range_sort_key(path: Path) -> tuple:
    start = path.name.removeprefix("rows_").split("-")[0]
    return (str(path.parent), int(start) if start.isdigit() else -1, path.name)


def sample_lengths(range_dirs: Sequence[Path]) -> dict:
    """{"total_samples", "total_tokens", "total_loss_tokens", "lengths": {sample_id: T}}, from index files only."""
    lengths: dict[str, int] = {}
    total_loss = 0
    for range_dir in range_dirs:
        _, columns = read_index_columns(range_dir)
        clash = lengths.keys() & set(columns["sample_id"])
        if clash:
            raise DraftflowError(f"{range_dir}: sample id {min(clash)!r} appears in more than one range")
        lengths.update(zip(columns["sample_id"], columns["length"]))
        total_loss += sum(columns["loss_tokens"])
    return {
        "total_samples": len(lengths),
        "total_tokens": sum(lengths.values()),
        "total_loss_tokens": total_loss,
        "lengths": lengths,
    }


def summarize(range_dirs: Sequence[Path]) -> dict:
    """Totals over the given ranges, from index files only.

    `meta` holds the index meta keys that are identical in every range (layer ids,
    hidden size …), so a caller can write data_config.json from it.
    """
    ranges, lengths, loss, stored, raw = [], [], 0, 0, 0
    shared: dict[str, Any] | None = None
    for range_dir in range_dirs:
        meta, columns = read_index_columns(range_dir)
        meta = {k: v for k, v in meta.items() if k != "store_root"}
        shared = meta if shared is None else {k: v for k, v in shared.items() if meta.get(k) == v}
        ranges.append({"range": str(range_dir), "samples": len(columns["length"]), "tokens": sum(columns["length"])})
        lengths += columns["length"]
        loss += sum(columns["loss_tokens"])
        stored += sum(columns["nbytes"])
        raw += sum(columns["raw_nbytes"])
    arr = np.asarray(lengths, dtype=np.int64)
    return {
        "ranges": ranges,
        "total_samples": int(arr.size),
        "total_tokens": int(arr.sum()),
        "total_loss_tokens": loss,
        "min_length": int(arr.min()) if arr.size else 0,
        "max_length": int(arr.max()) if arr.size else 0,
        "mean_length": float(arr.mean()) if arr.size else 0.0,
        "stored_bytes": stored,
        "raw_bytes": raw,
        "compression_ratio": stored / raw if raw else None,
        "meta": shared or {},
    }


# ---------------------------------------------------------------- reader


@dataclass(frozen=True)
class BadRead:
    """A sample that could not be read back as indexed: missing, damaged or inconsistent."""

    range_dir: str
    sample_id: str
    key: str
    path: str  # the store file
    reason: str

    @property
    def repair_command(self) -> str:
        # A range folder's parent holds the split's ranges: verify finds and repairs them there.
        return f"draftflow verify --hidden-states {Path(self.range_dir).parent} --repair"

    def message(self) -> str:
        return (
            f"range {self.range_dir}, sample {self.sample_id}, key {self.key}: {self.reason} ({self.path}); "
            f"repair it with `{self.repair_command}`"
        )


ON_BAD_SAMPLE = ("fail", "skip")


class HiddenStateReader:
    """Random access to the samples of some ranges, for training, evaluation and conversion.

    Every read is checked: the file's checksum must equal its index entry's (an xxh3 pass,
    far faster than decoding), so a flipped byte is never decoded into training data.
    `read(i)` returns a `BadRead` for a missing or damaged sample (the caller decides: fail or
    skip and count); `reader[i]` raises it as a DraftflowError.

    Holds only paths and small arrays, so it pickles into DataLoader worker processes; each
    read loads and decodes one file.
    """

    def __init__(
        self,
        range_dirs: Sequence[Path],
        store_root: Path | None = None,
        check: bool = False,
        verify: bool = True,
        fp8_codes: bool = False,
    ):
        self.range_dirs = [Path(d) for d in range_dirs]
        self.check = check  # also verify the raw-payload checksum after decoding (a second, costlier hash)
        self.verify = verify  # the file checksum against the index on every read (off: benchmarks only)
        self.fp8_codes = fp8_codes  # fp8 files: also return their codes (Sample.fp8); training needs only values
        self._stores: list[SampleStore] = []
        range_of: list[int] = []
        self.keys: list[str] = []
        self.sample_ids: list[str] = []
        self.checksums: list[str] = []
        lengths: list[int] = []
        loss: list[int] = []
        first: dict = {}
        for range_dir in self.range_dirs:
            meta, columns = read_index_columns(range_dir)
            first = first or meta
            self._stores.append(SampleStore(Path(store_root) if store_root else store_root_of(range_dir, meta)))
            range_of += [len(self._stores) - 1] * len(columns["key"])
            self.keys += columns["key"]
            self.sample_ids += columns["sample_id"]
            self.checksums += columns["checksum"]
            lengths += columns["length"]
            loss += columns["loss_tokens"]
        self._range_of = np.asarray(range_of, dtype=np.int32)  # [N]
        self.lengths = np.asarray(lengths, dtype=np.int64)  # [N]
        self.loss_tokens = np.asarray(loss, dtype=np.int64)  # [N]
        # (L, H, dtype name) of the samples, for a batch whose every sample was unreadable
        self.sample_shape = (first.get("num_layers_captured"), first.get("hidden_size"), first.get("dtype", "bfloat16"))

    def subset(self, indices: Sequence[int]) -> "HiddenStateReader":
        """A reader over samples `indices` of this one (in that order), e.g. without missing ones."""
        idx = np.asarray(indices, dtype=np.int64)
        out = object.__new__(HiddenStateReader)
        out.__dict__.update(self.__dict__)
        for name in ("keys", "sample_ids", "checksums"):
            values = getattr(self, name)
            setattr(out, name, [values[i] for i in idx.tolist()])
        out._range_of, out.lengths, out.loss_tokens = self._range_of[idx], self.lengths[idx], self.loss_tokens[idx]
        return out

    def __len__(self) -> int:
        return len(self.keys)

    def _bad(self, i: int, reason: str) -> BadRead:
        store = self._stores[self._range_of[i]]
        return BadRead(
            str(self.range_dirs[self._range_of[i]]), self.sample_ids[i], self.keys[i], str(store.path(self.keys[i])),
            reason,
        )  # fmt: skip

    def read(self, i: int) -> Sample | BadRead:
        """Sample i, or a BadRead saying why it cannot be used."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i = i % len(self)
        path = self._stores[self._range_of[i]].path(self.keys[i])
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return self._bad(i, "store file missing")
        except OSError as e:
            return self._bad(i, f"unreadable: {e.strerror}")
        if self.verify and not verify_checksum(self.checksums[i], data):
            return self._bad(i, "file checksum differs from its index entry (the file is damaged)")
        try:
            sample = decode_sample(data, check=self.check, fp8_codes=self.fp8_codes)
        except ValueError as e:
            return self._bad(i, str(e))
        if sample.input_ids.shape[0] != self.lengths[i]:
            return self._bad(i, f"{sample.input_ids.shape[0]} tokens, the index says {self.lengths[i]}")
        return sample

    def __getitem__(self, i: int) -> Sample:
        sample = self.read(i)
        if isinstance(sample, BadRead):
            raise DraftflowError(sample.message())
        return sample

    def without(self, bad: Sequence[BadRead]) -> "HiddenStateReader":
        """This reader less the samples named in `bad` (by range and sample id)."""
        gone = {(b.range_dir, b.sample_id) for b in bad}
        keep = [
            i for i, sid in enumerate(self.sample_ids) if (str(self.range_dirs[self._range_of[i]]), sid) not in gone
        ]  # fmt: skip
        return self.subset(keep)

    def missing(self) -> list[BadRead]:
        """Samples whose store file does not exist: one stat per distinct file, no reads."""
        bad, seen = [], {}
        for i, key in enumerate(self.keys):
            path = self._stores[self._range_of[i]].path(key)
            if path not in seen:
                seen[path] = path.is_file()
            if not seen[path]:
                bad.append(self._bad(i, "store file missing"))
        return bad


def check_present(reader: HiddenStateReader, label: str, on_bad_sample: str) -> list[BadRead]:
    """Before a stage starts: every sample it will read has its store file (stat only).

    on_bad_sample "fail" raises naming the range and sample id of each missing file (first
    ten) and the repair command; "skip" returns them for the caller to leave out and count.
    """
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise DraftflowError(f"on_bad_sample must be one of {ON_BAD_SAMPLE}, not {on_bad_sample!r}")
    missing = reader.missing()
    if missing and on_bad_sample == "fail":
        lines = "\n".join(f"  {b.range_dir}: sample {b.sample_id} (key {b.key})" for b in missing[:10])
        more = f"\n  … and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise DraftflowError(
            f"{len(missing)} of the {len(reader)} {label} samples have no store file:\n{lines}{more}\n"
            f"repair them with `{missing[0].repair_command}` (or set on_bad_sample: skip to leave them out)"
        )
    return missing
