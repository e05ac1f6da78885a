"""Output folders that never look complete unless they are: stage, then rename."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from mcore_proxy.errors import OutputError


def check_output_path(out: str | Path, inputs: tuple[str | Path, ...] = ()) -> Path:
    """The output must not exist and must not lie inside (or contain) an input."""
    out = Path(out).absolute()
    if out.exists():
        raise OutputError(f"{out}: output folder already exists; choose a new path or remove it first")
    for src in inputs:
        src = Path(src).resolve()
        if out.resolve() == src or src in out.resolve().parents or out.resolve() in src.parents:
            raise OutputError(f"{out}: output must not be inside the input checkpoint {src} (or hold it); "
                              "choose a path outside it")
    if not out.parent.is_dir():
        raise OutputError(f"{out.parent}: parent folder of the output does not exist; create it first")
    return out


@contextlib.contextmanager
def staged_output(out: str | Path, inputs: tuple[str | Path, ...] = ()):
    """Yield a hidden temporary folder beside `out`; rename it to `out` only on success.

    On any failure the temporary folder is removed, so no partial output is left behind; a
    failed write (e.g. a full disk) becomes one OutputError sentence.
    """
    out = check_output_path(out, inputs)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        os.replace(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = "the disk is full" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        raise OutputError(f"{out}: writing the output failed ({reason}); nothing was left behind, "
                          "fix the cause and run again") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
