"""Hidden-state extraction for one range of merged samples, and the summary over all ranges.

`draftflow extract` runs records [start, end) of a merged split through the target once
(prefill only) and stores, per sample, the aux layers + final state in the content-keyed
store (draftflow.hidden_states.storage). The range folder gets only a small index: Snakemake deletes it
before a rerun, the store survives, so

* a sample already in the store (same target, layers, engine numerics and tokens) is
  never recomputed: a rerun after a crash resumes at sample granularity, and a sample a
  re-merge moved to another range is reused;
* batches are a fixed partition of the range (sorted by length, packed up to
  batch_tokens) decided before looking at the store, and a batch runs whenever one of
  its members is missing: a resumed run writes exactly the bytes an uninterrupted one would.

On CUDA the GPU never waits on the disk: each captured batch is copied into a pinned host
buffer on a side stream, and a writer pool (zstd and file I/O release the GIL) encodes and
stores the samples while the next batch runs. A small ring of buffers bounds memory. With
`extract.storage: fp8` the GPU quantizes each capture (`storage.quantize_fp8`) before the
copy, so half the bytes cross to the host and the writers only compress (`fp8_aux`, whose
final state stays lossless, is quantized by the writers).

`draftflow summarize-hidden-states` writes data_config.json and sample_lengths.json from
the range indexes only, never from tensor data.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

import draftflow
from draftflow.progress import Progress
from draftflow.threads import default_threads, split_threads
from draftflow.engines.capture import (
    CONVENTION,
    FINAL,
    layer_meanings,
    CaptureEngine,
    CaptureError,
    capture_settings,
    check_finite,
    check_shape,
    layer_names,
    make_capture_engine,
    nonfinite_per_layer,
    plan_batches,
)
from draftflow.errors import DraftflowError, where
from draftflow.jsonl import read_json, write_json
from draftflow.hidden_states.storage import (
    STORAGE_MODES,
    Fp8Hidden,
    IndexEntry,
    SampleStore,
    encode_sample_parts,
    quantize_fp8,
    read_range_index,
    sample_key,
    sample_lengths,
    settings_digest,
    summarize,
    write_range_index,
)

log = logging.getLogger("draftflow.hidden_states.extract")

FAILURES_NAME = "failures.json"


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Record:
    sample_id: str
    dataset: str
    input_ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T] uint8
    row: int  # 0-based record number in the split file


def _parse_record(line: bytes, path: Path, row: int) -> Record:
    try:
        obj = json.loads(line)
        ids = np.asarray(obj["input_ids"], dtype=np.int64)
        mask = np.asarray(obj["loss_mask"], dtype=np.uint8)
        sample_id = str(obj["id"])
    except json.JSONDecodeError as e:
        raise DraftflowError(f"{where(path, row + 1)}: not valid JSON: {e.msg}") from None
    except KeyError as e:
        raise DraftflowError(f"{where(path, row + 1, e.args[0])}: missing") from None
    except (TypeError, ValueError) as e:
        raise DraftflowError(f"{where(path, row + 1)}: bad token list: {e}") from None
    if ids.ndim != 1 or ids.size == 0:
        raise DraftflowError(f"{where(path, row + 1, 'input_ids')}: must be a non-empty list of ints")
    if mask.shape != ids.shape:
        raise DraftflowError(
            f"{where(path, row + 1, 'loss_mask')}: {mask.size} values for {ids.size} input_ids"
        )
    return Record(sample_id, str(obj.get("dataset", "")), ids, mask, row)


def read_records(path: str | Path, start: int, end: int) -> list[Record]:
    """Records [start, end) of a merged JSONL file; only those lines are parsed."""
    path = Path(path)
    if not 0 <= start <= end:
        raise DraftflowError(f"bad range [{start}, {end}) for {path}")
    with open(path, "rb") as f:
        lines = list(itertools.islice(f, start, end))
    if len(lines) != end - start:
        raise DraftflowError(
            f"{path} has {start + len(lines)} records, fewer than the range end {end}: "
            "the range plan and the merged file disagree (rerun merge)"
        )
    return [_parse_record(line, path, start + k) for k, line in enumerate(lines)]


# ---------------------------------------------------------------- settings


def resolve_settings(settings: dict, target_dir: str | Path) -> dict:
    """Fill the target identity (by content: the store keys of a moved or copied model stay the
    same, a rule run and a hand run agree) and, for hand runs, the default aux ids."""
    settings = dict(settings)
    if not settings.get("target_identity"):
        from draftflow.target import target_identity

        settings["target_identity"] = target_identity(target_dir)
    if not settings.get("aux_layer_ids"):
        from draftflow.config import default_aux_layer_ids

        config = read_json(Path(target_dir) / "config.json")
        num_layers = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")
        settings["aux_layer_ids"] = default_aux_layer_ids(int(num_layers))
        log.info("aux_layer_ids not set: using the default %s", settings["aux_layer_ids"])
    return settings


# ---------------------------------------------------------------- writer pool


class _SlotRing:
    """A bounded ring of host buffers, one per captured batch awaiting the writers.

    The capture loop blocks on `acquire` when the writers fall behind, so host memory stays
    bounded. On CUDA the buffers are pinned (device->host copies run asynchronously) and made
    on first need: pinning ~0.5 GB takes a noticeable fraction of a second, which then overlaps
    the forward just queued instead of delaying the first one. On CPU a slot is just a permit (None).
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pinned: bool):
        if count < 2:
            raise ValueError("the capture pipeline needs at least 2 slots (one in flight, one being written)")
        self._free: queue.Queue = queue.Queue()
        self._unmade = count  # slots not yet allocated
        self._numel, self._dtype, self._pinned = numel, dtype, pinned
        self.alloc_s = 0.0  # time spent pinning host memory

    def acquire(self) -> torch.Tensor | None:
        if self._unmade and self._free.empty():
            self._unmade -= 1
            if not self._pinned:
                return None
            t0 = time.monotonic()
            slot = torch.empty(self._numel, dtype=self._dtype, pin_memory=True)
            self.alloc_s += time.monotonic() - t0
            return slot
        return self._free.get()

    def release(self, slot: torch.Tensor | None) -> None:
        self._free.put(slot)


