"""`draftflow convert`: move hidden states between draftflow, SpecForge and speculators.

Formats (checked against SpecForge main: `scripts/prepare_hidden_states.py`,
`OfflineEagle3Dataset`; and speculators 0.9.0: `speculators.train.data.ArrowDataset`,
`hs_connectors.FileTransfer`, `Eagle3` core's `verifier_norm`):

* **draftflow**: range folders `rows_{start}-{end}/index.json` (optionally under a
  split folder) pointing into a content-keyed store (`draftflow.hidden_states.storage`).
* **SpecForge**: `rows_{g}-{g+2000}/data_{i}.ckpt` (or `.ckpt.gz`, gzip), one
  `torch.save` dict per sample: `input_ids` [T] int64, `loss_mask` [T] int64,
  `aux_hidden_state` [1, T, A·H] (aux layers concatenated along the last dim in
  layer order) and `hidden_state` [1, T, H], the final state *after* the norm
  (SpecForge's target head is the bare LM head) — the draftflow convention.
* **speculators**: a `datasets.save_to_disk` folder with columns `input_ids`,
  `loss_mask`, `seq_len` (torch format), and `hidden_states/hs_{i}.safetensors`
  for row i: `token_ids` [T] int64 and `hidden_states` [T, A+1, H]. Its last slot
  is vLLM's layer N: the last layer's output *before* the final norm (the
  speculators trainer applies `verifier_norm` itself). Converting that slot to or
  from draftflow's post-norm state needs the target's final norm weight
  (`--target`), or an explicit `--copy-final` to copy the bits unchanged.
  FP8 (hs-connectors 0.9.0, which speculators 0.9.0 requires: `FP8HiddenStatesConnector`
  writes, `FP8Transfer` behind `--hidden-states-backend fp8` reads): `hidden_states` is
  float8_e4m3fn [T, A+1, H] and `hidden_states_scales` float32, read as
  `hidden_states.to(bf16) * scales.to(bf16)`. Their connector writes one scale per token
  ([T, 1, 1]); the export of an fp8 draftflow store writes draftflow's own per-token,
  per-state power-of-two scales ([T, A+1, 1], which that product broadcasts), so their
  reader decodes exactly the bf16 values draftflow's reader returns.

Internally every converter yields draftflow `Sample`s (post-norm final state); fp8
samples keep their codes and scales (`Sample.fp8`), so fp8 -> fp8 conversions copy them.
Exports also write `draftflow_export.json` (sample ids, content keys, range meta)
so an import of an export restores ids, keys and metadata.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from draftflow.errors import DraftflowError
from draftflow.jsonl import atomic_path, read_json, write_json
from draftflow.hidden_states.storage import (
    FP8_MAX_EXP,
    FP8_MIN_EXP,
    FP8_MODES,
    STORAGE_MODES,
    Fp8Hidden,
    HiddenStateReader,
    IndexEntry,
    Sample,
    SampleStore,
    encode_sample,
    quantize_fp8,
    find_range_dirs,
    read_range_index,
    sample_key,
    settings_digest,
    write_range_index,
)

log = logging.getLogger(__name__)

FORMATS = ("draftflow", "specforge", "speculators")
SIDECAR = "draftflow_export.json"
SPECFORGE_GROUP = 2000  # SpecForge's default file_group_size
SPECULATORS_SCALES = "hidden_states_scales"  # hs-connectors' fp8 scale tensor
SPECULATORS_HIDDEN = ("auto", "fp8", "bf16")  # --speculators-hidden: auto = fp8 when the source is
_SPECFORGE_FILE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
_SPECULATORS_FILE = re.compile(r"^hs_(\d+)\.safetensors$")


@dataclass(frozen=True)
class Item:
    """One sample on its way between formats."""

    index: int  # position in the source (SpecForge data_{i}, speculators row i, draftflow order)
    sample_id: str
    key: str | None  # draftflow content key, when known and still valid for these bits
    sample: Sample  # final state post-norm (draftflow convention)


# ---------------------------------------------------------------- the final norm


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm, to map speculators' pre-norm last state to draftflow's post-norm one."""

    weight: torch.Tensor  # [H]
    eps: float

    def apply(self, pre: torch.Tensor) -> torch.Tensor:
        """Llama-style RMSNorm, op for op as HF transformers computes it (so results match bitwise)."""
        dtype = pre.dtype
        x = pre.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x.to(dtype)

    def unapply(self, post: torch.Tensor) -> torch.Tensor:
        """A pre-norm stand-in: post / weight has RMS ~1, so apply() maps it back to post up to rounding."""
        weight = self.weight.to(torch.float32)
        if bool((weight == 0).any()):
            raise DraftflowError("the final norm has zero weights; its input cannot be reconstructed")
        return (post.to(torch.float32) / weight).to(post.dtype)

    @classmethod
    def from_target(cls, target_dir: Path) -> FinalNorm:
        """Read `model.norm.weight` and `rms_norm_eps` from an HF model folder (safetensors)."""
        from safetensors import safe_open

        target_dir = Path(target_dir)
        config = read_json(target_dir / "config.json")
        config = config.get("text_config", config)  # multimodal wrappers nest the LM config
        eps = float(config.get("rms_norm_eps", 1e-6))
        name = "model.norm.weight"
        index = target_dir / "model.safetensors.index.json"
        if index.is_file():
            shard = read_json(index)["weight_map"].get(name)
            files = [target_dir / shard] if shard else []
        else:
            files = sorted(target_dir.glob("*.safetensors"))
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():
                    return cls(weight=f.get_tensor(name), eps=eps)
        raise DraftflowError(f"{target_dir}: no tensor '{name}' in its safetensors files")


