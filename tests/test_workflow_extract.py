"""Extraction's crash safety and reuse, proven through Snakemake itself (DESIGN.md §4).

Snakemake deletes a `directory()` output before its job reruns, so everything that must
survive a crash or a re-merge lives in the content-keyed store outside the range folders.
These tests kill a real extract job mid-range, re-merge with a new dataset, and corrupt a
stored sample, and check from the store's files (inode + mtime) and the range indexes'
`computed` / `reused` counts that exactly the missing samples were computed.

One shrunk workflow is run through merge once per module (the target build dominates);
every test works on its own copy of it (results and .snakemake metadata included).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import copy_workflow, load_default_config, planned_jobs, snakemake, snakemake_env, write_config
from draftflow.hidden_states.storage import SUFFIX, read_index_columns

pytestmark = pytest.mark.slow  # real Snakemake runs, killed and resumed (minutes): not in make test-fast

CONFIG = "--configfile=config/test.yaml"  # the `=` form: --configfile takes several values
MERGED = "results/merged/manifest.json"
DATA_CONFIG = "results/hidden_states/data_config.json"
HIDDEN = "results/hidden_states"
STORE = f"{HIDDEN}/store"


def small_config() -> dict:
    """The embedded default, shrunk: several ranges per split, several batches per range."""
    config = load_default_config()
    # The target build is the slowest step: few, small training steps.
    config["target"]["builtin"] = {"train_steps": 20, "train_batch_size": 4}
    for dataset in config["datasets"].values():
        dataset["max_samples"] = 12
    config["regenerate"]["max_new_tokens"] = 8
    config["merge"]["samples_per_range"] = 16  # 60 samples: 4 train ranges + 1 eval range
    config["extract"]["batch_tokens"] = 512  # ~9 batches per range
    config["train"]["epochs"] = 1
    config["evaluate"].update(max_prompts=4, max_new_tokens=16)
    return config


# ---- helpers ------------------------------------------------------------------------------


def clone(src: Path, dest: Path) -> Path:
    """A copy of a workflow directory with its results and Snakemake metadata (mtimes kept)."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


def store_files(workdir: Path) -> dict[str, tuple[int, int]]:
    """key -> (inode, mtime_ns) of every complete store file (temp files start with '.')."""
    out = {}
    for path in (workdir / STORE).glob(f"*/*/*{SUFFIX}"):
        if not path.name.startswith("."):
            st = path.stat()
            out[path.name[: -len(SUFFIX)]] = (st.st_ino, st.st_mtime_ns)
    return out


def count_store_files(root: Path) -> int:
    """Fast count for polling (no stat calls)."""
    n = 0
    try:
        for a in os.scandir(root):
            if a.is_dir():
                for b in os.scandir(a.path):
                    n += sum(1 for f in os.scandir(b.path) if f.name.endswith(SUFFIX) and f.name[0] != ".")
    except FileNotFoundError:  # a folder appears or the store does not exist yet
        pass
    return n


def store_bytes(workdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (workdir / STORE).glob(f"*/*/*{SUFFIX}") if not p.name.startswith(".")}


def manifest(workdir: Path) -> dict:
    return json.loads((workdir / MERGED).read_text())


def range_dirs_of(workdir: Path, split: str) -> list[Path]:
    return [workdir / HIDDEN / split / r["name"] for r in manifest(workdir)["ranges"][split]]


def range_dirs(workdir: Path) -> list[Path]:
    return range_dirs_of(workdir, "train") + range_dirs_of(workdir, "eval")


def counts(range_dir: Path) -> dict:
    return read_index_columns(range_dir)[0]["counts"]


def total_counts(workdir: Path) -> dict[str, int]:
    totals: dict[str, int] = {}
    for d in range_dirs(workdir):
        for k, v in counts(d).items():
            totals[k] = totals.get(k, 0) + v
    return totals


def draftflow(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "draftflow.cli", *args], cwd=workdir, capture_output=True, text=True, timeout=300
    )


