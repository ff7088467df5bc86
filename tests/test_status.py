"""Progress lines (draftflow/progress.py) and `draftflow status` on a real job's log: running
with done/total, rate and ETA, then interrupted once killed. (The end-to-end test checks
`status` on a finished run.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from draftflow.progress import Progress, format_seconds, parse_progress, parse_seconds
from draftflow.status import run_status


def test_progress_line_round_trip(caplog):
    caplog.set_level("INFO")
    ticker = Progress(400, "steps", every_s=1e9, resumed=100)
    ticker.start -= 30.0  # this run did 20 steps in 30 s
    ticker.update(120)
    line = parse_progress(caplog.records[-1].getMessage())
    assert (line.done, line.total, line.unit) == (120, 400, "steps")
    assert abs(line.rate - 20 / 30) < 0.01  # the 100 resumed steps do not count
    assert abs(line.eta_s - 280 / (20 / 30)) <= 1
    ticker.update(130)  # within every_s: no new line
    assert parse_progress(caplog.records[-1].getMessage()).done == 120
    ticker.update(400, extra="loss 1.5")  # the end is always logged
    last = parse_progress(caplog.records[-1].getMessage())
    assert last.done == 400 and last.eta_s == 0 and last.extra == "loss 1.5"


def test_fast_and_slow_rates_parse_back():
    for rate in (7321.4, 2.456, 0.00123, 1e-7):
        ticker = Progress(10**9, "tokens")
        ticker.done, ticker.start = 10**6, 0.0
        line = parse_progress(ticker.line(now=10**6 / rate))
        assert line is not None and abs(line.rate - rate) <= 0.01 * rate + 1e-6, (rate, ticker.line(now=10**6 / rate))
    assert parse_progress("progress: 5/9 tokens (55.6%), 7.32e+03 tokens/s, elapsed 1s, ETA 0s").rate == 7320


def test_seconds_format_both_ways():
    for seconds, text in ((0, "0s"), (59, "59s"), (312, "5m12s"), (7512, "2h05m12s")):
        assert format_seconds(seconds) == text and parse_seconds(text) == seconds
    assert format_seconds(float("nan")) == "?" and parse_seconds("?") is None


def status_json(workdir: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "draftflow.cli", "status", "--json"], cwd=workdir, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_status_follows_a_real_job_from_running_to_interrupted(tmp_path: Path):
    """A real `draftflow build-target` writing its log where the rule does."""
    log = tmp_path / "results" / "logs" / "build_target.log"
    log.parent.mkdir(parents=True)
    settings = {"train_steps": 5000, "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                "num_attention_heads": 2, "num_key_value_heads": 1, "train_seq_len": 16, "train_batch_size": 1}  # fmt: skip
    with open(log, "w") as f:
        job = subprocess.Popen(
            [sys.executable, "-m", "draftflow.cli", "--threads", "1", "build-target", "--settings",
             json.dumps(settings), "--output", str(tmp_path / "results" / "target")],
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while "progress: " not in log.read_text():
            assert job.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        status = status_json(tmp_path)
        (entry,) = status["jobs"]
        assert (entry["rule"], entry["state"], entry["stage"], entry["pid"]) == ("build_target", "running", "build-target", job.pid)
        assert entry["threads"] == 1
        progress = entry["progress"]
        assert progress["unit"] == "steps" and progress["total"] == 5000 and 1 <= progress["done"] < 5000
        assert progress["rate"] > 0 and entry["eta_s"] > 0
        assert status["stages"] == {"build_target": {"running": 1}}

        text = subprocess.run([sys.executable, "-m", "draftflow.cli", "status"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120).stdout  # fmt: skip
        assert "running jobs (1):" in text and f"pid {job.pid}" in text and "ETA " in text, text
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # like a reboot: no finished/failed line
        job.wait()
    (entry,) = run_status("results", tmp_path).jobs
    assert entry.state == "interrupted" and entry.eta_s is None