# ---------------------------------------------------------------- readers


def read_draftflow(input_dir: Path, store_root: Path | None = None) -> list[tuple[str, dict, Iterator[Item]]]:
    """Groups of ranges that share a parent folder (a split), each as (name, meta, items)."""
    range_dirs = find_range_dirs(input_dir)
    if not range_dirs:
        raise DraftflowError(f"{input_dir}: no rows_*/index.json found (nor */rows_*/index.json)")
    parents = sorted({d.parent for d in range_dirs})
    groups = []
    for parent in parents:
        dirs = [d for d in range_dirs if d.parent == parent]
        meta, _ = read_range_index(dirs[0])
        name = "" if len(parents) == 1 else parent.name
        groups.append((name, _carry_meta(meta), _draftflow_items(dirs, store_root)))
    return groups


def _draftflow_items(range_dirs: list[Path], store_root: Path | None) -> Iterator[Item]:
    reader = HiddenStateReader(range_dirs, store_root=store_root, check=True, fp8_codes=True)
    for i in range(len(reader)):
        yield Item(i, reader.sample_ids[i], reader.keys[i], reader[i])


_RANGE_ONLY_META = (
    "store_root",
    "format_version",
    "start",
    "end",
    "split",
    "counts",
    "timings",
    "records",
    "target_dir",
    "extract_settings",
)


def _carry_meta(meta: dict) -> dict:
    """The meta that describes the data set (layer ids, engine …), not one range of it."""
    return {k: v for k, v in meta.items() if k not in _RANGE_ONLY_META}


def _read_sidecar(input_dir: Path) -> dict:
    path = Path(input_dir) / SIDECAR
    return read_json(path) if path.is_file() else {}


def read_specforge(input_dir: Path) -> tuple[dict, Iterator[Item]]:
    input_dir = Path(input_dir)
    files = _indexed_files(input_dir, _SPECFORGE_FILE, recursive=True)
    if not files:
        raise DraftflowError(f"{input_dir}: no SpecForge data_*.ckpt files found")
    sidecar = _read_sidecar(input_dir)
    return _sidecar_meta(sidecar), _specforge_items(files, sidecar)


def _specforge_items(files: list[tuple[int, Path]], sidecar: dict) -> Iterator[Item]:
    known = _sidecar_samples(sidecar)
    for index, path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as f:
                raw = torch.load(f, map_location="cpu", weights_only=True)
            sample = specforge_to_sample(raw)
        except (KeyError, ValueError, RuntimeError, OSError) as e:
            raise DraftflowError(f"{path}: not a SpecForge EAGLE-3 sample: {e}") from None
        sample_id, key = known.get(index, (f"specforge-{index}", None))
        yield Item(index, sample_id, key, sample)


