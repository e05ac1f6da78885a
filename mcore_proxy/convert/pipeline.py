"""Convert: source checkpoint x plan -> pruned ModelView -> the target format's writer.

The pipeline knows no format, only the Writer interface (`checkpoint/interface.py`):
  prepare    views, target layout, the writer's `check`, its units, the output path, its lock
             and free space: every check before a byte is written (`--dry-run` stops here);
  write      the units, in this process, over `--workers` spawned processes, or over the ranks
             of a `torchrun` launch (each a disjoint share, balanced by bytes); dropped experts
             are never read, one canonical tensor in memory at a time;
  finish     the writer's finish step, in one process (rank 0 under torchrun);
  manifest   manifest.json from the sizes and sha256 the units computed while writing (the
             output is never read back), listing the markers with the hashes they will have;
  markers    the completeness markers, the tracker last; then the staging folder is renamed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.convert.twin import require_proven
from mcore_proxy.checkpoint.formats import detect_format, format_names, get_format, writer_of
from mcore_proxy.checkpoint.interface import TargetOptions, Unit, WrittenFile
from mcore_proxy.checkpoint.layout import ParallelLayout
from mcore_proxy.core.output import staged_output, write_markers
from mcore_proxy.checkpoint.safe_globals import unsafe_args
from mcore_proxy.checkpoint.target import first_last
from mcore_proxy.checkpoint.view import ModelView, router_fingerprint, tensor_nbytes
from mcore_proxy.convert.manifest import relative_to_output, plan_fingerprint, write_manifest
from mcore_proxy.convert.prune import MERGE_RULE, PrunedView
from mcore_proxy.core.errors import ProxyError
from mcore_proxy.core.tensors import host_tensors
from mcore_proxy.mcore.megatron_args import DEFAULTS
from mcore_proxy.runtime.memory import expect_torch, return_freed_buffers_to_os
from mcore_proxy.runtime.progress import byte_bar

FILE_OVERHEAD = 64 << 10  # bytes allowed per output file beyond its tensors (zip headers, pickles)
PLANNED_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-router-num-groups", "--moe-router-group-topk")


@dataclass(frozen=True)
class ConvertRequest:
    """What the user asked for. target: the output's layout and names (None fields: keep the
    source's; EP: the plan's EP degree; naming None: the source's for legacy output)."""

    ckpt: Path
    out: Path
    plan: Path | None = None
    target: TargetOptions = TargetOptions()
    format: str | None = None  # None: the source's format
    workers: int = 1
    dequantize: bool = False  # a quantized source (FP8, FP4, MXFP4): read its weights as bf16
    force: bool = False  # replace an existing earlier output (swapped in when the new one is complete)
    merge: bool = False  # each kept expert := its cluster's frequency-weighted mean (changes weights: prune.MERGE_RULE)

    @property
    def inputs(self) -> tuple[Path, ...]:
        """What the output must neither lie in nor replace."""
        return (self.ckpt,) + ((self.plan,) if self.plan else ())

    def __post_init__(self):
        if self.format is not None and self.format not in format_names(writable=True):
            raise ProxyError(f"--format {self.format!r} is not one of {', '.join(format_names(writable=True))}")
        if self.merge and self.plan is None:
            raise ProxyError("--merge-clusters merges each plan cluster into its kept expert; pass --plan")
        if self.workers < 1:
            raise ProxyError(f"--workers {self.workers} must be at least 1")


@dataclass
class ConvertResult:
    out: Path
    target: ParallelLayout | None  # None: a format not sharded by parallel rank (Hugging Face)
    num_experts: int
    source_experts: int
    bytes_read: int
    files: int
    seconds: float
    launch_flags: list[str] = field(default_factory=list)
    dropped_args: dict[str, str] = field(default_factory=dict)  # args field -> why it was not written
    output_bytes: int = 0  # estimated size of the output
    format: str = "legacy"
    merged: bool = False  # kept experts are cluster means (--merge-clusters), not the source's bits


