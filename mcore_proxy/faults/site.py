"""`Site`: one module of a model an injector attaches to (the kinds: `faults/sites.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Site:
    kind: str
    module: torch.nn.Module
    layer: Callable[[], str | None] = lambda: None
    engine: str = "trainer"  # "rollout": a module of a model a rollout engine (vLLM) built

    def __repr__(self) -> str:
        return f"Site({self.kind}, {type(self.module).__name__})"