def specforge_to_sample(raw: dict) -> Sample:
    """A SpecForge data_{i}.ckpt dict -> Sample (hidden = aux layers then final, [T, A+1, H])."""
    ids = raw["input_ids"].reshape(-1)  # [T] (tolerate [1, T])
    mask = raw["loss_mask"].reshape(-1)  # [T]
    final = raw["hidden_state"].reshape(-1, raw["hidden_state"].shape[-1])  # [T, H]
    T, H = final.shape
    aux = raw["aux_hidden_state"].reshape(T, -1)  # [T, A*H]
    if aux.shape[1] % H or ids.shape[0] != T or mask.shape[0] != T:
        raise ValueError(
            f"inconsistent shapes: input_ids {tuple(ids.shape)}, aux {tuple(aux.shape)}, final {tuple(final.shape)}"
        )
    if aux.dtype != final.dtype:
        raise ValueError(f"aux dtype {aux.dtype} differs from final dtype {final.dtype}")
    hidden = torch.cat([aux.reshape(T, -1, H), final[:, None]], dim=1)  # [T, A+1, H]
    return Sample(ids.numpy().astype(np.int64), mask.numpy().astype(np.uint8), hidden)


def read_speculators(input_dir: Path, norm: FinalNorm | None, copy_final: bool) -> tuple[dict, Iterator[Item]]:
    from datasets import load_from_disk

    input_dir = Path(input_dir)
    _check_final_choice(norm, copy_final)
    try:
        rows = load_from_disk(str(input_dir)).with_format(None)
    except FileNotFoundError:
        raise DraftflowError(f"{input_dir}: not a speculators dataset folder (datasets.save_to_disk output)") from None
    for column in ("input_ids", "loss_mask"):
        if column not in rows.column_names:
            raise DraftflowError(f"{input_dir}: dataset has no column '{column}'")
    files = _indexed_files(input_dir / "hidden_states", _SPECULATORS_FILE, recursive=False)
    if not files:
        raise DraftflowError(f"{input_dir}/hidden_states: no hs_*.safetensors files found")
    sidecar = _read_sidecar(input_dir)
    meta = _sidecar_meta(sidecar)
    # Keys name exact bits: after renormalizing, the sidecar's keys (for the original bits) no longer apply,
    # and new keys must not collide with the extraction's (a derived settings digest).
    exact = norm is None and sidecar.get("copy_final", True)
    if not exact:
        if "settings_digest" in meta:
            meta["settings_digest"] = settings_digest(
                {"derived_from": meta["settings_digest"], "via": "speculators final norm"}
            )
        sidecar = {k: v for k, v in sidecar.items() if k != "samples"} | {
            "samples": [[i, sample_id, None] for i, sample_id, _ in sidecar.get("samples", [])]
        }
    return meta, _speculators_items(files, rows, sidecar, norm)


def _speculators_items(files, rows, sidecar: dict, norm: FinalNorm | None) -> Iterator[Item]:
    from safetensors.torch import load_file

    known = _sidecar_samples(sidecar)
    missing = len(rows) - len(files)
    if missing:
        log.warning("%d dataset rows have no hs_*.safetensors file; they are skipped", missing)
    for index, path in files:
        if index >= len(rows):
            raise DraftflowError(f"{path}: row {index} is past the end of the dataset ({len(rows)} rows)")
        row = rows[index]
        loaded = load_file(str(path))
        try:
            token_ids, hidden = loaded["token_ids"].reshape(-1), loaded["hidden_states"]  # [T], [T, A+1, H]
        except KeyError as e:
            raise DraftflowError(f"{path}: missing tensor {e}") from None
        fp8 = None
        if SPECULATORS_SCALES in loaded:  # hs-connectors' FP8 files
            hidden, fp8 = _speculators_dequantize(path, hidden, loaded[SPECULATORS_SCALES])
        if token_ids.tolist() != list(row["input_ids"]) or hidden.dim() != 3 or hidden.shape[0] != token_ids.shape[0]:
            raise DraftflowError(
                f"{path}: token_ids / hidden_states {tuple(hidden.shape)} do not match dataset row {index}"
            )
        if norm is not None:
            hidden = torch.cat([hidden[:, :-1], norm.apply(hidden[:, -1])[:, None]], dim=1)
            fp8 = None  # the final slot is no longer what the codes hold
        mask = np.asarray(row["loss_mask"], dtype=np.uint8)
        sample_id, key = known.get(index, (f"speculators-{index}", None))
        yield Item(index, sample_id, key, Sample(token_ids.numpy().astype(np.int64), mask, hidden, fp8))


