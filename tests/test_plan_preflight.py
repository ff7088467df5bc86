"""Stages `plan-storage` and `preflight`: byte arithmetic, model dimensions, layer ids, free disk."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from draftflow import cli
from draftflow.checks import CheckResult
from draftflow.errors import DraftflowError
from draftflow.jsonl import read_json, write_json
from draftflow.hidden_states.plan import (
    PlanSettings,
    format_bytes,
    plan_storage,
    resolve_aux_layer_ids,
    resolve_model_dims,
    storage_bytes,
)
from draftflow.hidden_states.preflight import (
    PreflightContext,
    PreflightSettings,
    check_free_disk,
    preflight,
)

KIMI_TOKENS = 21_033_536  # the user's 10K-sample run
KIMI_CONFIG = {  # Kimi-K2.5 keeps the language model's dimensions in text_config
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61},
    "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
}


def manifest_with(train_tokens: list[int], eval_tokens: list[int], per_range: int = 2000) -> dict:
    """A merge manifest's range plan: one range per token count."""

    def ranges(tokens):
        return [
            {"name": f"rows_{i * per_range}-{(i + 1) * per_range}", "start": i * per_range,
             "end": (i + 1) * per_range, "samples": per_range, "tokens": t, "digest": "x"}
            for i, t in enumerate(tokens)
        ]  # fmt: skip

    return {"ranges": {"train": ranges(train_tokens), "eval": ranges(eval_tokens)}}


