"""The format interface: how a checkpoint format plugs into mcore-proxy.

A format is one package under `mcore_proxy/checkpoint/` (`legacy/`, `torch_dist/`; `hf/` next)
exposing one `Format` record, registered by one row in `checkpoint/formats.py`. Everything else
goes through that table: `open_checkpoint`, `detect_format`, `inspect`, the CLI's `--format`
choices, `write_checkpoint` and `convert` (one process, `--workers N`, or `torchrun` ranks). No
caller outside `checkpoint/` imports a module inside a format package (its `__init__` is its
public face; tests/test_package_imports.py checks it), and a format imports no other format.

Reading (`Format.detect`, `Format.open`):
  detect(path) -> bool       cheap, no tensor data: does `path` (a checkpoint root or a data
                             folder) look like this format? True also for a damaged or unfinished
                             checkpoint of it, so that `open` can say what is wrong. Formats are
                             tried in table order.
  open(path) -> ModelView    the canonical view (`checkpoint/view.py`: full tensors under
                             megatron-core names, read lazily, one `ViewInfo` record); reads
                             metadata only; bad input is one CheckpointError sentence.

Writing (`Format.writer`, a `Writer`): an output is a set of independent *units* (a legacy rank
folder group, a torch_dist data file, a safetensors shard: files any process can write in any
order), then one `finish` step:
  target(view, options)      the target to write at from the user's `TargetOptions`: a Megatron
                             ParallelLayout (default: the source's, `checkpoint/target.py`), or
                             None for a format not sharded by parallel rank (which refuses
                             layout options). Every later step gets it as `target`.
  check(view, target)        every feasibility check of writing `view` at `target` (dividing
                             sizes, what the format can store, the args it will write); raises
                             ProxyError. `convert --dry-run` runs it; nothing is written.
  units(view, target) -> [Unit]
                             the independent output units, each with the bytes it will write
                             (progress totals, the free-space check, balancing over processes).
  write_unit(view, root, target, unit, progress) -> [WrittenFile]
                             write one unit under `root` (a staging folder; create subfolders
                             with exist_ok: other processes write beside you). Return every file
                             written with its relative path, size and sha256 computed while
                             writing, plus any `records` finish needs (JSON-able data: the units
                             may run in other processes). `progress(nbytes)` after each write.
                             Files must be on disk (fsync) before returning.
  write_units(view, root, target, units, progress) -> [[WrittenFile]]
                             the units one process writes, results in the order given; the
                             default writes them one by one. A writer whose units read the same
                             tensors overrides it to read them once (legacy: the EP rank files of
                             one stage all hold its non-expert tensors).
  finish(view, root, target, results) -> Finished
                             in one process, after every unit (`results[i]` is what unit i
                             returned): the files that need all units (torch_dist `.metadata`
                             from the units' chunk records, `common.pt`), and the completeness
                             markers, NOT written: the caller writes manifest.json (from the
                             returned hashes; the output is never read back) and then the
                             markers in order, the tracker last, then renames the folder.
Writers keep no state between calls: `write_unit` may run in a spawned worker or a torchrun rank
that reopened the same view.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.checkpoint.target import source_target

Progress = Callable[[int], None] | None  # called with the bytes just written


@dataclass(frozen=True)
class Unit:
    """One independent piece of an output. key: the writer's own coordinates (plain data);
    nbytes: the bytes it will write (an estimate good to a few kB per file)."""

    key: tuple
    nbytes: int


@dataclass(frozen=True)
class WrittenFile:
    """A file a writer wrote: path relative to the output root (posix), size in bytes, sha256 of
    its bytes (hex), and `records` the writer's finish step reads (JSON-able, may be empty)."""

    path: str
    size: int
    sha256: str
    records: tuple = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Finished:
    """What `finish` wrote, and the completeness markers (relative path -> bytes, in writing
    order: the tracker last) that the caller writes after the manifest."""

    files: tuple[WrittenFile, ...]
    markers: dict[str, bytes]


