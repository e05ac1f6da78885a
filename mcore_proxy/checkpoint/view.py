"""The canonical ModelView: full, un-sharded tensors under megatron-core names, read lazily.

Canonical names use global layer numbers and one key per routed expert
(`decoder.layers.{L}.mlp.experts.{e}.linear_fc1.weight` [2F, H], gate rows then up rows).
Readers yield this; writers consume it; nothing else knows about shards.
"""
from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from typing import Iterator

import torch

from mcore_proxy.spec import ModelSpec, expert_bias_name, router_weight_name

_LAYER_RE = re.compile(r"^(decoder\.layers\.(\d+)|mtp\.layers\.(\d+))\.")


def group_of(name: str) -> str:
    """Streaming unit of a canonical name: a layer id (`"3"`, `"mtp.0"`) or `"other"`."""
    m = _LAYER_RE.match(name)
    if not m:
        return "other"
    return m.group(2) if m.group(2) is not None else f"mtp.{m.group(3)}"


class ModelView(ABC):
    """A checkpoint seen as canonical tensors. `get` reads only the bytes of that tensor."""

    spec: ModelSpec
    args: object | None = None          # the source `args` namespace, if any
    iteration: int | str | None = None
    layer_spec: str = "local"           # megatron-core layer spec of the tensors (checkpoint/layer_spec.py)

    @abstractmethod
    def names(self) -> list[str]:
        """Every canonical tensor name, in a stable order."""

    @abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """The full un-sharded tensor `name`."""

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.get(name).dtype

    def groups(self) -> dict[str, list[str]]:
        """Names per streaming unit (one layer, or `"other"` for embeddings and final norms)."""
        out: dict[str, list[str]] = {}
        for name in self.names():
            out.setdefault(group_of(name), []).append(name)
        return out

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.get(name)


class DictModelView(ModelView):
    """A ModelView over an in-memory dict (tests, small models, pruned results)."""

    def __init__(self, tensors: dict[str, torch.Tensor], spec: ModelSpec, args=None, iteration=None):
        self._tensors = dict(tensors)
        self.spec, self.args, self.iteration = spec, args, iteration

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def router_fingerprint(view: ModelView) -> str:
    """sha256 over every MoE layer's router weight (and expert bias): identifies the source.

    Hashes raw bytes in layer order, so any change of a router row or of the expert order shows.
    """
    h = hashlib.sha256()
    names = set(view.names())
    for layer_id in view.spec.moe_layer_ids:
        for name in (router_weight_name(layer_id), expert_bias_name(layer_id)):
            if name in names:
                t = view.get(name).detach().contiguous().cpu()
                h.update(name.encode())
                h.update(str(t.dtype).encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tensor_nbytes(view: ModelView, name: str) -> int:
    """Bytes of one canonical tensor from its shape and dtype (0 for non-tensor entries)."""
    shape, dtype = view.shape(name), view.dtype(name)
    if shape is None or dtype is None:
        return 0
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
