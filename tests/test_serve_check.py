"""The export gate (`draftflow serve-check`, rule serve_check): it passes the default run's good
exports, reports served τ against in-process τ, and fails, naming the cause, on each broken export:
aux ids shifted by one, d2t offsets wrong, a zeroed fc, the wrong norm_output, a dtype the engine
refuses. Each of them fails the workflow itself. The served part, alone, catches what only serving
shows (a real vLLM, its CPU build): a zeroed draft LM head, and aux ids shifted by one on a target
whose neighbouring layers differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import snakemake
from real_vllm import vllm_python
from test_workflow_extract import CONFIG, clone

from draftflow.errors import DraftflowError
from draftflow.export.common import ExportSettings
from draftflow.export.serve_check import CheckSettings, GateFailed, run_check, serve, served_findings

pytestmark = pytest.mark.slow  # the default run and a real vLLM: not in make test-fast

METHODS = ("eagle3", "dflash")


def export_settings(workdir: Path, method: str) -> ExportSettings:
    recorded = json.loads((workdir / "results" / "export" / method / "export.json").read_text())["settings"]
    return ExportSettings.from_dict({k: v for k, v in recorded.items() if k != "engine_versions"})


def broken_copy(workdir: Path, method: str, dest: Path) -> Path:
    """A copy of the default run's export folder for `method`, to break."""
    return Path(shutil.copytree(workdir / "results" / "export" / method, dest))


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def check(workdir: Path, export_dir: Path, method: str, tmp_path: Path, **settings) -> dict:
    results = workdir / "results"
    return run_check(export_dir, results / "drafter" / method, results / "target", results / "merged" / "eval.jsonl",
                     export_settings(workdir, method), CheckSettings.from_dict({"check": "off", **settings}),
                     tmp_path / "serve_check.json", 2)  # fmt: skip


def break_export(folder: Path, config_edit, tensor_edit) -> None:
    """Apply one break (an edit of config.json, of the tensors, or both) to an export folder."""
    if config_edit:
        edit_config(folder, config_edit)
    if tensor_edit:
        edit_tensors(folder, tensor_edit)


def shift_ids(config: dict) -> None:
    if "eagle_config" in config:  # SGLang
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    elif "dflash_config" in config:
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    else:
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]


def zero_fc(tensors: dict) -> None:
    tensors["fc.weight"] = torch.zeros_like(tensors["fc.weight"])


def shift_d2t(tensors: dict) -> None:
    tensors["d2t"] = tensors["d2t"] + 1


def flip_norm_output(config: dict) -> None:
    config["norm_output"] = not config.get("norm_output", False)


def refused_dtype(config: dict) -> None:
    config["torch_dtype"] = "int8"


# (name, engine folder, edit of config.json or None, edit of the tensors or None, what the error says)
BREAKS = [
    ("aux ids shifted by one", "vllm", shift_ids, None,
     "do not match the ids the drafter was trained on"),
    ("aux ids shifted by one (SGLang)", "sglang", shift_ids, None,
     "do not match the ids the drafter was trained on"),
    ("d2t offsets wrong", "vllm", None, shift_d2t, "d2t offsets wrong"),
    ("zeroed fc", "vllm", None, zero_fc, "fc.weight is all zeros"),
    ("zeroed fc (SGLang)", "sglang", None, zero_fc, "fc.weight is all zeros"),
    ("wrong norm_output", "vllm", flip_norm_output, None, "norm_output is"),
    ("a dtype the engine refuses", "vllm", refused_dtype, None, "torch_dtype 'int8' is refused by vllm"),
]  # fmt: skip


def test_good_exports_pass_and_the_default_reports_served_tau(default_run):
    """The default run (make test passes DRAFTFLOW_VLLM_PYTHON) served each method's export through
    its own launch.sh: outputs equal the target's, τ equal to the hf engine's on the same prompts."""
    vllm_python()  # in CI a missing vLLM fails here
    results = default_run.workdir / "results"
    for method in METHODS:
        report = json.loads((results / "export" / method / "serve_check.json").read_text())
        assert report["ok"] and report["findings"] == []
        assert all(report["static"][engine]["ok"] for engine in ("sglang", "vllm"))
        assert report["sglang_served"] is False and "not served" in report["sglang_note"]
        served = report["served"]
        assert served["served"] is True, served
        assert served["outputs_equal_target"] == served["prompts"] == served["outputs_equal_in_process"] == 4
        # float32 on the CPU, as the hf engine: the same verify steps, so the same τ
        assert served["verify_steps_served"] == served["verify_steps_in_process"]
        assert served["tau_served"] == pytest.approx(served["tau_in_process"])
        if method == "eagle3":  # the shrunk default's DFlash learns little: τ ~ 1 in both engines alike
            assert served["tau_served"] > 1.5, served  # the drafter is accepted, not ~1
        assert served["weight_log_lines"] == []
        # the target alone was served once, by serve_target, not again by each method's gate
        assert not (results / "export" / method / "serve_check_logs" / "vllm-target.log").exists()
    alone = json.loads((results / "export" / "target_alone.json").read_text())
    assert alone["served"] is True and len(alone["outputs"]) == 4 and all(alone["outputs"])
    assert (results / "export" / "serve_check_logs" / "vllm-target.log").is_file()
    page = (results / "report" / "summary.rst").read_text()
    assert "Serve check (export/eagle3/serve_check.json)" in page and "served τ" in page