@dataclass(frozen=True)
class TargetOptions:
    """What the user asked of the output's parallel layout; None: not given (keep the source's).
    plan_ep: the plan's EP degree, the default EP when `ep` is not given; naming: the tensor names
    (not a layout: each writer's `refuse_options` checks it against the format)."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    expert_layout: str | None = None
    stage_layers: tuple[int, ...] | None = None
    pipeline_layout: str | None = None
    vpp: int | None = None
    plan_ep: int | None = None
    naming: str | None = None  # one of NAMINGS; a format that does not write it refuses it
    tp_extend_ep: bool | None = None  # MindSpeed-LLM --moe-tp-extend-ep

    def __post_init__(self):
        # a size of 0 is not "the source's" (that is None): a library caller gets the sentence the CLI gives
        for name in ("tp", "pp", "ep", "etp", "vpp"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ProxyError(f"--target-{name} {value!r} is not a size: give an integer >= 1, or leave it out")

    def given(self) -> list[str]:
        """The layout options the user set (field names; the plan's EP is not the user's)."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("plan_ep", "naming") and getattr(self, f.name) is not None
        ]


# the tensor names a Megatron checkpoint is written in (`--naming`: a value; the legacy writer maps it)
NAMINGS = ("megatron", "mindspeed-llm")


class Writer(ABC):
    """Writes any ModelView at a target (module docstring).

    `namings`: the `--naming` values this format writes; `tp_extend_ep`: whether it writes
    MindSpeed-LLM's --moe-tp-extend-ep layout. `refuse_options` turns the others away."""

    namings: tuple[str, ...] = ("megatron",)
    tp_extend_ep: bool = False

    def refuse_options(self, options: TargetOptions) -> None:
        """ProxyError for an option this format does not write (call first in `target`)."""
        if options.naming not in (None, *NAMINGS):
            raise ProxyError(f"--naming {options.naming!r} is not one of {', '.join(NAMINGS)}")
        if options.naming is not None and options.naming not in self.namings:
            raise ProxyError(
                f"--naming {options.naming} is written in the legacy format only (MindSpeed-LLM saves "
                "--ckpt-format torch); pass --format legacy"
            )
        if options.tp_extend_ep and not self.tp_extend_ep:
            raise ProxyError(
                "--moe-tp-extend-ep is a layout of legacy rank folders (MindSpeed-LLM); pass --format legacy"
            )

    def target(self, view, options: TargetOptions):
        """A Megatron ParallelLayout: the options given, else the source's TP/PP/ETP and the plan's EP."""
        self.refuse_options(options)
        return source_target(
            view,
            tp=options.tp,
            pp=options.pp,
            ep=options.ep or options.plan_ep,
            etp=options.etp,
            expert_layout=options.expert_layout,
            stage_layers=options.stage_layers,
            pipeline_layout=options.pipeline_layout,
            vpp=options.vpp,
        )

    def model_flags(self, view, target) -> list[str]:
        """The model-shape flags of the launch line that loads `view` written at `target`
        (Megatron-LM's, from the view's args; a writer of another framework's names overrides)."""
        from mcore_proxy.mcore.launch_flags import model_flags

        return model_flags(view.args)

    @abstractmethod
    def check(self, view, target) -> None: ...

    @abstractmethod
    def units(self, view, target) -> list[Unit]: ...

    @abstractmethod
    def write_unit(self, view, root: Path, target, unit: Unit, progress: Progress = None) -> list[WrittenFile]: ...

    def write_units(
        self, view, root: Path, target, units: list[Unit], progress: Progress = None
    ) -> list[list[WrittenFile]]:
        return [self.write_unit(view, root, target, unit, progress) for unit in units]

    @abstractmethod
    def finish(self, view, root: Path, target, results: list[list[WrittenFile]]) -> Finished: ...


@dataclass(frozen=True)
class Format:
    """One checkpoint format: its name (the `--format` value), detection, reader and writer, and
    the framework that runs its checkpoints (`verify --functional` runs both sides in it)."""

    name: str
    summary: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], object]
    writer: Writer | None = None
    framework: str = "megatron-core"
    # load_rank(path, (tp, pp, ep), layout) -> dict: the state dict one megatron-core rank loads
    # from the checkpoint at `path` written at `layout` (weights only: nothing in it runs); a format
    # megatron-core loads rank file by rank file has one (legacy)
    load_rank: Callable[[Path, tuple, object], dict] | None = None