def open_views(
    ckpt: Path, plan_path: Path | None, dequantize: bool = False, fmt: str | None = None, merge: bool = False
) -> tuple[ModelView, ModelView, object]:
    """(source view, view to write, plan or None). Plan problems are PlanErrors naming the file.
    With `dequantize` the source is read with its quantized weights as bf16 (`ModelView.dequantized`);
    with an output format `fmt`, under the names its framework's writer reads (`ModelView.named_for`:
    a Hugging Face source written as a Megatron checkpoint is read under megatron-core names); with
    `merge`, kept experts are their clusters' frequency-weighted means (`prune.MERGE_RULE`). A
    family discovered from transformers is refused unless its tiny twin proves it (`twin.py`)."""
    source = open_checkpoint(ckpt)
    if plan_path is not None:
        require_proven(source)
    if dequantize:
        source = source.dequantized()
    if fmt is not None:
        source = source.named_for(get_format(fmt).framework)
    if plan_path is None:
        return source, source, None
    from mcore_proxy.core.errors import PlanError
    from mcore_proxy.select.plan import load_plan

    plan = load_plan(plan_path)
    try:
        return source, PrunedView(source, plan, merge=merge), plan
    except PlanError as err:
        raise PlanError(f"{plan_path}: {err} (checkpoint {ckpt})") from None


def bytes_only(ckpt: Path, fmt: str, dequantize: bool, merge: bool = False) -> bool:
    """Whether writing moves bytes only, so tensors need no torch (`core.tensors`): a legacy
    source written as legacy, neither dequantized nor merged. torch_dist and Hugging Face writers,
    and their readers, keep torch tensors."""
    return fmt == "legacy" and not (dequantize or merge) and detect_format(ckpt) == "legacy"


def target_options(req: ConvertRequest, plan) -> TargetOptions:
    """The layout options of a request; the writer turns them into its target (`Writer.target`)."""
    return dataclasses.replace(req.target, plan_ep=plan.expert_parallel_size if plan else None)


def output_format(req: ConvertRequest) -> str:
    """--format, or the source's format when it can be written."""
    if req.format is not None:
        return req.format
    source = detect_format(req.ckpt)
    if source not in format_names(writable=True):
        raise ProxyError(
            f"{req.ckpt}: its format {source!r} cannot be written; pass --format "
            f"{' or '.join(format_names(writable=True))}"
        )
    return source


def launch_flags(view: ModelView, target: ParallelLayout, plan, writer) -> list[str]:
    """Megatron launch flags that must change to train or evaluate the proxy written by `writer`
    (its format's Writer). A source without a parallel layout (Hugging Face, in memory) was not
    saved by a Megatron launch: every model flag its args hold (the writer's `model_flags`) comes
    first."""
    flags = [
        f"--tensor-model-parallel-size {target.tp}",
        f"--pipeline-model-parallel-size {target.pp}",
        f"--expert-model-parallel-size {target.ep}",
        f"--expert-tensor-parallel-size {target.etp}",
    ]
    if plan is not None:
        r = plan.router
        flags = [f"--num-experts {plan.num_experts}", f"--moe-router-topk {r.topk}"] + flags
        if r.num_groups:
            flags += [f"--moe-router-num-groups {r.num_groups}", f"--moe-router-group-topk {r.group_topk}"]
    if view.layout is None and view.args is not None:
        # the source's args hold its expert count and routing; with a plan, the plan's say what the proxy has
        shape = writer.model_flags(view, target)
        flags = [f for f in shape if plan is None or f.split()[0] not in PLANNED_FLAGS] + flags
    flags += pipeline_flags(view.layout, target)
    flags.append("--moe-grouped-gemm" if target.expert_layout != "sequential" else "(no --moe-grouped-gemm)")
    if target.expert_layout == "grouped" and view.layer_spec == "transformer_engine":
        flags.append("--moe-use-legacy-grouped-gemm")  # GroupedMLP, not TE's TEGroupedMLP
    # the proxy carries no optimizer or RNG state: load weights only
    flags += ["--no-load-optim", "--no-load-rng"]
    return flags


