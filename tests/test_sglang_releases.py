"""What draftflow assumes of SGLang releases, checked against their released source (issue 33:
a real SGLang 0.5.18 served our export once, outside the tests; SGLang cannot run here).

The files come from the release wheels on PyPI, pinned by sha256 (helpers_engine_source.py);
helpers_sglang_args.py reads their command-line flags, `ServerArgs` fields and HTTP routes.
"""

from __future__ import annotations

import ast

import pytest

from draftflow.drafters.eagle3 import VARIANT_FLAGS
from draftflow.export.eagle3 import SGLANG_NEWEST_READ, sglang_applied_variants
from helpers_engine_source import PINNED, SourceUnavailable, engine_source
from helpers_sglang_args import cli_flags, routes, server_arg_fields, unknown_or_deprecated  # noqa: F401

LLAMA_EAGLE3 = "sglang/srt/models/llama_eagle3.py"
EAGLE3_RELEASES = sorted((v for (p, v), members in PINNED.items() if p == "sglang" and LLAMA_EAGLE3 in members),
                         key=lambda v: tuple(map(int, v.split("."))))  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def released_source():
    try:
        for project, version in PINNED:
            if project == "sglang":
                engine_source(project, version)
    except SourceUnavailable as e:
        pytest.fail(str(e))


# ---------------------------------------------------------------- recipe norms per release


def norms_read(version: str) -> set[str]:
    """The recipe-norm names the release's LlamaForCausalLMEagle3 source reads from the drafter
    config (`getattr(config, "norm_output", …)`, `eagle_config.get("norm_before_fc", …)`)."""
    tree = ast.parse((engine_source("sglang", version) / LLAMA_EAGLE3).read_text(encoding="utf-8"))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in VARIANT_FLAGS}


def test_the_recipe_norm_ranges_are_what_each_release_reads():
    """norm_output from 0.5.12 on (0.5.11 has none), norm_before_fc from 0.5.17 on (0.5.16 has
    not), norm_before_residual in none; 0.5.18, served in issue 33, applies norm_output (the
    export warned it did not: any release but 0.5.14 and 0.5.23 counted as applying none)."""
    assert EAGLE3_RELEASES == ["0.5.11", "0.5.12", "0.5.14", "0.5.16", "0.5.17", "0.5.18", "0.5.23"]
    for version in EAGLE3_RELEASES:
        assert sglang_applied_variants(version) == norms_read(version), version
    assert sglang_applied_variants("0.5.18") == {"norm_output", "norm_before_fc"}
    assert sglang_applied_variants("0.5.12.post1") == {"norm_output"}
    assert EAGLE3_RELEASES[-1] == SGLANG_NEWEST_READ


# ---------------------------------------------------------------- dtype


def test_sglangs_auto_dtype_splits_a_float32_target_from_a_bfloat16_drafter():
    """Why launch.sh needs --dtype (issue 33): 0.5.18's own dtype rule (configs/model_config.py,
    run here) turns `auto` into float16 for a float32 config and keeps bfloat16 for the drafter's
    (Half != BFloat16 in fc); --dtype bfloat16 gives both the drafter's dtype."""
    import logging

    import torch

    from helpers_engine_source import load_defs

    path = engine_source("sglang", "0.5.18") / "sglang/srt/configs/model_config.py"
    env = load_defs(path, ["_STR_DTYPE_TO_TORCH_DTYPE", "_get_and_verify_dtype"],
                    {"logger": logging.getLogger("released-sglang")})  # fmt: skip
    resolve = env["_get_and_verify_dtype"]
    target = {"model_type": "llama", "torch_dtype": "float32"}  # the embedded default target
    drafter = {"model_type": "llama", "torch_dtype": "bfloat16"}  # export.dtype's default
    assert (resolve(target, "auto"), resolve(drafter, "auto")) == (torch.float16, torch.bfloat16)
    assert resolve(target, "bfloat16") == resolve(drafter, "bfloat16") == torch.bfloat16


# ---------------------------------------------------------------- launch commands