def _speculators_dequantize(path: Path, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, Fp8Hidden | None]:
    """An hs-connectors FP8 file's [T, L, H] codes and scales -> bf16 as their FP8Transfer computes it,
    plus the codes as an `Fp8Hidden` when the scales are draftflow's (powers of two per row)."""
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 3:
        raise DraftflowError(f"{path}: '{SPECULATORS_SCALES}' given but hidden_states is {codes.dtype} {tuple(codes.shape)}")
    T, L, _ = codes.shape
    try:
        scales = scales.float().reshape(T, -1, 1).expand(T, L, 1)  # [T, 1 or L, 1] -> [T, L, 1]
    except RuntimeError:
        raise DraftflowError(f"{path}: '{SPECULATORS_SCALES}' {tuple(scales.shape)} does not fit hidden_states {tuple(codes.shape)}") from None
    hidden = codes.to(torch.bfloat16) * scales.to(torch.bfloat16)  # [T, L, H], their dequantization
    mant, exp = torch.frexp(scales[..., 0])  # [T, L]
    exps = exp - 1
    if bool((mant == 0.5).all()) and FP8_MIN_EXP <= int(exps.min()) and int(exps.max()) <= FP8_MAX_EXP:
        return hidden, Fp8Hidden(codes.view(torch.uint8).contiguous(), exps.to(torch.int8).contiguous(), torch.bfloat16)
    return hidden, None


def _indexed_files(folder: Path, pattern: re.Pattern, recursive: bool) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    paths = folder.rglob("*") if recursive else folder.iterdir()
    found = [(int(m.group(1)), p) for p in paths if (m := pattern.match(p.name))]
    return sorted(found)


def _sidecar_samples(sidecar: dict) -> dict[int, tuple[str, str | None]]:
    return {index: (sample_id, key) for index, sample_id, key in sidecar.get("samples", [])}


def _sidecar_meta(sidecar: dict) -> dict:
    return dict(sidecar.get("meta", {}))


def _check_final_choice(norm: FinalNorm | None, copy_final: bool) -> None:
    if norm is None and not copy_final:
        raise DraftflowError(
            "speculators stores the last layer's output before the final norm (its trainer applies the norm); "
            "draftflow stores it after. Pass --target MODEL_DIR so the final norm can be applied or undone, "
            "or --copy-final to copy the final state's bits unchanged"
        )


# ---------------------------------------------------------------- writers


def _ordered_map(fn: Callable, items: Iterable, workers: int) -> Iterator:
    """map() over a thread pool with bounded look-ahead; zstd, hashing and file I/O release the GIL."""
    pending: list[Future] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


@dataclass
class ConvertResult:
    samples: int = 0
    outputs: list[str] = field(default_factory=list)


def write_draftflow(
    items: Iterable[Item],
    output_dir: Path,
    meta: dict,
    store_root: Path | None = None,
    range_size: int = SPECFORGE_GROUP,
    level: int = 1,
    digest: str | None = None,
    workers: int = 4,
    storage: str | None = None,
) -> ConvertResult:
    """Store samples and write range indexes `output_dir/rows_{s}-{e}/index.json` of `range_size` samples.

    storage: lossless | fp8 | fp8_aux (None: the source's, from `meta`). fp8 samples with
    codes (`Sample.fp8`) are stored as they are (between fp8 and fp8_aux: their final state
    requantized, or kept as fp8 decoded it); others are quantized.
    """
    output_dir = Path(output_dir)
    store = SampleStore(store_root or output_dir / "store")
    source_storage = meta.get("storage", "lossless")
    storage = storage or source_storage
    if storage not in STORAGE_MODES:
        raise DraftflowError(f"--storage {storage!r}: expected one of {', '.join(STORAGE_MODES)}")
    keep_keys = digest is None  # an explicit digest means: key every sample afresh under it
    digest = digest or meta.get("settings_digest") or settings_digest({"imported_into": str(output_dir.resolve())})
    if storage != source_storage:  # other stored values: keys of their own, never the source's
        keep_keys = False
        digest = settings_digest({"derived_from": digest, "storage": storage})
    result = ConvertResult()
    shape: tuple[int, int, str] | None = None

    def put(item: Item) -> IndexEntry:
        key = (item.key if keep_keys else None) or sample_key(digest, item.sample.input_ids)
        if store.contains(key):  # content-keyed: an existing file holds these exact bits already
            return store.entry_for(key, item.sample_id)
        hidden = item.sample.fp8 if storage in FP8_MODES and item.sample.fp8 is not None else item.sample.hidden
        data = encode_sample(item.sample.input_ids, item.sample.loss_mask, hidden, level=level, storage=storage)
        return store.put(key, data).entry(item.sample_id, key)

    def checked(items: Iterable[Item]) -> Iterator[Item]:
        nonlocal shape
        for item in items:
            h = item.sample.hidden
            this = (h.shape[1], h.shape[2], str(h.dtype).removeprefix("torch."))
            if shape is not None and this != shape:
                seen = f"[T, {shape[0]}, {shape[1]}] {shape[2]}"
                raise DraftflowError(
                    f"sample {item.sample_id}: hidden [T, {this[0]}, {this[1]}] {this[2]}, earlier {seen}"
                )
            shape = this
            yield item

    entries: list[IndexEntry] = []
    start = 0

    def flush(end: int) -> None:
        range_meta = dict(meta, settings_digest=digest, store_root=str(store.root.resolve()),
                          num_layers_captured=shape[0], hidden_size=shape[1], dtype=shape[2], storage=storage)  # fmt: skip
        range_dir = output_dir / f"rows_{start}-{end}"
        write_range_index(range_dir, entries, range_meta)
        result.outputs.append(str(range_dir))

    for entry in _ordered_map(put, checked(items), workers):
        entries.append(entry)
        result.samples += 1
        if len(entries) == range_size:
            flush(start + range_size)
            start, entries = start + range_size, []
    if entries:
        flush(start + len(entries))
    if result.samples == 0:
        raise DraftflowError("nothing to import: the source has no samples")
    return result


