"""Acceptance through served engines: the counter arithmetic as SGLang 0.5.14 and vLLM 0.25.1
define it, and `draftflow evaluate` against fake engine servers on 127.0.0.1 that speak those
releases' endpoints and metric names, with injected faults (a dead server, missing metrics,
counters reset) and resume per prompt set. Every server a test starts is stopped by it."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from draftflow.cli import main as cli_main
from draftflow.errors import DraftflowError
from draftflow.evaluation.engine_counters import (
    SpecCounts,
    VllmCounters,
    check_version,
    sglang_avg_accept_length,
    sglang_request_counts,
    sglang_server_k,
)
from fake_engines import FakeSGLang, FakeVllm

# The fake servers run as a script (the launcher is a command line, as for the real engines).
FAKE_ENGINES = str(Path(__file__).parent / "fake_engines.py")

# ---------------------------------------------------------------- the arithmetic, pinned


def test_sglang_counts_from_its_meta_info():
    """SGLang 0.5.14 schedule_batch.py documents the histogram with this example: h[0] = 5 steps
    accepted no draft, h[3] = 10 steps accepted 3. At K = 3 that is 15 verify steps and 30
    accepted drafts; its scheduler's average, (accepted drafts + verify steps) / verify steps,
    is 45 / 15 = 3.0."""
    meta = {"spec_verify_ct": 15, "spec_num_correct_drafts": 30, "spec_correct_drafts_histogram": [5, 0, 0, 10],
            "completion_tokens": 46}  # fmt: skip
    c = sglang_request_counts(meta, 3, "test")
    # the one τ: 45 tokens delivered by 15 verify steps (the 46th came from the prefill)
    assert c.emitted_tokens == 45 and c.tau == 3.0 == (30 + 15) / 15 == c.engine_tau
    assert c.accepted_at == [10, 10, 10] and c.reached == [15, 10, 10]
    assert c.alpha == [10 / 15, 1.0, 1.0]
    assert c.rate_per_position == [10 / 15] * 3
    assert c.as_json()["draft_acceptance_rate"] == 30 / 45  # spec_accept_rate: correct / (verify_ct * (K+1-1))
    # a histogram that does not match the totals is refused
    with pytest.raises(DraftflowError, match="inconsistent counters"):
        sglang_request_counts({**meta, "spec_num_correct_drafts": 29}, 3, "test")
    # no spec fields on a multi-token answer: the server is not speculating
    with pytest.raises(DraftflowError, match="has no spec_verify_ct"):
        sglang_request_counts({"completion_tokens": 12}, 3, "test")
    assert sglang_request_counts({"completion_tokens": 1}, 3, "test").verify_steps == 0
    # verify steps that delivered more than K + 1 tokens each: the counters mean something else
    with pytest.raises(DraftflowError, match="outside what K = 3 chain drafting allows"):
        sglang_request_counts({**meta, "completion_tokens": 100}, 3, "test")


def test_sglang_server_info_fields():
    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4, "internal_states": [{"avg_spec_accept_length": 2.5},
            {"avg_spec_accept_length": 3.5}], "version": "0.5.14"}  # fmt: skip
    assert sglang_server_k(info) == (3, 1)
    assert sglang_avg_accept_length(info) == 3.0
    assert sglang_server_k({"speculative_algorithm": None}) == (0, 0)


VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 8.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 36.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 24.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 19.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 9.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 1.0
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
"""


def test_vllm_counts_from_its_prometheus_counters():
    """Per-position counts [10, 7, 2] (engine 0) and [5, 3, 1] (engine 1) are the example in vLLM
    0.25.1's metrics/reader.py; its SpecDecodingProm documents mean acceptance length =
    1 + accepted / drafts and per-position rate = per_pos / drafts."""
    c = VllmCounters.from_metrics(VLLM_METRICS, "test").since(VllmCounters(0, 0, 0, [0, 0, 0], 0), "test",
                                                              emitted=46)  # fmt: skip
    assert (c.verify_steps, c.draft_tokens, c.accepted_tokens, c.accepted_at) == (20, 60, 28, [15, 10, 3])
    assert c.engine_tau == 1 + 28 / 20  # vLLM's own mean acceptance length
    assert c.tau == 46 / 20  # the one τ: the tokens the client received from verify steps
    assert c.rate_per_position == [15 / 20, 10 / 20, 3 / 20]
    assert c.alpha == [15 / 20, 10 / 15, 3 / 10]
    assert c.engine_tau == pytest.approx(1 + sum(c.rate_per_position))


