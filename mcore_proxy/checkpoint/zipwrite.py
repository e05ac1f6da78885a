"""The zip layout `torch.save` writes, produced without torch's C++ writer, hashed as it is written.

A `torch.save` file is a zip archive of stored (uncompressed) members under one folder:
`{archive}/data.pkl` (the pickled structure), `{archive}/data/{key}` (one member per storage, its
data aligned to 64 bytes so `torch.load(mmap=True)` can map it), `.format_version`,
`.storage_alignment`, `byteorder` and `version` (checked with torch 2.13's writer; `torch.load`
of torch >= 1.6 reads it, and it checks no CRC, but we write correct ones so any zip tool does).

Why not `torch._C.PyTorchFileWriter`: it copies every record through its own buffer and computes
the CRC in the writing thread; a failed write surfaces as `RuntimeError` (not `OSError`), and its
destructor can abort the process after one; and the bytes pass by unseen, so a manifest has to
read every file a second time to hash it. Here tensors are written straight from their memory
with `os.write`, the CRC is computed with zlib (which releases the GIL), and sha256 runs in a
helper thread over the same buffers while the next ones are written.
"""
from __future__ import annotations

import hashlib
import os
import queue
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

ALIGNMENT = 64
_SMALL = 1 << 16              # writes below this are gathered into one system call
_ZIP64_LIMIT = 0xFFFFFFFF
_FB_EXTRA = 0x4246            # torch's padding extra field ("FB")


class HashingSink:
    """A file written front to back; `sha256` of every byte is computed in a helper thread.

    `write` takes any buffer (bytes, memoryview of a tensor's memory); large buffers are written
    in place, without a copy, and handed to the hashing thread, which holds at most `depth`
    buffers (bounding the memory kept alive to about one tensor). `close()` returns the hex digest.
    OSError from the file system (ENOSPC, EFBIG, EIO) propagates from `write`/`close` unchanged.
    """

    def __init__(self, path: str | Path, depth: int = 2, start: int = 0):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.position = start
        self._pending = bytearray()
        self._hash = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._hash_loop, name="sha256", daemon=True)
        self._thread.start()
        self.digest: str | None = None

    def _hash_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._hash.update(item)

    def write(self, buf) -> None:
        view = memoryview(buf).cast("B")
        if len(view) < _SMALL:
            self._pending += view
            if len(self._pending) >= _SMALL:
                self._flush_pending()
        else:
            self._flush_pending()
            self._write_all(view)
            self._queue.put(view)
        self.position += len(view)

    def _flush_pending(self) -> None:
        if self._pending:
            data = bytes(self._pending)
            self._pending.clear()
            self._write_all(memoryview(data))
            self._queue.put(data)

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):  # os.write may write less than asked
            done += os.write(self._fd, view[done:])

    def close(self) -> str:
        """Flush, close the file and return its sha256 (hex)."""
        if self.digest is None:
            try:
                self._flush_pending()
            finally:
                self._queue.put(None)
                self._thread.join()
                os.close(self._fd)
            self.digest = self._hash.hexdigest()
        return self.digest

    def abort(self) -> None:
        """Stop hashing and close the descriptor after a failure (the caller removes the file)."""
        if self.digest is None:
            self._queue.put(None)
            self._thread.join()
            os.close(self._fd)
            self.digest = ""


@dataclass(frozen=True)
class _Member:
    name: bytes
    offset: int      # of its local header, relative to the archive's start
    size: int
    crc: int


def _nbytes(buf) -> int:
    return memoryview(buf).nbytes


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
        GLU shard), data aligned to 64 bytes; CRC first, then header and data."""
        buffers = [memoryview(b).cast("B") for b in buffers]
        size = sum(len(b) for b in buffers)
        crc = 0
        for b in buffers:
            crc = zlib.crc32(b, crc)
        encoded = f"{self.archive}/{name}".encode("utf-8")
        offset = self.sink.position - self.base
        zip64 = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        head = 30 + len(encoded) + len(extra) + 4
        pad = (-(offset + head)) % ALIGNMENT  # relative to the archive, as torch aligns
        extra += struct.pack("<HH", _FB_EXTRA, pad) + b"Z" * pad
        small = _ZIP64_LIMIT if zip64 else size
        self.sink.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0x0800, 0, 0, 0,
                                    crc, small, small, len(encoded), len(extra)) + encoded + extra)
        for b in buffers:
            self.sink.write(b)
        self.members.append(_Member(encoded, offset, size, crc))

    def finish(self) -> None:
        """The central directory and end records (zip64 ones when sizes or offsets need them)."""
        start = self.sink.position - self.base
        out = bytearray()
        for m in self.members:
            big = m.size >= _ZIP64_LIMIT or m.offset >= _ZIP64_LIMIT
            fields = b""
            if m.size >= _ZIP64_LIMIT:
                fields += struct.pack("<QQ", m.size, m.size)
            if m.offset >= _ZIP64_LIMIT:
                fields += struct.pack("<Q", m.offset)
            extra = struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""
            size = min(m.size, _ZIP64_LIMIT)
            offset = min(m.offset, _ZIP64_LIMIT)
            out += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45 if big else 20, 45 if big else 20,
                               0x0800, 0, 0, 0, m.crc, size, size, len(m.name), len(extra), 0, 0, 0, 0,
                               offset) + m.name + extra
        size = len(out)
        count = len(self.members)
        if count >= 0xFFFF or start >= _ZIP64_LIMIT or size >= _ZIP64_LIMIT:
            eocd64 = start + size
            out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, size, start)
            out += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                           min(size, _ZIP64_LIMIT), min(start, _ZIP64_LIMIT), 0)
        self.sink.write(out)


def torch_archive_records(writer: TorchZipWriter, pickled: bytes) -> None:
    """The members `torch.save` writes besides the storages, then the directory."""
    writer.write_member("data.pkl", [pickled])
    writer.write_member(".format_version", [b"1"])
    writer.write_member(".storage_alignment", [str(ALIGNMENT).encode()])
    writer.write_member("byteorder", [sys.byteorder.encode()])
    writer.write_member("version", [b"3\n"])
    writer.finish()
