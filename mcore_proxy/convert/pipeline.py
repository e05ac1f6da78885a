"""Convert: source checkpoint x plan -> pruned ModelView -> writer at the target layout.

Streaming: the legacy writer reads one canonical tensor at a time and writes its shards into
the output rank files as it goes; dropped experts are never read. Parallel: the output rank
files are split over `--workers` processes on one machine, or over the ranks of a `torchrun`
launch (each rank writes a disjoint set; rank 0 writes the tracker and manifest last).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.layout import ParallelLayout
from mcore_proxy.checkpoint.legacy import (iteration_subdir, legacy_units, resolve_target, tracker_marker,
                                          write_legacy_units)
from mcore_proxy.checkpoint.output import staged_output
from mcore_proxy.checkpoint.view import ModelView, router_fingerprint, tensor_nbytes
from mcore_proxy.convert.manifest import relative_to_output, plan_fingerprint, write_manifest
from mcore_proxy.convert.prune import PrunedView
from mcore_proxy.checkpoint.safe_globals import unsafe_args
from mcore_proxy.errors import ProxyError
from mcore_proxy.megatron_args import DEFAULTS
from mcore_proxy.memory import return_freed_buffers_to_os
from mcore_proxy.units import BYTES_PROGRESS

FORMATS = ("legacy", "torch_dist", "hf")


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
    format: str | None = None          # None: the source's format
    workers: int = 1
    dequantize_fp8: bool = False       # HF FP8 source: read its weights as bf16
    force: bool = False                # replace an existing earlier output (swapped in when the new one is complete)

    @property
    def inputs(self) -> tuple[Path, ...]:
        """What the output must neither lie in nor replace."""
        return (self.ckpt,) + ((self.plan,) if self.plan else ())

    def __post_init__(self):
        if self.format is not None and self.format not in FORMATS:
            raise ProxyError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.workers < 1:
            raise ProxyError(f"--workers {self.workers} must be at least 1")


@dataclass
class ConvertResult:
    out: Path
    target: ParallelLayout | None      # None for HF output (not sharded by parallel rank)
    num_experts: int
    source_experts: int
    bytes_read: int
    files: int
    seconds: float
    launch_flags: list[str] = field(default_factory=list)
    dropped_args: dict[str, str] = field(default_factory=dict)   # args field -> why it was not written
    output_bytes: int = 0                                          # estimated size of the output
    format: str = "legacy"


def open_views(ckpt: Path, plan_path: Path | None, dequantize_fp8: bool = False) -> tuple[ModelView, ModelView, object]:
    """(source view, view to write, plan or None). Plan problems are PlanErrors naming the file."""
    source = open_checkpoint(ckpt)
    if dequantize_fp8:
        from mcore_proxy.checkpoint.hf import dequantized
        source = dequantized(source)
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
    # a layout string's stages per pipeline rank are kept as a plain (first/last) split: the writers
    # write no layout string nor virtual stages (MTP goes to the last stage)
    stages = req.stage_layers or (src.stage_layers if src and src.pp == pp and (src.vpp == 1 or src.pipeline_layout)
                                  else None)
    return resolve_target(view, tp=tp, pp=pp, ep=ep, etp=etp,
                          expert_layout=req.expert_layout, stage_layers=stages)


def launch_flags(view: ModelView, target: ParallelLayout, plan) -> list[str]:
    """Megatron launch flags that must change to train or evaluate the proxy."""
    flags = [f"--tensor-model-parallel-size {target.tp}", f"--pipeline-model-parallel-size {target.pp}",
             f"--expert-model-parallel-size {target.ep}", f"--expert-tensor-parallel-size {target.etp}"]
    if getattr(view, "hf", None) is not None:
        # from Hugging Face there are no Megatron launch flags yet: all of the model's, from config.json
        from mcore_proxy.checkpoint.hf.launch import model_flags
        flags = model_flags(view.args) + flags
    elif plan is not None:
        r = plan.router
        flags = [f"--num-experts {plan.num_experts}", f"--moe-router-topk {r.topk}"] + flags
        if r.num_groups:
            flags += [f"--moe-router-num-groups {r.num_groups}", f"--moe-router-group-topk {r.group_topk}"]
    if target.uneven:
        from mcore_proxy.checkpoint.legacy import _first_last
        first, last = _first_last(target.stage_layers)
        flags += [f"--decoder-first-pipeline-num-layers {first}"] if first else []
        flags += [f"--decoder-last-pipeline-num-layers {last}"] if last else []
    src = getattr(view, "layout", None)
    if src is not None and src.pipeline_layout:
        flags.append("(no --pipeline-model-parallel-layout)")
    if src is not None and src.vpp > 1:
        flags.append("(no --virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage)")
    flags.append("--moe-grouped-gemm" if target.expert_layout != "sequential" else "(no --moe-grouped-gemm)")
    # the proxy carries no optimizer or RNG state: load weights only
    flags += ["--no-load-optim", "--no-load-rng"]
    return flags


def hold(phase: str) -> None:
    """Fault-injection point for the interruption tests: with MCORE_PROXY_TEST_HOLD=<phase>, write
    this pid to MCORE_PROXY_TEST_HOLD_FILE and wait (up to 5 min) for the test's signal."""
    if os.environ.get("MCORE_PROXY_TEST_HOLD") != phase:
        return
    Path(os.environ["MCORE_PROXY_TEST_HOLD_FILE"]).write_text(str(os.getpid()))
    time.sleep(300)