def test_vllm_counters_must_move_while_verify_steps_deliver_tokens():
    """The run-time check that replaces a list of accepted releases: a release whose counters
    stand still (renamed, or counted elsewhere) is refused, not read as τ = 1."""
    now = VllmCounters.from_metrics(VLLM_METRICS, "test")
    with pytest.raises(DraftflowError, match="counters did not move"):
        now.since(now, "test", emitted=30)
    assert now.since(now, "test", emitted=0).verify_steps == 0  # nothing decoded past the prefill: fine


def test_vllm_counters_that_went_down_or_are_missing_are_refused():
    now = VllmCounters.from_metrics(VLLM_METRICS, "test")
    later = VllmCounters(now.drafts - 5, now.draft_tokens, now.accepted, now.per_pos, now.generation_tokens)
    with pytest.raises(DraftflowError, match="went from 20 down to 15: the server restarted"):
        later.since(now, "test")
    with pytest.raises(DraftflowError, match="counters restarted during the measurement"):
        now.since(VllmCounters(0, 0, 0, [0, 0, 0], 0), "test", received=120, emitted=46)
    no_spec = "\n".join(line for line in VLLM_METRICS.splitlines() if "spec_decode" not in line)
    with pytest.raises(DraftflowError, match="no speculative-decoding counters"):
        VllmCounters.from_metrics(no_spec, "test")


def test_engine_releases_are_measured_with_a_warning_when_their_source_was_not_read(caplog):
    assert check_version("sglang", "0.5.14.post1", "here") == "0.5.14"
    assert check_version("vllm", "0.25.1+cu129", "here") == "0.25.1"
    assert check_version("vllm", "0.32.0", "here") == "0.32.0" and check_version("vllm", "0.33.0", "h") == "0.33.0"
    assert not caplog.records
    assert check_version("vllm", "0.34.1", "here") == "0.34.1"  # a newer release: measured, checked as read
    assert "vLLM 0.34.1: its counters were not read in its source here" in caplog.text
    with pytest.raises(DraftflowError, match="reported no release"):
        check_version("vllm", None, "here")


def test_counts_add_up():
    a, b = SpecCounts(2, 3, 6, 4, [3, 1], 7), SpecCounts(2, 1, 2, 0, [0, 0], 1)
    assert (a + b).as_json()["accepted"] == [3, 1] and (a + b).verify_steps == 4 and (a + b).tau == 8 / 4