def exec_flags(script: str) -> list[str]:
    """The options of a launch.sh's server command (its `exec` line and continuations)."""
    command = script[script.index("\nexec ") :]
    return [word.strip('"') for word in command.split() if word.startswith("--")]


@pytest.mark.parametrize("version", ["0.5.14", "0.5.18"])
def test_export_launch_scripts_use_flags_the_release_has(version):
    """Every option of the exported launch.sh is a current flag of SGLang `version` by its full
    name (`--tp` only worked as an argparse abbreviation of --tp-size), --dtype included."""
    from pathlib import Path

    from draftflow.export import dflash, eagle3

    for script in (eagle3.sglang_launch(Path("/t"), 3, 2, True, version, "bfloat16"),
                   dflash.sglang_launch(Path("/t"), 5, 2, True, version, "bfloat16")):  # fmt: skip
        flags = exec_flags(script)
        assert "--dtype" in flags and "--tp-size" in flags
        assert unknown_or_deprecated(flags, version) == []


# ---------------------------------------------------------------- server information


def test_server_info_paths_are_the_releases_routes():
    """/server_info is current in 0.5.14 and 0.5.18, /get_server_info deprecated there, and the
    only one in 0.5.5: ask the first, fall back to the second (engines/sglang_http.py)."""
    from draftflow.engines.sglang_http import SERVER_INFO_PATHS

    current, older = SERVER_INFO_PATHS
    for version in ("0.5.14", "0.5.18"):
        served = routes(version)
        assert served[current] is False and served[older] is True, version
    assert current not in routes("0.5.5") and routes("0.5.5")[older] is False


@pytest.mark.parametrize("version", ["0.5.14", "0.5.18"])
def test_evaluations_launch_command_uses_flags_the_release_has(version, tmp_path):
    """The served evaluation's SGLang command (drafter and baseline): --dtype, --disable-radix-cache
    and the speculative flags are current flags of the release by their full names."""
    from draftflow.evaluation.served import ServerConfig, ServerSettings, server_argv

    for k in (3, 0):
        argv = server_argv("sglang", ServerSettings(port=30000, launcher=("python3", "-m", "sglang.launch_server")),
                           tmp_path, tmp_path, ServerConfig(k), True, "bfloat16")  # fmt: skip
        assert {"--dtype", "--disable-radix-cache"} <= set(argv)
        assert unknown_or_deprecated(argv, version) == []


# ---------------------------------------------------------------- the extraction server


def launch_sglang_extract(tmp_path, *extra: str) -> list[str]:
    """scripts/launch_sglang.sh extract --dry-run on a tiny config (this Python has no SGLang)."""
    import json
    import os
    import shlex
    import subprocess
    import sys

    from conftest import REPO

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 32}))
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(REPO / "scripts" / "launch_sglang.sh"), "extract", str(model), "--dry-run", *extra],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return shlex.split(run.stdout)


@pytest.mark.parametrize("version", ["0.5.14", "0.5.18"])
def test_the_extraction_server_command_uses_flags_the_release_has(version, tmp_path):
    """Issue 33: launch_sglang.sh passed --disable-cuda-graph, deprecated since 0.5.14 (0.5.18
    warns: use --cuda-graph-backend-{decode,prefill}=disabled)."""
    cmd = launch_sglang_extract(tmp_path)
    assert unknown_or_deprecated(cmd, version) == []


def test_cuda_graphs_are_turned_off_as_each_release_spells_it():
    """0.5.13 knows only --disable-cuda-graph; 0.5.14 and later the per-phase backends (the old
    flag deprecated). The installed release picks (none installed: the current spelling)."""
    from draftflow.engines.sglang_capture import cuda_graph_off_flags

    current, deprecated = cli_flags("0.5.13")
    assert "--disable-cuda-graph" in current and "--cuda-graph-backend-decode" not in current | deprecated
    assert cuda_graph_off_flags("0.5.13") == ["--disable-cuda-graph"]
    for version in ("0.5.14", "0.5.18", "0.5.18.post1"):
        flags = cuda_graph_off_flags(version)
        assert unknown_or_deprecated(flags, version.split(".post")[0]) == [] and "disabled" in flags
    assert cuda_graph_off_flags(None) == cuda_graph_off_flags("0.5.18")


