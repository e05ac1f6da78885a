"""Read-only file descriptors of many checkpoint files, a bounded number open at once.

A legacy checkpoint of a large job has one rank file per TP x PP x EP rank: 512 to several
thousand files, more than a process may hold open (`ulimit -n`, 1,024 by default). Readers index
every file once and then pread the tensors they need, in whatever order the writer asks, so they
borrow descriptors from one pool instead of holding one per file: a file's descriptor is opened on
first use and closed again when the pool is full and it is the least recently used one not being
read (`borrow` is a context manager; threads may share the pool). Each descriptor is opened with
POSIX_FADV_RANDOM: readers pread exactly the bytes they need, and the kernel's readahead would
pull in the dropped experts beside them (bench/RESULTS.md, DeepSeek-V3 scale).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

try:
    import resource
except ImportError:  # not on every platform; the pool then keeps its default bound
    resource = None

DEFAULT_LIMIT = 128  # far below 1,024; a quarter of a lower soft limit


def default_limit() -> int:
    """How many descriptors the pool keeps open: 128, or a quarter of a lower `ulimit -n` (the
    rest is left to the interpreter, sockets, output files and libraries), at least 4."""
    if resource is None:
        return DEFAULT_LIMIT
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_LIMIT
    return max(4, min(DEFAULT_LIMIT, soft // 4))


WILL_NEED_CHUNK = 2 << 20


def will_need(fd: int, offset: int, length: int) -> None:
    """Start reading bytes [offset, offset+length) of `fd` in the background (POSIX_FADV_WILLNEED,
    a hint: nothing happens where unsupported). Linux reads at most about one device request or
    readahead window per call (measured here: one call for 768 MiB read 8 MiB of it), so the
    range is asked for in 2 MiB pieces; a tensor of 56 MiB was otherwise read ahead by its first
    few MiB only (bench/RESULTS.md, real width)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for start in range(offset, offset + length, WILL_NEED_CHUNK):
        os.posix_fadvise(fd, start, min(WILL_NEED_CHUNK, offset + length - start), os.POSIX_FADV_WILLNEED)


# A torch zip's metadata when nothing better is known: data.pkl at its start (12-60 KiB in the
# DeepSeek-V3 benches) and the central directory at its end (2-17 KiB there).
HEAD_BYTES, TAIL_BYTES = 64 << 10, 32 << 10


class MetadataReadAhead:
    """Asks the kernel, from `threads` background threads, for the first `head` and the last `tail`
    bytes of each of many files in order, at most `depth` files ahead of their reader (`consumed`
    after each); what a parse reads beyond them it reads on demand.

    Indexing thousands of rank files from a cold disk waits on small reads, one file after another
    in each parsing process; asked for all at once, the disk serves them in parallel. Opening a
    file on a cold disk waits too (its folder and inode: 0.29 s for 2,048 rank files in one thread),
    so several threads open them (bench/RESULTS.md, 2,048 rank folders). At most `threads`
    descriptors are open at a time."""

    def __init__(self, paths, head: int = HEAD_BYTES, tail: int = TAIL_BYTES, depth: int = 256, threads: int = 4):
        self._head, self._tail = head, tail
        self._slots = threading.Semaphore(depth)
        self._stopped = False
        self._paths, self._lock = iter(list(paths)), threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        if hasattr(os, "posix_fadvise"):
            for t in self._threads:
                t.start()

    def _next(self):
        with self._lock:
            return next(self._paths, None)

    def _run(self) -> None:
        while True:
            self._slots.acquire()
            path = None if self._stopped else self._next()
            if path is None:
                return
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # the parse says what is wrong with the file
            try:
                size = os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, min(size, self._head), os.POSIX_FADV_WILLNEED)
                os.posix_fadvise(fd, max(0, size - self._tail), self._tail, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def consumed(self) -> None:
        """One more file has been read: the threads may ask for one more."""
        self._slots.release()

    def close(self) -> None:
        self._stopped = True
        for _ in self._threads:
            self._slots.release()


class DescriptorPool:
    """Path -> an open read-only descriptor, at most `limit` idle ones kept (least recently used
    closed first; one being read is never closed under its reader)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or default_limit()
        self._open: OrderedDict[Path, int] = OrderedDict()
        self._busy: dict[Path, int] = {}  # path -> readers inside `borrow`
        self._lock = threading.Lock()
        self.opened = 0  # descriptors opened so far (tests, benches)

    def _evict(self) -> None:
        for path in list(self._open):
            if len(self._open) < self.limit:
                return
            if not self._busy.get(path):
                os.close(self._open.pop(path))

    @contextmanager
    def borrow(self, path: Path):
        """The open descriptor of `path` for the duration of the block (OSError if it cannot be
        opened: the caller names the file)."""
        with self._lock:
            fd = self._open.get(path)
            if fd is None:
                self._evict()
                fd = os.open(path, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                self._open[path] = fd
                self.opened += 1
            self._open.move_to_end(path)
            self._busy[path] = self._busy.get(path, 0) + 1
        try:
            yield fd
        finally:
            with self._lock:
                self._busy[path] -= 1
                if not self._busy[path]:
                    del self._busy[path]

    def forget(self, path: Path) -> None:
        """Close the descriptor of `path` if it is open and idle (its file is done with)."""
        with self._lock:
            if path in self._open and not self._busy.get(path):
                os.close(self._open.pop(path))

    def open_count(self) -> int:
        return len(self._open)


POOL = DescriptorPool()
