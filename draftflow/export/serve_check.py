"""`draftflow serve-check`: the gate after export. An export that loads and then accepts nothing
costs a user days; this stage fails the workflow before such an export ships.

Two parts, written to `results/export/<method>/serve_check.json`:

* **Static** (always, both engines): each engine folder is compared with what `draftflow export`
  writes for the trained drafter now, through the same functions, which encode the pinned
  releases' loaders (tests/test_export_engines.py reads those against the released source):
  every tensor name mapped and every value equal (a zeroed `fc`, wrong `d2t` offsets), the config
  keys the engine reads (aux ids translated back to the layers they make the engine capture, the
  recipe norms, a dtype the engine accepts), and launch.sh. SGLang stops here: it cannot run on
  this project's machines (its CPU kernel is published only as source), and the report says so.
* **Served** (vLLM, when installed; `export.check: auto | vllm | off`): the export's own
  launch.sh starts vLLM with the drafter, a second server runs the target alone, and a few eval
  prompts are decoded greedily by both and by the in-process hf engine. It fails when a drafted
  output differs from the target's own, when served τ falls short of in-process τ by more than
  `export.serve_check.tolerance`, or when the server's log says a weight was not loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from draftflow.drafters.checkpoint import drafter_method
from draftflow.errors import DraftflowError, reject_unknown_keys
from draftflow.export import common, dflash, eagle3
from draftflow.export.common import DTYPES, ExportSettings
from draftflow.jsonl import read_json, write_json

log = logging.getLogger(__name__)

MODES = ("auto", "vllm", "off")
ENGINE_DTYPES = {  # config torch_dtype values each engine's loader accepts for a drafter
    "vllm": set(DTYPES),
    "sglang": set(DTYPES),
}
# Lines vLLM's loaders log (or raise with) when a checkpoint's names do not fit the model
# (vllm/model_executor/model_loader/default_loader.py, models/utils.py, models/llama_eagle3.py).
WEIGHT_LOG_LINES = re.compile(
    r"(weights were not initialized from checkpoint.*|There is no module or parameter named.*|"
    r"Skipping loading \S+|\S+ is not loaded\.?)"
)
# Config keys whose mismatch has a known consequence: (key path suffix, what it breaks).
KEY_CAUSES = {
    "eagle_aux_hidden_state_layer_ids": "the aux layer ids",
    "target_layer_ids": "the target layer ids",
    "norm_output": "a recipe norm",
    "norm_before_fc": "a recipe norm",
    "norm_before_residual": "a recipe norm",
    "torch_dtype": "the dtype",
    "draft_vocab_size": "the draft vocabulary",
}
# vLLM's CPU build on a small machine (as config/vllm-cpu.yaml): float32 as the hf engine on a
# CPU, eager (compiling takes minutes on 2 cores), a 1 GiB KV cache (else it wants 92% of the
# NUMA node's memory free).
VLLM_CPU_ARGS = ("--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "1073741824")
NOT_SERVED_SGLANG = (
    "SGLang was not served: its CPU kernel is published only as source, which this project does not "
    "build; the sglang/ export was checked against the pinned release's loader (static part only)"
)


@dataclass(frozen=True)
class CheckSettings:
    """config `export.check` and `export.serve_check` (config.schema.yaml)."""

    check: str = "auto"
    prompts: int = 4
    max_new_tokens: int = 32
    tolerance: float = 0.1  # served τ may fall this fraction below in-process τ (bf16 serving vs fp32)
    python: str | None = None  # the Python that has vLLM; None: the stage's own, if it has vLLM
    extra_args: tuple[str, ...] | None = None  # None: VLLM_CPU_ARGS on a host without GPUs, else none
    startup_timeout_s: float = 900.0
    trust_remote_code: bool = False

    @classmethod
    def from_dict(cls, settings: dict) -> "CheckSettings":
        reject_unknown_keys(settings, {f.name for f in fields(cls)}, "serve-check --settings")
        values = dict(settings)
        if values.get("extra_args") is not None:
            values["extra_args"] = tuple(str(a) for a in values["extra_args"])
        s = cls(**values)
        if s.check not in MODES:
            raise DraftflowError(f"export.check: {s.check!r} is not one of {', '.join(MODES)}")
        if s.prompts < 1 or s.max_new_tokens < 1 or not 0 <= s.tolerance < 1:
            raise DraftflowError("export.serve_check: prompts and max_new_tokens must be >= 1, tolerance in [0, 1)")
        return s


class GateFailed(DraftflowError):
    """The export would serve badly; the message lists every finding."""


# ---------------------------------------------------------------- the static part


def expected_export(drafter_dir: Path, target: Path, s: ExportSettings) -> tuple[str, dict[str, dict]]:
    """(method, {engine: {"config", "tensors", "launch"}}): what `draftflow export` writes for this
    drafter with these settings, built in memory by the export's own functions."""
    target_config = common.target_config(target)
    target_path = target.resolve()
    trust = "auto_map" in target_config or "auto_map" in (target_config.get("text_config") or {})
    tp = s.tensor_parallel
    if drafter_method(read_json(drafter_dir / "config.json")) == "dflash":
        cfg, tensors = dflash.read_dflash(drafter_dir)
        config = {**cfg.to_dict(), "torch_dtype": s.dtype}
        tensors = common.cast(tensors, DTYPES[s.dtype])
        return "dflash", {
            "sglang": {"config": config, "tensors": tensors, "aux_ids": list(cfg.target_layer_ids),
                       "launch": dflash.sglang_launch(target_path, cfg.block_size, tp, trust, s.sglang_version, s.dtype)},
            "vllm": {"config": config, "tensors": tensors, "aux_ids": list(cfg.target_layer_ids),
                     "launch": dflash.vllm_launch(target_path, cfg.block_size, tp, trust, s.vllm_version, s.dtype)},
        }  # fmt: skip
    cfg, tensors = eagle3.read_drafter(drafter_dir)
    tensors = common.cast(tensors, DTYPES[s.dtype])
    steps = s.num_speculative_tokens
    sg_ids = eagle3.engine_aux_ids("sglang", s.sglang_version, target_config, cfg.aux_layer_ids).ids
    vl_ids = eagle3.engine_aux_ids("vllm", s.vllm_version, target_config, cfg.aux_layer_ids).ids
    return "eagle3", {
        "sglang": {"config": eagle3.sglang_config(cfg, sg_ids, s.dtype), "tensors": eagle3.sglang_tensors(tensors, cfg),
                   "aux_ids": list(cfg.aux_layer_ids),
                   "launch": eagle3.sglang_launch(target_path, steps, tp, trust, s.sglang_version, s.dtype)},
        "vllm": {"config": eagle3.vllm_config(cfg, vl_ids, target_config, target_path, steps, s.dtype),
                 "tensors": eagle3.vllm_tensors(tensors, cfg), "aux_ids": list(cfg.aux_layer_ids),
                 "launch": eagle3.vllm_launch(target_path, steps, tp, trust, s.vllm_version, s.dtype)},
    }  # fmt: skip


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _aux_ids_message(engine: str, version: str, target: Path, key: str, got, want, trained: list[int]) -> str:
    """A wrong aux-id list, said in layers: which layers the engine would capture instead."""
    captured = ""
    if "eagle" in key and isinstance(got, list) and all(isinstance(i, int) for i in got):
        try:
            ours = eagle3.our_aux_ids(engine, version, common.target_config(target), got)
            captured = f" (so {engine} {version} would feed the drafter the outputs of layers {ours})"
        except DraftflowError:
            captured = ""
    return (f"{key} is {got}{captured}, but the drafter was trained on layers {trained}: the export's aux ids "
            f"do not match the ids the drafter was trained on (expected {want}); served τ would fall to ~1")  # fmt: skip


