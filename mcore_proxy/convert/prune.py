"""The proxy as a lazy ModelView: a source ModelView seen through a selection plan.

Kept experts are renumbered in plan order (new expert j is original `kept[j]`), router rows
(`weight` [E, H]: axis 0) and bias entries (`bias`, `expert_bias` [E] or [1, E]: the last axis)
are taken in the same order, a hash-routed layer's table [V, k] of expert ids is rewritten to the
new ids, a dropped expert's slots to its substitutes by the plan's rule (`select.plan.substitute_rows`), and every
other tensor is the source's, bit for bit. Dropped experts are never read, unless `merge` (convert
--merge-clusters, opt-in, changes weights): then each kept expert's tensors are the
frequency-weighted mean of its cluster's members' same-named tensors (MERGE_RULE). The hash table is
`mlp.router.hash_table` in a Hugging Face view (checkpoint/hf/native.py) and `mlp.router.tid2eid`
under Megatron-LM's names (HF -> Megatron, and Megatron checkpoints): one rule for both.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.names import group_of, split_expert_name
from mcore_proxy.checkpoint.view import ModelView
from mcore_proxy.core.errors import PlanError, ProxyError
from mcore_proxy.core.tensors import HostTensor
from mcore_proxy.select.plan import substitute_rows

if TYPE_CHECKING:
    import torch

_ROUTER_ROWS = re.compile(r"^(.*)\.mlp\.router\.(weight|bias|expert_bias)$")
_HASH_TABLE = re.compile(r"^(.*)\.mlp\.router\.(hash_table|tid2eid)$")


def _layer_id_of_prefix(module_prefix: str) -> str:
    """`decoder.layers.3.mlp.experts` -> "3"; `mtp.layers.0.transformer_layer.mlp.experts` -> "mtp.0"."""
    return group_of(module_prefix + ".")


MERGE_RULE = (
    "each kept expert's tensors become the mean of its cluster's members' same-named tensors, member m "
    "weighted by its share of the cluster's routed selections in the statistics (the plan's cluster "
    "frequencies), summed in float32 in member order and cast to the tensor's dtype; a cluster of one "
    "expert, a cluster no token selected and a layer selected without statistics keep the "
    "representative bit for bit; the router's rows and bias entries, and every tensor outside the experts, "
    "are the pruned proxy's"
)


class PrunedView(ModelView):
    """`source` with K of E experts per MoE layer, as `plan` says. Same names otherwise. With `merge`,
    each kept expert is its cluster's frequency-weighted mean (MERGE_RULE)."""

    def __init__(self, source: ModelView, plan, merge: bool = False):
        plan.check_matches(source)
        self.source, self.plan = source, plan
        self._merged: dict[str, list[tuple[str, float]]] = {}  # proxy name -> (source name, weight) of members
        self._weights = merge_weights(plan) if merge else {}
        super().__init__(
            dataclasses.replace(
                source.info,
                spec=dataclasses.replace(
                    source.spec,
                    num_experts=plan.num_experts,
                    topk=plan.router.topk,
                    num_groups=plan.router.num_groups,
                    group_topk=plan.router.group_topk,
                ),
            )
        )
        self._kept = {lid: plan.kept(lid) for lid in source.spec.moe_layer_ids}
        self._origin: dict[str, str] = {}  # proxy name -> source name, in the source's order
        self._rows: dict[str, list[int]] = {}  # router tensors -> rows (entries) to take
        self._tables: dict[str, str] = {}  # hash tables -> their layer id
        for name in source.names():
            self._map(name)

    def _map(self, name: str) -> None:
        if _ROUTER_ROWS.match(name) and group_of(name) in self._kept:
            self._origin[name] = name
            self._rows[name] = self._kept[group_of(name)]
            return
        if _HASH_TABLE.match(name) and group_of(name) in self._kept:
            self._origin[name] = name
            self._tables[name] = group_of(name)
            return
        parts = split_expert_name(name)
        if parts is None:
            self._origin[name] = name
            return
        prefix, e, rest = parts
        kept = self._kept[_layer_id_of_prefix(prefix)]
        if e in kept:
            proxy_name = f"{prefix}.{kept.index(e)}.{rest}"
            self._origin[proxy_name] = name
            weights = self._weights.get((_layer_id_of_prefix(prefix), e))
            if weights is not None:
                self._merged[proxy_name] = [(f"{prefix}.{m}.{rest}", w) for m, w in weights]

    def source_name(self, name: str) -> str:
        """The source tensor a proxy tensor comes from (the same name unless an expert)."""
        return self._origin[name]

    def names(self) -> list[str]:
        """In the source's order, each kept expert where it stood (experts renumbered in order)."""
        return list(self._origin)

    def get(self, name: str):
        members = self._merged.get(name)
        if members is not None:
            return self._merge(name, members)
        value = self.source.get(self._origin[name])
        rows = self._rows.get(name)
        if rows is not None:
            return value[rows].clone() if name.endswith(".weight") else value[..., rows].clone()
        layer_id = self._tables.get(name)
        if layer_id is not None:
            where = f"{self.source.info.path}: {name}"  # names the checkpoint
            value = value.torch() if isinstance(value, HostTensor) else value  # ids are computed on
            rows = substitute_rows(value, self.plan, layer_id, self.source.spec.num_experts, where)
            return new_ids(self.plan.kept(layer_id), self.source.spec.num_experts)[rows.long()].to(value.dtype)
        return value

    def _merge(self, name: str, members: list[tuple[str, float]]):
        import torch

        rep = self.source.get(self._origin[name])
        rep = rep.torch() if isinstance(rep, HostTensor) else rep
        if not rep.is_floating_point():
            raise ProxyError(
                f"{self.source.info.path}: {self._origin[name]} is {rep.dtype}, not a floating-point weight; "
                "--merge-clusters averages weights, so convert a quantized checkpoint with --dequantize"
            )
        total = torch.zeros(rep.shape, dtype=torch.float32)
        for source_name, weight in members:
            value = rep if source_name == self._origin[name] else self.source.get(source_name)
            value = value.torch() if isinstance(value, HostTensor) else value
            total += weight * value.float()
        return total.to(rep.dtype)

    def sources(self, name: str) -> list[str]:
        """The source tensors a proxy tensor is computed from: its cluster's members when merged."""
        return [m for m, _ in self._merged.get(name, ())] or [self._origin[name]]

    @property
    def merged(self) -> bool:
        """Whether any tensor of this view is a merge of several experts (not bit for bit)."""
        return bool(self._merged)

    def shape(self, name: str):
        shape = self.source.shape(self._origin[name])
        if name in self._rows and shape is not None:
            shape = tuple(shape)
            return (
                (len(self._rows[name]),) + shape[1:]
                if name.endswith(".weight")
                else shape[:-1] + (len(self._rows[name]),)
            )
        return shape

    def dtype(self, name: str):
        return self.source.dtype(self._origin[name])

    def dtype_name(self, name: str):
        return self.source.dtype_name(self._origin[name])

    def prefetch(self, names: list[str]) -> None:
        self.source.prefetch([s for n in names for s in self.sources(n)])


def merge_weights(plan) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """(layer id, kept expert) -> [(member, weight)] of every cluster MERGE_RULE merges. PlanError when
    the plan has no cluster frequencies at all (a ranking method, or a plan older than them)."""
    out = {}
    for layer_id in plan.layer_ids:
        for c in plan.layers[layer_id].clusters:
            weights = c.merge_weights()
            if weights is not None:
                out[(layer_id, c.representative)] = list(zip(c.members, weights))
    observed = [lid for lid in plan.layer_ids if lid not in plan.unobserved]
    if not any(c.frequencies is not None for lid in observed for c in plan.layers[lid].clusters):
        raise PlanError(
            f"--merge-clusters needs the plan's clusters and their members' frequencies, but this plan "
            f"(method {plan.method!r}) has none; make it with a clustering method (--method multiview, the "
            "default) and this version of select"
        )
    return out


def new_ids(kept: list[int], num_experts: int) -> torch.Tensor:
    """[E] int64: each kept expert's id in the proxy (-1 for dropped ones)."""
    import torch

    out = torch.full((num_experts,), -1, dtype=torch.int64)
    out[list(kept)] = torch.arange(len(kept))
    return out