# ---------------------------------------------------------------- the stage against fake servers


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tokenizer-only target folder (a served engine needs only the tokenizer here)."""
    from helpers_tokenizers import build_fast_tokenizer

    folder = tmp_path_factory.mktemp("served-target")
    build_fast_tokenizer("llama3").save_pretrained(folder)
    return folder


@pytest.fixture
def inputs(tmp_path, target):
    """eval.jsonl (4 records with a prompt), an MT-bench question file, an exported drafter folder."""
    rows = [{"id": f"s{i}", "dataset": "d", "input_ids": [1, 2, 3 + i, 4, 5, 6], "loss_mask": [0, 0, 0, 1, 1, 1]}
            for i in range(4)]  # fmt: skip
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = [{"question_id": 81 + i, "turns": [f"Question {i}?", f"And then {i}?"]} for i in range(3)]
    (tmp_path / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    exported = tmp_path / "export"
    exported.mkdir()
    (exported / "config.json").write_text('{"torch_dtype": "bfloat16"}')  # export.dtype's default
    return tmp_path


SETS = {"eval": {"kind": "eval"}, "mtbench": {"kind": "mtbench", "path": "QUESTIONS", "turns": 2}}


def evaluate(tmp: Path, target: Path, engine: str, server: dict, **overrides) -> int:
    sets = json.loads(json.dumps(overrides.pop("prompt_sets", SETS)).replace("QUESTIONS", str(tmp / "question.jsonl")))
    settings = {"engine": engine, "draft_tokens": [3], "max_prompts": 8, "max_new_tokens": 24,
                "engine_version": "0.5.14" if engine == "sglang" else "0.32.0", "prompt_sets": sets,
                "server": {"check_gpus": False, "request_timeout_s": 10, **server}, **overrides}  # fmt: skip
    return cli_main([
        "evaluate", "--drafter", str(tmp / "export"), "--target", str(target), "--eval-data", str(tmp / "eval.jsonl"),
        "--settings", json.dumps(settings), "--output-dir", str(tmp / "eval"), "--state-dir", str(tmp / "state"),
        "--served-drafter", str(tmp / "export"),
    ])  # fmt: skip


def expected(log, sizes: dict[str, int]) -> dict[str, tuple[float, list[float]]]:
    """τ and α per set counted by hand from the fake server's per-step log (requests arrive in
    set order, one at a time): τ = 1 + accepted / steps; α_i over steps that accepted i-1."""
    out, i = {}, 0
    for name, n in sizes.items():
        entries, i = log[i : i + n], i + n
        steps = [a for e in entries for a in e.accepted]
        k = 3
        at = [sum(a > j for a in steps) for j in range(k)]
        reached = [len(steps)] + at[:-1]
        out[name] = (1 + sum(steps) / len(steps), [a / r if r else 0.0 for a, r in zip(at, reached)])
    return out


def rows(report: dict, method: str = "eagle3", temperature: float = 0.0) -> dict[str, dict]:
    return {r["prompt_set"]: r for r in report["per_set"] if r["method"] == method and r["temperature"] == temperature}


def test_sglang_endpoint_acceptance_per_set_matches_a_hand_count(inputs, target):
    with FakeSGLang(k=3, lifetime_s=60) as server:
        assert evaluate(inputs, target, "sglang", {"endpoint": server.url}) == 0
        log = list(server.log)
    report = json.loads((inputs / "eval" / "acceptance.json").read_text())
    assert report["prompt_sets"]["mtbench"]["requests"] == 6 and report["prompt_sets"]["eval"]["requests"] == 4
    hand = expected(log, {"eval": 4, "mtbench": 6})
    got = rows(report)
    for name, (tau, alpha) in hand.items():
        assert got[name]["acceptance_length"] == pytest.approx(tau, abs=1e-12)
        assert got[name]["alpha"] == pytest.approx(alpha, abs=1e-12)
        assert got[name]["server"]["version"] == "0.5.14"
    all_steps = [a for e in log for a in e.accepted]
    assert report["acceptance_length"] == pytest.approx(1 + sum(all_steps) / len(all_steps), abs=1e-12)
    assert report["acceptance_length_simulated"] is None and report["ngram"] == {}
    # SpecForge's definition (completion tokens per verify step) as SGLang reports it per request
    assert got["eval"]["acceptance_length_specforge"] == pytest.approx(
        sum(len(e.tokens) for e in log[:4]) / sum(len(e.accepted) for e in log[:4]))  # fmt: skip
    # turn 2 of MT-bench carries turn 1 and the engine's own answer to it
    turn1, turn2 = log[4], log[5]
    assert turn2.prompt[: len(turn1.prompt) - 4] == turn1.prompt[: len(turn1.prompt) - 4] and len(turn2.prompt) > len(turn1.prompt)
    outputs = [json.loads(line) for line in (inputs / "eval" / "outputs.jsonl").read_text().splitlines()]
    assert [o["tokens"] for o in outputs] == [e.tokens for e in log]


def test_sglang_server_info_comes_from_the_current_endpoint_with_the_old_one_as_fallback(inputs, target):
    """Issue 33: evaluation asked only /get_server_info, which SGLang marks deprecated since
    0.5.6 (0.5.18 logs a warning per call). It asks /server_info, and /get_server_info only on a
    404 (releases before 0.5.6), by the capture client's logic (engines/sglang_http.py)."""
    from draftflow.evaluation.served import SGLangClient

    with FakeSGLang(k=3, lifetime_s=60) as server:
        assert evaluate(inputs, target, "sglang", {"endpoint": server.url}, prompt_sets={"eval": {"kind": "eval"}}) == 0
        asked = list(server.gets)
    assert "/server_info" in asked and "/get_server_info" not in asked
    with FakeSGLang(k=3, info_paths=("/get_server_info",), lifetime_s=60) as old:
        assert SGLangClient(old.url, 10).info().k == 3
        assert SGLangClient(old.url, 10).server_average() is None  # nothing decoded yet
        assert old.gets == ["/server_info", "/get_server_info"] * 2
    with FakeSGLang(k=3, info_paths=(), lifetime_s=60) as other:
        with pytest.raises(DraftflowError, match="answers neither /server_info nor /get_server_info"):
            SGLangClient(other.url, 10).info()


