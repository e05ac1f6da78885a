"""The canonical ModelView: full, un-sharded tensors under megatron-core names, read lazily.

Canonical names use global layer numbers and one key per routed expert
(`decoder.layers.{L}.mlp.experts.{e}.linear_fc1.weight` [2F, H], gate rows then up rows).
Readers yield this; writers consume it; nothing else knows about shards.

The contract is explicit: a ModelView is constructed with one `ViewInfo` record (what the view is
besides its tensors) and implements `names`, `shape`, `dtype` and `get`; a class that forgets one
of them cannot be instantiated (ABC), so it fails at construction, not by reading every byte
through a default. `shape` and `dtype` read no tensor data. `groups` (streaming units) and
`prefetch` (a hint: these tensors are read next) have defaults.
"""

from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from mcore_proxy.checkpoint.layout import ParallelLayout
from mcore_proxy.checkpoint.names import group_of
from mcore_proxy.core.dtypes import FLOAT8, dtype_name, nbytes
from mcore_proxy.mcore.spec import ModelSpec, expert_bias_name, router_weight_name

if TYPE_CHECKING:  # a view indexes names, shapes and dtype names without torch
    import torch


@dataclass(frozen=True)
class ViewInfo:
    """What a checkpoint view is besides its tensors; derived views `dataclasses.replace` it.

    spec: the model as Megatron builds it (a pruned view's has K experts);
    format: "legacy", "torch_dist", ... ("memory" for an in-memory view);
    path: the iteration folder read (None in memory); iteration: a step, "release" or None;
    args: the saving run's `args` namespace (never mutated: writers copy it);
    checkpoint_version: Megatron's format revision from the files (None: absent);
    layout: the saving run's parallel layout (None if unknown);
    variants: the NAME_VARIANTS spellings the source used (writers spell names the same way);
    linear_extra_state: the source's linears saved `_extra_state: None` (readers drop those
      entries; writers re-create them for the target's modules);
    format_info: the format's own record of the source, for a writer of the same format (for a
      Hugging Face folder its `HFSource`: config.json, tokenizer folder, FP8 block size); None
      for Megatron formats;
    layer_spec: the megatron-core layer spec that saved the tensors, "local" or
      "transformer_engine" (checkpoint/layer_spec.py); it picks spec-specific sharding rows;
    naming: the source's naming of multi-latent attention when it is not megatron-core's, a
      `mindspeed_llm.MindSpeedNaming` (None: megatron-core names); writers write it back.
    """

    spec: ModelSpec
    format: str
    path: Path | None = None
    iteration: int | str | None = None
    args: object | None = dataclasses.field(default=None, repr=False, compare=False)
    checkpoint_version: float | None = None
    layout: ParallelLayout | None = None
    variants: frozenset[str] = frozenset()
    linear_extra_state: bool = True
    format_info: object | None = dataclasses.field(default=None, compare=False)
    layer_spec: str = "local"
    naming: object | None = None


