"""Stopping on SIGINT, SIGTERM and SIGHUP: clean up, say one line, exit 128 + signal.

Schedulers stop jobs with SIGTERM (SLURM, Kubernetes), terminals with SIGINT and SIGHUP. The CLI
turns the first of them into `Interrupted`, which unwinds through the `finally` blocks that kill
worker processes and remove staging folders; later signals are ignored so that cleanup finishes.

Inside `deferred()` (while torch's C++ zip writer calls back into Python) a signal is held and
raised when the block ends: an exception thrown through the C++ writer mid-record leaves it
inconsistent, and its destructor would then abort the process.

Workers call `as_worker()`: they ignore SIGINT (the parent stops them), die on SIGTERM/SIGHUP
without Python cleanup, and on Linux get SIGKILL when their parent dies (PR_SET_PDEATHSIG), so
no worker outlives the converter, not even after `kill -9` of the parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading

from mcore_proxy.core.errors import Interrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state = {"depth": 0, "pending": None, "fired": False}


def _handler(signum, frame):
    if _state["fired"]:
        return  # cleanup of the first signal is running: let it finish
    if _state["depth"]:
        _state["pending"] = signum
        return
    _state["fired"] = True
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals():
    """Within the block, SIGINT/SIGTERM/SIGHUP raise `Interrupted` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
    _state.update(depth=0, pending=None, fired=False)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def deferred():
    """Hold stop signals until the block ends (see the module docstring)."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if not _state["depth"] and _state["pending"] is not None and not _state["fired"]:
            signum, _state["pending"] = _state["pending"], None
            _state["fired"] = True
            raise Interrupted(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def as_worker(parent_pid: int) -> None:
    """Signal set-up of a worker process (call first thing in the worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)