def target_dir(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "target"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---------------------------------------------------------------- plan


def test_storage_bytes_matches_the_hand_computation():
    expected = 21_033_536 * 4 * 7168 * 2
    assert expected == 1_206_147_088_384
    assert storage_bytes(KIMI_TOKENS, 4, 7168, "bfloat16") == expected
    assert format_bytes(expected) == "1.21 TB"
    assert storage_bytes(10, 4, 4096, "float32") == 10 * 4 * 4096 * 4
    with pytest.raises(DraftflowError, match="unknown dtype 'int8'"):
        storage_bytes(1, 1, 1, "int8")


def test_plan_for_kimi_per_range_split_and_total(tmp_path):
    manifest = manifest_with([10_000_000, 10_000_000], [1_000_000, 33_536])
    target = target_dir(tmp_path, KIMI_CONFIG)
    plan = plan_storage(manifest, target, PlanSettings())

    assert plan["aux_layer_ids"] == [1, 29, 57]  # default for 61 layers
    assert (plan["num_layers_captured"], plan["hidden_size"], plan["num_hidden_layers"]) == (4, 7168, 61)
    assert plan["bytes_per_token"] == 4 * 7168 * 2 == 57_344
    total = plan["total"]
    assert total["tokens"] == KIMI_TOKENS and total["samples"] == 8000
    assert total["bytes_raw"] == 1_206_147_088_384
    assert total["bytes_expected"] == math.ceil(1_206_147_088_384 * 0.72)
    assert plan["splits"]["eval"]["bytes_raw"] == 1_033_536 * 57_344
    last = plan["splits"]["eval"]["ranges"][-1]
    assert (last["name"], last["tokens"], last["bytes_raw"]) == ("rows_2000-4000", 33_536, 33_536 * 57_344)
    assert sum(r["bytes_raw"] for s in plan["splits"].values() for r in s["ranges"]) == total["bytes_raw"]

    explicit = plan_storage(manifest, target, PlanSettings(aux_layer_ids=[2, 30, 58], dtype="float32"))
    assert explicit["aux_layer_ids"] == [2, 30, 58] and explicit["bytes_per_token"] == 4 * 7168 * 4


def test_model_dims_from_config_nested_text_config_and_overrides(tmp_path):
    flat = target_dir(tmp_path / "flat", {"hidden_size": 4096, "num_hidden_layers": 32})
    assert resolve_model_dims(flat) == (32, 4096)
    nested = target_dir(tmp_path / "kimi", KIMI_CONFIG)
    assert resolve_model_dims(nested, {"hidden_size": None, "num_hidden_layers": None}) == (61, 7168)
    # overrides win, and a missing model directory is fine when both are given
    assert resolve_model_dims(nested, {"num_hidden_layers": 4, "hidden_size": None}) == (4, 7168)
    assert resolve_model_dims(tmp_path / "absent", {"num_hidden_layers": 61, "hidden_size": 7168}) == (61, 7168)


def test_model_dims_missing_names_the_config_keys_to_set(tmp_path):
    with pytest.raises(
        DraftflowError, match=r"does not exist.*set `target.num_hidden_layers` and `target.hidden_size`"
    ):
        resolve_model_dims(tmp_path / "absent")
    odd = target_dir(tmp_path, {"text_config": {"num_hidden_layers": 61}, "d_model": 7168})
    with pytest.raises(DraftflowError, match=r"no integer hidden_size.*set `target.hidden_size` in the config"):
        resolve_model_dims(odd)


def test_aux_layer_ids_are_validated():
    assert resolve_aux_layer_ids(None, 32) == [1, 15, 28]
    assert resolve_aux_layer_ids([2, 30, 58], 61) == [2, 30, 58]
    with pytest.raises(DraftflowError, match=r"layer 61 does not exist; the target has 61 decoder layers \(ids 0..60"):
        resolve_aux_layer_ids([2, 30, 61], 61)
    with pytest.raises(DraftflowError, match=r"lists layer\(s\) \[30\] more than once"):
        resolve_aux_layer_ids([30, 2, 30], 61)
    assert resolve_aux_layer_ids(None, 4) == [0, 1, 2]  # [1, N//2 - 1, N - 4] would repeat: [1, 1, 0]
    with pytest.raises(DraftflowError, match=r"3 decoder layer\(s\) has no default aux layers .* set extract.aux_layer_ids"):
        resolve_aux_layer_ids(None, 3)


def test_cli_plan_storage(tmp_path, capsys):
    write_json(tmp_path / "manifest.json", manifest_with([1000, 500], [100]))
    target = target_dir(tmp_path, {"hidden_size": 128, "num_hidden_layers": 8})
    out = tmp_path / "storage_plan.json"
    settings = {"aux_layer_ids": None, "dtype": "bfloat16", "expected_compression_ratio": 0.5,
                "hidden_size": None, "num_hidden_layers": None}  # fmt: skip
    args = [
        "plan-storage",
        "--manifest",
        str(tmp_path / "manifest.json"),
        "--target",
        str(target),
        "--output",
        str(out),
    ]
    assert cli.main([*args, "--settings", json.dumps(settings)]) == 0
    plan = read_json(out)
    assert plan["aux_layer_ids"] == [1, 3, 4]
    assert plan["total"] == {
        "samples": 6000,
        "tokens": 1600,
        "bytes_raw": 1600 * 4 * 128 * 2,
        "bytes_expected": 1600 * 4 * 128,
    }

    bad = dict(settings, aux_layer_ids=[1, 8])
    assert cli.main([*args, "--settings", json.dumps(bad)]) == 1
    assert "layer 8 does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------- preflight


def plan_of(bytes_expected: int) -> dict:
    return {"total": {"bytes_expected": bytes_expected}}


def test_free_disk_refuses_a_plan_bigger_than_the_disk(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    where = tmp_path / "hidden_states"  # does not exist yet: measured at tmp_path
    with pytest.raises(DraftflowError) as refused:
        preflight(plan_of(2 * free), where, PreflightSettings(free_disk_margin=0.1))
    message = str(refused.value)
    assert f"not enough free disk for hidden states at {where}" in message
    assert re.search(
        r"need \d+\.\d\d [GTP]B .* \+ 10% margin\), \d+\.\d\d [GTP]B free at " + re.escape(str(tmp_path)), message
    )
    for hint in ("point `results` at a bigger filesystem", "lower `extract.free_disk_margin`", "fewer samples"):
        assert hint in message


def test_free_disk_passes_a_small_plan_and_reports_the_figures(tmp_path):
    report = preflight(plan_of(1_000_000), tmp_path / "a" / "b", PreflightSettings(free_disk_margin=0.5))
    assert report["ok"] is True
    (check,) = report["checks"]
    assert check["name"] == "free_disk" and check["ok"] is True
    details = check["details"]
    assert details["measured_at"] == str(tmp_path)
    assert details["needed_bytes"] == 1_500_000 and details["free_bytes"] >= 1_500_000


def test_bytes_already_in_the_store_count_as_written(tmp_path):
    store = tmp_path / "hs" / "store" / "ab" / "cd"
    store.mkdir(parents=True)
    (store / "one.dfhs").write_bytes(b"x" * 300)
    (store.parent / "ef").mkdir()
    (store.parent / "ef" / "two.dfhs").write_bytes(b"x" * 100)
    ctx = PreflightContext(plan_of(1000), tmp_path / "hs", PreflightSettings(free_disk_margin=0.5))
    result = check_free_disk(ctx)
    assert isinstance(result, CheckResult) and result.ok
    assert result.details["store_bytes"] == 400
    assert result.details["needed_bytes"] == math.ceil((1000 - 400) * 1.5)
    # a store holding more than the plan needs nothing more
    done = check_free_disk(PreflightContext(plan_of(300), tmp_path / "hs", PreflightSettings()))
    assert done.details["needed_bytes"] == 0


def test_every_failed_check_is_reported(tmp_path):
    def failing(ctx):
        return CheckResult("gpus", False, "GPU 0 is held by another process", {})

    with pytest.raises(DraftflowError, match="GPU 0 is held by another process"):
        preflight(plan_of(1), tmp_path, PreflightSettings(), checks=[check_free_disk, failing])


def test_cli_preflight(tmp_path, capsys):
    out = tmp_path / "preflight.json"
    plan_path = tmp_path / "storage_plan.json"
    args = ["preflight", "--plan", str(plan_path), "--path", str(tmp_path / "hs"),
            "--settings", '{"free_disk_margin": 0.1}', "--output", str(out)]  # fmt: skip
    write_json(plan_path, plan_of(1000))
    assert cli.main(args) == 0
    assert read_json(out)["checks"][0]["details"]["needed_bytes"] == 1100

    out.unlink()
    write_json(plan_path, plan_of(2 * shutil.disk_usage(tmp_path).free))
    assert cli.main(args) == 1
    assert "not enough free disk" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------- server checks (regenerate.engine: openai)


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def models_server():
    """A minimal OpenAI-compatible /v1/models endpoint on 127.0.0.1 serving 'target-7b'."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "target-7b", "object": "model"}]}).encode()
            status = 200 if self.path == "/v1/models" else 404
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def regenerate(endpoints, model="target-7b", engine="openai") -> dict:
    return {"engine": engine, "batch_size": 64, "openai": {"endpoints": endpoints, "model": model, "api_key_env": None}}


def test_cli_preflight_refuses_an_unreachable_regenerate_endpoint(tmp_path, capsys):
    out = tmp_path / "preflight.json"
    plan_path = tmp_path / "storage_plan.json"
    write_json(plan_path, plan_of(1000))
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    settings = {"free_disk_margin": 0.1, "regenerate": regenerate([dead]), "server_timeout_s": 5}
    args = ["preflight", "--plan", str(plan_path), "--path", str(tmp_path / "hs"),
            "--settings", json.dumps(settings), "--output", str(out)]  # fmt: skip
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "preflight refused" in err and f"{dead}/models is not reachable" in err
    assert not out.exists()


def test_preflight_server_checks_pass_a_live_endpoint_and_refuse_a_wrong_model(tmp_path, models_server):
    settings = PreflightSettings(regenerate=regenerate([models_server]))
    report = preflight(plan_of(1), tmp_path, settings)
    names = [c["name"] for c in report["checks"]]
    assert names == ["free_disk", "openai_endpoints", "served_model"]
    assert report["checks"][-1]["details"]["models"] == ["target-7b"]

    with pytest.raises(DraftflowError, match=r"serves \['target-7b'\], not regenerate.openai.model = 'other'"):
        preflight(plan_of(1), tmp_path, PreflightSettings(regenerate=regenerate([models_server], model="other")))
    with pytest.raises(DraftflowError, match="regenerate.openai.endpoints is empty"):
        preflight(plan_of(1), tmp_path, PreflightSettings(regenerate=regenerate([])))
    # engine hf: no server to check, even with stale endpoints in the config
    hf = PreflightSettings(regenerate=regenerate([f"http://127.0.0.1:{closed_port()}/v1"], engine="hf"))
    assert [c["name"] for c in preflight(plan_of(1), tmp_path, hf)["checks"]] == ["free_disk"]


def test_cli_preflight_without_a_plan_checks_only_the_servers(tmp_path, models_server):
    out = tmp_path / "preflight.json"
    settings = {"regenerate": regenerate([models_server])}
    args = ["preflight", "--path", str(tmp_path), "--settings", json.dumps(settings), "--output", str(out)]
    assert cli.main(args) == 0
    checks = read_json(out)["checks"]
    assert checks[0]["name"] == "free_disk" and checks[0]["details"] == {"skipped": True}
    assert checks[-1]["name"] == "served_model" and checks[-1]["ok"]
    with pytest.raises(DraftflowError, match="unknown key"):
        PreflightSettings.from_dict({"regenerat": {}})
