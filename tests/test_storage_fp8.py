"""extract.storage: fp8 and fp8_aux — quantizer, sample files, store keys, summaries, verify, plan/preflight, interop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from draftflow.engines.capture import capture_settings
from draftflow.errors import DraftflowError
from draftflow.hidden_states.extract import ExtractOptions, Record, extract_range, summarize_hidden_states
from draftflow.hidden_states.interop import ConvertOptions, convert
from draftflow.hidden_states.plan import PlanSettings, plan_storage
from draftflow.hidden_states.preflight import PreflightSettings, preflight, stored_sample_bytes
from draftflow.hidden_states.storage import (
    FP8_MAX_EXP,
    FP8_MIN_EXP,
    Fp8Hidden,
    HiddenStateReader,
    SampleStore,
    decode_sample,
    encode_sample,
    fp8_problem,
    quantize_fp8,
    read_header,
    read_range_index,
    sample_key,
    settings_digest,
    storage_of_file,
    write_range_index,
)
from draftflow.hidden_states.verify import verify_hidden_states
from test_storage import activations, bits, make_sample

FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # [256]


def reference_dequantize(q: Fp8Hidden) -> torch.Tensor:
    """codes × 2^k in float64, then the capture dtype: what every reader must return."""
    values = q.codes.view(torch.float8_e4m3fn).double() * torch.pow(2.0, q.exps.double())[..., None]
    return values.to(q.dtype)


def row_relative_error(decoded: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """[T, L] ||decoded - original|| / ||original|| per row."""
    x = original.double()
    return (decoded.double() - x).norm(dim=-1) / x.norm(dim=-1)


# ---------------------------------------------------------------- quantizer and files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_round_trip_decodes_exactly_codes_times_power_of_two(dtype):
    ids, mask, hidden = make_sample(37, dtype=dtype)
    data = encode_sample(ids, mask, hidden, storage="fp8")
    header = read_header(data)
    assert header.storage == "fp8" and header.dtype == str(dtype).removeprefix("torch.")
    assert header.raw_nbytes == 9 * 37 + hidden.numel() * hidden.element_size()  # counted as what it decodes to
    assert decode_sample(data).fp8 is None  # values only, unless asked (the trainer's reader)
    sample = decode_sample(data, check=True, fp8_codes=True)
    assert sample.input_ids.tolist() == ids.tolist() and sample.loss_mask.tolist() == mask.tolist()
    assert sample.hidden.dtype == dtype and sample.hidden.shape == hidden.shape
    q = quantize_fp8(hidden)
    assert torch.equal(sample.fp8.codes, q.codes) and torch.equal(sample.fp8.exps, q.exps)
    assert torch.equal(bits(sample.hidden), bits(reference_dequantize(q)))
    # 3 mantissa bits: a row is off by ~2.5% (L2); at most 2^-4 from rounding normal values plus
    # 2^-6 from the subnormal grid (absolute step <= RMS/64), and per element 2^-4 of the row's max
    rel = row_relative_error(sample.hidden, hidden)
    assert float(rel.mean()) < 0.035 and float(rel.max()) < (2**-8 + 2**-12) ** 0.5
    top = hidden.double().abs().amax(dim=-1, keepdim=True)
    assert float(((sample.hidden.double() - hidden.double()).abs() / top).max()) <= 2**-4
    assert fp8_problem(sample.fp8) is None
    # the file is smaller than the lossless one by far
    assert len(data) < 0.7 * len(encode_sample(ids, mask, hidden))


def test_scales_are_powers_of_two_with_the_row_max_inside_e4m3():
    hidden = activations(50, L=4, H=256, dtype=torch.float32)
    q = quantize_fp8(hidden)
    amax = hidden.abs().amax(dim=-1)  # [T, L]
    rms = hidden.pow(2).mean(dim=-1).sqrt()
    scale = torch.pow(2.0, q.exps.double())
    assert bool((amax / scale <= 448).all())  # the max fits: no clipping
    # the RMS lands at or above 2^-4 of the grid; where the max allows, in [2^-4, 2^-3)
    assert bool((rms / scale >= 2**-4 * (1 - 1e-6)).all())
    free = amax / scale < 224
    assert bool((rms[free] / scale[free] < 2**-3).all())


def test_all_zero_rows_have_scale_one_and_decode_to_exact_zeros():
    ids, mask, hidden = make_sample(8, dtype=torch.bfloat16)
    hidden[2] = 0  # a token with every state zero
    hidden[5, 1] = 0  # one state of a token
    hidden[6, 3, :] = -0.0
    q = quantize_fp8(hidden)
    assert q.exps[2].tolist() == [0, 0, 0, 0] and int(q.exps[5, 1]) == 0 and int(q.exps[6, 3]) == 0
    sample = decode_sample(encode_sample(ids, mask, hidden, storage="fp8"), check=True)
    assert bool((sample.hidden[2] == 0).all()) and bool((sample.hidden[5, 1] == 0).all())
    assert bool(torch.signbit(sample.hidden[6, 3]).all())  # -0.0 stays -0.0
    assert bool(torch.isfinite(sample.hidden).all())


def test_huge_and_tiny_rows_keep_finite_values_and_relative_precision():
    T, L, H = 4, 2, 64
    g = torch.Generator().manual_seed(1)
    base = torch.randn(T, L, H, generator=g)
    magnitudes = torch.tensor([3.0e38, 1.0e30, 1.0e-30, 1.0e-38])[:, None, None]  # bf16 max is 3.39e38
    hidden = (base / base.abs().amax(dim=-1, keepdim=True) * magnitudes).to(torch.bfloat16)
    hidden[0, 0, 0] = torch.finfo(torch.bfloat16).max  # a row that needs the largest scale
    q = quantize_fp8(hidden)
    assert int(q.exps.max()) <= FP8_MAX_EXP and int(q.exps.min()) >= FP8_MIN_EXP
    decoded = decode_sample(encode_sample(np.arange(T), np.ones(T, np.uint8), hidden, storage="fp8"), check=True).hidden
    assert bool(torch.isfinite(decoded).all())
    rel = row_relative_error(decoded, hidden)
    assert float(rel[:3].max()) < (2**-8 + 2**-12) ** 0.5  # rows inside the scale range: full fp8 precision
    # the bf16-max value saturates at 448 × 2^119 (0.88 of it) rather than becoming inf
    assert float(decoded[0, 0, 0]) == pytest.approx(448 * 2.0**119)
    assert fp8_problem(q) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(bad):
    ids, mask, hidden = make_sample(5)
    hidden[3, 2, 7] = bad
    with pytest.raises(ValueError, match=r"hidden\[3, 2, 7\] is not finite"):
        encode_sample(ids, mask, hidden, storage="fp8")
    with pytest.raises(ValueError, match="not finite"):
        quantize_fp8(hidden)


def test_sign_chain_makes_correlated_states_smaller_on_disk():
    """Consecutive residual-stream states share signs; the stored plane XORs them."""
    ids, mask, hidden = make_sample(256, H=512)  # activations(): a stream shared by the states
    q = quantize_fp8(hidden)
    chained = read_header(encode_sample(ids, mask, q)).sections
    plane = {s["name"]: s for s in chained}["hidden.fp8"]
    import zstandard

    from draftflow.hidden_states.storage import compression_params

    plain = len(zstandard.ZstdCompressor(compression_params=compression_params(1)).compress(q.codes.numpy().tobytes()))
    assert plane["nbytes"] < 0.97 * plain


def test_fp8_aux_keeps_the_final_state_exact_and_the_aux_states_as_fp8(tmp_path):
    ids, mask, hidden = make_sample(50, seed=3)
    files = {mode: encode_sample(ids, mask, hidden, storage=mode) for mode in ("lossless", "fp8", "fp8_aux")}
    assert len(files["fp8"]) < len(files["fp8_aux"]) < len(files["lossless"])
    aux = decode_sample(files["fp8_aux"], check=True, fp8_codes=True)
    fp8 = decode_sample(files["fp8"], check=True, fp8_codes=True)
    assert read_header(files["fp8_aux"]).storage == "fp8_aux"
    assert torch.equal(bits(aux.hidden[:, -1]), bits(hidden[:, -1]))  # the targets' source, bit-exact
    assert torch.equal(bits(aux.hidden[:, :-1]), bits(fp8.hidden[:, :-1]))  # the aux states as fp8 stores them
    assert not torch.equal(bits(fp8.hidden[:, -1]), bits(hidden[:, -1]))
    assert torch.equal(bits(aux.fp8.dequantize()), bits(aux.hidden)) and fp8_problem(aux.fp8) is None
    assert not aux.fp8.codes[:, -1].any()  # the final slot's codes: zeros, the values are in their own sections

    # between the two fp8 modes: to fp8, the final state is quantized as fp8 itself would; to fp8_aux,
    # fp8's final state is kept as it decodes (its error cannot be undone)
    assert encode_sample(ids, mask, aux.fp8, storage="fp8") == files["fp8"]
    from_fp8 = decode_sample(encode_sample(ids, mask, fp8.fp8, storage="fp8_aux"), check=True)
    assert torch.equal(bits(from_fp8.hidden), bits(fp8.hidden))

    store = SampleStore(tmp_path / "store")
    for mode, data in files.items():
        store.put(sample_key(mode, ids), data)
        assert storage_of_file(store.path(sample_key(mode, ids))) == mode
    damaged = bytearray(files["fp8_aux"])
    damaged[-3] ^= 0x10  # inside the final state's last byte plane
    with pytest.raises(ValueError, match="checksum"):
        decode_sample(bytes(damaged), check=True)


def test_version_2_files_are_fp8_and_damage_is_detected():
    ids, mask, hidden = make_sample(9)
    data = bytearray(encode_sample(ids, mask, hidden, storage="fp8"))
    assert data[4:6] == (2).to_bytes(2, "little")  # lossless files stay format 1
    assert bytes(encode_sample(ids, mask, hidden)[4:6]) == (1).to_bytes(2, "little")
    data[-5] ^= 0x10  # inside the exponent section (stored raw or not, the checksum sees it)
    with pytest.raises(ValueError):
        decode_sample(bytes(data), check=True)


# ---------------------------------------------------------------- keys, extraction, summaries


def test_storage_mode_enters_the_content_key_and_lossless_keys_are_unchanged():
    base = {"engine": "hf", "aux_layer_ids": [1, 2], "target_identity": "t", "dtype": "bfloat16"}
    before = settings_digest(capture_settings(base))  # as computed before storage modes existed
    assert settings_digest(capture_settings({**base, "storage": "lossless"})) == before
    fp8 = settings_digest(capture_settings({**base, "storage": "fp8"}))
    assert fp8 != before
    assert settings_digest(capture_settings({**base, "storage": "fp8_aux"})) not in (before, fp8)
    with pytest.raises(DraftflowError, match="extract.storage"):
        capture_settings({**base, "storage": "fp4"})


class TinyEngine:
    """A deterministic capture engine on the CPU: [T, L, H] activations from the token ids."""

    name = "hf"
    num_layers = 4
    hidden_size = 32
    aux_layer_ids = [0, 1, 2]
    dtype = torch.bfloat16
    device = "cpu"

    @property
    def engine_layer_ids(self):
        return self.aux_layer_ids

    def capture(self, batch):
        out = []
        for ids in batch:
            g = torch.Generator().manual_seed(int(np.asarray(ids).sum()))
            out.append((torch.randn(len(ids), 1, 32, generator=g) + 0.5 * torch.randn(len(ids), 4, 32, generator=g)).bfloat16())
        return out


def run_range(store: Path, storage: str, records) -> list:
    settings = {"engine": "hf", "aux_layer_ids": [0, 1, 2], "target_identity": "tiny", "dtype": "bfloat16",
                "batch_tokens": 64, "writer_threads": 2, "storage": storage}  # fmt: skip
    outcome = extract_range(records, TinyEngine(), SampleStore(store), settings, label=storage)
    return outcome


def range_meta(outcome, store: Path, storage: str) -> dict:
    """A range index's meta for `run_range`'s samples."""
    return {"settings_digest": outcome.settings_digest, "store_root": store, "num_layers_captured": 4,
            "hidden_size": 32, "storage": storage, "split": "train", "convention": "c", "aux_layer_ids": [0, 1, 2],
            "final": "post_norm", "num_hidden_layers": 4, "dtype": "bfloat16", "engine": "hf",
            "engine_layer_ids": [0, 1, 2]}  # fmt: skip


def records(n: int = 6) -> list[Record]:
    rng = np.random.default_rng(0)
    return [Record(f"s{i}", "d", rng.integers(1, 300, size=5 + 3 * i), np.ones(5 + 3 * i, np.uint8), i) for i in range(n)]


def test_extraction_in_both_modes_keeps_separate_files_and_refuses_mixed_summaries(tmp_path):
    recs = records()
    store = tmp_path / "store"
    lossless = run_range(store, "lossless", recs)
    fp8 = run_range(store, "fp8", recs)
    assert lossless.stats.computed == fp8.stats.computed == len(recs)  # switching re-extracts
    assert not {e.key for e in lossless.entries} & {e.key for e in fp8.entries}
    modes = {storage_of_file(SampleStore(store).path(e.key)) for e in fp8.entries}
    assert modes == {"fp8"}
    # reader: bf16 either way, fp8 within quantization error of the lossless capture
    for name, outcome in (("lossless", lossless), ("fp8", fp8)):
        write_range_index(tmp_path / name / "train" / "rows_0-6", outcome.entries, range_meta(outcome, store, name))
    exact, approx = HiddenStateReader([tmp_path / "lossless/train/rows_0-6"]), HiddenStateReader([tmp_path / "fp8/train/rows_0-6"])
    for i in range(len(recs)):
        a, b = exact[i].hidden, approx[i].hidden
        assert b.dtype == torch.bfloat16 and float(row_relative_error(b, a).max()) < 0.05
    data_config, _ = summarize_hidden_states([tmp_path / "fp8/train/rows_0-6"])
    assert data_config["storage"] == "fp8" and data_config["compression_ratio"] < 0.6
    with pytest.raises(DraftflowError, match=r"meta\.(settings_digest|storage)"):
        summarize_hidden_states([tmp_path / "lossless/train/rows_0-6", tmp_path / "fp8/train/rows_0-6"])


def test_fp8_aux_extraction_reads_the_final_state_exactly(tmp_path):
    recs = records(4)
    store = tmp_path / "store"
    outcomes = {mode: run_range(store, mode, recs) for mode in ("lossless", "fp8_aux")}
    assert {storage_of_file(SampleStore(store).path(e.key)) for e in outcomes["fp8_aux"].entries} == {"fp8_aux"}
    readers = {}
    for mode, outcome in outcomes.items():
        write_range_index(tmp_path / mode / "rows_0-4", outcome.entries, range_meta(outcome, store, mode))
        readers[mode] = HiddenStateReader([tmp_path / mode / "rows_0-4"])
    for i in range(len(recs)):
        exact, mixed = readers["lossless"][i].hidden, readers["fp8_aux"][i].hidden
        assert torch.equal(bits(mixed[:, -1]), bits(exact[:, -1]))
        assert float(row_relative_error(mixed[:, :-1], exact[:, :-1]).max()) < 0.05
    data_config, _ = summarize_hidden_states([tmp_path / "fp8_aux" / "rows_0-4"])
    assert data_config["storage"] == "fp8_aux"


def test_indexes_without_a_storage_key_read_as_lossless(tmp_path):
    recs = records(3)
    outcome = run_range(tmp_path / "store", "lossless", recs)
    meta = {"settings_digest": outcome.settings_digest, "store_root": tmp_path / "store", "num_layers_captured": 4,
            "hidden_size": 32, "split": "train", "convention": "c", "aux_layer_ids": [0, 1, 2], "final": "post_norm",
            "num_hidden_layers": 4, "dtype": "bfloat16", "engine": "hf", "engine_layer_ids": [0, 1, 2]}  # fmt: skip
    write_range_index(tmp_path / "old" / "rows_0-3", outcome.entries, meta)  # an index from before storage modes
    write_range_index(tmp_path / "new" / "rows_3-6", outcome.entries, {**meta, "storage": "lossless"})
    data_config, _ = summarize_hidden_states([tmp_path / "old" / "rows_0-3"])
    assert data_config["storage"] == "lossless"
    with pytest.raises(DraftflowError, match="more than one"):  # same ids twice: but no storage complaint
        summarize_hidden_states([tmp_path / "old" / "rows_0-3", tmp_path / "new" / "rows_3-6"])


def test_options_must_match_the_settings_that_key_the_store(tmp_path):
    settings = {"engine": "hf", "aux_layer_ids": [0, 1, 2], "target_identity": "tiny", "storage": "fp8"}
    with pytest.raises(DraftflowError, match="extract.storage"):
        extract_range(records(1), TinyEngine(), SampleStore(tmp_path), settings, ExtractOptions(storage="lossless"))


# ---------------------------------------------------------------- verify, plan, preflight


def fp8_ranges(tmp_path: Path, n: int = 3, storage: str = "fp8") -> tuple[Path, list]:
    hs = tmp_path / "hs"
    store = SampleStore(hs / "store")
    digest = settings_digest({"t": storage})
    entries, samples = [], []
    for i in range(n):
        ids, mask, hidden = make_sample(6 + i, seed=i)
        key = sample_key(digest, ids)
        entries.append(store.put(key, encode_sample(ids, mask, hidden, storage=storage)).entry(f"f{i}", key))
        samples.append((f"f{i}", key, ids, mask, hidden))
    meta = {"settings_digest": digest, "store_root": hs / "store", "num_layers_captured": 4, "hidden_size": 64,
            "storage": storage}  # fmt: skip
    write_range_index(hs / "train" / f"rows_0-{n}", entries, meta)
    return hs, samples


def test_verify_decode_checks_fp8_samples_and_their_scales(tmp_path):
    hs, samples = fp8_ranges(tmp_path)
    assert verify_hidden_states(hs, decode=True).ok
    range_dir = hs / "train" / "rows_0-3"
    meta, entries = read_range_index(range_dir)
    store = SampleStore(hs / "store")
    ids, mask, hidden = samples[1][2:]
    q = quantize_fp8(hidden)
    # stored by a buggy writer: a NaN code, a zero row with a scale, a row squeezed to tiny codes
    broken = {
        "nan code": Fp8Hidden(q.codes.clone().index_put_((torch.tensor([0]), torch.tensor([1]), torch.tensor([2])), torch.tensor([0x7F], dtype=torch.uint8)), q.exps, q.dtype),
        "zero row": Fp8Hidden(q.codes.clone().index_fill_(0, torch.tensor([3]), 0), q.exps.clone().index_fill_(0, torch.tensor([3]), 5), q.dtype),
        "squeezed": Fp8Hidden(torch.where(q.codes & 0x7F > 0x10, (q.codes & 0x80) | 0x10, q.codes), q.exps, q.dtype),
    }
    reasons = {}
    for name, bad in broken.items():
        store.put(entries[1].key, encode_sample(ids, mask, bad))
        entries[1] = store.entry_for(entries[1].key, entries[1].sample_id)
        write_range_index(range_dir, entries, meta)
        assert verify_hidden_states(hs, decode=False).ok  # consistent with its index: only --decode sees it
        report = verify_hidden_states(hs, decode=True)
        assert [b.sample_id for b in report.bad] == ["f1"]
        reasons[name] = report.bad[0].reason
    assert "NaN fp8 code at [0, 1, 2]" in reasons["nan code"]
    assert "all-zero row [3, 0] has scale 2^5" in reasons["zero row"]
    assert "uses only codes below" in reasons["squeezed"]


def manifest(tokens: int) -> dict:
    return {"ranges": {"train": [{"name": "rows_0-10", "start": 0, "end": 10, "tokens": tokens}]}}


def test_plan_and_preflight_account_for_the_storage_mode(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 64}))
    lossless = plan_storage(manifest(1000), target, PlanSettings.from_dict({}))
    fp8 = plan_storage(manifest(1000), target, PlanSettings.from_dict({"storage": "fp8"}))
    assert lossless["storage"] == "lossless" and lossless["expected_compression_ratio"] == 0.72
    assert fp8["storage"] == "fp8" and fp8["expected_compression_ratio"] == 0.42
    assert fp8["total"]["bytes_raw"] == lossless["total"]["bytes_raw"] == 1000 * 4 * 64 * 2
    assert fp8["total"]["bytes_expected"] == 215_040  # 0.42 × 512,000
    explicit = plan_storage(manifest(1000), target, PlanSettings.from_dict({"storage": "fp8", "expected_compression_ratio": 0.5}))
    assert explicit["expected_compression_ratio"] == 0.5
    assert plan_storage(manifest(1000), target, PlanSettings.from_dict({"storage": "fp8_aux"}))["expected_compression_ratio"] == 0.53
    with pytest.raises(DraftflowError, match="extract.storage"):
        PlanSettings.from_dict({"storage": "int4"})

    # preflight subtracts only store files of the plan's mode: lossless files are not reused by fp8
    hs, _ = fp8_ranges(tmp_path)
    store = hs / "store"
    ids, mask, hidden = make_sample(40, seed=7)
    SampleStore(store).put(sample_key("l", ids), encode_sample(ids, mask, hidden))
    fp8_bytes, all_bytes = stored_sample_bytes(store, "fp8"), stored_sample_bytes(store, None)
    assert 0 < fp8_bytes < all_bytes and stored_sample_bytes(store, "lossless") == all_bytes - fp8_bytes
    report = preflight(fp8, hs, PreflightSettings())
    details = report["checks"][0]["details"]
    assert details["storage"] == "fp8" and details["store_bytes"] == fp8_bytes


# ---------------------------------------------------------------- speculators FP8 layout


def test_speculators_export_of_fp8_writes_their_fp8_layout_and_round_trips_exactly(tmp_path):
    hs, samples = fp8_ranges(tmp_path)
    out = tmp_path / "spec"
    convert("draftflow", "speculators", hs, out, ConvertOptions(copy_final=True))
    reader = HiddenStateReader([hs / "train" / "rows_0-3"])
    for i in range(len(samples)):
        tensors = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(tensors) == {"token_ids", "hidden_states", "hidden_states_scales"}
        codes, scales = tensors["hidden_states"], tensors["hidden_states_scales"]
        assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert scales.shape == (codes.shape[0], 4, 1)
        # hs-connectors 0.9.0 FP8Transfer: fp8.to(bf16) * scale.to(bf16) — exactly what our reader returns
        theirs = codes.to(torch.bfloat16) * scales.to(torch.bfloat16)
        assert torch.equal(bits(theirs), bits(reader[i].hidden))
    assert json.loads((out / "draftflow_export.json").read_text())["hidden_states"] == "fp8"

    back = tmp_path / "back"
    convert("speculators", "draftflow", out, back, ConvertOptions(copy_final=True))
    again = HiddenStateReader(sorted(back.glob("rows_*")))
    assert read_range_index(next(back.glob("rows_*")))[0]["storage"] == "fp8"
    for i in range(len(samples)):
        assert again.keys[i] == reader.keys[i]  # same bits, same content keys
        assert SampleStore(back / "store").get(again.keys[i]) == SampleStore(hs / "store").get(reader.keys[i])

    plain = tmp_path / "spec-bf16"
    convert("draftflow", "speculators", hs, plain, ConvertOptions(copy_final=True, speculators_hidden="bf16"))
    tensors = load_file(str(plain / "hidden_states" / "hs_0.safetensors"))
    assert set(tensors) == {"token_ids", "hidden_states"} and tensors["hidden_states"].dtype == torch.bfloat16


def test_speculators_export_of_fp8_aux_quantizes_the_final_slot(tmp_path):
    """Their layout has one fp8 tensor for every state: fp8_aux's lossless final state is quantized
    into it as fp8 storage would, never left as the zero codes of its slot."""
    hs, samples = fp8_ranges(tmp_path, storage="fp8_aux")
    out = tmp_path / "spec"
    convert("draftflow", "speculators", hs, out, ConvertOptions(copy_final=True))
    reader = HiddenStateReader([hs / "train" / "rows_0-3"])
    for i, (_, _, ids, mask, hidden) in enumerate(samples):
        tensors = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        theirs = tensors["hidden_states"].to(torch.bfloat16) * tensors["hidden_states_scales"].to(torch.bfloat16)
        as_fp8 = decode_sample(encode_sample(ids, mask, hidden, storage="fp8")).hidden
        assert torch.equal(bits(theirs[:, :-1]), bits(reader[i].hidden[:, :-1]))
        assert torch.equal(bits(theirs[:, -1]), bits(as_fp8[:, -1]))


def test_import_into_another_mode_rekeys_the_samples(tmp_path):
    hs, samples = fp8_ranges(tmp_path)
    out = tmp_path / "lossless"
    convert("draftflow", "draftflow", hs, out, ConvertOptions(storage="lossless"))
    meta, entries = read_range_index(next(out.glob("rows_*")))
    assert meta["storage"] == "lossless"
    assert not {e.key for e in entries} & {s[1] for s in samples}  # fp8 keys name fp8 files only
    fp8 = HiddenStateReader([hs / "train" / "rows_0-3"])
    lossless = HiddenStateReader([next(out.glob("rows_*"))])
    for i in range(len(samples)):
        assert torch.equal(bits(lossless[i].hidden), bits(fp8[i].hidden))  # the decoded values, stored exactly
        assert lossless[i].fp8 is None


def test_speculators_own_fp8_files_import_as_their_trainer_reads_them(tmp_path):
    """hs-connectors' FP8HiddenStatesConnector: one amax/448 scale per token over all states ([T, 1, 1])."""
    from safetensors.torch import save_file

    from test_storage import build_ranges

    hs, samples = build_ranges(tmp_path)
    spec = tmp_path / "spec"
    convert("draftflow", "speculators", hs, spec, ConvertOptions(copy_final=True))
    expected = []
    for i, (_, _, ids, _, hidden) in enumerate(samples):
        x = hidden.float()
        scale = (x.abs().amax(dim=(1, 2), keepdim=True) / 448).clamp(min=1e-12)  # [T, 1, 1], not a power of two
        codes = (x / scale).to(torch.float8_e4m3fn)
        save_file({"token_ids": torch.from_numpy(ids), "hidden_states": codes, "hidden_states_scales": scale},
                  str(spec / "hidden_states" / f"hs_{i}.safetensors"))  # fmt: skip
        expected.append(codes.to(torch.bfloat16) * scale.to(torch.bfloat16))  # their FP8Transfer
    for storage in ("lossless", "fp8"):
        out = tmp_path / storage
        convert("speculators", "draftflow", spec, out, ConvertOptions(copy_final=True, storage=storage))
        reader = HiddenStateReader(sorted(out.glob("rows_*")))
        for i, want in enumerate(expected):
            got = reader[i].hidden
            if storage == "lossless":
                assert torch.equal(bits(got), bits(want))
            else:  # quantized again, with draftflow's scales
                assert float(row_relative_error(got, want).max()) < (2**-8 + 2**-12) ** 0.5
