"""`CheckResult`: the outcome of one named precondition check.

Preflight (`draftflow.hidden_states.preflight`) runs checks and reports them; the server checks
(`draftflow.engines.servers`) return them too. Both import it from here, so that preflight may
depend on servers without servers depending on preflight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)