def write_specforge(
    items: Iterable[Item], output_dir: Path, meta: dict, group_size: int = SPECFORGE_GROUP, workers: int = 4
) -> ConvertResult:
    """Write `rows_{g}-{g+group_size}/data_{i}.ckpt` per sample, as SpecForge's prepare_hidden_states lays them out."""
    output_dir = Path(output_dir)

    def save(numbered: tuple[int, Item]) -> list:
        i, item = numbered
        group = (i // group_size) * group_size
        path = output_dir / f"rows_{group}-{group + group_size}" / f"data_{i}.ckpt"
        with atomic_path(path) as tmp:
            torch.save(sample_to_specforge(item.sample), tmp)
        return [i, item.sample_id, item.key]

    samples = list(_ordered_map(save, enumerate(items), workers))
    return _finish_export(output_dir, "specforge", samples, meta, {})


def write_speculators(
    items: Iterable[Item],
    output_dir: Path,
    meta: dict,
    norm: FinalNorm | None,
    copy_final: bool,
    workers: int = 4,
    hidden_format: str = "auto",
) -> ConvertResult:
    """Write a speculators dataset folder + `hidden_states/hs_{i}.safetensors` (row i of the dataset).

    hidden_format: fp8 writes hs-connectors' FP8 layout (module docstring), bf16 plain
    tensors, auto = fp8 for samples stored as fp8.
    """
    if hidden_format not in SPECULATORS_HIDDEN:
        raise DraftflowError(f"--speculators-hidden {hidden_format!r}: expected one of {', '.join(SPECULATORS_HIDDEN)}")
    import pyarrow as pa
    from datasets import Dataset
    from safetensors.torch import save_file

    _check_final_choice(norm, copy_final)
    output_dir = Path(output_dir)

    def save(numbered: tuple[int, Item]) -> tuple[list, Sample]:
        i, item = numbered
        hidden = item.sample.hidden  # [T, A+1, H], final post-norm
        if norm is not None:  # speculators' last slot is pre-norm; its trainer re-applies the norm
            hidden = torch.cat([hidden[:, :-1], norm.unapply(hidden[:, -1])[:, None]], dim=1)
        tensors = {
            "token_ids": torch.from_numpy(item.sample.input_ids.astype(np.int64)),
            "hidden_states": hidden.contiguous(),
        }
        if hidden_format == "fp8" or (hidden_format == "auto" and item.sample.fp8 is not None):
            tensors.update(_speculators_fp8(item.sample, hidden, norm is not None))
        with atomic_path(output_dir / "hidden_states" / f"hs_{i}.safetensors") as tmp:
            save_file(tensors, str(tmp))
        return [i, item.sample_id, item.key], item.sample

    # Build the dataset from Arrow batches: Python int lists for 88M tokens would take several GB.
    samples, batches, batch, fp8_rows = [], [], [], 0
    for row, sample in _ordered_map(save, enumerate(items), workers):
        samples.append(row)
        batch.append(sample)
        fp8_rows += hidden_format == "fp8" or (hidden_format == "auto" and sample.fp8 is not None)
        if len(batch) == 1000:
            batches.append(_speculators_batch(batch))
            batch = []
    if batch:
        batches.append(_speculators_batch(batch))
    if not batches:
        raise DraftflowError("nothing to export: the source has no samples")
    dataset = Dataset(pa.Table.from_batches(batches))
    dataset.set_format(type="torch")  # as speculators' prepare_data saves it; its trainer torch.equal()s input_ids
    dataset.save_to_disk(str(output_dir))
    norm_note = {
        "copy_final": copy_final,
        "final_state": "post-norm copied" if norm is None else "post-norm / norm weight",
        "hidden_states": "fp8" if fp8_rows else "bf16",
    }
    if fp8_rows:
        log.info("%d samples in hs-connectors' FP8 layout: train with `--hidden-states-backend fp8`", fp8_rows)
    return _finish_export(output_dir, "speculators", samples, meta, norm_note)


def _speculators_fp8(sample: Sample, hidden: torch.Tensor, final_changed: bool) -> dict[str, torch.Tensor]:
    """`hidden_states` (float8_e4m3fn) and `hidden_states_scales` ([T, L, 1] float32) for one sample.

    The stored codes when there are any (the final slot requantized if the norm changed
    it, or if fp8_aux kept it lossless), else a quantization of `hidden`.
    """
    q = sample.fp8 if sample.fp8 is not None else quantize_fp8(hidden)
    codes, exps = q.codes.clone(), q.exps.clone()  # [T, L, H], [T, L]
    if sample.fp8 is not None and (final_changed or sample.fp8.final is not None):
        final = quantize_fp8(hidden[:, -1:].contiguous())
        codes[:, -1:], exps[:, -1:] = final.codes, final.exps
    scales = torch.from_numpy(np.ldexp(np.float32(1), exps.numpy().astype(np.int32)))[..., None]  # [T, L, 1] 2^k, exact
    return {"hidden_states": codes.view(torch.float8_e4m3fn), SPECULATORS_SCALES: scales}


def _speculators_batch(samples: list[Sample]):
    """Rows `input_ids` list<int64>, `loss_mask` list<int64>, `seq_len` int64 for some samples."""
    import pyarrow as pa

    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    ids = np.concatenate([s.input_ids for s in samples]).astype(np.int64)
    mask = np.concatenate([s.loss_mask for s in samples]).astype(np.int64)
    return pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(offsets, pa.array(ids)),
            pa.ListArray.from_arrays(offsets, pa.array(mask)),
            pa.array(lengths),
        ],
        names=["input_ids", "loss_mask", "seq_len"],
    )