def test_vllm_endpoint_with_baseline_and_temperatures(inputs, target):
    with FakeVllm(k=3, latency_s=0.02, lifetime_s=60) as spec, FakeVllm(k=0, latency_s=0.05, lifetime_s=60) as base:
        code = evaluate(inputs, target, "vllm", {"endpoint": spec.url, "baseline_endpoint": base.url},
                        temperatures=[0.0, 0.7])  # fmt: skip
        assert code == 0
        log = list(spec.log)
    report = json.loads((inputs / "eval" / "acceptance.json").read_text())
    # requests go set by set, each set at every temperature: eval t0, eval t0.7, mtbench t0, mtbench t0.7
    hand0 = expected(log[:4] + log[8:14], {"eval": 4, "mtbench": 6})
    hand1 = expected(log[4:8] + log[14:20], {"eval": 4, "mtbench": 6})
    for t, hand in ((0.0, hand0), (0.7, hand1)):
        got = rows(report, temperature=t)
        for name, (tau, alpha) in hand.items():
            assert got[name]["acceptance_length"] == pytest.approx(tau, abs=1e-12)
            assert got[name]["alpha"] == pytest.approx(alpha, abs=1e-12)
            assert got[name]["speedup"] > 1.0  # the fake baseline is slower per request
    assert rows(report, temperature=0.7)["eval"]["acceptance_length"] < rows(report)["eval"]["acceptance_length"]
    assert set(rows(report, "baseline")) == {"eval", "mtbench"}
    assert report["greedy"]["tokens_per_second"] > 0
    # the report's figure draws a served report too (no simulated or n-gram curves)
    from test_evaluate import assert_png, plot_cli

    assert plot_cli(kind="acceptance", acceptance=inputs / "eval" / "acceptance.json", output=inputs / "acc.png") == 0
    assert_png(inputs / "acc.png")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_dead_server_fails_clearly_and_a_rerun_resumes_per_prompt_set(inputs, target, engine):
    fake = FakeSGLang if engine == "sglang" else FakeVllm
    with fake(k=3, die_after=6, lifetime_s=60) as server:  # dies on request 7: mtbench, after eval's 4
        assert evaluate(inputs, target, engine, {"endpoint": server.url}) == 1
        port = server.port
    assert not (inputs / "eval" / "acceptance.json").exists()
    assert not (inputs / "eval" / "outputs.jsonl").exists()
    assert [p.name.split(".")[0] for p in (inputs / "state").rglob("*.json")] == ["eval"]
    with fake(k=3, port=port, lifetime_s=60) as restarted:
        assert evaluate(inputs, target, engine, {"endpoint": restarted.url}) == 0
        assert len(restarted.log) == 6  # mtbench only: eval was kept
    report = json.loads((inputs / "eval" / "acceptance.json").read_text())
    assert set(rows(report)) == {"eval", "mtbench"}


