"""The selection plan: the contract between select and convert (DESIGN.md 4.2).

`plan.json` says, per MoE layer, which original experts the proxy keeps (`kept`, sorted: new
expert j is original `kept[j]`), how they were chosen, and what the proxy's router must be set
to. Everything needed to reproduce the selection is recorded under `method` and `params`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mcore_proxy.core.jsonfile import read_json_object
from mcore_proxy.core.errors import PlanError
from mcore_proxy.core.stats import layer_sort_key

if TYPE_CHECKING:  # torch only where a hash table is rewritten
    import torch

FORMAT = "mcore-proxy-plan/1"


def _ids(values, what: str) -> tuple[int, ...]:
    """Expert ids as a tuple of plain ints (JSON and numpy integers both accepted)."""
    out = []
    for v in values:
        if isinstance(v, bool) or int(v) != v or int(v) < 0:
            raise PlanError(f"{what} holds {v!r}, expected non-negative integer expert ids")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class Cluster:
    """One K-Medoids cluster of original expert ids and the one expert kept for it.

    frequencies: each member's routed selections in the statistics (`LayerStats.freq`), in member
    order: the weights of `convert --merge-clusters`; None where the layer had no statistics (and in
    plans older than the field)."""

    members: tuple[int, ...]
    representative: int
    frequencies: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "members", _ids(self.members, "cluster members"))
        object.__setattr__(self, "representative", int(self.representative))
        if self.representative not in self.members:
            raise PlanError(
                f"cluster representative {self.representative} is not among its members {list(self.members)}"
            )
        if self.frequencies is not None:
            freq = _ids(self.frequencies, "cluster frequencies")
            if len(freq) != len(self.members):
                raise PlanError(f"cluster of {list(self.members)} has {len(freq)} frequencies, expected one per member")
            object.__setattr__(self, "frequencies", freq)

    def merge_weights(self) -> tuple[float, ...] | None:
        """Each member's share of the cluster's routed selections (summing to 1), or None when there is
        nothing to weigh: no frequencies, a single member, or no member ever selected."""
        if self.frequencies is None or len(self.members) == 1 or sum(self.frequencies) == 0:
            return None
        total = sum(self.frequencies)
        return tuple(f / total for f in self.frequencies)

    def to_json(self) -> dict:
        out = {"members": list(self.members), "representative": self.representative}
        return out if self.frequencies is None else {**out, "frequencies": list(self.frequencies)}


@dataclass(frozen=True)
class LayerPlan:
    """Selection for one MoE layer.

    kept: sorted original expert ids (new expert j is `kept[j]`); clusters: empty for ranking
    baselines (frequency, random, ...); token_coverage / gate_mass_coverage: share in [0, 1] of
    the layer's routed selections (freq) and of its gate mass that the kept experts received;
    never_selected: experts with freq 0 in the statistics (no co-activation or prototype signal);
    dead_kept: the never-selected experts that are kept anyway (only when fewer than K were
    selected), with `dead_note` saying why (plans older than this field read as none);
    substitutes: for a hash-routed layer (DeepSeek-V4), dropped expert -> every kept expert in the
    order its tokens' slots take them (`selector.hash_substitutes`; `substitute_rows`
    applies the rule); empty for other layers. A single kept expert (an older plan) reads as that
    expert, then the other kept ones by id.
    """

    kept: tuple[int, ...]
    clusters: tuple[Cluster, ...] = ()
    token_coverage: float = 0.0
    gate_mass_coverage: float = 0.0
    never_selected: tuple[int, ...] = ()
    dead_kept: tuple[int, ...] = ()
    dead_note: str = ""
    substitutes: dict = field(default_factory=dict)

    def __post_init__(self):
        kept = _ids(self.kept, "kept")
        if list(kept) != sorted(set(kept)):
            raise PlanError(f"kept experts {list(kept)} must be sorted and distinct")
        object.__setattr__(self, "kept", kept)
        object.__setattr__(self, "never_selected", _ids(self.never_selected, "never_selected"))
        object.__setattr__(self, "dead_kept", _ids(self.dead_kept, "dead_kept"))
        if not set(self.dead_kept) <= set(kept) & set(self.never_selected):
            raise PlanError(f"dead_kept {list(self.dead_kept)} must be kept, never-selected experts")
        clusters = tuple(c if isinstance(c, Cluster) else Cluster(**c) for c in self.clusters)
        object.__setattr__(self, "clusters", clusters)
        if clusters:
            reps = sorted(c.representative for c in clusters)
            if reps != list(kept):
                raise PlanError(f"cluster representatives {reps} differ from kept {list(kept)}")
            members = [m for c in clusters for m in c.members]
            if len(members) != len(set(members)):
                raise PlanError("an expert appears in more than one cluster")
        subs = {}
        for e, ranked in dict(self.substitutes).items():
            ranked = _ids([ranked] if isinstance(ranked, int) else ranked, f"substitutes of expert {e}")
            if int(e) in kept or not set(ranked) <= set(kept) or len(set(ranked)) != len(ranked):
                raise PlanError(
                    f"substitutes {list(ranked)} for expert {e}: the expert must be dropped and its "
                    "substitutes distinct kept experts"
                )
            subs[int(e)] = ranked + tuple(k for k in kept if k not in ranked)
        object.__setattr__(self, "substitutes", subs)
        for name in ("token_coverage", "gate_mass_coverage"):
            value = float(getattr(self, name))
            if not 0.0 <= value <= 1.0 + 1e-9:
                raise PlanError(f"{name} {value} is not a share in [0, 1]")
            object.__setattr__(self, name, value)

    def to_json(self) -> dict:
        return {
            "kept": list(self.kept),
            "clusters": [c.to_json() for c in self.clusters],
            "coverage": {"tokens": self.token_coverage, "gate_mass": self.gate_mass_coverage},
            "never_selected": list(self.never_selected),
            "dead_kept": {"count": len(self.dead_kept), "experts": list(self.dead_kept), "why": self.dead_note},
            **(
                {"substitutes": {str(e): list(r) for e, r in sorted(self.substitutes.items())}}
                if self.substitutes
                else {}
            ),
        }

    @classmethod
    def from_json(cls, d: dict) -> "LayerPlan":
        cov = d.get("coverage", {})
        return cls(
            kept=d["kept"],
            clusters=tuple(Cluster(**c) for c in d.get("clusters", [])),
            token_coverage=cov.get("tokens", 0.0),
            gate_mass_coverage=cov.get("gate_mass", 0.0),
            never_selected=d.get("never_selected", []),
            dead_kept=d.get("dead_kept", {}).get("experts", []),
            dead_note=d.get("dead_kept", {}).get("why", ""),
            substitutes={int(e): r for e, r in d.get("substitutes", {}).items()},
        )


@dataclass(frozen=True)
class SourceInfo:
    """Identity of the checkpoint the plan was made for.

    router_fingerprint: sha256 of every router weight and expert bias
    (`mcore_proxy.checkpoint.router_fingerprint`), or None when selection ran on bare arrays.
    """

    num_experts: int
    topk: int
    num_groups: int | None = None
    group_topk: int | None = None
    iteration: int | str | None = None
    router_fingerprint: str | None = None

    def to_json(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "topk": self.topk,
            "num_groups": self.num_groups,
            "group_topk": self.group_topk,
            "iteration": self.iteration,
            "router_fingerprint": self.router_fingerprint,
        }


@dataclass(frozen=True)
class RouterSettings:
    """Router flags the proxy must run with (Megatron `--moe-router-*`).

    num_groups / group_topk None: no group-limited routing (as in the source). A flattened
    grouped router records num_groups=1, group_topk=1 explicitly, because MindSpeed-LLM falls
    back to the EP size as group count when the flag is unset (DESIGN.md 7).
    """

    topk: int
    num_groups: int | None = None
    group_topk: int | None = None
    score_function: str = "softmax"

    def to_json(self) -> dict:
        return {
            "topk": self.topk,
            "num_groups": self.num_groups,
            "group_topk": self.group_topk,
            "score_function": self.score_function,
        }


@dataclass(frozen=True, repr=False)
class SelectionPlan:
    """K experts per MoE layer, with provenance. Derive variants with `dataclasses.replace`.

    layers: layer id (`"12"`, `"mtp.0"`) -> LayerPlan; every layer keeps exactly K experts
    because Megatron requires the same expert count in every MoE layer.
    """

    source: SourceInfo
    num_experts: int  # K, experts kept per layer
    expert_parallel_size: int
    method: str
    params: dict
    router: RouterSettings
    layers: dict[str, LayerPlan] = field(default_factory=dict)

    def __post_init__(self):
        k, e = self.num_experts, self.source.num_experts
        if not 0 < k < e:
            raise PlanError(f"K={k} experts to keep must be in 1..{e - 1} (the source has {e})")
        if self.expert_parallel_size < 1 or k % self.expert_parallel_size:
            raise PlanError(f"K={k} is not divisible by the expert-parallel degree {self.expert_parallel_size}")
        if self.router.topk > k:
            raise PlanError(f"router top-k {self.router.topk} exceeds K={k}")
        if not self.layers:
            raise PlanError("the plan holds no MoE layer")
        for layer_id, lp in self.layers.items():
            try:
                layer_sort_key(layer_id)
            except ValueError:
                raise PlanError(f"layer id {layer_id!r} is neither 'L' nor 'mtp.K'") from None
            if len(lp.kept) != k:
                raise PlanError(f"layer {layer_id} keeps {len(lp.kept)} experts, expected K={k}")
            if lp.kept[-1] >= e:
                raise PlanError(f"layer {layer_id} keeps expert {lp.kept[-1]} but the source has {e}")

    @property
    def layer_ids(self) -> list[str]:
        return sorted(self.layers, key=layer_sort_key)

    def kept(self, layer_id: str) -> list[int]:
        """Sorted original expert ids kept in `layer_id`; new expert j is `kept[j]`."""
        try:
            return list(self.layers[str(layer_id)].kept)
        except KeyError:
            raise PlanError(f"the plan has no MoE layer {layer_id!r}; it has {self.layer_ids}") from None

    @property
    def unobserved(self) -> dict[str, str]:
        """Layers selected without statistics -> why (`selector.select_unobserved`)."""
        return dict(self.params.get("unobserved_layers", {}).get("layers", {}))

    def mean_coverage(self) -> tuple[float, float]:
        """(token share, gate-mass share) averaged over the layers with statistics."""
        observed = [lp for lid, lp in self.layers.items() if lid not in self.unobserved] or list(self.layers.values())
        n = len(observed)
        return (sum(lp.token_coverage for lp in observed) / n, sum(lp.gate_mass_coverage for lp in observed) / n)

    def check_matches(self, view) -> None:
        """PlanError unless the plan was made for the checkpoint behind `view` (a ModelView):
        same expert count, the same top-k and router tensors (when recorded), the same MoE layers."""
        from mcore_proxy.checkpoint.view import router_fingerprint

        spec = view.spec
        if spec.num_experts != self.source.num_experts:
            raise PlanError(
                f"the plan is for {self.source.num_experts} experts per layer but the "
                f"checkpoint has {spec.num_experts}; select again for this checkpoint"
            )
        # a plan made from a checkpoint records its top-k; another one would silently become the plan's
        if self.source.router_fingerprint is not None and spec.topk != self.source.topk:
            raise PlanError(
                f"the plan is for a router choosing the top {self.source.topk} experts but the "
                f"checkpoint's chooses the top {spec.topk}; select again for this checkpoint"
            )
        missing = [lid for lid in spec.moe_layer_ids if lid not in self.layers]
        extra = [lid for lid in self.layer_ids if lid not in spec.moe_layer_ids]
        if missing or extra:
            raise PlanError(
                f"the plan's layers do not match the checkpoint's MoE layers (missing "
                f"{missing}, not MoE {extra}); select again for this checkpoint"
            )
        fp = self.source.router_fingerprint
        if fp is not None and fp != router_fingerprint(view):
            raise PlanError(
                "the checkpoint's router weights differ from those the plan was made "
                "for (router_fingerprint); select again for this checkpoint"
            )

    def to_json(self) -> dict:
        from mcore_proxy import __version__

        return {
            "format": FORMAT,
            "created_by": f"mcore-proxy {__version__}",
            "source": self.source.to_json(),
            "target": {"num_experts": self.num_experts, "expert_parallel_size": self.expert_parallel_size},
            "method": self.method,
            "params": self.params,
            "router": self.router.to_json(),
            "layers": {lid: self.layers[lid].to_json() for lid in self.layer_ids},
        }

    @classmethod
    def from_json(cls, d: dict) -> "SelectionPlan":
        if d.get("format") != FORMAT:
            raise PlanError(f"format is {d.get('format')!r}, expected {FORMAT!r}")
        return cls(
            source=SourceInfo(**d["source"]),
            num_experts=int(d["target"]["num_experts"]),
            expert_parallel_size=int(d["target"]["expert_parallel_size"]),
            method=str(d["method"]),
            params=dict(d["params"]),
            router=RouterSettings(**d["router"]),
            layers={str(k): _layer_from_json(k, v) for k, v in d["layers"].items()},
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically (temp file in the same folder, then rename); overwrites."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    def __repr__(self) -> str:
        return (
            f"SelectionPlan(method={self.method!r}, E={self.source.num_experts}, "
            f"K={self.num_experts}, layers={len(self.layers)})"
        )


def _layer_from_json(layer_id: str, d: dict) -> LayerPlan:
    try:
        return LayerPlan.from_json(d)
    except PlanError as err:
        raise PlanError(f"layer {layer_id}: {err}") from None


def load_plan(path: str | os.PathLike) -> SelectionPlan:
    """Read `plan.json`; PlanError names the file on any defect."""
    path = Path(path)
    data = read_json_object(
        path,
        "plan file",
        "regenerate it with `mcore-proxy select`",
        PlanError,
        missing_fix=f"write one with `mcore-proxy select ... -o {path}`",
    )
    try:
        return SelectionPlan.from_json(data)
    except PlanError as err:
        raise PlanError(f"{path}: {err}; regenerate it with `mcore-proxy select`") from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        detail = f"missing key {err}" if isinstance(err, KeyError) else str(err)
        raise PlanError(
            f"{path}: not a valid {FORMAT} plan ({detail}); regenerate it with `mcore-proxy select`"
        ) from None


def substitute_rows(
    table: torch.Tensor, plan: SelectionPlan, layer_id: str, num_experts: int, where: str
) -> torch.Tensor:
    """A hash-routed layer's table [V, k] of original expert ids with every slot that names a dropped
    expert given the first of its ranked substitutes (`LayerPlan.substitutes`) that the row does not
    already name, slots in order: a row of k distinct experts keeps k distinct kept experts. Still
    original ids, in the table's dtype; the proxy's table and the reference of a restricted original
    both come from here."""
    import torch

    from mcore_proxy.core.errors import CheckpointError, PlanError

    ids = table.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise CheckpointError(
            f"{where}: holds expert ids {int(ids.min())}..{int(ids.max())}, but the layer has "
            f"{num_experts} experts; the checkpoint is damaged, copy it again"
        )
    kept, subs = plan.kept(layer_id), plan.layers[layer_id].substitutes
    is_kept = torch.zeros(num_experts, dtype=torch.bool)
    is_kept[list(kept)] = True
    missing = sorted(set(ids[~is_kept[ids]].unique().tolist()) - set(subs))
    if missing:
        raise PlanError(
            f"layer {layer_id} routes tokens by a hash table, and the plan names no substitute for "
            f"dropped expert {missing[0]}; make the plan again with this version of select"
        )
    ranking = torch.zeros((num_experts, len(kept)), dtype=torch.int64)
    for e, ranked in subs.items():
        ranking[e] = torch.tensor(ranked)
    used = torch.zeros((ids.shape[0], num_experts), dtype=torch.bool)
    used.scatter_(1, ids, is_kept[ids])
    out = ids.clone()
    for slot in range(ids.shape[1]):
        rows = (~is_kept[ids[:, slot]]).nonzero().squeeze(1)
        if rows.numel():
            candidates = ranking[ids[rows, slot]]  # [n, K], preferred first
            free = ~used[rows.unsqueeze(1), candidates]
            pick = candidates[torch.arange(rows.numel()), free.int().argmax(1)]  # the first free one
            out[rows, slot] = pick
            used[rows, pick] = True
    return out.to(table.dtype)
