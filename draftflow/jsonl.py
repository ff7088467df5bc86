"""Reading and writing record files: JSONL, optionally zstd-compressed (`.zst`).

Every writer goes through `atomic_path`: write to a temporary name in the same
folder, fsync, then rename, so a killed job never leaves a half-written file
under the final name.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import zstandard


def file_mode(executable: bool = False) -> int:
    """The mode `open()` gives a new file: 0666 (0777 if executable) less the umask.
    safetensors writes its files 0600, private to one user: wrong for a model others serve."""
    try:  # Linux: read it without changing it (os.umask is process-wide, racy with threads)
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


@contextlib.contextmanager
def atomic_path(path: str | Path, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync it (chmod it to `mode` if
    given) and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if mode is not None:
            tmp.chmod(mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def fsync_dir(folder: str | Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_text(path: Path, mode: str, compressed: bool):
    if compressed:
        if "r" in mode:
            raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        else:
            raw = zstandard.ZstdCompressor(level=3).stream_writer(open(path, "wb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Yield the records of a JSONL(.zst) file; a bad line raises naming file and line."""
    path = Path(path)
    with _open_text(path, "r", compressed=path.suffix == ".zst") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {e.msg}") from None


def write_jsonl(path: str | Path, records: Iterable[dict]) -> int:
    """Atomically write records to a JSONL(.zst) file; returns the count."""
    path = Path(path)
    count = 0
    with atomic_path(path) as tmp:
        with _open_text(tmp, "w", compressed=path.suffix == ".zst") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
                count += 1
    return count


def write_json(path: str | Path, obj: Any) -> None:
    """Atomically write pretty JSON (sorted keys, so reruns are byte-identical)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
            f.write("\n")


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
