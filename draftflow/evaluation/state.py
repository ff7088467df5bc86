"""Resume state of `draftflow evaluate`: one JSON file per finished unit of work.

Snakemake deletes a rule's outputs before rerunning it, so finished prompt sets are kept
outside them (`results/state/evaluate/`), in a folder keyed by everything the numbers depend
on (engine, drafter and target identity, decoding settings). A unit file also records its
prompt set's content digest: an edited prompt file is measured again, an unchanged one is not.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from draftflow.jsonl import read_json, write_json


def folder_digest(path: Path) -> str:
    """sha256 over the names and contents of a folder's files (a drafter: a few files, <~2 GB)."""
    h = hashlib.sha256()
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        h.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:16]


def settings_key(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


class UnitState:
    """`folder/<set>.<server>.t<temperature>.json` per finished unit; None = nothing to resume."""

    def __init__(self, root: Path | None, key: str):
        self.folder = None if root is None else Path(root) / key

    def _path(self, set_name: str, server: str, temperature: float) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{set_name}.{server}.t{temperature:g}")
        return self.folder / f"{safe}.json"

    def load(self, prompt_set, server: str, temperature: float) -> dict | None:
        if self.folder is None:
            return None
        path = self._path(prompt_set.name, server, temperature)
        try:
            saved = read_json(path)
        except (OSError, ValueError):
            return None
        if saved.get("set_digest") != prompt_set.digest():
            return None
        return saved["result"]

    def save(self, prompt_set, server: str, temperature: float, result: dict) -> None:
        if self.folder is not None:
            write_json(self._path(prompt_set.name, server, temperature),
                       {"set_digest": prompt_set.digest(), "result": result})  # fmt: skip