# DFlash drafters have no d2t and no recipe norms: nothing there to break
CASES = [(m, *b) for m in METHODS for b in BREAKS if m == "eagle3" or not b[0].startswith(("d2t", "wrong norm"))]


@pytest.mark.parametrize("method, name, engine, config_edit, tensor_edit, message", CASES,
                         ids=[f"{c[0]}: {c[1]}" for c in CASES])  # fmt: skip
def test_the_gate_fails_on_a_broken_export(default_run, tmp_path, method, name, engine, config_edit, tensor_edit,
                                           message):  # fmt: skip
    export = broken_copy(default_run.workdir, method, tmp_path / "export")
    break_export(export / engine, config_edit, tensor_edit)
    with pytest.raises(GateFailed) as failed:
        check(default_run.workdir, export, method, tmp_path)
    text = str(failed.value)
    assert message in text and str(export / engine) in text, text
    assert "export.check: off" in text  # how to turn it off
    assert not (tmp_path / "serve_check.json").exists()


def test_the_gate_passes_an_untouched_copy(default_run, tmp_path):
    export = broken_copy(default_run.workdir, "eagle3", tmp_path / "export")
    report = check(default_run.workdir, export, "eagle3", tmp_path)
    assert report["ok"] and report["served"] == {"served": False, "reason": "export.check is off"}


# each BREAKS case on the vLLM export, as `make run` meets it
WORKFLOW_BREAKS = [b for b in BREAKS if b[1] == "vllm"]


@pytest.mark.parametrize("name, engine, config_edit, tensor_edit, message", WORKFLOW_BREAKS,
                         ids=[b[0] for b in WORKFLOW_BREAKS])  # fmt: skip
def test_a_broken_export_fails_the_workflow(default_run, tmp_path, name, engine, config_edit, tensor_edit, message):
    workdir = clone(default_run.workdir, tmp_path / "wf")
    break_export(workdir / "results" / "export" / "eagle3" / engine, config_edit, tensor_edit)
    (workdir / "results" / "export" / "eagle3" / "serve_check.json").unlink()
    proc = snakemake(workdir, CONFIG, check=False)
    assert proc.returncode != 0
    log = (workdir / "results" / "logs" / "serve_check" / "eagle3.log").read_text()
    assert "would not serve the trained drafter" in log and message in log, log[-3000:]
    assert not (workdir / "results" / "export" / "eagle3" / "serve_check.json").exists()
    assert (workdir / "results" / "export" / "eagle3" / "export.json").is_file()  # nothing done is lost


def test_off_leaves_the_gate_out(default_run):
    proc = snakemake(default_run.workdir, CONFIG, "-n", "--config", "export={'check': 'off'}", "-F")
    assert "serve_check" not in proc.stdout + proc.stderr


def zero_lm_head(tensors: dict) -> None:
    tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])


# What serving alone must catch, with the static part bypassed: a weight the engine does not apply
# (a zeroed draft LM head), and aux ids that select other layers than those trained on (vLLM #43671:
# what an engine release that counts layers differently does to a correct export). The shrunk
# default's 20-step target is one whose neighbouring layers differ: a one-layer shift took its
# served τ to 1.00 against 3.875 in process at K = 3 (124 verify steps against 32; README, "The
# serve check"); on the full embedded default it would not show (2.13 against 2.15, README).
# (name, edit of config.json or None, edit of the tensors or None)
SERVED_BREAKS = [("zeroed draft LM head", None, zero_lm_head), ("aux ids shifted by one", shift_ids, None)]


