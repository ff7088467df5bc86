"""What a released SGLang accepts, read from its source (helpers_engine_source.py fetches it),
without importing SGLang: the command-line flags of `sglang.launch_server` (current and
deprecated), the fields of `ServerArgs` (the keyword arguments of `sglang.Engine`), and the
HTTP routes of its server (with those it marks deprecated).

Flags: since 0.5.14 `ServerArgs.add_cli_args` derives one flag per field annotated
`A[type, "help"]` or `A[type, Arg(...)]` (name `--field-name`, or Arg's `cli_name`, plus its
`aliases`; `Arg(no_cli=True)` has none), then registers a few flags by hand with
`parser.add_argument`; deprecated spellings use the actions named `Deprecated…`
(`DeprecatedStoreTrueAction`, …), which warn and map to the new flag.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers_engine_source import engine_source

SERVER_ARGS = "sglang/srt/server_args.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"


def _server_args_class(tree: ast.Module) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            return node
    raise AssertionError("no class ServerArgs")


def _field_flags(item: ast.AnnAssign) -> list[str]:
    """The flags of one `ServerArgs` field ([] when it has none on the command line)."""
    annotation = item.annotation
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple)):
        return []
    name, aliases, cli = "--" + item.target.id.replace("_", "-"), [], False
    for meta in annotation.slice.elts[1:]:
        if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
            cli = True
        elif isinstance(meta, ast.Call) and getattr(meta.func, "id", "") == "Arg":
            cli = True
            for kw in meta.keywords:
                if kw.arg == "no_cli" and getattr(kw.value, "value", False):
                    return []
                if kw.arg == "cli_name":
                    name = kw.value.value
                if kw.arg == "aliases":
                    aliases = [e.value for e in kw.value.elts]
    return [name, *aliases] if cli else []


def server_arg_fields(version: str) -> set[str]:
    """The `ServerArgs` dataclass fields of SGLang `version`: what `sglang.Engine(**kwargs)` takes."""
    tree = ast.parse((engine_source("sglang", version) / SERVER_ARGS).read_text(encoding="utf-8"))
    return {
        item.target.id
        for item in _server_args_class(tree).body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


def cli_flags(version: str) -> tuple[set[str], set[str]]:
    """(current flags, deprecated flags) of `python -m sglang.launch_server` in SGLang `version`."""
    tree = ast.parse((engine_source("sglang", version) / SERVER_ARGS).read_text(encoding="utf-8"))
    current: set[str] = set()
    for item in _server_args_class(tree).body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            current.update(_field_flags(item))
    deprecated: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        action = next((kw.value for kw in node.keywords if kw.arg == "action"), None)
        action_name = getattr(action, "id", "") or getattr(action, "attr", "")
        (deprecated if action_name.startswith("Deprecated") else current).update(names)
    return current - deprecated, deprecated


def unknown_or_deprecated(argv: list[str], version: str) -> list[str]:
    """The options of an `sglang.launch_server` command line that SGLang `version` does not know
    by that exact name (argparse would take an unambiguous prefix: we do not rely on it) or
    marks deprecated, each with the reason."""
    current, deprecated = cli_flags(version)
    problems = []
    for arg in argv:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        if flag in deprecated:
            problems.append(f"{flag}: deprecated in SGLang {version}")
        elif flag not in current:
            problems.append(f"{flag}: not a flag of SGLang {version}")
    return problems


def routes(version: str) -> dict[str, bool]:
    """GET routes of SGLang `version`'s HTTP server -> whether its handler says it is deprecated."""
    tree = ast.parse((engine_source("sglang", version) / HTTP_SERVER).read_text(encoding="utf-8"))
    out: dict[str, bool] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = (ast.get_docstring(node) or "").lower()
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") in ("get", "api_route") and deco.args:
                path = deco.args[0]
                if isinstance(path, ast.Constant):
                    out[path.value] = "deprecated" in doc
    return out


def source_path(version: str, member: str) -> Path:
    return engine_source("sglang", version) / member