def config_findings(engine: str, version: str, target: Path, got: dict, want: dict, trained: list[int]) -> list[str]:
    """Every config key the export writes that differs (paths recorded at export are skipped)."""
    findings = []
    if got.get("torch_dtype") not in ENGINE_DTYPES[engine]:
        findings.append(f"torch_dtype {got.get('torch_dtype')!r} is refused by {engine} (it loads "
                        f"{sorted(ENGINE_DTYPES[engine])}); export.dtype sets it")  # fmt: skip
    flat_got, flat_want = _flatten(got), _flatten(want)
    for key in sorted(set(flat_got) | set(flat_want)):
        if key.endswith(("name_or_path", "target_path")):
            continue
        g, w = flat_got.get(key, "(absent)"), flat_want.get(key, "(absent)")
        if key in ("norm_output",) and {g, w} <= {False, "(absent)"}:
            continue
        if g == w:
            continue
        leaf = key.rsplit(".", 1)[-1]
        if leaf in ("eagle_aux_hidden_state_layer_ids", "target_layer_ids"):
            findings.append(_aux_ids_message(engine, version, target, key, g, w, trained))
        elif leaf.startswith("norm_"):
            findings.append(f"{key} is {g}, but the drafter was trained with {w}: the engine would compute a "
                            "different drafter than the trained one")  # fmt: skip
        elif leaf == "torch_dtype" and "torch_dtype" not in " ".join(findings):
            findings.append(f"{key} is {g!r}, export.dtype is {w!r}")
        elif leaf != "torch_dtype":
            findings.append(f"{key} is {g!r}, expected {w!r}")
    return findings