def pipeline_flags(src: ParallelLayout | None, target: ParallelLayout) -> list[str]:
    """Megatron-LM's flags for the target's pipeline stages, and "(no --flag)" notes for the
    source's stage flags the proxy's launch must drop. Megatron-LM accepts at most one of the
    layout string, `--num-layers-per-virtual-pipeline-stage` and `--num-virtual-stages-per-
    pipeline-rank` (validate_args), and derives VPP from it; the even split is given by layers
    per virtual stage, the spelling MindSpeed and older Megatron-LM also have."""
    if target.pipeline_layout:
        # quoted: '|' is a shell pipe
        flags = [f"--pipeline-model-parallel-layout {shlex.quote(target.pipeline_layout)}"]
    elif target.vpp > 1:
        flags = [f"--num-layers-per-virtual-pipeline-stage {target.stage_layers[0] // target.vpp}"]
    elif target.uneven:
        first, last = first_last(target.stage_layers)
        flags = ([f"--decoder-first-pipeline-num-layers {first}"] if first else []) + (
            [f"--decoder-last-pipeline-num-layers {last}"] if last else []
        )
    else:
        flags = []
    if src is None:
        return flags
    if src.pipeline_layout and not target.pipeline_layout:
        flags.append("(no --pipeline-model-parallel-layout)")
    if src.vpp > 1 and not src.pipeline_layout and (target.vpp == 1 or target.pipeline_layout):
        flags.append("(no --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank)")
    if src.uneven and not src.pipeline_layout and (target.pipeline_layout or not target.uneven):
        flags.append("(no --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers / --num-layer-list)")
    return flags


def hold(phase: str) -> None:
    """Fault-injection point for the interruption tests: with MCORE_PROXY_TEST_HOLD=<phase>, write
    this pid to MCORE_PROXY_TEST_HOLD_FILE and wait (up to 5 min) for the test's signal."""
    if os.environ.get("MCORE_PROXY_TEST_HOLD") != phase:
        return
    Path(os.environ["MCORE_PROXY_TEST_HOLD_FILE"]).write_text(str(os.getpid()))
    time.sleep(300)


def _manifest_info(
    req: ConvertRequest, fmt: str, source: ModelView, view: ModelView, target: ParallelLayout | None, plan
) -> dict:
    from mcore_proxy import __version__

    return {
        "created_by": f"mcore-proxy {__version__}",
        "source": {
            "path": relative_to_output(req.ckpt, req.out),
            "format": source.info.format,
            "iteration": source.iteration,
            "num_experts": source.spec.num_experts,
            "router_fingerprint": router_fingerprint(source),
        },
        "plan": None
        if plan is None
        else {
            "path": relative_to_output(req.plan, req.out),
            "sha256": plan_fingerprint(req.plan),
            "method": plan.method,
            **({"merged_clusters": MERGE_RULE} if isinstance(view, PrunedView) and view.merged else {}),
        },
        "dropped_args": unsafe_args(source.args, needed=DEFAULTS),
        "target": {
            "format": fmt,
            "num_experts": view.spec.num_experts,
            **(
                {}
                if target is None
                else {
                    "tp": target.tp,
                    "pp": target.pp,
                    "ep": target.ep,
                    "etp": target.etp,
                    "expert_layout": target.expert_layout,
                    "stage_layers": list(target.stage_layers),
                    "vpp": target.vpp,
                    "pipeline_layout": target.pipeline_layout,
                }
            ),
        },
    }


@dataclass
class Prepared:
    """Everything `convert` decided and checked before writing a byte."""

    source: ModelView
    view: ModelView
    plan: object
    target: ParallelLayout | None
    format: str
    writer: object
    units: list[Unit]
    result: ConvertResult
    needed_bytes: int


