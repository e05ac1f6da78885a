"""Keep a streaming process's resident memory flat.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), after
which tensor-sized buffers come from the heap, where freed blocks fragment and are not returned
to the system: peak RSS then grows with the number of layers instead of staying at one layer.
A fixed 1 MiB threshold keeps every tensor buffer in its own mapping, returned on free.
Measured in bench/RESULTS.md (convert): 566 -> 245 MiB at 16 layers, 837 -> 247 MiB at 32.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

_M_MMAP_THRESHOLD = -3
_done = False


def return_freed_buffers_to_os(threshold: int = 1 << 20) -> bool:
    """Set glibc's mmap threshold (process-wide, idempotent); False where libc is not glibc."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        logging.getLogger(__name__).debug("mallopt unavailable; resident memory may grow with layers")
    return _done


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def prefer_huge_pages(address: int, length: int) -> None:
    """Ask Linux to back the 2 MiB-aligned interior of a fresh buffer with transparent huge pages
    (a hint; nothing happens elsewhere or where THP is off). A tensor-sized buffer is a fresh
    mapping (`return_freed_buffers_to_os`), and filling it with 4 KiB pages costs one fault and
    one zeroed page each: reading 840 MiB into fresh buffers took 0.51 s, 0.13 s with huge pages
    (bench/RESULTS.md, real width)."""
    start = (address + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (address + length) & ~(_HUGE_PAGE - 1)
    madvise = _libc_madvise() if end - start >= _HUGE_PAGE else None
    if madvise:
        madvise(start, end - start, _MADV_HUGEPAGE)  # EINVAL where THP is off: a hint only


_torch_expected = False


def expect_torch() -> None:
    """Say that this command will make tensors, so that `import_torch_while_waiting` may import
    torch early (inspect never calls it and stays torch-free)."""
    global _torch_expected
    _torch_expected = True


def import_torch_while_waiting() -> None:
    """Import torch now if the command expects it: called where this process would otherwise wait
    for others (rank files being parsed by forked workers, `torchfile.open_many`). Importing torch
    costs 1.8 s warm and 2.6 s cold here, as much as indexing 256 rank files; done after the workers
    are forked (never fork with a half-imported torch), the two overlap (bench/RESULTS.md)."""
    if _torch_expected:
        import torch  # noqa: F401