def _unit_worker(ckpt: str, plan: str | None, dequantize: bool, target: ParallelLayout, root: str, units) -> None:
    """One worker process: reopen the views (cheap: metadata only) and write its rank files."""
    return_freed_buffers_to_os()
    _, view, _ = open_views(Path(ckpt), Path(plan) if plan else None, dequantize)
    write_legacy_units(view, Path(root), target, units)
    hold("write")


def _split(units: list, parts: int) -> list[list]:
    return [units[i::parts] for i in range(parts) if units[i::parts]]


def _write_parallel(req: ConvertRequest, target: ParallelLayout, root: Path, progress) -> None:
    from mcore_proxy.convert.workers import run_workers

    jobs = [(str(req.ckpt), str(req.plan) if req.plan else None, req.dequantize_fp8, target, str(root), chunk)
            for chunk in _split(legacy_units(target), req.workers)]
    run_workers(_unit_worker, jobs, on_done=lambda i: progress.update(1) if progress is not None else None)


def _manifest_info(req: ConvertRequest, fmt: str, source: ModelView, view: ModelView, target: ParallelLayout | None,
                   plan) -> dict:
    from mcore_proxy import __version__

    return {
        "created_by": f"mcore-proxy {__version__}",
        "source": {"path": relative_to_output(req.ckpt, req.out), "format": getattr(source, "format", "?"),
                   "iteration": source.iteration, "num_experts": source.spec.num_experts,
                   "router_fingerprint": router_fingerprint(source)},
        "plan": None if plan is None else {"path": relative_to_output(req.plan, req.out),
                                           "sha256": plan_fingerprint(req.plan), "method": plan.method},
        "dropped_args": unsafe_args(source.args, needed=DEFAULTS),
        "target": {"format": fmt, "num_experts": view.spec.num_experts, **({} if target is None else {
                   "tp": target.tp, "pp": target.pp, "ep": target.ep, "etp": target.etp,
                   "expert_layout": target.expert_layout, "stage_layers": list(target.stage_layers)})},
    }