@pytest.mark.parametrize("name, config_edit, tensor_edit", SERVED_BREAKS, ids=[b[0] for b in SERVED_BREAKS])
def test_vllm_served_catches_what_only_serving_shows(default_run, tmp_path, name, config_edit, tensor_edit):
    """The served part alone, through a real vLLM: the broken export loads, serves, and still
    decodes every greedy output unchanged (speculative decoding is lossless), so nothing but τ
    shows it. The served τ falls far below the in-process τ of the trained drafter and the gate's
    finding names the likely causes. Without the gate the export would ship. (A zeroed fc does not
    show in served τ here: the toy's drafter still drafts from the token embeddings, 3.76 against
    3.875 in-process, measured; the static part catches it.)"""
    python = str(vllm_python())
    workdir = default_run.workdir
    results = workdir / "results"
    settings = CheckSettings.from_dict({"check": "vllm", "python": python})
    s = export_settings(workdir, "eagle3")

    broken = broken_copy(workdir, "eagle3", tmp_path / "broken")
    break_export(broken / "vllm", config_edit, tensor_edit)
    # compared with the run's own target-alone outputs (serve_target): one launch, the drafter's
    served = serve(broken, results / "drafter" / "eagle3", results / "target", results / "merged" / "eval.jsonl",
                   "eagle3", s, settings, python, tmp_path / "logs", 2,
                   results / "export" / "target_alone.json")  # fmt: skip
    findings = served_findings(served, settings.tolerance)
    assert served.outputs_equal_target == served.prompts  # lossless still: only τ shows it
    assert served.weight_log_lines == []  # vLLM loaded every weight: its log does not show it either
    assert served.tau_served < 1.2 and served.tau_in_process > 1.5, served
    assert [f for f in findings if "served τ" in f and "in-process" in f and "aux ids" in f], findings
    assert not (tmp_path / "logs" / "vllm-target.log").exists()


def test_a_target_vllm_cannot_run_is_named_as_such_not_blamed_on_the_export(default_run, tmp_path):
    """A target whose attention vLLM's CPU build cannot run (head size 16, as the rerun table's tiny
    target, on which vLLM 0.32.0 started and then answered HTTP 500): the target-alone server
    goes first, and the gate says the target, not the export, is what vLLM cannot serve."""
    from draftflow.config import validate_config
    from draftflow.target import BuiltinSettings, build_target

    # the default builtin target's vocabulary (the eval prompts' ids fit it) with the tiny shape
    settings = validate_config({"datasets": {"x": {"path": "x.jsonl"}}})["target"]["builtin"]
    settings.update(train_steps=0, num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1)  # fmt: skip
    tiny = tmp_path / "tiny-target"
    build_target(BuiltinSettings.from_dict(settings), tiny)
    python = str(vllm_python())
    results = default_run.workdir / "results"
    with pytest.raises(GateFailed, match=r"(?s)could not serve the target .*tiny-target alone \(no drafter\).*"
                                         r"vLLM's error: .*head_dim=16.*The export was not tested") as e:  # fmt: skip
        serve(results / "export" / "eagle3", results / "drafter" / "eagle3", tiny, results / "merged" / "eval.jsonl",
              "eagle3", export_settings(default_run.workdir, "eagle3"),
              CheckSettings.from_dict({"check": "vllm", "python": python}), python, tmp_path / "logs", 2)  # fmt: skip
    assert "vllm-target.log ends:" in str(e.value)
    assert not (tmp_path / "logs" / "vllm-drafter.log").exists()  # the export was never launched


def test_a_stale_target_alone_is_refused_before_any_server_starts(default_run, tmp_path):
    """serve_target's outputs were decoded from other prompts (here: another max_new_tokens): the gate
    names the file and what differs instead of comparing against the wrong outputs."""
    results = default_run.workdir / "results"
    stale = json.loads((results / "export" / "target_alone.json").read_text())
    stale["max_new_tokens"] = 7
    (tmp_path / "target_alone.json").write_text(json.dumps(stale))
    python = str(vllm_python())
    settings = CheckSettings.from_dict({"check": "vllm", "python": python})
    with pytest.raises(DraftflowError, match=r"target_alone\.json: the target alone was served on other prompts"):
        serve(results / "export" / "eagle3", results / "drafter" / "eagle3", results / "target",
              results / "merged" / "eval.jsonl", "eagle3", export_settings(default_run.workdir, "eagle3"), settings,
              python, tmp_path / "logs", 2, tmp_path / "target_alone.json")  # fmt: skip
    assert not (tmp_path / "logs").exists()  # no server was launched
