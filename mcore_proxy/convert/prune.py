"""The proxy as a lazy ModelView: a source ModelView seen through a selection plan.

Kept experts are renumbered in plan order (new expert j is original `kept[j]`), router rows and
`expert_bias` entries are taken in the same order, and every other tensor is the source's, bit
for bit. Dropped experts are never read.
"""
from __future__ import annotations

import dataclasses
import re

from mcore_proxy.checkpoint.names import split_expert_name
from mcore_proxy.checkpoint.view import ModelView, group_of

_ROUTER_ROWS = re.compile(r"^(.*)\.mlp\.router\.(weight|bias|expert_bias)$")


def _layer_id_of_prefix(module_prefix: str) -> str:
    """`decoder.layers.3.mlp.experts` -> "3"; `mtp.layers.0.transformer_layer.mlp.experts` -> "mtp.0"."""
    return group_of(module_prefix + ".")


class PrunedView(ModelView):
    """`source` with K of E experts per MoE layer, as `plan` says. Same names otherwise."""

    def __init__(self, source: ModelView, plan):
        plan.check_matches(source)
        self.source, self.plan = source, plan
        self.args, self.iteration = source.args, source.iteration
        self.spec = dataclasses.replace(
            source.spec, num_experts=plan.num_experts, topk=plan.router.topk,
            num_groups=plan.router.num_groups, group_topk=plan.router.group_topk)
        for attr in ("checkpoint_version", "linear_extra_state", "variants", "layer_spec", "layout", "format", "path",
                     "hf"):
            if hasattr(source, attr):
                setattr(self, attr, getattr(source, attr))
        self._kept = {lid: plan.kept(lid) for lid in source.spec.moe_layer_ids}
        self._origin: dict[str, str] = {}      # proxy name -> source name
        self._rows: dict[str, list[int]] = {}  # router tensors -> rows to take
        for name in source.names():
            self._map(name)

    def _map(self, name: str) -> None:
        if _ROUTER_ROWS.match(name) and group_of(name) in self._kept:
            self._origin[name] = name
            self._rows[name] = self._kept[group_of(name)]
            return
        parts = split_expert_name(name)
        if parts is None:
            self._origin[name] = name
            return
        prefix, e, rest = parts
        kept = self._kept[_layer_id_of_prefix(prefix)]
        if e in kept:
            self._origin[f"{prefix}.{kept.index(e)}.{rest}"] = name

    def source_name(self, name: str) -> str:
        """The source tensor a proxy tensor comes from (the same name unless an expert)."""
        return self._origin[name]

    def names(self) -> list[str]:
        from mcore_proxy.checkpoint.legacy import canonical_sort_key
        return sorted(self._origin, key=canonical_sort_key)

    def get(self, name: str):
        value = self.source.get(self._origin[name])
        rows = self._rows.get(name)
        return value[rows].clone() if rows is not None else value

    def shape(self, name: str):
        shape = self.source.shape(self._origin[name])
        if name in self._rows and shape is not None:
            return (len(self._rows[name]),) + tuple(shape[1:])
        return shape

    def dtype(self, name: str):
        return self.source.dtype(self._origin[name])
