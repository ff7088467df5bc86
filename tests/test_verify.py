"""`draftflow verify`: finds exactly the damaged samples, and --repair removes them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from draftflow import cli
from draftflow.errors import DraftflowError
from draftflow.hidden_states.storage import (
    SampleStore, checksum, encode_sample, read_header, read_range_index, sample_key, write_range_index,
)  # fmt: skip
from draftflow.hidden_states.verify import remove_bad_samples, verify_hidden_states
from test_storage import build_ranges, make_sample


def flip_byte(path, offset_from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_clean_store_verifies(tmp_path):
    hs, samples = build_ranges(tmp_path)
    for decode in (False, True):
        report = verify_hidden_states(hs, decode=decode)
        assert report.ok and report.samples == 5 and report.files == 5 and report.ranges == 2


def test_single_flipped_byte_names_exactly_that_sample(tmp_path):
    hs, samples = build_ranges(tmp_path)
    sample_id, key = samples[2][:2]
    flip_byte(SampleStore(hs / "store").path(key))
    for decode in (False, True):
        report = verify_hidden_states(hs, decode=decode)
        assert [(b.sample_id, b.key) for b in report.bad] == [(sample_id, key)]
        assert report.bad[0].reason == "file checksum mismatch"
        assert report.bad[0].range.endswith("rows_0-3")


def test_damage_before_indexing_is_caught_by_the_payload_checksum(tmp_path):
    """A file damaged before its checksum went into an index: the header's payload checksum
    sees it without decoding, --decode with the raw checksum too, and re-indexing refuses it."""
    hs, samples = build_ranges(tmp_path)
    range_dir = hs / "train" / "rows_3-5"
    meta, entries = read_range_index(range_dir)
    store = SampleStore(hs / "store")
    flip_byte(store.path(entries[1].key))  # the low-mantissa plane, stored raw
    with pytest.raises(DraftflowError, match=rf"\(sample {entries[1].sample_id}\): payload checksum mismatch"):
        store.entry_for(entries[1].key, entries[1].sample_id)  # extraction reusing it would stop here
    data = store.get(entries[1].key)
    entries[1] = dataclasses.replace(entries[1], checksum=checksum(data))  # an index agreeing with the bad bytes
    write_range_index(range_dir, entries, meta)

    for decode in (False, True):
        report = verify_hidden_states(hs, decode=decode)
        assert [b.sample_id for b in report.bad] == [entries[1].sample_id]
        assert "checksum" in report.bad[0].reason


def test_non_finite_values_and_shape_mismatch_are_reported(tmp_path):
    hs, _ = build_ranges(tmp_path)
    store = SampleStore(hs / "store")
    ids, mask, hidden = make_sample(6, seed=9)
    hidden[2, 1, 3] = float("nan")
    key = sample_key("nan", ids)
    entry = store.put(key, encode_sample(ids, mask, hidden)).entry("has-nan", key)
    meta, _ = read_range_index(hs / "train" / "rows_0-3")
    write_range_index(hs / "train" / "rows_5-6", [entry], meta)
    wrong = dict(meta, hidden_size=32)
    _, entries = read_range_index(hs / "train" / "rows_3-5")
    write_range_index(hs / "train" / "rows_3-5", entries, wrong)

    assert [b.sample_id for b in verify_hidden_states(hs, decode=False).bad] == ["d-1-0", "d-1-1"]
    bad = {b.sample_id: b.reason for b in verify_hidden_states(hs, decode=True).bad}
    assert bad["has-nan"] == "non-finite hidden-state values"
    assert bad["d-1-0"] == "header H=64, range meta says 32"


def test_cli_repair_deletes_only_bad_files_and_writes_report(tmp_path, capsys):
    hs, samples = build_ranges(tmp_path)
    store = SampleStore(hs / "store")
    bad_id, bad_key = samples[4][:2]
    flip_byte(
        store.path(bad_key), offset_from_end=len(store.get(bad_key)) - read_header(store.get(bad_key)).data_offset - 1
    )
    store.path(samples[0][1]).unlink()
    report_path = tmp_path / "report.json"

    rc = cli.main(["verify", "--hidden-states", str(hs), "--decode", "--repair", "--output", str(report_path)])

    assert rc == 1
    report = json.loads(report_path.read_text())
    assert report["ok"] is False
    assert {(b["sample_id"], b["reason"]) for b in report["bad"]} == {
        (samples[0][0], "missing store file"),
        (bad_id, "file checksum mismatch"),
    }
    assert not store.contains(bad_key)
    assert all(store.contains(s[1]) for s in samples[1:4])
    assert f"BAD {hs / 'train' / 'rows_3-5'} {bad_id} {bad_key}" in capsys.readouterr().out
    # After repair the deleted samples read as missing: exactly what re-extraction recomputes.
    after = verify_hidden_states(hs)
    assert {b.reason for b in after.bad} == {"missing store file"}
    assert remove_bad_samples(after) == 0


def test_repeated_samples_share_one_file(tmp_path):
    """Dataset weights > 1 repeat a sample (same tokens -> same key): one file, two index entries."""
    hs = tmp_path / "hs"
    store = SampleStore(hs / "store")
    ids, mask, hidden = make_sample(12)
    key = sample_key("w", ids)
    put = store.put(key, encode_sample(ids, mask, hidden.to(torch.float16)))
    meta = {"settings_digest": "w", "store_root": str(hs / "store"), "num_layers_captured": 4, "hidden_size": 64}
    write_range_index(hs / "rows_0-2", [put.entry("a", key), put.entry("a#1", key)], meta)
    report = verify_hidden_states(hs, decode=True)
    assert report.ok and report.samples == 2 and report.files == 1