class _SlotUse:
    """Counts a batch's samples still being written; the last one returns the slot to the ring."""

    def __init__(self, ring: _SlotRing, slot: torch.Tensor | None, users: int):
        self.ring, self.slot, self.users = ring, slot, users
        self.lock = threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.ring.release(self.slot)


class SampleWriter:
    """Encodes and stores samples on a thread pool (zstd, hashing and file I/O release the GIL)."""

    def __init__(self, store: SampleStore, level: int, threads: int, storage: str = "lossless"):
        self.store = store
        self.level = level
        self.storage = storage
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="draftflow-writer")
        self.error: BaseException | None = None  # the first failed write stops the capture loop
        self._lock = threading.Lock()

    def submit(self, record: Record, key: str, hidden: torch.Tensor | Fp8Hidden, slot: _SlotUse) -> Future:
        return self.pool.submit(self._write, record, key, hidden, slot)

    def submit_existing(self, key: str, sample_id: str) -> Future:
        """Index entry of a sample already stored (reads its file, never decodes tensors)."""
        return self.pool.submit(self.store.entry_for, key, sample_id)

    def _write(self, record: Record, key: str, hidden: torch.Tensor | Fp8Hidden, slot: _SlotUse) -> IndexEntry:
        try:
            if self.store.contains(key):  # another job stored the same content meanwhile
                return self.store.entry_for(key, record.sample_id)
            # A list of buffers, written with writev: joining it would hold the GIL for a full copy.
            parts = encode_sample_parts(record.input_ids, record.loss_mask, hidden, self.level, self.storage)
            return self.store.put(key, parts).entry(record.sample_id, key)
        except BaseException as e:
            with self._lock:
                self.error = self.error or e
            raise
        finally:
            slot.done()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# ---------------------------------------------------------------- device -> host


@dataclass
class _InFlight:
    """A captured batch between its launch and its hand-off to the writers."""

    positions: list[int]  # record positions it stores
    hiddens: list[torch.Tensor | Fp8Hidden]  # [T, L, H] each, in host memory once `ready` fired
    nonfinite: torch.Tensor  # [n, L] int64 non-finite counts, in host memory once `ready` fired
    slot: torch.Tensor | None
    ready: torch.cuda.Event | None  # None: already on the host