def tensor_findings(engine: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    findings = []
    for name in sorted(set(want) - set(got)):
        findings.append(f"{name} is missing: {engine} would leave it unset (export format mismatch)")
    for name in sorted(set(got) - set(want)):
        findings.append(f"{name} is not a tensor the export writes: {engine} ignores or refuses it "
                        "(export format mismatch)")  # fmt: skip
    for name in sorted(set(got) & set(want)):
        g, w = got[name], want[name]
        if g.shape != w.shape:
            findings.append(f"{name} has shape {list(g.shape)}, the trained drafter's is {list(w.shape)}")
        elif g.dtype != w.dtype:
            findings.append(f"{name} is stored as {str(g.dtype).removeprefix('torch.')}, "
                            f"export.dtype is {str(w.dtype).removeprefix('torch.')}")  # fmt: skip
        elif not torch.equal(g, w):
            if name == "d2t":
                wrong = int((g != w).sum())
                findings.append(f"d2t differs from the trained drafter's vocabulary map at {wrong} of {g.numel()} "
                                "entries: drafts would be read as the wrong target tokens (d2t offsets wrong)")  # fmt: skip
            elif g.is_floating_point() and not torch.any(g):
                findings.append(f"{name} is all zeros, the trained drafter's is not: the engine would draft from "
                                "zeroed weights")  # fmt: skip
            else:
                delta = (g.float() - w.float()).abs().max().item() if g.is_floating_point() else "n/a"
                findings.append(f"{name} differs from the trained drafter's (max |Δ| {delta})")
    return findings


def static_check(export_dir: Path, drafter_dir: Path, target: Path, s: ExportSettings) -> tuple[str, dict]:
    """(method, {engine: {"ok", "findings"}}) for sglang/ and vllm/ under export_dir."""
    from safetensors.torch import load_file

    method, expected = expected_export(drafter_dir, target, s)
    report = {}
    for engine, want in expected.items():
        folder = export_dir / engine
        version = s.sglang_version if engine == "sglang" else s.vllm_version
        findings: list[str] = []
        try:
            got_config = read_json(folder / "config.json")
            findings += config_findings(engine, version, target, got_config, want["config"], want["aux_ids"])
        except (OSError, ValueError) as e:
            findings.append(f"config.json unreadable: {e}")
        try:
            findings += tensor_findings(engine, load_file(str(folder / "model.safetensors")), want["tensors"])
        except Exception as e:  # safetensors raises its own error types for a damaged file
            findings.append(f"model.safetensors unreadable: {e}")
        try:
            if (folder / "launch.sh").read_text() != want["launch"]:
                findings.append("launch.sh differs from what export writes for this drafter and export settings")
        except OSError as e:
            findings.append(f"launch.sh unreadable: {e}")
        if engine == "sglang" and method == "eagle3":
            cfg, _ = eagle3.read_drafter(drafter_dir)
            ignored = eagle3.sglang_ignored_variants(cfg, version)
            if ignored:
                findings.append(f"SGLang {version} does not apply {', '.join(ignored)} (its released source): "
                                "serve the vllm/ export, or train with these norms off")  # fmt: skip
        report[engine] = {"ok": not findings, "findings": [f"{folder}: {f}" for f in findings], "version": version}
    return method, report


# ---------------------------------------------------------------- the served part (vLLM)


def has_vllm(python: str) -> bool:
    """`python` can import vllm (a spec lookup in a child process: no import, ~0.1 s)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_python(settings: CheckSettings) -> str | None:
    """The Python to serve with: export.serve_check.python (must have vLLM), else this one if it has it."""
    if settings.python:
        if not has_vllm(settings.python):
            raise DraftflowError(f"export.serve_check.python = {settings.python}: cannot import vllm there; install "
                                 "it (make vllm-setup) or set export.check: off")  # fmt: skip
        return settings.python
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@dataclass
class Served:
    """What the served part measured (serve_check.json `served`)."""

    engine: str
    version: str
    k: int
    prompts: int
    tau_served: float
    tau_in_process: float
    verify_steps_served: int
    verify_steps_in_process: int
    outputs_equal_target: int  # drafted outputs equal to the target alone's, of `prompts`
    outputs_equal_in_process: int
    weight_log_lines: list[str]
    seconds: float


def _gate_prompts(target: Path, eval_data: Path, settings: CheckSettings):
    from draftflow.evaluation.prompt_sets import PromptSetSpec, load_prompt_set
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=settings.trust_remote_code)
    spec = PromptSetSpec("serve_check", "eval")
    prompts = load_prompt_set(spec, tokenizer, eval_data, settings.prompts, None)
    if not prompts.prompts:
        raise DraftflowError(f"{eval_data}: no eval prompts to serve; the serve check needs the merged eval split "
                             "(merge.eval_fraction > 0) or export.check: off")  # fmt: skip
    return prompts, tokenizer


def in_process(drafter_dir: Path, target: Path, prompts, k: int, settings: CheckSettings):
    """(stats, outputs) of the hf engine's greedy speculative decoding on the same prompts at K."""
    from draftflow.drafters.checkpoint import load_drafter
    from draftflow.evaluation.evaluate import eos_token_ids, run_real
    from draftflow.evaluation.speculative import DFlashProposer, Eagle3Proposer, Target
    from draftflow.target import load_target, resolve_device

    device = resolve_device("auto")
    dtype = torch.float32 if device.type == "cpu" else "auto"
    model, tokenizer = load_target(target, dtype=dtype, device=str(device), trust_remote_code=settings.trust_remote_code)
    drafter, cfg = load_drafter(drafter_dir, target, device=device, dtype=next(model.parameters()).dtype)
    proposer = DFlashProposer(drafter) if hasattr(cfg, "block_size") else Eagle3Proposer(drafter)
    wrapped = Target(model, cfg.aux_layer_ids)
    outputs: list[dict] = []
    try:
        results, _ = run_real(wrapped, [proposer], prompts.prompts, [k], settings.max_new_tokens,
                              eos_token_ids(model, tokenizer), tokenizer, outputs)  # fmt: skip
    finally:
        wrapped.close()
    drafted = [o["tokens"] for o in outputs if o["method"] != "greedy"]
    return results[proposer.name][k].stats, drafted


def _has_gpus() -> bool:
    from draftflow.gpu import host_gpu_ids, scheduler_visible_ids

    visible = scheduler_visible_ids()
    return bool(visible if visible is not None else host_gpu_ids())


def _server_env(python: str, threads: int) -> dict[str, str]:
    """launch.sh's $PYTHON; on a CPU, vLLM's worker within the job's threads (a user's bind wins)."""
    from draftflow.threads import vllm_cpu_env

    # no usage reports: nothing leaves the machine at run time
    env = {**os.environ, "PYTHON": python, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if not _has_gpus() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env.update(vllm_cpu_env(threads))
    return env


def _server_extra_args(settings: CheckSettings) -> tuple[str, ...]:
    """export.serve_check.extra_args, else VLLM_CPU_ARGS on a host without GPUs."""
    return settings.extra_args if settings.extra_args is not None else (() if _has_gpus() else VLLM_CPU_ARGS)


def _serve_unit(name: str, argv_for_port, prompts, tokenizer, k: int, method: str, settings: CheckSettings,
                env: dict, server_log: Path, target: Path, export_dir: Path | None):  # fmt: skip
    """Launch one vLLM (`argv_for_port(host, port)`), decode the prompts greedily, stop it.
    Returns (UnitResult, vLLM's version). `name`: "target" (alone) or "drafter" (the export's launch.sh)."""
    from draftflow.evaluation.served import LaunchedServer, ServerConfig, free_port, make_client, run_unit

    host = "127.0.0.1"
    port = free_port(host)
    server_log.unlink(missing_ok=True)
    url = f"http://{host}:{port}"
    server = LaunchedServer(argv_for_port(host, port), url, server_log, settings.startup_timeout_s, env)
    try:
        server.__enter__()  # stops the server itself when it fails to start
    except DraftflowError as e:  # vLLM refuses a checkpoint whose names do not fit at load time
        refused = sorted(set(WEIGHT_LOG_LINES.findall(server_log.read_text(errors="replace")))) \
            if server_log.exists() else []  # fmt: skip
        if refused and export_dir is not None:
            raise GateFailed(f"vLLM refused the export {export_dir / 'vllm'}: {'; '.join(refused)} (export "
                             "format mismatch: re-export with `draftflow export`)") from None  # fmt: skip
        raise GateFailed(f"vLLM did not start with {name == 'drafter' and 'the export' or 'the target'}: {e}") from None
    try:
        client = make_client("vllm", url, 600.0)
        info = client.info()
        if name == "drafter" and info.k != k:
            raise GateFailed(f"{export_dir / 'vllm' / 'launch.sh'} serves K = {info.k}, expected {k}")
        config = ServerConfig(k if name == "drafter" else 0, method)
        try:
            unit = run_unit(client, prompts, config, 0.0, tokenizer, settings.max_new_tokens, 1, {})
        except (DraftflowError, OSError) as e:  # a request failed: the engine died or answered an error
            raise GateFailed(_request_failed(name, target, export_dir, e, server_log)) from None
        return unit, str(info.version)
    finally:
        server.stop()


def _target_alone_argv(python: str, target: Path, s: ExportSettings, settings: CheckSettings):
    from draftflow.evaluation.served import VLLM_SERVER, ServerConfig, ServerSettings, server_argv

    extra = _server_extra_args(settings)

    def argv(host: str, port: int) -> list[str]:
        alone = ServerSettings(launcher=(python, *VLLM_SERVER), host=host, port=port, extra_args=tuple(extra))
        return server_argv("vllm", alone, target, None, ServerConfig(0), settings.trust_remote_code, s.dtype)

    return argv


def serve_target_alone(target: Path, prompts, tokenizer, s: ExportSettings, settings: CheckSettings, python: str,
                       log_dir: Path, threads: int) -> dict:  # fmt: skip
    """The target alone (no drafter) served by vLLM on the gate's prompts, greedy: the outputs every
    method's gate compares its drafted outputs with (one launch for all methods). Fails, naming the
    target and not an export, when vLLM cannot serve the target at all."""
    started = time.monotonic()
    unit, version = _serve_unit("target", _target_alone_argv(python, target, s, settings), prompts, tokenizer, 0, "",
                                settings, _server_env(python, threads), log_dir / "vllm-target.log", target, None)  # fmt: skip
    return {"served": True, "engine": "vllm", "version": version, "prompts_digest": prompts.digest(),
            "max_new_tokens": settings.max_new_tokens, "dtype": s.dtype,
            "outputs": [o["tokens"] for o in unit.outputs], "seconds": time.monotonic() - started}  # fmt: skip


def _check_target_alone(alone: dict, path: Path, prompts, settings: CheckSettings, s: ExportSettings) -> None:
    """The shared target-alone outputs were decoded from these prompts, at this length and dtype."""
    want = {"prompts_digest": prompts.digest(), "max_new_tokens": settings.max_new_tokens, "dtype": s.dtype}
    got = {key: alone.get(key) for key in want}
    if got != want:
        raise DraftflowError(f"{path}: the target alone was served on other prompts or settings ({got}, this gate "
                             f"has {want}); delete it and rerun, and Snakemake serves it again")  # fmt: skip


def serve(export_dir: Path, drafter_dir: Path, target: Path, eval_data: Path, method: str, s: ExportSettings,
          settings: CheckSettings, python: str, log_dir: Path, threads: int,
          target_alone: Path | None = None) -> Served:  # fmt: skip
    """Serve the export through its own launch.sh and compare with the target alone (read from
    `target_alone`, `serve-target`'s output, or served here first) and with the in-process hf engine."""
    started = time.monotonic()
    prompts, tokenizer = _gate_prompts(target, eval_data, settings)
    k = read_json(drafter_dir / "config.json").get("block_size", 0) - 1 if method == "dflash" else s.num_speculative_tokens
    env = _server_env(python, threads)
    alone_report = read_json(target_alone) if target_alone is not None else {"served": False}
    if alone_report["served"]:
        _check_target_alone(alone_report, target_alone, prompts, settings, s)
    else:  # not served by serve_target (no vLLM there then): the target alone first, here; when vLLM
        # cannot serve the target itself, the export is not at fault
        alone_report = serve_target_alone(target, prompts, tokenizer, s, settings, python, log_dir, threads)
    extra = _server_extra_args(settings)

    def drafter_argv(host: str, port: int) -> list[str]:  # exactly the export's own launch command
        # every prompt token computed by the server, as by the hf engine
        return ["bash", str(export_dir / "vllm" / "launch.sh"), str(target), "--host", host, "--port", str(port),
                "--no-enable-prefix-caching", *extra]  # fmt: skip

    server_log = log_dir / "vllm-drafter.log"
    unit, version = _serve_unit("drafter", drafter_argv, prompts, tokenizer, k, method, settings, env, server_log,
                                target, export_dir)  # fmt: skip
    weight_lines = sorted(set(WEIGHT_LOG_LINES.findall(server_log.read_text(errors="replace"))))
    stats, hf_drafted = in_process(drafter_dir, target, prompts, k, settings)
    drafted = [o["tokens"] for o in unit.outputs]
    alone = alone_report["outputs"]
    counts = unit.counts
    return Served("vllm", version, k, len(drafted), counts.tau, stats.tau, counts.verify_steps, stats.steps,
                  sum(a == b for a, b in zip(drafted, alone)), sum(a == b for a, b in zip(drafted, hf_drafted)),
                  weight_lines, time.monotonic() - started)  # fmt: skip


# the root cause an engine process logs before the API answers HTTP 500
ENGINE_ERROR = re.compile(r"\b((?:Runtime|Value|NotImplemented|Assertion|Type)Error: .+)")


def _request_failed(name: str, target: Path, export_dir: Path | None, error: Exception, server_log: Path) -> str:
    """The gate's message when a started server fails a request: which server, whose fault, and
    the engine's own error from its log (the HTTP answer only says "EngineCore encountered an issue")."""
    from draftflow.evaluation.served import tail

    text = server_log.read_text(errors="replace") if server_log.exists() else ""
    causes = ENGINE_ERROR.findall(text)
    error = f"{error}\nvLLM's error: {causes[0]}" if causes else error
    log_tail = tail(server_log)
    if name == "target":
        return (f"vLLM started but could not serve the target {target} alone (no drafter): {error}\n"
                f"The export was not tested: vLLM cannot run this target here (on a CPU, its attention "
                f"kernels support only some head sizes). Serve on a target vLLM runs, or set export.check: off "
                f"(the static part still runs where vLLM is not installed). {server_log} ends:\n{log_tail}")
    return (f"vLLM served the target alone but failed with the export {export_dir / 'vllm'}: {error}\n"
            f"The drafter breaks the engine (a shape, dtype or config the release does not accept): re-export with "
            f"`draftflow export` for export.vllm_version. {server_log} ends:\n{log_tail}")


def served_findings(served: Served, tolerance: float) -> list[str]:
    findings = []
    if served.weight_log_lines:
        findings.append(f"vLLM did not load every weight: {'; '.join(served.weight_log_lines)} (export format "
                        "mismatch: re-export with `draftflow export` for export.vllm_version)")  # fmt: skip
    if served.outputs_equal_target < served.prompts:
        findings.append(f"{served.prompts - served.outputs_equal_target} of {served.prompts} greedy outputs with the "
                        "drafter differ from the target's own: speculative decoding must not change a greedy output "
                        "(a dtype or engine defect)")  # fmt: skip
    floor = served.tau_in_process * (1 - tolerance)
    if served.tau_served < floor:
        findings.append(
            f"served τ {served.tau_served:.2f} against {served.tau_in_process:.2f} in-process on the same "
            f"{served.prompts} prompts (K = {served.k}; tolerance {tolerance:.0%}): the served drafter is not the "
            "trained one. Likely causes: aux ids that select other layers in this vLLM release (set "
            "export.vllm_version to the served release and re-export), weights it did not load, or recipe norms"
        )
    return findings


# ---------------------------------------------------------------- the stage


def run_check(export_dir: Path, drafter_dir: Path, target: Path, eval_data: Path, s: ExportSettings,
              settings: CheckSettings, output: Path, threads: int, target_alone: Path | None = None) -> dict:  # fmt: skip
    method, static = static_check(export_dir, drafter_dir, target, s)
    report: dict = {"method": method, "check": settings.check, "static": static, "sglang_served": False,
                    "sglang_note": NOT_SERVED_SGLANG, "settings": asdict(settings)}  # fmt: skip
    findings = [f for engine in static.values() for f in engine["findings"]]
    python = None if settings.check == "off" else vllm_python(settings)
    if settings.check == "vllm" and python is None:
        raise DraftflowError("export.check is vllm but this environment cannot import vllm: set "
                             "export.serve_check.python to a Python that has it (make vllm-setup: "
                             ".venv-vllm/bin/python), or export.check: auto to check statically only")  # fmt: skip
    if findings:  # serving a statically broken export only repeats the finding, slower
        report["served"] = {"served": False, "reason": "the static check failed"}
    elif python is None:
        reason = "export.check is off" if settings.check == "off" else "vLLM is not installed here (make vllm-setup)"
        report["served"] = {"served": False, "reason": reason}
        log.warning("serve check: not served (%s); static check passed", reason)
    else:
        served = serve(export_dir, drafter_dir, target, eval_data, method, s, settings, python,
                       output.parent / "serve_check_logs", threads, target_alone)  # fmt: skip
        findings += served_findings(served, settings.tolerance)
        report["served"] = {"served": True, **asdict(served), "tolerance": settings.tolerance}
        log.info("served τ %.3f against %.3f in-process (K = %d, %d prompts, %d/%d outputs equal the target's)",
                 served.tau_served, served.tau_in_process, served.k, served.prompts, served.outputs_equal_target,
                 served.prompts)  # fmt: skip
    report["ok"] = not findings
    report["findings"] = findings
    if findings:
        raise GateFailed(f"the export under {export_dir} would not serve the trained drafter:\n- " + "\n- ".join(findings)
                         + "\nFix the cause and rerun; export.check: off skips this gate")  # fmt: skip
    write_json(output, report)
    return report


def run_target_alone(target: Path, eval_data: Path, s: ExportSettings, settings: CheckSettings, output: Path,
                     threads: int) -> dict:  # fmt: skip
    """`serve-target`: the target alone's outputs for every gate, or why it was not served."""
    python = None if settings.check == "off" else vllm_python(settings)
    if python is None:
        reason = "export.check is off" if settings.check == "off" else "vLLM is not installed here (make vllm-setup)"
        report = {"served": False, "reason": reason}
    else:
        prompts, tokenizer = _gate_prompts(target, eval_data, settings)
        report = serve_target_alone(target, prompts, tokenizer, s, settings, python,
                                    output.parent / "serve_check_logs", threads)  # fmt: skip
        log.info("the target alone served by vLLM %s: %d greedy outputs in %.0f s", report["version"],
                 len(report["outputs"]), report["seconds"])  # fmt: skip
    write_json(output, report)
    return report


def configure_parser(parser: argparse.ArgumentParser, stage: str) -> None:
    from draftflow.cli import settings_arg

    parser.add_argument("--target", type=Path, required=True, help="target model folder")
    parser.add_argument("--eval-data", type=Path, required=True, help="merged eval split: the served prompts")
    parser.add_argument("--export-settings", type=settings_arg, default={}, help="the export rule's --settings")
    parser.add_argument("--settings", type=settings_arg, default={}, help="config export.check + export.serve_check")
    if stage == "serve-target":
        parser.add_argument("--output", type=Path, required=True, help="target_alone.json")
        return
    parser.add_argument("--export-dir", type=Path, required=True, help="results/export/<method> (sglang/, vllm/)")
    parser.add_argument("--drafter", type=Path, required=True, help="the trained drafter folder")
    parser.add_argument("--target-alone", type=Path, default=None,
                        help="serve-target's output (the target alone's greedy outputs); without it the gate serves "
                             "the target alone itself")  # fmt: skip
    parser.add_argument("--output", type=Path, required=True, help="serve_check.json")


def main(args: argparse.Namespace) -> int:
    from draftflow.threads import default_threads

    threads = args.threads or default_threads()
    s = ExportSettings.from_dict(args.export_settings)
    settings = CheckSettings.from_dict(args.settings)
    if args.stage == "serve-target":
        run_target_alone(args.target, args.eval_data, s, settings, args.output, threads)
    else:
        run_check(args.export_dir, args.drafter, args.target, args.eval_data, s, settings, args.output, threads,
                  args.target_alone)  # fmt: skip
    return 0