def _finish_export(output_dir: Path, fmt: str, samples: list[list], meta: dict, extra: dict) -> ConvertResult:
    if not samples:
        raise DraftflowError("nothing to export: the source has no samples")
    sidecar = {"format_version": 1, "format": fmt, "meta": meta, "samples": samples, **extra}
    write_json(output_dir / SIDECAR, sidecar)
    return ConvertResult(samples=len(samples), outputs=[str(output_dir)])


def sample_to_specforge(sample: Sample) -> dict[str, torch.Tensor]:
    """Sample -> SpecForge data_{i}.ckpt dict (shapes and dtypes as SpecForge's prepare_hidden_states writes)."""
    T, L, H = sample.hidden.shape
    return {
        "input_ids": torch.from_numpy(sample.input_ids.astype(np.int64)),  # [T] int64
        "loss_mask": torch.from_numpy(sample.loss_mask.astype(np.int64)),  # [T] int64
        "hidden_state": sample.final.contiguous().reshape(1, T, H),  # [1, T, H], post-norm
        "aux_hidden_state": sample.aux.reshape(1, T, (L - 1) * H),  # [1, T, A*H], layer order
    }


# ---------------------------------------------------------------- conversion


@dataclass(frozen=True)
class ConvertOptions:
    target: Path | None = None  # HF model folder with the final norm (speculators conversions)
    copy_final: bool = False  # speculators: copy the final state's bits instead of (un)applying the norm
    split: str | None = None  # importing into draftflow: write OUTPUT/<split>/rows_*
    store: Path | None = None  # importing into draftflow: store folder (default OUTPUT/store)
    range_size: int = SPECFORGE_GROUP
    level: int = 1
    settings_digest: str | None = None  # key imported samples under this digest (e.g. the extraction's)
    workers: int = 4
    storage: str | None = None  # importing into draftflow: lossless | fp8 | fp8_aux (None: the source's)
    speculators_hidden: str = "auto"  # exporting to speculators: auto | fp8 | bf16


