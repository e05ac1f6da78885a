"""Writing a native view (`native.HFNativeView`, or a pruned one) back in the source's spelling.

Every canonical MoE name goes back to the Hugging Face key it was read from
(`HFNativeSource.spelling`): a per-expert key with the (renumbered) expert id, or, for fused
tensors, one key whose rows are the kept experts in order, written piece by piece (the bytes of a
tensor stacked on axis 0 are its rows' bytes back to back, so no stacked copy is made). Every
other tensor keeps its key. config.json is the source's with the expert count, top-k and routing
groups of the view in every spelling it has (`proxy_config`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.hf.descriptor import FUSED, MoEFamily
from mcore_proxy.checkpoint.hf.native import HFNativeSource

if TYPE_CHECKING:
    import torch

_EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<leaf>.+)$")


@dataclass(frozen=True)
class NativeOut:
    """One output tensor: HF `key`, made of the canonical `sources` (several: rows of a fused tensor)."""

    key: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        import torch

        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def native_source(view) -> HFNativeSource | None:
    info = view.info.format_info
    return info if isinstance(info, HFNativeSource) else None


def native_outputs(view) -> list[NativeOut]:
    """Every output tensor of a native view, in the view's order (a fused tensor where its first
    row stands)."""
    spelling = native_source(view).spelling
    outs: list[NativeOut] = []
    fused: dict[str, list[str]] = {}
    for name in view.names():
        m = _EXPERT_NAME.match(name)
        if m:
            template = f"{m.group('prefix')}.{{e}}.{m.group('leaf')}"
            hf, kind = spelling[template]
            if kind == FUSED:
                if hf not in fused:
                    fused[hf] = []
                    outs.append(NativeOut(hf, (), (), view.dtype(name)))  # completed below
                fused[hf].append(name)
                continue
            outs.append(NativeOut(hf.replace("{e}", m.group("e")), (name,), tuple(view.shape(name)), view.dtype(name)))
            continue
        key = spelling.get(name, (name, None))[0]
        outs.append(NativeOut(key, (name,), tuple(view.shape(name)), view.dtype(name)))
    for i, out in enumerate(outs):
        if not out.sources:
            rows = fused[out.key]
            outs[i] = NativeOut(out.key, tuple(rows), (len(rows), *view.shape(rows[0])), out.dtype)
    return outs


def _set_every(config: dict, keys: tuple[str, ...], value) -> None:
    """Set every spelling of a setting present at the top level or in `text_config`; the first
    spelling at the top level when none is."""
    places = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    found = False
    for place in places:
        for key in keys:
            if key in place:
                place[key] = value
                found = True
    if not found:
        (places[-1] if len(places) > 1 else config)[keys[0]] = value


def proxy_config(source: dict, spec, family: MoEFamily) -> dict:
    """The source's config.json for a view of `spec`: expert count, top-k and routing groups in
    every spelling present; everything else as it was."""
    import copy

    config = copy.deepcopy(source)
    keys = family.config
    _set_every(config, keys.experts, spec.num_experts)
    _set_every(config, keys.topk, spec.topk)
    if keys.groups:
        _set_every(config, keys.groups[:1], spec.num_groups or 1)
        _set_every(config, keys.groups[1:], spec.group_topk or 1)
    config.pop("auto_map", None)  # the model is built into transformers; no remote code
    return config