class ModelView(ABC):
    """A checkpoint seen as canonical tensors. `get` reads only the bytes of that tensor."""

    def __init__(self, info: ViewInfo):
        if not isinstance(info, ViewInfo):
            raise TypeError(f"{type(self).__name__} needs a ViewInfo, got {type(info).__name__}")
        self.info = info

    # the record's most used fields (the others: `view.info.<field>`)
    @property
    def spec(self) -> ModelSpec:
        return self.info.spec

    @property
    def args(self):
        return self.info.args

    @property
    def iteration(self) -> int | str | None:
        return self.info.iteration

    @property
    def layout(self) -> ParallelLayout | None:
        return self.info.layout

    @property
    def layer_spec(self) -> str:
        return self.info.layer_spec

    @abstractmethod
    def names(self) -> list[str]:
        """Every canonical tensor name, in a stable order (`names.canonical_sort_key`)."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of the full tensor `name` (None for a non-tensor entry); reads no tensor data."""

    @abstractmethod
    def dtype(self, name: str) -> torch.dtype | None:
        """dtype of `name` (None for a non-tensor entry); reads no tensor data."""

    def dtype_name(self, name: str) -> str | None:
        """torch's name of `name`'s dtype ('bfloat16'; None for a non-tensor entry): what sizes and
        `inspect` need, which readers that index without torch answer without importing it."""
        dtype = self.dtype(name)
        return None if dtype is None else dtype_name(dtype)

    @abstractmethod
    def get(self, name: str):
        """The full un-sharded tensor `name` (a fresh tensor, or the value of a non-tensor entry)."""

    def groups(self) -> dict[str, list[str]]:
        """Names per streaming unit (one layer, or `"other"` for embeddings and final norms)."""
        out: dict[str, list[str]] = {}
        for name in self.names():
            out.setdefault(group_of(name), []).append(name)
        return out

    def prefetch(self, names: list[str]) -> None:
        """Hint that `names` are read next (readers start reading their bytes); default: nothing."""

    def named_for(self, framework: str) -> "ModelView":
        """The view under the names a writer of `framework` ("megatron-core", "transformers")
        reads: itself, except for views that name tensors in their own format's terms (a
        Hugging Face view read as megatron-core names: `HFNativeView.named_for`)."""
        return self

    def embeddings_tied(self) -> bool:
        """Whether the output layer is the word embeddings: the args' say, else the tensors'
        (`names.embeddings_tied`)."""
        from mcore_proxy.checkpoint.names import OUTPUT_LAYER, embeddings_tied

        return embeddings_tied(self.args, OUTPUT_LAYER in self.names())

    def quantized_schemes(self) -> frozenset[str]:
        """The quantization schemes of the weights this view holds with their companions, read from
        the names alone (no tensor data): "fp8-block", "e8m0-scale", "mxfp4", "int4-packed"
        (`checkpoint/hf/quant.py`; FP8 block scales keep their companions under Megatron names)."""
        from mcore_proxy.checkpoint.hf.quant import find_quantized

        return frozenset(q.scheme for q in find_quantized(self.names()))

    def dequantized(self) -> "ModelView":
        """The same checkpoint with block-quantised (FP8) weights read as bf16 and no scale tensors
        (`convert --dequantize`); a view that holds none refuses."""
        from mcore_proxy.core.errors import ProxyError

        raise ProxyError(
            f"--dequantize: {self.info.path or 'the checkpoint'} holds no FP8 weights with block "
            "scales; leave the option out"
        )


class DictModelView(ModelView):
    """A ModelView over an in-memory dict (tests, small models, pruned results)."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], spec: ModelSpec, args=None, iteration=None, info: ViewInfo | None = None
    ):
        super().__init__(info or ViewInfo(spec=spec, format="memory", args=args, iteration=iteration))
        self._tensors = dict(tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str):
        import torch

        t = self._tensors[name]
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None

    def dtype(self, name: str):
        import torch

        t = self._tensors[name]
        return t.dtype if isinstance(t, torch.Tensor) else None

    def get(self, name: str):
        return self._tensors[name]


READ_AHEAD = 64 << 20  # bytes of the next tensors a stream asks the reader to fetch ahead


def stream(view: ModelView, names: list[str], ahead: int = READ_AHEAD) -> Iterator[tuple[str, object]]:
    """(name, value) for `names` in order, one tensor in memory at a time, while the reader is
    asked to fetch the next `ahead` bytes (`prefetch`): the disk reads the next tensors while
    this one is written. The page cache holds what is read ahead; the process's memory does not."""
    sizes = [tensor_nbytes(view, n) for n in names]
    issued, window = 0, 0
    for i, name in enumerate(names):
        batch = []
        while issued < len(names) and (issued <= i or window < ahead):
            batch.append(names[issued])
            window += sizes[issued]
            issued += 1
        if batch:
            view.prefetch(batch)
        yield name, view.get(name)
        window -= sizes[i]


def router_fingerprint(view: ModelView) -> str:
    """sha256 over every MoE layer's router weight (and expert bias): identifies the source.

    Hashes raw bytes in layer order, so any change of a router row or of the expert order shows.
    """
    from mcore_proxy.checkpoint.zipwrite import as_bytes

    h = hashlib.sha256()
    names = set(view.names())
    for layer_id in view.spec.moe_layer_ids:
        for name in (router_weight_name(layer_id), expert_bias_name(layer_id)):
            if name in names:
                t = view.get(name).detach().contiguous().cpu()  # a torch tensor or a HostTensor
                h.update(name.encode())
                h.update(f"torch.{dtype_name(t.dtype)}".encode())
                h.update(as_bytes(t) if t.numel() else b"")
    return h.hexdigest()


def holds_fp8(view: ModelView) -> bool:
    """Whether any tensor is stored as float8 (block-quantised weights); reads no tensor data."""
    return any(view.dtype_name(n) in FLOAT8 for n in view.names())


def tensor_nbytes(view: ModelView, name: str) -> int:
    """Bytes of one canonical tensor from its shape and dtype (0 for non-tensor entries)."""
    shape, dtype = view.shape(name), view.dtype_name(name)
    if shape is None or dtype is None:
        return 0
    return nbytes(shape, dtype)