def convert(
    src: str, dst: str, input_dir: Path, output_dir: Path, options: ConvertOptions = ConvertOptions()
) -> ConvertResult:
    """Convert a hidden-state folder from one format to another (see the module docstring)."""
    for name, fmt in (("--from", src), ("--to", dst)):
        if fmt not in FORMATS:
            raise DraftflowError(f"{name} {fmt!r}: expected one of {', '.join(FORMATS)}")
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if not input_dir.is_dir():
        raise DraftflowError(f"{input_dir}: not a folder")
    if input_dir.resolve() == output_dir.resolve():
        raise DraftflowError("--input and --output must be different folders")
    norm = FinalNorm.from_target(options.target) if options.target else None
    if "speculators" in (src, dst):
        _check_final_choice(norm, options.copy_final)

    if src == "draftflow":
        groups = read_draftflow(input_dir, store_root=None)
    elif src == "specforge":
        groups = [("", *read_specforge(input_dir))]
    else:
        groups = [("", *read_speculators(input_dir, norm, options.copy_final))]

    total = ConvertResult()
    for name, meta, items in groups:
        out = output_dir / name if name else output_dir
        if dst == "draftflow":
            out = out / options.split if options.split else out
            store = options.store or output_dir / "store"
            result = write_draftflow(items, out, meta, store, options.range_size, options.level,
                                     options.settings_digest, options.workers, options.storage)  # fmt: skip
        elif dst == "specforge":
            result = write_specforge(items, out, meta, workers=options.workers)
        else:
            result = write_speculators(items, out, meta, norm, options.copy_final, options.workers,
                                       options.speculators_hidden)  # fmt: skip
        total.samples += result.samples
        total.outputs += result.outputs
    return total


# ---------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    parser.add_argument("--from", dest="src", choices=FORMATS, required=True)
    parser.add_argument("--to", dest="dst", choices=FORMATS, required=True)
    parser.add_argument("--input", type=Path, required=True, metavar="DIR")
    parser.add_argument("--output", type=Path, required=True, metavar="DIR")
    parser.add_argument(
        "--target",
        type=Path,
        metavar="MODEL_DIR",
        help="HF target folder whose final norm maps speculators' pre-norm last state to draftflow's post-norm one",
    )
    parser.add_argument("--copy-final", action="store_true", help="speculators: copy the final state's bits unchanged")
    parser.add_argument("--split", help="into draftflow: write OUTPUT/SPLIT/rows_* (e.g. train)")
    parser.add_argument("--store", type=Path, metavar="DIR", help="into draftflow: sample store (default OUTPUT/store)")
    parser.add_argument("--range-size", type=int, default=SPECFORGE_GROUP, help="into draftflow: samples per range")
    parser.add_argument("--level", type=int, default=1, help="into draftflow: zstd level")
    parser.add_argument("--settings-digest", help="into draftflow: key samples under this capture-settings digest")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="writer threads")
    parser.add_argument(
        "--storage", choices=STORAGE_MODES, default=None,
        help="into draftflow: lossless, fp8 or fp8_aux sample files (default: the source's, else lossless)",
    )  # fmt: skip
    parser.add_argument(
        "--speculators-hidden", choices=SPECULATORS_HIDDEN, default="auto",
        help="into speculators: fp8 = hs-connectors' FP8 layout (train with --hidden-states-backend fp8), "
        "bf16 = plain; auto = fp8 for an fp8 store",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    options = ConvertOptions(
        target=args.target, copy_final=args.copy_final, split=args.split, store=args.store,
        range_size=args.range_size, level=args.level, settings_digest=args.settings_digest, workers=args.workers,
        storage=args.storage, speculators_hidden=args.speculators_hidden,
    )  # fmt: skip
    result = convert(args.src, args.dst, args.input, args.output, options)
    print(f"converted {result.samples} samples {args.src} -> {args.dst}: {', '.join(result.outputs[:3])}"
          + (" …" if len(result.outputs) > 3 else ""))  # fmt: skip
    return 0