def run_until_killed(workdir: Path, target: str, expected: int, at_least: int = 3) -> int:
    """Start Snakemake on `target` in its own session; SIGKILL the whole process group
    (Snakemake and its extract job) once `at_least` of the range's `expected` samples are
    in the store. Returns how many were stored when it died."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "1", target, CONFIG]
    log = open(workdir / "killed-run.log", "w")
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=snakemake_env())
    root, deadline = workdir / STORE, time.monotonic() + 300
    try:
        while count_store_files(root) < at_least:
            if proc.poll() is not None:
                raise AssertionError(
                    f"snakemake exited ({proc.returncode}) before the kill:\n"
                    + (workdir / "killed-run.log").read_text()[-4000:]
                )
            if time.monotonic() > deadline:
                raise AssertionError("no sample was stored within 300 s")
            time.sleep(0.002)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
    return count_store_files(root)


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    """The shrunk workflow run through merge (target built, datasets tokenized)."""
    workdir = copy_workflow(tmp_path_factory.mktemp("merged") / "wf")
    write_config(workdir, small_config())
    snakemake(workdir, MERGED, CONFIG)
    return workdir


@pytest.fixture(scope="module")
def extracted(merged, tmp_path_factory) -> Path:
    """`merged` with every range extracted and summarized."""
    workdir = clone(merged, tmp_path_factory.mktemp("extracted") / "wf")
    snakemake(workdir, DATA_CONFIG, CONFIG)
    return workdir


# ---- a killed extract job resumes at sample granularity ----------------------------------------


def test_killed_extraction_resumes_and_matches_an_uninterrupted_run(merged, tmp_path):
    config = small_config()
    # Slow the writers (level 19, one thread) so the kill lands mid-range; neither setting
    # enters the store keys, and the uninterrupted run below uses the same ones.
    config["extract"].update(compression_level=19, writer_threads=1)
    first_range = manifest(merged)["ranges"]["train"][0]
    target = f"{HIDDEN}/train/{first_range['name']}"
    expected = first_range["samples"]

    killed = clone(merged, tmp_path / "killed")
    write_config(killed, config)
    for _ in range(3):  # the kill races the writers; on a loaded machine retry a lost race
        stored = run_until_killed(killed, target, expected)
        if stored < expected:
            break
        shutil.rmtree(killed / STORE)
        shutil.rmtree(killed / target, ignore_errors=True)
        snakemake(killed, "--unlock", CONFIG)
    assert 0 < stored < expected, f"the kill should land mid-range: {stored}/{expected} stored"
    assert not (killed / target / "index.json").exists(), "a killed range must not look complete"
    before = store_files(killed)
    assert len(before) == stored

    # A SIGKILLed Snakemake leaves its lock behind: unlock, as a user would, then rerun.
    snakemake(killed, "--unlock", CONFIG)
    snakemake(killed, "--cores", "1", "--rerun-incomplete", target, CONFIG)
    after = store_files(killed)
    assert len(after) == expected
    rewritten = {k for k, stat in before.items() if after.get(k) != stat}
    assert not rewritten, f"samples stored before the kill were rewritten: {sorted(rewritten)}"
    c = counts(killed / target)
    assert (c["reused"], c["computed"], c["failed"]) == (stored, expected - stored, 0), c
    check = draftflow(killed, "verify", "--hidden-states", HIDDEN, "--decode")
    assert check.returncode == 0, check.stdout + check.stderr

    # The same range, uninterrupted, in a fresh copy of the merged workflow.
    clean = clone(merged, tmp_path / "clean")
    write_config(clean, config)
    snakemake(clean, "--cores", "1", target, CONFIG)
    assert counts(clean / target)["computed"] == expected
    files_killed, files_clean = store_bytes(killed), store_bytes(clean)
    assert files_killed.keys() == files_clean.keys()
    differing = [name for name in files_clean if files_clean[name] != files_killed[name]]
    assert not differing, f"resumed samples differ from an uninterrupted run: {differing}"
    meta_k, entries_k = read_index_columns(killed / target)
    meta_c, entries_c = read_index_columns(clean / target)
    assert entries_k == entries_c
    volatile = ("counts", "timings")
    assert {k: v for k, v in meta_k.items() if k not in volatile} == {
        k: v for k, v in meta_c.items() if k not in volatile
    }


# ---- a re-merge with a new dataset computes only the new samples ----------------------------------


def _write_new_dataset(path: Path, n: int = 10) -> Path:
    lines = []
    for i in range(n):
        messages = [
            {"role": "user", "content": f"Fresh question number {i}: what is {i} plus {i * 7 + 3}?"},
            {"role": "assistant", "content": f"{i} plus {i * 7 + 3} is {i * 8 + 3}. Anything else about sum {i}?"},
            {"role": "user", "content": f"Now double it, please ({i})."},
            {"role": "assistant", "content": f"Doubled, {i * 8 + 3} becomes {2 * (i * 8 + 3)}."},
        ]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_remerge_with_a_new_dataset_computes_only_its_samples(extracted, tmp_path):
    workdir = clone(extracted, tmp_path / "wf")
    old_manifest = manifest(workdir)
    old_ranges = {(s, r["name"], r["digest"]) for s in ("train", "eval") for r in old_manifest["ranges"][s]}
    before = store_files(workdir)
    assert len(before) == old_manifest["total"]["all"]["samples"]

    config = small_config()
    config["datasets"]["fresh"] = {"path": str(_write_new_dataset(tmp_path / "fresh.jsonl"))}
    write_config(workdir, config)
    snakemake(workdir, DATA_CONFIG, CONFIG)

    unextracted = [str(d.relative_to(workdir)) for d in range_dirs(workdir) if not (d / "index.json").exists()]
    assert not unextracted, f"snakemake succeeded but did not extract the re-merged ranges {unextracted}"
    new_manifest = manifest(workdir)
    n_new = new_manifest["datasets"]["fresh"]["all"]["samples"]
    assert n_new == 10
    total = new_manifest["total"]["all"]["samples"]
    assert total == old_manifest["total"]["all"]["samples"] + n_new
    # A range is rerun unless its content digest is unchanged; count over the rerun ones.
    rerun = [
        d
        for s in ("train", "eval")
        for r, d in zip(new_manifest["ranges"][s], range_dirs_of(workdir, s))
        if (s, r["name"], r["digest"]) not in old_ranges
    ]
    assert rerun, "adding samples must change some ranges"
    computed = sum(counts(d)["computed"] for d in rerun)
    reused = sum(counts(d)["reused"] for d in rerun)
    samples = sum(counts(d)["samples"] for d in rerun)
    assert computed == n_new, f"computed {computed} samples, the re-merge added {n_new}"
    assert reused == samples - n_new
    after = store_files(workdir)
    assert len(after) == len(before) + n_new
    rewritten = {k for k, stat in before.items() if after.get(k) != stat}
    assert not rewritten, f"{len(rewritten)} store files from before the re-merge were rewritten"
    data_config = json.loads((workdir / DATA_CONFIG).read_text())
    assert data_config["total_samples"] == total


def test_capture_settings_change_reextracts_every_range(extracted, tmp_path):
    """A change that re-plans storage (here the dtype) must also rerun every range. A dry-run
    shows only plan_storage and preflight: Snakemake re-plans the ranges once the preflight
    checkpoint ran, so the plan runs here with --touch (the real scheduler, nothing computed)."""
    workdir = clone(extracted, tmp_path / "wf")
    config = small_config()
    config["extract"]["dtype"] = "float16"
    write_config(workdir, config)
    jobs = planned_jobs(snakemake(workdir, "-n", DATA_CONFIG, CONFIG).stdout)
    assert {"plan_storage", "preflight"} <= set(jobs), jobs
    touched = snakemake(workdir, "--touch", DATA_CONFIG, CONFIG)
    jobs = planned_jobs(touched.stdout + touched.stderr)
    assert len(jobs.get("extract", [])) == len(range_dirs(workdir)), jobs
    assert all("Params have changed" in reason and '"dtype":"float16"' in reason for reason in jobs["extract"])


def test_storage_switch_reextracts_only_hidden_states_and_switching_back_reuses_every_file(extracted, tmp_path):
    """extract.storage: fp8 gets its own store keys; lossless and fp8 files never mix."""
    from draftflow.hidden_states.storage import storage_of_file

    workdir = clone(extracted, tmp_path / "wf")
    config = small_config()
    config["extract"]["storage"] = "fp8"
    write_config(workdir, config)
    jobs = planned_jobs(snakemake(workdir, "-n", DATA_CONFIG, CONFIG).stdout)
    assert not {"build_target", "prepare", "regenerate", "tokenize", "merge"} & set(jobs), jobs
    assert {"plan_storage", "preflight"} <= set(jobs), jobs  # extract: re-planned after the preflight checkpoint
    lossless_files = store_files(workdir)
    snakemake(workdir, DATA_CONFIG, CONFIG)
    data_config = json.loads((workdir / DATA_CONFIG).read_text())
    assert data_config["storage"] == "fp8" and data_config["compression_ratio"] < 0.5
    # every range extracted again; nothing lossless was taken
    assert all(counts(d)["reused"] == 0 and counts(d)["computed"] > 0 for d in range_dirs(workdir))
    modes = {}
    for path in (workdir / STORE).glob(f"*/*/*{SUFFIX}"):
        modes.setdefault(storage_of_file(path), set()).add(path.name[: -len(SUFFIX)])
    assert modes["lossless"] == set(lossless_files) and len(modes["fp8"]) == len(lossless_files)

    config["extract"]["storage"] = "lossless"  # and back: every lossless file is still there
    write_config(workdir, config)
    snakemake(workdir, DATA_CONFIG, CONFIG)
    assert all(counts(d)["computed"] == 0 for d in range_dirs(workdir))
    assert json.loads((workdir / DATA_CONFIG).read_text())["storage"] == "lossless"
    assert {k: v for k, v in store_files(workdir).items() if k in lossless_files} == lossless_files


# ---- verify --repair recomputes exactly the bad sample, and nothing reruns -------------------------


def test_verify_repair_recomputes_only_the_corrupted_sample_and_nothing_reruns(extracted, tmp_path):
    workdir = clone(extracted, tmp_path / "wf")
    victim_range = range_dirs(workdir)[1]
    _, columns = read_index_columns(victim_range)
    sample_id, key = columns["sample_id"][0], columns["key"][0]
    path = workdir / STORE / key[:2] / key[2:4] / f"{key}{SUFFIX}"
    original = path.read_bytes()
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0x01
    path.write_bytes(bytes(corrupted))
    before = store_files(workdir)
    indexes = {d: (d / "index.json").read_bytes() for d in range_dirs(workdir)}

    check = draftflow(workdir, "verify", "--hidden-states", HIDDEN)
    assert check.returncode != 0
    bad = [line for line in check.stdout.splitlines() if line.startswith("BAD ")]
    assert len(bad) == 1 and sample_id in bad[0] and key in bad[0], check.stdout

    repair = draftflow(workdir, "verify", "--hidden-states", HIDDEN, "--repair")
    assert repair.returncode == 0, repair.stdout + repair.stderr
    assert f"REPAIRED {HIDDEN}/{victim_range.parent.name}/{victim_range.name} {sample_id} {key}" in repair.stdout
    assert path.read_bytes() == original, "the recomputed sample must equal the original bytes"
    after = store_files(workdir)
    assert after.keys() == before.keys()
    rewritten = {k for k, stat in before.items() if k != key and after.get(k) != stat}
    assert not rewritten
    assert {d: (d / "index.json").read_bytes() for d in range_dirs(workdir)} == indexes
    check = draftflow(workdir, "verify", "--hidden-states", HIDDEN, "--decode")
    assert check.returncode == 0, check.stdout + check.stderr
    jobs = planned_jobs(snakemake(workdir, "-n", DATA_CONFIG, CONFIG).stdout)
    assert jobs == {}, f"a repair must leave every output up to date, Snakemake plans {jobs}"
