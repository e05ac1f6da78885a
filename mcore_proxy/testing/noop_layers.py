"""Legacy checkpoints with MindSpeed `--noop-layers`, DERIVED from a megatron-core-saved one (tests only).

Derived, not saved by MindSpeed: mindspeed cannot be installed here. MindSpeed's noop layer is a
`NoopTransformerLayer` without parameters that keeps its place in `decoder.layers`
(`pipeline_layout.py` point 3), so a MindSpeed save of the same weights with noop layers differs
from the megatron-core save only in (a) args: `num_layers` counts the noop layers and
`noop_layers` is the set of their 0-based global ids (MindSpeed's `post_validate_args` form), and
(b) keys: every real layer's `decoder.layers.{local}` index is its new global id minus its stage's
first global id, leaving gaps where noop layers sit. Noop ids are chosen so that every real layer
stays on the stage it was saved on (the stage split counts noop layers as layers): the tensors
are not moved between rank files, only renamed.

The rank files are read with `torch.load(weights_only=False)`: they are this package's own fixtures.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import torch

from mcore_proxy.checkpoint.layout import stage_layer_counts
from mcore_proxy.testing.dist_ckpt import iteration_dir

_FOLDER = re.compile(r"^mp_rank_\d{2}(?:_(\d{3}))?(?:_\d{3})?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def _stage_offsets(counts) -> list[int]:
    return [sum(counts[:p]) for p in range(len(counts))]


def _copy(source: Path, out: Path):
    """Copy checkpoint `source` to `out`: (its iteration folder, first rank folder, that file's args)."""
    shutil.copytree(source, out)
    out_it = out / iteration_dir(source).relative_to(source)
    first = next(p for p in sorted(out_it.iterdir()) if _FOLDER.match(p.name))
    return out_it, first, torch.load(first / "model_optim_rng.pt", map_location="cpu", weights_only=False)["args"]


def _rewrite(it_dir: Path, pp: int, edit_args, new_local) -> None:
    """Rewrite every rank file of `it_dir` in place: `edit_args(args)` on a copy of its args, and
    `decoder.layers.{local}` renamed to `new_local(pipeline stage, local)`."""
    for folder in sorted(it_dir.iterdir()):
        m = _FOLDER.match(folder.name)
        if not m:
            continue
        p = int(m.group(1)) if pp > 1 else 0  # the first suffix is EP's at PP 1
        f = folder / "model_optim_rng.pt"
        obj = torch.load(f, map_location="cpu", weights_only=False)
        obj["args"] = argparse.Namespace(**vars(obj["args"]))
        edit_args(obj["args"])
        renamed = {}
        for key, value in obj["model"].items():
            if lm := _LAYER.match(key):
                key = f"decoder.layers.{new_local(p, int(lm.group(1)))}.{lm.group(2)}"
            renamed[key] = value
        obj["model"] = renamed
        torch.save(obj, f)


def derive_noop_checkpoint(source: Path, out: Path, noop: set[int]) -> Path:
    """Copy legacy checkpoint `source` to `out` with noop layers at new global ids `noop`; returns
    `out`. Refuses (ValueError) noop ids that would move a real layer to another stage."""
    out_it, _, args = _copy(source, out)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None) or getattr(
        args, "pipeline_model_parallel_layout", None
    ):
        raise ValueError("derive_noop_checkpoint handles plain stage splits only")
    old_counts = stage_layer_counts(
        args.num_layers, pp, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    )
    total = args.num_layers + len(noop)
    new_counts = stage_layer_counts(total, pp)  # MindSpeed: even split, noop layers counted
    real = [g for g in range(total) if g not in noop]  # old global id i -> real[i]
    old_off, new_off = _stage_offsets(old_counts), _stage_offsets(new_counts)
    for p in range(pp):
        for i in range(old_off[p], old_off[p] + old_counts[p]):
            if not new_off[p] <= real[i] < new_off[p] + new_counts[p]:
                raise ValueError(f"noop layers {sorted(noop)} move layer {i} off pipeline stage {p}")

    def edit(args):
        args.num_layers, args.noop_layers = total, set(noop)
        args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
        if isinstance(args.moe_layer_freq, (list, tuple)):  # a per-layer pattern: noop layers dense
            pattern = iter(args.moe_layer_freq)
            args.moe_layer_freq = [0 if g in noop else next(pattern) for g in range(total)]

    _rewrite(out_it, pp, edit, lambda p, local: real[old_off[p] + local] - new_off[p])
    return out


def remove_noop_layers(source: Path, out: Path) -> tuple[Path, list[int]]:
    """The inverse of `derive_noop_checkpoint` for a legacy checkpoint with noop layers (VPP 1, a
    plain stage split): copy to `out` with the noop layers taken out of args and the real layers
    renumbered 0.. within each stage, so megatron-core (which has no noop layer) builds and loads
    it; each stage keeps its real layers. Returns (out, real layers per stage)."""
    from mcore_proxy.checkpoint.layout import layout_from_args
    from mcore_proxy.mcore.pipeline_layout import noop_layer_ids

    out_it, first, args = _copy(source, out)
    layout = layout_from_args(args, first)
    pp = layout.pp
    if layout.vpp != 1 or layout.pipeline_layout:
        raise ValueError("remove_noop_layers handles plain stage splits only")
    noop = noop_layer_ids(getattr(args, "noop_layers", None), args.num_layers)
    offsets = _stage_offsets(layout.stage_layers)
    real = [[g for g in range(o, o + n) if g not in noop] for o, n in zip(offsets, layout.stage_layers)]
    counts = [len(r) for r in real]

    def edit(args):
        args.num_layers, args.noop_layers = sum(counts), None
        args.decoder_first_pipeline_num_layers = counts[0] if len(set(counts)) > 1 else None
        if isinstance(args.moe_layer_freq, (list, tuple)):
            args.moe_layer_freq = [x for g, x in enumerate(args.moe_layer_freq) if g not in noop]

    _rewrite(out_it, pp, edit, lambda p, local: real[p].index(offsets[p] + local))
    return out, counts