def prepare(req: ConvertRequest, check_space: bool = True) -> Prepared:
    """Every check the conversion makes, in the order it makes them; nothing is written.

    `convert --dry-run` runs exactly this: the views and plan, the target layout, the writer's
    checks (the args it will store: dropped and needed fields), the output path, its lock and
    free space."""
    from mcore_proxy.core.output import check_free_space, check_output_path, output_lock, write_failure

    fmt = output_format(req)
    source, view, plan = open_views(req.ckpt, req.plan, req.dequantize, fmt, req.merge)
    if req.merge and source.quantized_schemes():
        raise ProxyError(
            f"{req.ckpt}: holds quantized expert weights, which --merge-clusters cannot average; add --dequantize"
        )
    writer = writer_of(fmt)
    target = writer.target(view, target_options(req, plan))
    writer.check(view, target)
    units = writer.units(view, target)
    sources = view.sources if isinstance(view, PrunedView) else lambda n: [n]
    read = sum(tensor_nbytes(view, n) * len(sources(n)) for n in view.names())
    flags = [] if target is None else launch_flags(view, target, plan, writer)
    result = ConvertResult(
        req.out,
        target,
        view.spec.num_experts,
        source.spec.num_experts,
        read,
        0,
        0.0,
        flags,
        unsafe_args(source.args, needed=DEFAULTS),
        format=fmt,
        merged=isinstance(view, PrunedView) and view.merged,
    )
    needed = result.output_bytes = sum(u.nbytes for u in units) + (len(units) + 3) * FILE_OVERHEAD
    prep = Prepared(source, view, plan, target, fmt, writer, units, result, needed)
    out = check_output_path(req.out, req.inputs, replace=req.force)
    if os.environ.get("RANK", "0") != "0" and _torchrun_world() > 1:
        return prep  # rank 0 owns the output
    try:
        with output_lock(out):
            pass
        if check_space:
            check_free_space(out, needed)
    except OSError as err:
        raise write_failure(out, err) from None
    return prep


def convert(
    req: ConvertRequest, progress: bool = True, dry_run: bool = False, check_space: bool = True
) -> ConvertResult:
    """Run one conversion; every check happens before the first byte is written (`prepare`)."""
    return_freed_buffers_to_os()
    host = bytes_only(req.ckpt, output_format(req), req.dequantize, req.merge)
    if not (dry_run or host):
        expect_torch()
    start = time.perf_counter()
    with host_tensors(host):
        prep = prepare(req, check_space)
        if dry_run:
            return prep.result
        _convert_prepared(req, prep, check_space, progress)
    prep.result.files = sum(1 for p in Path(req.out).rglob("*") if p.is_file())
    prep.result.seconds = time.perf_counter() - start
    return prep.result


def _convert_prepared(req: ConvertRequest, prep: Prepared, check_space: bool, progress: bool) -> None:
    if _torchrun_world() > 1:
        _convert_under_torchrun(req, prep, check_space)
    else:
        with (
            staged_output(
                req.out, inputs=req.inputs, needed_bytes=prep.needed_bytes, check_space=check_space, replace=req.force
            ) as tmp,
            byte_bar(sum(u.nbytes for u in prep.units), "convert", progress) as bar,
        ):
            results = _write_units(req, prep, tmp, bar)
            if req.workers == 1:
                hold("write")
            _finish(req, prep, tmp, results)


def _finish(req: ConvertRequest, prep: Prepared, root: Path, results: list[list[WrittenFile]]) -> None:
    """The writer's finish, manifest.json from the units' hashes, then the markers (tracker last)."""
    finished = prep.writer.finish(prep.view, root, prep.target, results)
    files = [f for unit in results for f in unit] + list(finished.files)
    write_manifest(
        root,
        _manifest_info(req, prep.format, prep.source, prep.view, prep.target, prep.plan),
        files={f.path: {"size": f.size, "sha256": f.sha256} for f in files},
        pending=finished.markers,
    )
    hold("manifest")
    write_markers(root, finished.markers)


def balance(units: list[Unit], parts: int) -> list[list[int]]:
    """Unit indices for `parts` processes, largest first to the least loaded (deterministic)."""
    loads = [[0, p, []] for p in range(parts)]
    for i in sorted(range(len(units)), key=lambda i: (-units[i].nbytes, i)):
        least = min(loads, key=lambda load: (load[0], load[1]))
        least[0] += units[i].nbytes
        least[2].append(i)
    return [sorted(load[2]) for load in loads if load[2]]


def _write_here(
    view: ModelView, writer, root: Path, target: ParallelLayout, units: list[Unit], progress=None
) -> list[list[WrittenFile]]:
    return writer.write_units(view, root, target, units, progress)


def _unit_worker(
    ckpt: str,
    plan: str | None,
    dequantize: bool,
    merge: bool,
    fmt: str,
    target: ParallelLayout | None,
    root: str,
    units: list[Unit],
    progress=None,
) -> list[list[dict]]:
    """One worker process: reopen the views (cheap: metadata only) and write its units."""
    return_freed_buffers_to_os()
    with host_tensors(bytes_only(Path(ckpt), fmt, dequantize, merge)):
        _, view, _ = open_views(Path(ckpt), Path(plan) if plan else None, dequantize, fmt, merge)
        results = _write_here(view, writer_of(fmt), Path(root), target, units, progress)
    hold("write")
    return [[dataclasses.asdict(f) for f in files] for files in results]