def output_bytes(view: ModelView, target: ParallelLayout | None, fmt: str) -> int:
    """Bytes the output will take (an estimate for the free-space check): legacy rank files repeat
    replicated tensors in every (TP, EP) folder of their stage and TP-sharded ones in every EP
    folder; torch_dist stores each tensor once. Plus a little per file for zip headers."""
    from mcore_proxy.sharding import REPLICATED, rule_for

    total, files = 0, len(view.groups()) + 3
    for name in view.names():
        nbytes = tensor_nbytes(view, name)
        if fmt == "legacy":
            rule = rule_for(name, view.layer_spec)
            if rule.expert:
                nbytes *= max(1, target.tp // target.etp) if rule.group == "etp" else 1
            else:
                nbytes *= target.tp * target.ep if rule.kind == REPLICATED else target.ep
        total += nbytes
    if fmt == "legacy":
        files = len(legacy_units(target)) + 2
    return total + files * (64 << 10)


@dataclass
class Prepared:
    """Everything `convert` decided and checked before writing a byte."""

    source: ModelView
    view: ModelView
    plan: object
    target: ParallelLayout | None
    result: ConvertResult
    needed_bytes: int
    format: str = "legacy"


def prepare(req: ConvertRequest, check_space: bool = True) -> Prepared:
    """Every check the conversion makes, in the order it makes them; nothing is written.

    `convert --dry-run` runs exactly this: the views and plan, the target layout, the args the
    writer will store (dropped and needed fields), the output path, its lock and free space."""
    from mcore_proxy.checkpoint.legacy import checkpoint_version, target_args
    from mcore_proxy.checkpoint.output import check_free_space, check_output_path, output_lock

    source, view, plan = open_views(req.ckpt, req.plan, req.dequantize_fp8)
    fmt = req.format or getattr(source, "format", "legacy")
    if fmt == "hf":
        from mcore_proxy.checkpoint.hf.writer import check_hf_request
        target = check_hf_request(view, req)
    else:
        if getattr(getattr(view, "hf", None), "fp8_block", None):
            raise ProxyError(f"{req.ckpt}: FP8 weights with block scales have no Megatron layout; pass "
                             "--dequantize-fp8 to write them as bf16")
        target = plan_target(req, source, view, plan)
    if fmt != "legacy" and _torchrun_world() > 1:
        raise ProxyError(f"under torchrun only --format legacy is split across ranks; run {fmt} "
                         "conversion as a single process")
    if fmt == "torch_dist":
        from mcore_proxy.checkpoint.torch_dist import check_dist_target, dist_target_args
        check_dist_target(view, target)
        dist_target_args(view, target)
    elif fmt == "legacy":
        target_args(view, target)
    checkpoint_version(view)
    read = sum(tensor_nbytes(view, n) for n in view.names())
    flags = [] if target is None else launch_flags(view, target, plan)
    result = ConvertResult(req.out, target, view.spec.num_experts, source.spec.num_experts, read, 0, 0.0,
                           flags, unsafe_args(source.args, needed=DEFAULTS), format=fmt)
    needed = result.output_bytes = output_bytes(view, target, fmt)
    out = check_output_path(req.out, req.inputs, replace=req.force)
    if os.environ.get("RANK", "0") != "0" and _torchrun_world() > 1:
        return Prepared(source, view, plan, target, result, needed, fmt)  # rank 0 owns the output
    try:
        with output_lock(out):
            pass
        if check_space:
            check_free_space(out, needed)
    except OSError as err:
        from mcore_proxy.checkpoint.output import write_failure
        raise write_failure(out, err) from None
    return Prepared(source, view, plan, target, result, needed, fmt)


def convert(req: ConvertRequest, progress: bool = True, dry_run: bool = False,
            check_space: bool = True) -> ConvertResult:
    """Run one conversion; every check happens before the first byte is written (`prepare`).

    Order of writing inside the staging folder: data files, manifest.json (listing the markers
    with the hashes they will have), then the markers, the tracker last; then the rename."""
    from tqdm import tqdm

    from mcore_proxy.checkpoint.output import write_markers

    return_freed_buffers_to_os()
    start = time.perf_counter()
    prep = prepare(req, check_space)
    source, view, plan, target, result = prep.source, prep.view, prep.plan, prep.target, prep.result
    if dry_run:
        return result
    if _torchrun_world() > 1:
        _convert_under_torchrun(req, prep, check_space)
    else:
        with staged_output(req.out, inputs=req.inputs, needed_bytes=prep.needed_bytes,
                           check_space=check_space, replace=req.force) as tmp:
            if prep.format == "hf":
                from mcore_proxy.checkpoint.hf.writer import write_hf_into

                with tqdm(total=result.bytes_read, **BYTES_PROGRESS, mininterval=2, desc="convert",
                          disable=not progress) as bar:
                    markers = write_hf_into(view, tmp, bar)
            elif prep.format == "torch_dist":
                from mcore_proxy.checkpoint.torch_dist import write_torch_dist_into

                with tqdm(total=result.bytes_read, **BYTES_PROGRESS, mininterval=2, desc="convert",
                          disable=not progress) as bar:
                    markers = write_torch_dist_into(view, tmp, target, bar)
            elif req.workers > 1:
                with tqdm(total=len(legacy_units(target)), unit="file", desc="convert", disable=not progress) as bar:
                    _write_parallel(req, target, tmp, bar)
                markers = tracker_marker(view)
            else:
                with tqdm(total=result.bytes_read, **BYTES_PROGRESS, mininterval=2, desc="convert",
                          disable=not progress) as bar:
                    write_legacy_units(view, tmp, target, legacy_units(target), progress=bar)
                markers = tracker_marker(view)
            if req.workers == 1 or prep.format != "legacy":
                hold("write")
            write_manifest(tmp, _manifest_info(req, prep.format, source, view, target, plan), pending=markers)
            hold("manifest")
            write_markers(tmp, markers)
    result.files = sum(1 for p in Path(req.out).rglob("*") if p.is_file())
    result.seconds = time.perf_counter() - start
    return result


# -- torchrun: each rank writes a disjoint set of rank files ------------------------------------

def _torchrun_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ or \
        os.environ.get("MCORE_PROXY_DISTRIBUTED") == "1" else 1


class _Ranks:
    """Coordination of the ranks of a launch through the launcher's key-value store, by polling:
    a rank waiting for the others stays in Python, so a signal (the launcher forwards SIGTERM)
    stops it at once instead of after a collective's timeout."""

    def __init__(self):
        import torch.distributed as dist

        self.store, self.rank, self.world = next(dist.rendezvous("env://"))
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        self.prefix = f"mcore-proxy/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

    def put(self, key: str, value: str) -> None:
        self.store.set(self.prefix + key, value)

    def take(self, key: str) -> str:
        full = self.prefix + key
        while not self.store.check([full]):
            time.sleep(0.05)
        return self.store.get(full).decode()


def _convert_under_torchrun(req: ConvertRequest, prep: Prepared, check_space: bool) -> None:
    """Rank 0 takes the lock and makes the staging folder; every rank writes its share of rank
    files and reports; rank 0 then writes manifest and tracker and renames, or removes the folder
    if any rank failed. Other ranks wait for rank 0's verdict."""
    from mcore_proxy.checkpoint.output import staged_output, write_markers
    from mcore_proxy.interrupts import die_with_parent

    die_with_parent(signal.SIGTERM)  # the launcher died: stop (and clean up) as for its own SIGTERM
    ranks = _Ranks()
    view, target = prep.view, prep.target
    units = legacy_units(target)[ranks.rank::ranks.world]
    if ranks.rank != 0:
        root = ranks.take("staging")
        if root.startswith("error:"):
            raise ProxyError(f"{req.out}: rank 0 refused the output ({root[6:]})")
        try:
            write_legacy_units(view, Path(root), target, units)
            hold("write")
            ranks.put(f"done/{ranks.rank}", "ok")
        except Exception as err:  # noqa: BLE001 - reported to rank 0, then re-raised here
            ranks.put(f"done/{ranks.rank}", f"error:{err}")
            raise
        verdict = ranks.take("final")
        if verdict != "ok":
            raise ProxyError(f"{req.out}: the conversion failed on another rank ({verdict}); nothing was left behind")
        return
    try:
        with staged_output(req.out, inputs=req.inputs, needed_bytes=prep.needed_bytes, check_space=check_space,
                           staging_id=f"torchrun-{os.getpid()}", replace=req.force) as tmp:
            (tmp / iteration_subdir(view)).mkdir()
            ranks.put("staging", str(tmp))
            write_legacy_units(view, tmp, target, units)
            hold("write")
            for r in range(1, ranks.world):
                status = ranks.take(f"done/{r}")
                if status != "ok":
                    raise ProxyError(f"rank {r} failed: {status[6:]}")
            markers = tracker_marker(view)
            write_manifest(tmp, _manifest_info(req, prep.format, prep.source, view, target, prep.plan), pending=markers)
            hold("manifest")
            write_markers(tmp, markers)
    except BaseException as err:
        if not ranks.store.check([ranks.prefix + "staging"]):
            ranks.put("staging", f"error:{err}")
        ranks.put("final", f"error:{err}")
        raise
    ranks.put("final", "ok")
