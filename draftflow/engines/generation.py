"""The generation-engine interface: chat requests in, assistant responses out.

`regenerate` talks to every engine through `GenerationEngine`; engines live in their own
modules and are imported only when chosen, so the in-process HF engine does not pay for an
HTTP client and the OpenAI engine does not pay for torch.

To add an engine: write `draftflow/engines/<name>_generate.py` with
`create_engine(settings: dict, target_dir: Path) -> GenerationEngine` and list it in
`ENGINE_MODULES`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from draftflow.errors import DraftflowError

# settings["engine"] -> module with create_engine(settings, target_dir)
ENGINE_MODULES: dict[str, str] = {
    "hf": "draftflow.engines.hf_generate",  # the target in-process (transformers)
    "openai": "draftflow.engines.openai_generate",  # OpenAI-compatible servers (vLLM, SGLang, APIs)
}


@dataclass(frozen=True)
class GenerationRequest:
    """One assistant turn to generate from the conversation so far."""

    messages: list[dict]  # conversation-schema messages, ending before the turn to generate
    tools: list[dict] | None = None  # OpenAI tool schemas offered to the model
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0  # for sampling; engines that cannot seed per request document what they do


@dataclass(frozen=True)
class GenerationResult:
    content: str
    reasoning_content: str | None = None  # only when the engine was asked to keep it
    finish_reason: str = "stop"  # "stop" (end of turn) or "length" (hit max_new_tokens)


@runtime_checkable
class GenerationEngine(Protocol):
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One result per request, in request order."""
        ...

    def close(self) -> None:
        """Release models, connections, worker threads."""
        ...


def make_generation_engine(settings: dict, target_dir: Path) -> GenerationEngine:
    """The engine named by settings["engine"] (config `regenerate`), ready to generate."""
    name = settings.get("engine", "hf")
    module_name = ENGINE_MODULES.get(name)
    if module_name is None:
        raise DraftflowError(
            f"regenerate.engine: unknown engine '{name}'; choose one of {sorted(ENGINE_MODULES)}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # a missing dependency of the engine: show the real error
        raise DraftflowError(
            f"regenerate.engine: '{name}' is not available in this version of draftflow"
        ) from None
    return module.create_engine(settings, Path(target_dir))
