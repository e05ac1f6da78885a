"""The one table of checkpoint formats, and what every caller asks of it.

`FORMATS` lists each format's `Format` record (`checkpoint/interface.py`) in detection order:
`detect_format`, `open_checkpoint`, `inspect`, the CLI's `--format` choices, `write_checkpoint` and
`convert` (its workers and torchrun ranks) all go through it. A new format is one package and
one row here.
"""

from __future__ import annotations

from pathlib import Path

from mcore_proxy.checkpoint import hf, legacy, torch_dist
from mcore_proxy.checkpoint.interface import Format, TargetOptions
from mcore_proxy.core.output import refuse_staging, staged_output, write_markers
from mcore_proxy.checkpoint.target import complete_target
from mcore_proxy.checkpoint.view import ModelView
from mcore_proxy.core.errors import CheckpointError, ProxyError
from mcore_proxy.runtime.memory import return_freed_buffers_to_os
from mcore_proxy.runtime.progress import byte_bar

# Tried in order: a torch_dist iteration folder also has a tracker beside it, as legacy ones do.
FORMATS: tuple[Format, ...] = (
    torch_dist.FORMAT,
    legacy.FORMAT,
    hf.FORMAT,
)


def format_names(writable: bool = False) -> tuple[str, ...]:
    """Names of the formats (only those with a writer if `writable`), in table order."""
    return tuple(f.name for f in FORMATS if f.writer is not None or not writable)


def get_format(name: str) -> Format:
    for f in FORMATS:
        if f.name == name:
            return f
    raise ProxyError(f"format {name!r} is not one of {', '.join(format_names())}")


def writer_of(name: str):
    """The Writer of format `name`; ProxyError if it cannot be written."""
    fmt = get_format(name)
    if fmt.writer is None:
        raise ProxyError(
            f"format {name!r} can be read but not written; write one of {', '.join(format_names(writable=True))}"
        )
    return fmt.writer


def detect_format(path: str | Path) -> str:
    """The format name of a checkpoint folder; CheckpointError with the fix if none fits."""
    path = Path(path)
    refuse_staging(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder; check the path")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file; pass the checkpoint folder Megatron saved")
    if not any(path.iterdir()):
        raise CheckpointError(f"{path}: folder is empty; pass the folder Megatron saved with --save")
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt.name
    raise CheckpointError(
        f"{path}: not a checkpoint (no latest_checkpointed_iteration.txt, iter_*, mp_rank_* or "
        "torch_dist metadata of Megatron, no config.json with safetensors of Hugging Face); pass "
        "the folder Megatron or save_pretrained wrote"
    )


def open_checkpoint(path: str | Path) -> ModelView:
    """Open a checkpoint folder of any supported format as a lazy canonical ModelView."""
    return get_format(detect_format(path)).open(Path(path))


def write_checkpoint(
    view: ModelView,
    out: str | Path,
    target=None,
    fmt: str = "legacy",
    *,
    inputs=(),
    progress: bool = True,
    replace: bool = False,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write `view` as a checkpoint of format `fmt` at `target` (default: the writer's for no
    options, i.e. the source's layout for Megatron formats)
    into `out` (created; must not exist unless `replace`), in this process: check, stage, every
    unit, `extra_files` (name -> text, at the top), finish, the markers last, rename. No manifest
    (that is `convert`'s: `convert.pipeline`)."""
    return_freed_buffers_to_os()
    writer = writer_of(fmt)
    target = writer.target(view, TargetOptions()) if target is None else complete_target(view, target)
    writer.check(view, target)
    units = writer.units(view, target)
    with (
        staged_output(out, inputs, check_space=False, replace=replace) as tmp,
        byte_bar(sum(u.nbytes for u in units), f"write {fmt}", progress) as bar,
    ):
        results = writer.write_units(view, tmp, target, units, bar)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        write_markers(tmp, writer.finish(view, tmp, target, results).markers)
    return Path(out)