def _write_units(req: ConvertRequest, prep: Prepared, root: Path, progress) -> list[list[WrittenFile]]:
    """Every unit's written files, in unit order: here, or over `req.workers` processes."""
    if req.workers == 1:
        return _write_here(prep.view, prep.writer, root, prep.target, prep.units, progress)
    from mcore_proxy.convert.workers import run_workers

    shares = balance(prep.units, req.workers)
    jobs = [
        (
            str(req.ckpt),
            str(req.plan) if req.plan else None,
            req.dequantize,
            req.merge,
            prep.format,
            prep.target,
            str(root),
            [prep.units[i] for i in share],
        )
        for share in shares
    ]
    done = run_workers(_unit_worker, jobs, on_progress=progress)
    return _in_unit_order(shares, done)


def _in_unit_order(shares: list[list[int]], done: list[list[list[dict]]]) -> list[list[WrittenFile]]:
    results: dict[int, list[WrittenFile]] = {}
    for share, files in zip(shares, done):
        for i, unit_files in zip(share, files):
            results[i] = [WrittenFile(**f) for f in unit_files]
    return [results[i] for i in sorted(results)]


# -- torchrun: each rank writes a disjoint share of the units -------------------------------------


def _torchrun_world() -> int:
    return (
        int(os.environ.get("WORLD_SIZE", "1"))
        if "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("MCORE_PROXY_DISTRIBUTED") == "1"
        else 1
    )


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
    """Rank 0 takes the lock and makes the staging folder; every rank writes its share of the
    units and reports their files (sizes, hashes, records) through the store; rank 0 then runs the
    writer's finish, writes manifest and markers and renames, or removes the folder if any rank
    failed. Other ranks wait for rank 0's verdict."""
    from mcore_proxy.runtime.interrupts import die_with_parent

    die_with_parent(signal.SIGTERM)  # the launcher died: stop (and clean up) as for its own SIGTERM
    ranks = _Ranks()
    shares = balance(prep.units, ranks.world)
    mine = shares[ranks.rank] if ranks.rank < len(shares) else []

    def write_mine(root: Path) -> str:
        results = _write_here(prep.view, prep.writer, root, prep.target, [prep.units[i] for i in mine])
        hold("write")
        return json.dumps([[dataclasses.asdict(f) for f in files] for files in results])

    if ranks.rank != 0:
        root = ranks.take("staging")
        if root.startswith("error:"):
            raise ProxyError(f"{req.out}: rank 0 refused the output ({root[6:]})")
        try:
            ranks.put(f"done/{ranks.rank}", "ok:" + write_mine(Path(root)))
        except Exception as err:  # noqa: BLE001 - reported to rank 0, then re-raised here
            ranks.put(f"done/{ranks.rank}", f"error:{err}")
            raise
        verdict = ranks.take("final")
        if verdict != "ok":
            raise ProxyError(f"{req.out}: the conversion failed on another rank ({verdict}); nothing was left behind")
        return
    try:
        with staged_output(
            req.out,
            inputs=req.inputs,
            needed_bytes=prep.needed_bytes,
            check_space=check_space,
            staging_id=f"torchrun-{os.getpid()}",
            replace=req.force,
        ) as tmp:
            ranks.put("staging", str(tmp))
            reports = {0: write_mine(tmp)}
            for r in range(1, ranks.world):
                status = ranks.take(f"done/{r}")
                if not status.startswith("ok:"):
                    raise ProxyError(f"rank {r} failed: {status[6:]}")
                reports[r] = status[3:]
            done = [json.loads(reports[r]) for r in range(len(shares))]
            _finish(req, prep, tmp, _in_unit_order(shares, done))
    except BaseException as err:
        if not ranks.store.check([ranks.prefix + "staging"]):
            ranks.put("staging", f"error:{err}")
        ranks.put("final", f"error:{err}")
        raise
    ranks.put("final", "ok")