def test_dead_server_message(inputs, target, capsys):
    with FakeSGLang(k=3, die_after=2, lifetime_s=60) as server:
        assert evaluate(inputs, target, "sglang", {"endpoint": server.url}) == 1
    err = capsys.readouterr().err
    assert "the SGLang server stopped answering during prompt set eval (eagle3-k3)" in err
    assert "rerun to resume" in err


def test_missing_metrics_and_counter_resets_are_refused(inputs, target, capsys):
    with FakeSGLang(k=3, no_spec_metrics=True, lifetime_s=60) as server:
        assert evaluate(inputs, target, "sglang", {"endpoint": server.url}) == 1
    assert "meta_info has no spec_verify_ct" in capsys.readouterr().err
    with FakeVllm(k=3, no_spec_metrics=True, lifetime_s=60) as server:
        assert evaluate(inputs, target, "vllm", {"endpoint": server.url}) == 1
    assert "runs without speculative decoding" in capsys.readouterr().err
    with FakeVllm(k=3, reset_after=2, lifetime_s=60) as server:  # counters restart inside the first set
        assert evaluate(inputs, target, "vllm", {"endpoint": server.url}) == 1
    assert "counters restarted during the measurement" in capsys.readouterr().err
    assert not (inputs / "eval" / "acceptance.json").exists()


def test_a_server_release_whose_counters_stand_still_is_refused(inputs, target, capsys, caplog):
    """No list of accepted releases: an unlisted one is measured, and refused only when the
    counters draftflow reads do not move while the drafter's tokens arrive."""
    with FakeVllm(k=3, version="0.34.0", frozen_metrics=True, lifetime_s=60) as server:
        assert evaluate(inputs, target, "vllm", {"endpoint": server.url}) == 1
    assert "counters did not move" in capsys.readouterr().err
    assert "vLLM 0.34.0: its counters were not read" in caplog.text
    with FakeVllm(k=3, version="0.34.0", lifetime_s=60) as server:
        assert evaluate(inputs, target, "vllm", {"endpoint": server.url}, engine_version="0.34.0") == 0
    assert json.loads((inputs / "eval" / "acceptance.json").read_text())["acceptance_length"] > 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_launched_servers_one_per_k_plus_baseline_all_stopped(inputs, target, engine):
    """The stage launches the engine's own command line (here the fake, which takes the same
    arguments), once per K and once without the drafter, and stops each one."""
    port = free_port()
    launcher = [sys.executable, FAKE_ENGINES, engine]
    server = {"launcher": launcher, "port": port, "startup_timeout_s": 60}
    assert evaluate(inputs, target, engine, server, draft_tokens=[2, 3], prompt_sets={"eval": {"kind": "eval"}}) == 0
    assert port_closed(port)
    report = json.loads((inputs / "eval" / "acceptance.json").read_text())
    assert sorted((r["method"], r["draft_tokens"]) for r in report["per_set"]) == [("baseline", 0), ("eagle3", 2), ("eagle3", 3)]
    assert set(report["eagle3"]) == {"2", "3"} and report["acceptance_length"] == report["eagle3"]["3"]["acceptance_length"]
    logs = sorted(p.name for p in (inputs / "state" / "logs").iterdir())
    assert logs == [f"{engine}-baseline.log", f"{engine}-eagle3-k2.log", f"{engine}-eagle3-k3.log"]
    assert "K = 3, dtype bfloat16" in (inputs / "state" / "logs" / f"{engine}-eagle3-k3.log").read_text()
    assert "dtype bfloat16" in (inputs / "state" / "logs" / f"{engine}-baseline.log").read_text()
    for log_file in (inputs / "state" / "logs").iterdir():  # SGLang's radix cache too (issue 33)
        assert "prefix cache off" in log_file.read_text(), log_file.name
    if engine == "vllm":  # the socket files vLLM leaves went with each server's own folder
        sockets = [Path(line.split()[-1]) for f in (inputs / "state" / "logs").iterdir()
                   for line in f.read_text().splitlines() if line.startswith("ipc socket ")]  # fmt: skip
        assert len(sockets) == 3 and len({p.parent for p in sockets}) == 3
        assert all(p.parent.name.startswith("draftflow-rpc-") and not p.parent.exists() for p in sockets), sockets