# ---------------------------------------------------------------- in-process capture on a CPU job


class RecordedEngine:
    """Stands in for `sglang.Engine`: records its keyword arguments."""

    instances: list["RecordedEngine"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        RecordedEngine.instances.append(self)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def sglang_0_5_18(monkeypatch):
    """An importable `sglang` 0.5.18 whose ServerArgs has the released fields and whose Engine records."""
    import dataclasses
    import sys
    import types

    module = types.ModuleType("sglang")
    module.__version__ = "0.5.18"
    module.Engine = RecordedEngine
    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.ServerArgs = dataclasses.make_dataclass("ServerArgs", sorted(server_arg_fields("0.5.18")))
    for name, mod in (("sglang", module), ("sglang.srt", types.ModuleType("sglang.srt")),
                      ("sglang.srt.server_args", server_args)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    RecordedEngine.instances.clear()


@pytest.fixture
def tiny_target(tmp_path):
    import json

    path = tmp_path / "target"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "num_hidden_layers": 6, "hidden_size": 32}))  # fmt: skip
    return path


def test_a_job_without_gpus_captures_on_sglangs_cpu_backend(sglang_0_5_18, tiny_target):
    """Issue 33: a job on a host without GPUs (extract.gpus_per_job 1: the claim fell back to the
    CPU) was told to "set extract.gpus_per_job to 1". In-process sglang.Engine capture runs on
    SGLang's CPU backend (shown on a CPU build with that check bypassed): the engine starts there
    with device "cpu", every argument a ServerArgs field of 0.5.18."""
    from draftflow.engines.capture import make_capture_engine

    settings = {"engine": "sglang", "aux_layer_ids": [1, 2, 4], "dtype": "bfloat16", "gpus_per_job": 1,
                "tensor_parallel": 1, "sglang": {"version": "0.5.18"}}  # fmt: skip
    engine = make_capture_engine(settings, tiny_target, ["cpu"])
    try:
        kwargs = RecordedEngine.instances[-1].kwargs
        assert kwargs["device"] == "cpu" and kwargs["tp_size"] == 1 and kwargs["dtype"] == "bfloat16"
        assert kwargs["disable_radix_cache"] is True and kwargs["forward_hooks"]
        assert set(kwargs) <= server_arg_fields("0.5.18")
        assert engine.engine_layer_ids == [2, 3, 5]
    finally:
        engine.close()
    # a GPU job keeps its checks and SGLang's own device choice
    engine = make_capture_engine({**settings, "tensor_parallel": 2, "gpus_per_job": 2}, tiny_target, ["cuda:0", "cuda:1"])
    engine.close()
    assert "device" not in RecordedEngine.instances[-1].kwargs
    from draftflow.engines.capture import CaptureError

    with pytest.raises(CaptureError, match=r"tensor_parallel is 2 but this job holds 1 GPU\(s\).*gpus_per_job to 2"):
        make_capture_engine({**settings, "tensor_parallel": 2}, tiny_target, ["cuda:0"])


def test_cpu_tensor_parallel_is_what_sglangs_cpu_backend_allows(monkeypatch):
    """One rank per NUMA node, or per CPU list in SGLANG_CPU_OMP_THREADS_BIND (0.5.18's
    numa_utils.init_threads_binding asserts it in the workers; here it is refused up front)."""
    from draftflow.engines.capture import CaptureError
    from draftflow.engines.sglang_capture import check_cpu_tensor_parallel

    check_cpu_tensor_parallel(1, 1, None)
    check_cpu_tensor_parallel(2, 2, None)
    check_cpu_tensor_parallel(4, 2, "0-15|16-31|32-47|48-63")
    with pytest.raises(CaptureError, match="this host has 1 NUMA node.*at most that"):
        check_cpu_tensor_parallel(2, 1, None)
    with pytest.raises(CaptureError, match="names the CPUs of 2 tensor-parallel rank.*tensor_parallel is 1"):
        check_cpu_tensor_parallel(1, 2, "0-15|16-31")
