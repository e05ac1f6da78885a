"""Convert: source checkpoint x plan -> pruned ModelView -> writer at the target layout.

Streaming: the legacy writer reads one canonical tensor at a time and writes its shards into
the output rank files as it goes; dropped experts are never read. Parallel: the output rank
files are split over `--workers` processes on one machine, or over the ranks of a `torchrun`
launch (each rank writes a disjoint set; rank 0 writes the tracker and manifest last).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.layout import ParallelLayout
from mcore_proxy.checkpoint.legacy import legacy_units, resolve_target, write_legacy_units, write_tracker
from mcore_proxy.checkpoint.output import staged_output
from mcore_proxy.checkpoint.view import ModelView, router_fingerprint, tensor_nbytes
from mcore_proxy.convert.manifest import plan_fingerprint, write_manifest
from mcore_proxy.convert.prune import PrunedView
from mcore_proxy.checkpoint.safe_globals import unsafe_args
from mcore_proxy.errors import ProxyError
from mcore_proxy.megatron_args import DEFAULTS
from mcore_proxy.memory import return_freed_buffers_to_os

FORMATS = ("legacy", "torch_dist")


@dataclass(frozen=True)
class ConvertRequest:
    """What the user asked for; None means "keep the source's" (EP: the plan's EP degree)."""

    ckpt: Path
    out: Path
    plan: Path | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    expert_layout: str | None = None
    stage_layers: tuple[int, ...] | None = None
    format: str = "legacy"
    workers: int = 1

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ProxyError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.workers < 1:
            raise ProxyError(f"--workers {self.workers} must be at least 1")


@dataclass
class ConvertResult:
    out: Path
    target: ParallelLayout
    num_experts: int
    source_experts: int
    bytes_read: int
    files: int
    seconds: float
    launch_flags: list[str] = field(default_factory=list)
    dropped_args: dict[str, str] = field(default_factory=dict)   # args field -> why it was not written


def open_views(ckpt: Path, plan_path: Path | None) -> tuple[ModelView, ModelView, object]:
    """(source view, view to write, plan or None). Plan problems are PlanErrors naming the file."""
    source = open_checkpoint(ckpt)
    if plan_path is None:
        return source, source, None
    from mcore_proxy.errors import PlanError
    from mcore_proxy.select.plan import load_plan

    plan = load_plan(plan_path)
    try:
        return source, PrunedView(source, plan), plan
    except PlanError as err:
        raise PlanError(f"{plan_path}: {err} (checkpoint {ckpt})") from None


def plan_target(req: ConvertRequest, source: ModelView, view: ModelView, plan) -> ParallelLayout:
    """Target layout: explicit options win; else the source's TP/PP/ETP and the plan's EP."""
    src = getattr(source, "layout", None)
    tp = req.tp or (src.tp if src else 1)
    pp = req.pp or (src.pp if src else 1)
    ep = req.ep or (plan.expert_parallel_size if plan else (src.ep if src else 1))
    etp = req.etp or (src.etp if src and src.etp in (1, src.tp) and not req.tp else None)
    stages = req.stage_layers or (src.stage_layers if src and src.pp == pp and src.vpp == 1 else None)
    return resolve_target(view, tp=tp, pp=pp, ep=ep, etp=etp,
                          expert_layout=req.expert_layout, stage_layers=stages)


def launch_flags(view: ModelView, target: ParallelLayout, plan) -> list[str]:
    """Megatron launch flags that must change to train or evaluate the proxy."""
    flags = [f"--tensor-model-parallel-size {target.tp}", f"--pipeline-model-parallel-size {target.pp}",
             f"--expert-model-parallel-size {target.ep}", f"--expert-tensor-parallel-size {target.etp}"]
    if plan is not None:
        r = plan.router
        flags = [f"--num-experts {plan.num_experts}", f"--moe-router-topk {r.topk}"] + flags
        if r.num_groups:
            flags += [f"--moe-router-num-groups {r.num_groups}", f"--moe-router-group-topk {r.group_topk}"]
    if target.uneven:
        from mcore_proxy.checkpoint.legacy import _first_last
        first, last = _first_last(target.stage_layers)
        flags += [f"--decoder-first-pipeline-num-layers {first}"] if first else []
        flags += [f"--decoder-last-pipeline-num-layers {last}"] if last else []
    flags.append("--moe-grouped-gemm" if target.expert_layout != "sequential" else "(no --moe-grouped-gemm)")
    # the proxy carries no optimizer or RNG state: load weights only
    flags += ["--no-load-optim", "--no-load-rng"]
    return flags


def _unit_worker(ckpt: str, plan: str | None, target: ParallelLayout, root: str, units) -> int:
    """One worker process: reopen the views (cheap: metadata only) and write its rank files."""
    return_freed_buffers_to_os()
    _, view, _ = open_views(Path(ckpt), Path(plan) if plan else None)
    write_legacy_units(view, Path(root), target, units)
    return sum(Path(p).stat().st_size for p in Path(root).rglob("*.pt"))


def _split(units: list, parts: int) -> list[list]:
    return [units[i::parts] for i in range(parts) if units[i::parts]]


def _write_parallel(req: ConvertRequest, target: ParallelLayout, root: Path, progress) -> None:
    chunks = _split(legacy_units(target), req.workers)
    ctx = mp.get_context("spawn")  # fork after torch/megatron imports is not safe
    with cf.ProcessPoolExecutor(max_workers=len(chunks), mp_context=ctx) as pool:
        futures = [pool.submit(_unit_worker, str(req.ckpt), str(req.plan) if req.plan else None,
                               target, str(root), chunk) for chunk in chunks]
        for fut in cf.as_completed(futures):
            fut.result()
            if progress is not None:
                progress.update(1)


def _manifest_info(req: ConvertRequest, source: ModelView, view: ModelView, target: ParallelLayout, plan) -> dict:
    from mcore_proxy import __version__

    return {
        "created_by": f"mcore-proxy {__version__}",
        "source": {"path": str(Path(req.ckpt).absolute()), "format": getattr(source, "format", "?"),
                   "iteration": source.iteration, "num_experts": source.spec.num_experts,
                   "router_fingerprint": router_fingerprint(source)},
        "plan": None if plan is None else {"path": str(Path(req.plan).absolute()),
                                           "sha256": plan_fingerprint(req.plan), "method": plan.method},
        "dropped_args": unsafe_args(source.args, needed=DEFAULTS),
        "target": {"format": req.format, "tp": target.tp, "pp": target.pp, "ep": target.ep,
                   "etp": target.etp, "expert_layout": target.expert_layout,
                   "stage_layers": list(target.stage_layers), "num_experts": view.spec.num_experts},
    }


def convert(req: ConvertRequest, progress: bool = True, dry_run: bool = False) -> ConvertResult:
    """Run one conversion; every check happens before the first byte is written."""
    from tqdm import tqdm

    return_freed_buffers_to_os()
    start = time.perf_counter()
    source, view, plan = open_views(req.ckpt, req.plan)
    target = plan_target(req, source, view, plan)
    read = sum(tensor_nbytes(view, n) for n in view.names())
    result = ConvertResult(req.out, target, view.spec.num_experts, source.spec.num_experts, read, 0, 0.0,
                           launch_flags(view, target, plan), unsafe_args(source.args, needed=DEFAULTS))
    if dry_run:
        return result
    if req.format == "torch_dist":
        from mcore_proxy.checkpoint.torch_dist import write_torch_dist_into

        def write_body(tmp: Path) -> None:
            with tqdm(total=read, unit="B", unit_scale=True, mininterval=2, desc="convert",
                      disable=not progress) as bar:
                write_torch_dist_into(view, tmp, target, bar)
    else:
        def write_body(tmp: Path) -> None:
            if req.workers > 1:
                with tqdm(total=len(legacy_units(target)), unit="file", desc="convert", disable=not progress) as bar:
                    _write_parallel(req, target, tmp, bar)
            else:
                with tqdm(total=read, unit="B", unit_scale=True, mininterval=2, desc="convert",
                          disable=not progress) as bar:
                    write_legacy_units(view, tmp, target, legacy_units(target), progress=bar)
            write_tracker(view, tmp)

    if _torchrun_world() > 1:
        _convert_under_torchrun(req, source, view, target, plan)
    else:
        with staged_output(req.out, inputs=(req.ckpt,)) as tmp:
            write_body(tmp)
            write_manifest(tmp, _manifest_info(req, source, view, target, plan))
    result.files = sum(1 for p in Path(req.out).rglob("*") if p.is_file())
    result.seconds = time.perf_counter() - start
    return result


# -- torchrun: each rank writes a disjoint set of rank files ------------------------------------

def _torchrun_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ or \
        os.environ.get("MCORE_PROXY_DISTRIBUTED") == "1" else 1


def _convert_under_torchrun(req: ConvertRequest, source, view, target, plan) -> None:
    """Rank 0 checks and creates the shared temporary folder; all ranks write their share; a
    failure anywhere removes it; rank 0 writes the tracker and manifest last and renames."""
    import shutil

    import torch
    import torch.distributed as dist

    if req.format != "legacy":
        raise ProxyError("under torchrun only --format legacy is split across ranks; run torch_dist "
                         "conversion as a single process")
    from mcore_proxy.checkpoint.output import check_output_path

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(req.out).absolute()
    tmp = out.with_name(f".{out.name}.partial-torchrun")
    failed, error = torch.zeros(1), None
    if rank == 0:
        try:
            check_output_path(out, (req.ckpt,))
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except ProxyError as err:
            error, failed = err, failed + 1
    dist.all_reduce(failed)
    if failed.item():
        dist.destroy_process_group()
        raise error or ProxyError(f"{out}: rank 0 refused the output folder; see its message")
    try:
        write_legacy_units(view, tmp, target, legacy_units(target)[rank::world])
    except Exception as err:  # noqa: BLE001 - reported to every rank below, then re-raised
        error, failed = err, failed + 1
    dist.all_reduce(failed)
    try:
        if failed.item():
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if error is not None:
                raise error
            raise ProxyError(f"{out}: another rank failed while writing; nothing was left behind")
        if rank == 0:
            write_tracker(view, tmp)
            write_manifest(tmp, _manifest_info(req, source, view, target, plan))
            os.replace(tmp, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