@pytest.mark.parametrize("k", [3, 0])
def test_launched_servers_compute_every_prompt_token(target, k):
    """Issue 33: the launched vLLM ran without prefix caching, SGLang with its radix cache on.
    Both engines now compute every prompt token, the baseline too (as the hf engine does)."""
    from draftflow.evaluation.served import ServerConfig, ServerSettings, server_argv

    sglang = server_argv("sglang", ServerSettings(port=1), target, target, ServerConfig(k), False, "bfloat16")
    assert sglang.count("--disable-radix-cache") == 1
    vllm = server_argv("vllm", ServerSettings(port=1), target, target, ServerConfig(k), False, "bfloat16")
    assert vllm.count("--no-enable-prefix-caching") == 1


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_launched_servers_run_the_target_in_the_drafters_dtype(inputs, target, engine, capsys):
    """Issue 33: the launched SGLang got no --dtype, its `auto` ran the float32 target in float16
    against the bfloat16 drafter, and the first forward failed. Every launched server (the
    baseline too) runs the target in the exported drafter's dtype; vLLM would not fail (it
    builds the drafter in the target's dtype) but would not serve the export's dtype either."""
    from draftflow.evaluation.served import ServerConfig, ServerSettings, drafter_dtype, server_argv

    exported = inputs / "export"
    for dtype in ("float32", "bfloat16"):
        (exported / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
        assert drafter_dtype(exported) == dtype
        for k in (3, 0):
            argv = server_argv(engine, ServerSettings(port=1), target, exported, ServerConfig(k), False, dtype)
            assert argv[argv.index("--dtype") + 1] == dtype and argv.count("--dtype") == 1
    # a --dtype of the user's own (config/vllm-cpu.yaml: float32, as the hf engine on a CPU) wins
    for extra in (("--dtype", "float32"), ("--dtype=float32",)):
        argv = server_argv(engine, ServerSettings(port=1, extra_args=extra), target, exported, ServerConfig(3), False,
                           "bfloat16")  # fmt: skip
        assert [a for a in argv if a.startswith("--dtype")] == [extra[0]] and argv[-len(extra):] == list(extra)
    (exported / "config.json").write_text("{}")
    with pytest.raises(DraftflowError, match="torch_dtype is None, not one of .*re-export the drafter"):
        drafter_dtype(exported)
    launcher = [sys.executable, FAKE_ENGINES, engine]
    server = {"launcher": launcher, "port": free_port(), "startup_timeout_s": 60}
    assert evaluate(inputs, target, engine, server, prompt_sets={"eval": {"kind": "eval"}}) == 1
    assert "export/config.json: torch_dtype is None" in capsys.readouterr().err


def test_a_launch_onto_a_busy_port_is_refused(inputs, target, capsys):
    with FakeSGLang(k=3, lifetime_s=60) as other:  # e.g. the regeneration server left running
        launcher = [sys.executable, FAKE_ENGINES, "sglang"]
        assert evaluate(inputs, target, "sglang", {"launcher": launcher, "port": other.port}) == 1
        assert other.log == []
    assert f"127.0.0.1:{other.port} is already in use" in capsys.readouterr().err


def test_a_launched_server_of_another_release_than_the_export_is_refused_and_stopped(inputs, target, capsys):
    """The drafter's aux ids were written for export.<engine>_version: a launched server of
    another release could read them differently."""
    port = free_port()
    launcher = [sys.executable, FAKE_ENGINES, "sglang"]
    server = {"launcher": launcher, "port": port, "startup_timeout_s": 60, "extra_args": ["--fake-version", "0.5.13"]}
    assert evaluate(inputs, target, "sglang", server) == 1
    assert "runs SGLang 0.5.13, but the drafter was exported for 0.5.14" in capsys.readouterr().err
    assert port_closed(port)
