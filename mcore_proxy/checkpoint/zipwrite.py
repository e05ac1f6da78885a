"""The zip layout `torch.save` writes, produced without torch's C++ writer, hashed as it is written.

A `torch.save` file is a zip archive of stored (uncompressed) members under one folder:
`{archive}/data.pkl` (the pickled structure), `{archive}/data/{key}` (one member per storage, its
data aligned to 64 bytes so `torch.load(mmap=True)` can map it), `.format_version`,
`.storage_alignment`, `byteorder` and `version` (checked with torch 2.13's writer; `torch.load`
of torch >= 1.6 reads it, and it checks no CRC, but we write correct ones so any zip tool does).

Why not `torch._C.PyTorchFileWriter` (measured against it in bench/bench_zipwrite.py): it
copies every record through its own buffer and computes the CRC in the writing thread; a failed
write surfaces as `RuntimeError` (not `OSError`), and its destructor can abort the process after
one; the bytes pass by unseen, so a manifest has to read every file a second time to hash it.

Here the writing thread only writes: each member's local header goes out with a placeholder
CRC, followed by the tensor's bytes straight from its memory (`os.writev`, no copy). A helper
thread then, in file order, computes the member's CRC-32 (zlib releases the GIL), patches the
header in place (`os.pwrite`), feeds header and data to sha256, and asks the kernel to start
writing back what it has hashed (`sync_file_range`), so that the fsync at close has little left
to wait for. A write error is a plain OSError (ENOSPC, EFBIG, EIO) from `write` or `close`.
Zip64 records are written for members or offsets past `ZIP64_LIMIT` (a module constant, so tests
can lower it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from mcore_proxy.core.tensors import HostTensor

ALIGNMENT = 64
ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on get zip64 records (tests lower it)
_FULL32, _FULL16 = 0xFFFFFFFF, 0xFFFF  # the values that tell a reader "see the zip64 record"
WRITEBACK_EVERY = 32 << 20  # start the kernel's writeback after this many hashed bytes
_FB_EXTRA = 0x4246  # torch's padding extra field ("FB")
_CRC_AT = 14  # offset of the CRC-32 field in a local file header


def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def as_bytes(buf) -> memoryview:
    """A flat byte view of a buffer: bytes, bytearray, memoryview, a numpy array, a contiguous
    HostTensor or a contiguous CPU tensor (any dtype, bf16 too: viewed as uint8; nothing is copied)."""
    if isinstance(buf, HostTensor):
        if not buf.is_contiguous():
            raise ValueError("as_bytes needs a contiguous tensor")
        buf = buf.array.reshape(-1).view("u1")
    elif hasattr(buf, "untyped_storage"):  # a torch tensor
        import torch

        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("as_bytes needs a contiguous CPU tensor")
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy() if buf.numel() else b""
    return memoryview(buf).cast("B")


class HashingSink:
    """A file written front to back; sha256 (and the CRC of deferred member headers) in a helper
    thread that holds at most `depth` pending writes (bounding the memory kept alive to a few
    tensors). `close()` returns (size, sha256 hex) once every byte is hashed and on disk (fsync)."""

    def __init__(self, path: str | Path, depth: int = 4):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.position = 0
        self._hash = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._hashed = self._kicked = 0
        self._thread = threading.Thread(target=self._loop, name=f"sha256 {self.path.name}", daemon=True)
        self._thread.start()
        self.digest: str | None = None

    # -- the helper thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()  # `drain`: everything before it is done
            elif self._error is None:  # after an error: keep draining so the writer never blocks
                try:
                    self._digest(*item)
                except BaseException as err:  # noqa: BLE001 - re-raised in the writing thread
                    self._error = err

    def _digest(self, offset: int, header, buffers, member) -> None:
        if member is not None:  # a member written with a placeholder CRC: compute it, patch it
            crc = 0
            for b in buffers:
                crc = zlib.crc32(b, crc)
            member.crc = crc
            struct.pack_into("<I", header, _CRC_AT, crc)
            os.pwrite(self._fd, header, offset)
        for b in (header, *buffers):
            self._hash.update(b)
            self._hashed += len(b)
        if _SYNC_FILE_RANGE is not None and self._hashed - self._kicked >= WRITEBACK_EVERY:
            _SYNC_FILE_RANGE(self._fd, self._kicked, self._hashed - self._kicked, _SYNC_FILE_RANGE_WRITE)
            self._kicked = self._hashed

    # -- the writing thread ------------------------------------------------------------------------
    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, *buffers, header: bytearray | None = None, member=None) -> None:
        """Write `header` (if any) and `buffers` back to back now; they are hashed later, in order.
        With `member`, the header's CRC field is computed over the buffers and patched first."""
        self._check()
        views = [as_bytes(b) for b in buffers]
        parts = ([memoryview(header)] if header is not None else []) + views
        total = sum(len(p) for p in parts)
        done = 0
        while done < total:  # os.writev may write less than asked
            n = os.writev(self._fd, _rest(parts, done))
            done += n
        self._queue.put((self.position, header if header is not None else b"", views, member))
        self.position += total

    def drain(self) -> None:
        """Wait until the helper thread has processed everything written (CRCs are known)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._check()

    def close(self) -> tuple[int, str]:
        """Hash the rest, fsync, close; -> (size in bytes, sha256 hex)."""
        if self.digest is None:
            try:
                self._queue.put(None)
                self._thread.join()
                self._check()
                os.fsync(self._fd)
            finally:
                self._close_fd()
            self.digest = self._hash.hexdigest()
        return self.position, self.digest

    def abort(self) -> None:
        """Stop the helper thread and close the file after a failure (the caller removes it)."""
        if self.digest is None:
            self._error = self._error or RuntimeError("aborted")
            self._queue.put(None)
            self._thread.join()
            self._close_fd()
            self.digest = ""

    def __enter__(self) -> "HashingSink":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is not None:
            self.abort()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _rest(parts: list[memoryview], skip: int) -> list[memoryview]:
    out = []
    for p in parts:
        if skip >= len(p):
            skip -= len(p)
            continue
        out.append(p[skip:])
        skip = 0
    return out


@dataclass
class _Member:
    name: bytes
    offset: int  # of its local header, relative to the archive's start
    size: int
    crc: int | None = None  # filled in by the sink's helper thread


class TorchZipWriter:
    """Writes one torch zip archive into `sink`, starting at the sink's current position.

    Several archives may follow each other in one sink (a `.distcp` file holds one archive per
    chunk): offsets inside an archive are relative to its first byte, as `torch.save` into an open
    file at an offset makes them.
    """

    def __init__(self, sink: HashingSink, archive: str = "archive"):
        self.sink, self.archive = sink, archive
        self.base = sink.position
        self.members: list[_Member] = []

    def write_member(self, name: str, buffers) -> None:
        """One stored member made of `buffers` written back to back (e.g. the gate and up rows of a
        GLU shard), its data aligned to 64 bytes; the CRC is filled in by the sink's helper thread."""
        views = [as_bytes(b) for b in buffers]
        size = sum(len(b) for b in views)
        encoded = f"{self.archive}/{name}".encode("utf-8")
        offset = self.sink.position - self.base
        zip64 = size >= ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        head = 30 + len(encoded) + len(extra) + 4
        pad = (-(offset + head)) % ALIGNMENT  # relative to the archive, as torch aligns
        extra += struct.pack("<HH", _FB_EXTRA, pad) + b"Z" * pad
        small = _FULL32 if zip64 else size
        header = bytearray(
            struct.pack(
                "<IHHHHHIIIHH",
                0x04034B50,
                45 if zip64 else 20,
                0x0800,
                0,
                0,
                0,
                0,
                small,
                small,
                len(encoded),
                len(extra),
            )
            + encoded
            + extra
        )
        member = _Member(encoded, offset, size)
        self.sink.write(*views, header=header, member=member)
        self.members.append(member)

    def finish(self) -> None:
        """The central directory and end records (zip64 ones when sizes or offsets need them)."""
        self.sink.drain()  # every member's CRC is known
        start = self.sink.position - self.base
        out = bytearray()
        for m in self.members:
            big = m.size >= ZIP64_LIMIT or m.offset >= ZIP64_LIMIT
            fields = b""
            if m.size >= ZIP64_LIMIT:
                fields += struct.pack("<QQ", m.size, m.size)
            if m.offset >= ZIP64_LIMIT:
                fields += struct.pack("<Q", m.offset)
            extra = struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""
            size = _FULL32 if m.size >= ZIP64_LIMIT else m.size
            offset = _FULL32 if m.offset >= ZIP64_LIMIT else m.offset
            out += (
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    45 if big else 20,
                    45 if big else 20,
                    0x0800,
                    0,
                    0,
                    0,
                    m.crc,
                    size,
                    size,
                    len(m.name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    offset,
                )
                + m.name
                + extra
            )
        size = len(out)
        count = len(self.members)
        zip64 = count >= _FULL16 or start >= ZIP64_LIMIT or size >= ZIP64_LIMIT
        if zip64:
            eocd64 = start + size
            out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, size, start)
            out += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
        entries = _FULL16 if zip64 else count
        out += struct.pack(
            "<IHHHHIIH", 0x06054B50, 0, 0, entries, entries, _FULL32 if zip64 else size, _FULL32 if zip64 else start, 0
        )
        self.sink.write(bytes(out))


def torch_archive_records(writer: TorchZipWriter, pickled: bytes) -> None:
    """The members `torch.save` writes besides the storages, then the directory."""
    writer.write_member("data.pkl", [pickled])
    writer.write_member(".format_version", [b"1"])
    writer.write_member(".storage_alignment", [str(ALIGNMENT).encode()])
    writer.write_member("byteorder", [sys.byteorder.encode()])
    writer.write_member("version", [b"3\n"])
    writer.finish()