class _Stager:
    """Moves captures to the host without stalling the GPU.

    On CUDA, the non-finite counts are taken and the captures copied into a pinned slot on a
    side stream, ordered after the forward; the host waits on that batch's event only after
    the next batch's forward has been queued, so the GPU always has work. fp8: the side stream
    quantizes the captures first and the slot (uint8) receives codes and scale exponents; on
    the CPU the writers quantize.
    """

    def __init__(self, ring: _SlotRing, device: torch.device | None, fp8: bool = False):
        self.ring = ring
        self.fp8 = fp8
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None

    def launch(self, positions: list[int], hiddens: list[torch.Tensor]) -> _InFlight:
        slot = self.ring.acquire()  # blocks while every slot still awaits the writers
        if self.stream is None or not hiddens[0].is_cuda:  # CPU: fp8 quantization is left to the writers
            nonfinite = torch.stack([nonfinite_per_layer(h) for h in hiddens])  # [n, L]
            return _InFlight(positions, hiddens, nonfinite.cpu(), slot, None)
        # Everything after the forward runs on the side stream: the non-finite counts, fp8's
        # quantization and the copies. On the capture stream their kernels sat between one forward
        # and the next (~3 ms a batch lossless, ~9 ms fp8); here they overlap the next forward.
        self.stream.wait_stream(torch.cuda.current_stream(hiddens[0].device))
        host, offset = [], 0
        with torch.cuda.stream(self.stream):
            for h in hiddens:
                h.record_stream(self.stream)  # the capture stream must not reuse it before this stream read it
            nonfinite = torch.stack([nonfinite_per_layer(h) for h in hiddens])  # [n, L]
            if self.fp8:  # non-finite values are refused by the counts above
                hiddens = [quantize_fp8(h, check=False) for h in hiddens]
            for h in hiddens:  # h: [T, L, H] on the GPU (fp8: codes [T, L, H] + exps [T, L])
                tensors = (h.codes, h.exps) if self.fp8 else (h,)
                copies = []
                for t in tensors:
                    dst = slot[offset : offset + t.numel()].view(t.dtype).view(t.shape)
                    dst.copy_(t, non_blocking=True)
                    copies.append(dst)
                    offset += t.numel()
                host.append(Fp8Hidden(*copies, h.dtype) if self.fp8 else copies[0])
            counts = torch.empty(nonfinite.shape, dtype=nonfinite.dtype, pin_memory=True)
            counts.copy_(nonfinite, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return _InFlight(positions, host, counts, slot, ready)


# ---------------------------------------------------------------- the driver


@dataclass
class ExtractStats:
    samples: int = 0
    computed: int = 0  # captured and stored by this run
    reused: int = 0  # already in the store when the run started
    duplicates: int = 0  # same tokens as an earlier sample of this range (stored once)
    failed: int = 0
    batches_run: int = 0
    tokens_computed: int = 0  # real tokens of the batches run (members already stored included)
    padded_tokens: int = 0  # batch size × longest length, summed over the batches run
    capture_s: float = 0.0  # launching captures and waiting for their results
    writer_wait_s: float = 0.0  # capture loop blocked because every host slot awaited the writers
    pin_s: float = 0.0  # allocating the pinned host slots (inside writer_wait_s: it happens as a slot is taken)
    setup_s: float = 0.0  # start of the run to the first batch queued (plan, store lookups, writers)
    drain_s: float = 0.0  # last batch handed to the writers to every file written
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_computed / self.wall_s if self.wall_s else 0.0


@dataclass
class RangeOutcome:
    entries: list[IndexEntry]  # range order, failed samples left out
    failures: list[dict]  # {"sample_id", "row", "reason"}
    stats: ExtractStats
    settings_digest: str


@dataclass(frozen=True)
class ExtractOptions:
    batch_tokens: int = 16384
    on_error: str = "fail"  # fail | skip
    compression_level: int = 1
    writer_threads: int = 4
    ring_slots: int = 3  # host slots: one batch being copied, the rest being written
    log_every_s: float = 30.0
    storage: str = "lossless"  # lossless | fp8 | fp8_aux (storage.py)

    @classmethod
    def from_settings(cls, settings: dict) -> "ExtractOptions":
        return cls(
            batch_tokens=int(settings.get("batch_tokens", 16384)),
            on_error=settings.get("on_error", "fail"),
            compression_level=int(settings.get("compression_level", 1)),
            writer_threads=int(settings.get("writer_threads", 4)),
            storage=settings.get("storage", "lossless"),
        )


class _Progress:
    """`progress:` lines in tokens to compute (what takes the time), with the sample counts."""

    def __init__(self, label: str, every_s: float, tokens_to_compute: int):
        self.label = label
        self.ticker = Progress(tokens_to_compute, "tokens", every_s=every_s, logger=log)

    def update(self, stats: ExtractStats, tokens_left: int, force: bool = False) -> None:
        done = stats.reused + stats.duplicates + stats.computed + stats.failed
        extra = (
            f"{self.label}: {done}/{stats.samples} samples (computed {stats.computed}, "
            f"reused {stats.reused}, failed {stats.failed})"
        )
        self.ticker.update(self.ticker.total - tokens_left, extra=extra, force=force)


def _fmt_s(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s"


class _RangeRun:
    """One extract_range call: plan, capture loop, hand-off to the writers, index entries."""

    def __init__(self, records, engine, store, settings, options: ExtractOptions, label: str):
        if options.on_error not in ("fail", "skip"):
            raise DraftflowError(f"extract.on_error must be 'fail' or 'skip', not {options.on_error!r}")
        if options.storage not in STORAGE_MODES or options.storage != settings.get("storage", "lossless"):
            raise DraftflowError(
                f"extract.storage {options.storage!r} must be one of {', '.join(STORAGE_MODES)} and match the "
                f"settings' {settings.get('storage', 'lossless')!r} (it enters the store keys)"
            )
        self.records, self.engine, self.store, self.options, self.label = records, engine, store, options, label
        self.digest = settings_digest(capture_settings(settings))
        self.keys = [sample_key(self.digest, r.input_ids) for r in records]
        self.lengths = [len(r.input_ids) for r in records]
        self.num_slots = len(engine.aux_layer_ids) + 1  # L
        self.names = layer_names(engine.aux_layer_ids)
        self.stats = ExtractStats(samples=len(records))
        self.futures: dict[int, Future] = {}  # position -> IndexEntry (owners and reused samples)
        self.failures: dict[int, str] = {}  # owner position -> reason
        self.tokens_left = 0

    def plan(self) -> list[list[int]]:
        """Fixed batches; the owner of each missing key is its first position in batch order."""
        batches = plan_batches(self.lengths, self.options.batch_tokens)  # decided before looking at the store
        self.present = {k for k in set(self.keys) if self.store.contains(k)}
        self.owner: dict[str, int] = {}
        for pos in itertools.chain.from_iterable(batches):
            if self.keys[pos] not in self.present:
                self.owner.setdefault(self.keys[pos], pos)
        self.stats.reused = sum(k in self.present for k in self.keys)
        self.stats.duplicates = sum(k in self.owner and self.owner[k] != p for p, k in enumerate(self.keys))
        self.tokens_left = sum(self.lengths[p] for p in self.owner.values())
        return batches

    def run(self) -> RangeOutcome:
        t0 = time.monotonic()
        batches = self.plan()
        todo = [b for b in batches if any(self.owner.get(self.keys[p]) == p for p in b)]
        log.info(
            "%s: %d samples, %d already stored, %d to compute in %d batches (batch_tokens %d)",
            self.label, len(self.records), self.stats.reused, len(self.owner), len(todo), self.options.batch_tokens,
        )
        device = getattr(self.engine, "device", None)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        slot_rows = max([self.options.batch_tokens, *self.lengths]) * self.num_slots
        fp8_on_gpu = on_cuda and self.options.storage == "fp8"
        if fp8_on_gpu:  # a code per value and a scale exponent per row, 1 byte each
            ring = _SlotRing(self.options.ring_slots, slot_rows * (self.engine.hidden_size + 1), torch.uint8, pinned=True)
        else:
            ring = _SlotRing(self.options.ring_slots, slot_rows * self.engine.hidden_size, self.engine.dtype, pinned=on_cuda)
        self.stager = _Stager(ring, torch.device(device) if on_cuda else None, fp8=fp8_on_gpu)
        self.writer = SampleWriter(
            self.store, self.options.compression_level, self.options.writer_threads, self.options.storage
        )
        self.ring = ring
        self.progress = _Progress(self.label, self.options.log_every_s, self.tokens_left)
        self.progress.update(self.stats, self.tokens_left, force=True)  # 0/total: `draftflow status` sees the job
        for pos, key in enumerate(self.keys):
            if key in self.present:
                self.futures[pos] = self.writer.submit_existing(key, self.records[pos].sample_id)
        error: CaptureError | None = None
        self.stats.setup_s = time.monotonic() - t0
        try:
            self._capture_loop(todo)
        except CaptureError as e:
            error = e
        finally:
            t_drain = time.monotonic()
            results = _collect(self.futures)  # wait for the writers, also when stopping on an error
            self.writer.close()
            self.stats.drain_s = time.monotonic() - t_drain
            self.stats.pin_s = ring.alloc_s
        if error is not None:
            raise DraftflowError(
                f"{self.label}: {error}. Samples stored before this one are kept and will be reused; "
                "set extract.on_error: skip to leave failing samples out"
            )
        outcome = self._outcome(results)
        self.stats.wall_s = time.monotonic() - t0
        self.progress.update(self.stats, 0, force=True)
        return outcome

    def _capture_loop(self, batches: list[list[int]]) -> None:
        pending: deque[_InFlight] = deque()  # launched, not yet handed to the writers
        for batch in batches:
            if self.writer.error is not None:
                break  # reported with the sample it concerns
            try:
                inflight = self._launch(batch)
            except CaptureError:
                while pending:  # batches launched before the failing one are complete: keep them
                    self._finish(pending.popleft())
                raise
            if inflight is not None:
                pending.append(inflight)
            while len(pending) > 1:  # the next batch is queued: now wait for the previous one
                self._finish(pending.popleft())
        while pending:
            self._finish(pending.popleft())

    def _launch(self, batch: list[int]) -> _InFlight | None:
        """Queue the batch's forward and its device->host copies; check shapes (no GPU sync)."""
        t0 = time.monotonic()
        hiddens = self.engine.capture([self.records[p].input_ids for p in batch])  # per member [T, L, H]
        positions, staged = [], []
        for p, hidden in zip(batch, hiddens):
            if self.owner.get(self.keys[p]) != p:
                continue  # already stored, or a repeat of an earlier member
            try:
                check_shape(self.records[p].sample_id, self.records[p].input_ids, hidden, self.num_slots, self.engine.hidden_size)
                if hidden.dtype != self.engine.dtype:
                    raise CaptureError(f"sample {self.records[p].sample_id}: capture dtype {hidden.dtype}, engine dtype {self.engine.dtype}")
            except CaptureError as e:
                self._reject(p, e)
                continue
            positions.append(p)
            staged.append(hidden)
        self.stats.batches_run += 1
        self.stats.tokens_computed += sum(self.lengths[p] for p in batch)
        self.stats.padded_tokens += len(batch) * max(self.lengths[p] for p in batch)
        self.tokens_left -= sum(self.lengths[p] for p in batch if self.owner.get(self.keys[p]) == p)
        inflight, waited = None, 0.0
        if staged:
            t_wait = time.monotonic()
            inflight = self.stager.launch(positions, staged)
            waited = time.monotonic() - t_wait  # ~all of it is the wait for a free slot
        self.stats.writer_wait_s += waited
        self.stats.capture_s += time.monotonic() - t0 - waited
        return inflight

    def _finish(self, inflight: _InFlight) -> None:
        """Wait for a batch's results on the host, check them, give the good ones to the writers."""
        t0 = time.monotonic()
        if inflight.ready is not None:
            inflight.ready.synchronize()
        self.stats.capture_s += time.monotonic() - t0
        counts = inflight.nonfinite.tolist()  # [n][L]
        good: list[tuple[int, torch.Tensor]] = []
        try:
            for p, hidden, nonfinite in zip(inflight.positions, inflight.hiddens, counts):
                try:
                    check_finite(self.records[p].sample_id, nonfinite, hidden.shape[0], hidden.shape[2], self.names)
                    good.append((p, hidden))
                except CaptureError as e:
                    self._reject(p, e)
        except CaptureError:
            self.ring.release(inflight.slot)
            raise
        if not good:
            self.ring.release(inflight.slot)
            return
        use = _SlotUse(self.ring, inflight.slot, len(good))
        for p, hidden in good:
            self.futures[p] = self.writer.submit(self.records[p], self.keys[p], hidden, use)
        self.stats.computed += len(good)
        self.progress.update(self.stats, self.tokens_left)

    def _reject(self, pos: int, error: CaptureError) -> None:
        if self.options.on_error == "fail":
            raise error
        log.warning("%s: skipping: %s", self.label, error)
        self.failures[pos] = str(error)
        self.stats.failed = len(self.failures)

    def _outcome(self, results: dict[int, IndexEntry | BaseException]) -> RangeOutcome:
        """Index entries in range order; repeats share their owner's file; failures listed apart."""
        errors = {p: r for p, r in results.items() if isinstance(r, BaseException)}
        if errors:
            p, exc = next(iter(errors.items()))
            raise DraftflowError(f"{self.label}: sample {self.records[p].sample_id}: {exc}") from exc
        entries, failures = [], []
        for pos, record in enumerate(self.records):
            src = self.owner.get(self.keys[pos], pos)
            if src in self.failures:
                failures.append({"sample_id": record.sample_id, "row": record.row, "reason": self.failures[src]})
            else:
                entries.append(dataclasses.replace(results[src], sample_id=record.sample_id))
        self.stats.failed = len(failures)
        return RangeOutcome(entries, failures, self.stats, self.digest)


def extract_range(
    records: Sequence[Record],
    engine: CaptureEngine,
    store: SampleStore,
    settings: dict,
    options: ExtractOptions | None = None,
    label: str = "range",
) -> RangeOutcome:
    """Capture and store every record not yet in the store; return index entries in range order.

    `settings` are the extract settings (aux ids resolved, target_identity set); only their
    capture-relevant part (`capture_settings`) enters the store keys.
    """
    options = options or ExtractOptions.from_settings(settings)
    return _RangeRun(records, engine, store, settings, options, label).run()


def _collect(futures: dict[int, Future]) -> dict[int, IndexEntry | BaseException]:
    out: dict[int, IndexEntry | BaseException] = {}
    for pos, future in futures.items():
        try:
            out[pos] = future.result()
        except BaseException as e:  # reported by the caller with the sample id
            out[pos] = e
    return out


# ---------------------------------------------------------------- one range, end to end


def resolve_devices(device: str, gpu_ids: Sequence[str]) -> list[str]:
    """Torch devices for the engine, after the GPU claim set CUDA_VISIBLE_DEVICES."""
    if device == "cpu":
        return ["cpu"]
    cuda = torch.cuda.is_available()
    if device == "auto":
        if gpu_ids and cuda:
            return [f"cuda:{i}" for i in range(len(gpu_ids))]
        if gpu_ids:
            log.warning("GPU(s) %s assigned but CUDA is not available to torch: running on CPU", ",".join(gpu_ids))
        return ["cpu"]
    if device.startswith("cuda"):
        if not cuda:
            raise DraftflowError(f"extract.device is {device!r} but CUDA is not available (use 'auto' or 'cpu')")
        return [device]
    raise DraftflowError(f"extract.device {device!r}: use auto, cpu, cuda or cuda:N")


def range_meta(
    outcome: RangeOutcome,
    engine: CaptureEngine,
    settings: dict,
    split: str,
    start: int,
    end: int,
    store_root: Path,
) -> dict:
    """The index meta of one range: everything data_config.json needs, without tensor data."""
    return {
        "split": split,
        "start": start,
        "end": end,
        "settings_digest": outcome.settings_digest,
        "capture_settings": capture_settings(settings),
        "store_root": str(Path(store_root).resolve()),
        "convention": CONVENTION,
        "aux_layer_ids": list(engine.aux_layer_ids),
        "final": FINAL,
        "num_hidden_layers": engine.num_layers,
        "num_layers_captured": len(engine.aux_layer_ids) + 1,
        "hidden_size": engine.hidden_size,
        "dtype": settings.get("dtype", "bfloat16"),
        "storage": settings.get("storage", "lossless"),
        **engine.layer_ids.as_json(),
        "versions": {
            "draftflow": draftflow.__version__,
            "torch": torch.__version__,
            **engine.versions(),
        },
        "counts": {k: getattr(outcome.stats, k) for k in ("samples", "computed", "reused", "duplicates", "failed")},
        "timings": {
            "wall_s": round(outcome.stats.wall_s, 3),
            "capture_s": round(outcome.stats.capture_s, 3),
            "writer_wait_s": round(outcome.stats.writer_wait_s, 3),
            "batches_run": outcome.stats.batches_run,
            "tokens_computed": outcome.stats.tokens_computed,
            "padded_tokens": outcome.stats.padded_tokens,
            "tokens_per_s": round(outcome.stats.tokens_per_s, 1),
        },
    }


def path_from(range_dir: Path, path: Path) -> str:
    """`path` as the range index records it: relative to the range folder when given relative
    (inside the workflow: the results folder can move), else absolute. `resolve_from` inverts it."""
    path = Path(path)
    if path.is_absolute():
        return path.as_posix()
    return Path(os.path.relpath(path.resolve(), Path(range_dir).resolve())).as_posix()


def resolve_from(range_dir: Path, recorded: str) -> Path:
    return (Path(range_dir) / recorded).resolve()


def write_range(range_dir: Path, outcome: RangeOutcome, meta: dict) -> None:
    """failures.json, then index.json last: an index means the range is complete."""
    write_json(Path(range_dir) / FAILURES_NAME, outcome.failures)
    write_range_index(Path(range_dir), outcome.entries, meta)


def check_sample_lengths(records: Sequence[Record], engine: CaptureEngine, input_path: Path) -> None:
    """Refuse a range with a sample longer than the engine's longest prefill (`max_tokens`, where
    the engine has one: vLLM's max_model_len) before anything runs; batches go shortest first,
    so the capture itself would find it last."""
    limit = getattr(engine, "max_tokens", None)
    longest = max(records, key=lambda r: len(r.input_ids), default=None)
    if limit and longest is not None and len(longest.input_ids) > limit:
        why = getattr(engine, "max_tokens_why", "") or f"the engine's limit of {limit} tokens"
        raise CaptureError(
            f"{where(input_path, longest.row + 1)}: sample {longest.sample_id} has {len(longest.input_ids)} "
            f"tokens, more than {why}; a sample must fit in one prefill: raise extract.batch_tokens (up to "
            "the target's max_position_embeddings) or lower merge.max_seq_len"
        )


def run_extract(
    input_path: Path,
    split: str,
    start: int,
    end: int,
    target_dir: Path,
    store_root: Path,
    settings: dict,
    output: Path,
    gpu_lock_dir: Path | None = None,
    engine_factory: Callable[[dict, Path, list[str]], CaptureEngine] = make_capture_engine,
) -> RangeOutcome:
    """The `draftflow extract` command: read the range, claim GPUs, capture, write the index."""
    from draftflow.gpu import claim_gpus, warn_if_gpus_idle

    settings = resolve_settings(settings, target_dir)
    records = read_records(input_path, start, end)
    store = SampleStore(store_root)
    removed = store.cleanup_temp()
    if removed:
        log.info("removed %d temp files left by killed writers in %s", removed, store_root)
    label = f"{split} rows_{start}-{end}"
    device = settings.get("device", "auto")
    wants_gpu = device != "cpu" and int(settings.get("gpus_per_job", 0)) > 0
    if device == "auto" and not wants_gpu:
        warn_if_gpus_idle("extraction", "extract.gpus_per_job", keep_cpu="extract.device: cpu")
    with claim_gpus(int(settings["gpus_per_job"]) if wants_gpu else 0, gpu_lock_dir) as claim:
        devices = resolve_devices(device, claim.ids)
        engine = engine_factory(settings, target_dir, devices)
        try:
            check_sample_lengths(records, engine, input_path)
            outcome = extract_range(records, engine, store, settings, label=label)
            meta = range_meta(outcome, engine, settings, split, start, end, store_root)
        finally:
            engine.close()
    # What `draftflow verify --repair` needs to recompute a damaged sample bit for bit: the same
    # records, target and settings (batch_tokens decides each batch's members).
    meta.update(records=path_from(output, input_path), target_dir=path_from(output, target_dir),
                extract_settings=settings)  # fmt: skip
    write_range(output, outcome, meta)
    s = outcome.stats
    log.info(
        "%s done in %s: %d computed, %d reused, %d duplicates, %d failed; %.0f tok/s",
        label, _fmt_s(s.wall_s), s.computed, s.reused, s.duplicates, s.failed, s.tokens_per_s,
    )
    return outcome


# ---------------------------------------------------------------- summary over ranges

# Index meta keys every range must agree on to form one data set.
SHARED_KEYS = (
    "settings_digest", "convention", "aux_layer_ids", "final", "num_hidden_layers",
    "num_layers_captured", "hidden_size", "dtype", "engine", "engine_layer_ids", "storage",
)  # fmt: skip
META_DEFAULTS = {"storage": "lossless"}  # what an index written before the key existed means


def summarize_hidden_states(range_dirs: Sequence[Path], max_seq_len: int | None = None) -> tuple[dict, dict]:
    """(data_config, sample_lengths) from the range indexes only."""
    if not range_dirs:
        raise DraftflowError("summarize-hidden-states: no range folders given")
    metas = {Path(d): read_range_index(Path(d))[0] for d in range_dirs}
    metas = {d: {**META_DEFAULTS, **meta} for d, meta in metas.items()}
    first_dir, first = next(iter(metas.items()))
    for d, meta in metas.items():
        for key in SHARED_KEYS:
            if meta.get(key) != first.get(key):
                raise DraftflowError(
                    f"{d}/index.json: field 'meta.{key}' is {meta.get(key)!r} but {first_dir} has "
                    f"{first.get(key)!r}: the ranges were extracted with different settings; rerun extract"
                )
    totals = summarize(list(metas))
    by_split: dict[str, list[Path]] = {}
    for d, meta in metas.items():
        by_split.setdefault(meta.get("split", "unknown"), []).append(d)
    splits, lengths = {}, {}
    for split, dirs in sorted(by_split.items()):
        per = sample_lengths(dirs)
        clash = lengths.keys() & per["lengths"].keys()
        if clash:
            raise DraftflowError(f"sample id {sorted(clash)[0]!r} appears in more than one split")
        lengths.update(per["lengths"])
        splits[split] = per
    versions = [m.get("versions") for m in metas.values()]
    distinct_versions = [v for i, v in enumerate(versions) if v not in versions[:i]]
    num_layers = first["num_hidden_layers"]
    data_config = {
        "convention": CONVENTION,
        "aux_layer_ids": first["aux_layer_ids"],
        # The user's style: aux ids + the last layer, whose entry here is the final state
        # (after the final norm); layer_meanings says exactly what each entry holds.
        "layer_ids": first["aux_layer_ids"] + [num_layers - 1],
        "layer_meanings": layer_meanings(first["aux_layer_ids"], num_layers),
        "final": first["final"],
        "num_hidden_layers": num_layers,
        "engine": first["engine"],
        "engine_layer_ids": first["engine_layer_ids"],
        "engine_layer_id_meaning": first.get("engine_layer_id_meaning"),
        "engine_final": first.get("engine_final"),
        "hidden_size": first["hidden_size"],
        "dtype": first["dtype"],
        "storage": first["storage"],
        "num_layers_captured": first["num_layers_captured"],
        "max_seq_len": max_seq_len if max_seq_len is not None else totals["max_length"],
        "total_samples": totals["total_samples"],
        "total_tokens": totals["total_tokens"],
        "total_loss_tokens": totals["total_loss_tokens"],
        "bytes_stored": totals["stored_bytes"],
        "bytes_raw": totals["raw_bytes"],
        "compression_ratio": totals["compression_ratio"],
        "settings_digest": first["settings_digest"],
        "splits": {
            s: {"ranges": len(by_split[s]), "samples": p["total_samples"], "tokens": p["total_tokens"],
                "loss_tokens": p["total_loss_tokens"]}
            for s, p in splits.items()
        },  # fmt: skip
        "failed_samples": sum(m.get("counts", {}).get("failed", 0) for m in metas.values()),
        "versions": distinct_versions[0] if len(distinct_versions) == 1 else distinct_versions,
    }
    sample_lengths_doc = {
        "total_samples": len(lengths),
        "total_tokens": sum(lengths.values()),
        "lengths": lengths,
        "splits": {s: p["lengths"] for s, p in splits.items()},
    }
    return data_config, sample_lengths_doc


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    if stage == "summarize-hidden-states":
        parser.add_argument("--ranges", nargs="+", type=Path, required=True, help="range folders (with index.json)")
        parser.add_argument("--output-dir", type=Path, required=True)
        parser.add_argument("--max-seq-len", type=int, default=None)
        return
    parser.add_argument("--input", type=Path, required=True, help="merged split file (train.jsonl / eval.jsonl)")
    parser.add_argument("--split", choices=["train", "eval"], required=True)
    parser.add_argument("--start", type=int, required=True, help="first record (0-based)")
    parser.add_argument("--end", type=int, required=True, help="end record (exclusive)")
    parser.add_argument("--target", type=Path, required=True, help="target model folder")
    parser.add_argument("--store", type=Path, required=True, help="content-keyed sample store folder")
    parser.add_argument("--settings", type=settings_arg, default={}, help="the config's extract section (JSON)")
    parser.add_argument("--output", type=Path, required=True, help="range folder to write (index.json)")
    parser.add_argument("--gpu-lock-dir", type=Path, default=None, help="host-wide GPU lock folder")


def use_threads(settings: dict, threads: int) -> dict:
    """The job's threads: the writer pool (encode, zstd, write) runs beside the capture loop."""
    compute, writers = split_threads(threads, int(settings.get("writer_threads", 4)))
    torch.set_num_threads(compute)
    log.info("%d CPU thread(s): %d for the capture, %d writer(s)", threads, compute, writers)
    return {**settings, "writer_threads": writers}  # not a capture setting: store keys unchanged


def main(args: argparse.Namespace) -> int:
    if args.stage == "summarize-hidden-states":
        data_config, lengths = summarize_hidden_states(args.ranges, args.max_seq_len)
        write_json(args.output_dir / "data_config.json", data_config)
        write_json(args.output_dir / "sample_lengths.json", lengths)
        log.info(
            "%d ranges: %d samples, %d tokens, %d bytes stored (%.3f of raw)",
            len(args.ranges), data_config["total_samples"], data_config["total_tokens"],
            data_config["bytes_stored"], data_config["compression_ratio"] or 0.0,
        )
        return 0
    settings = use_threads(args.settings, getattr(args, "threads", None) or default_threads())
    outcome = run_extract(
        args.input, args.split, args.start, args.end, args.target, args.store, settings,
        args.output, args.gpu_lock_dir,
    )
    return 0
