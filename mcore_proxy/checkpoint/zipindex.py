"""The zip directory of a torch.save file, read with a struct loop instead of `zipfile.ZipFile`.

`zipfile` builds a `ZipInfo` object per member and a reader object per read: 77 + 27 us per rank
file of 20-40 members, about a fifth of parsing one (bench/RESULTS.md, 2,048 rank folders). Only the
layout torch writes is read here: one disk, no archive comment, the end records where they say, the
directory right before them, no encrypted member, sizes and offsets in the zip64 extra field when
they do not fit 32 bits. Anything else gives None, and the caller lets `zipfile` read the file as
before, so a damaged or unusual file meets the same checks and errors it always did.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from typing import BinaryIO, NamedTuple

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes, right before it
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # 56 bytes, right before the locator
_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory header, 46 bytes
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header, 30 bytes
_FULL32, _FULL16 = 0xFFFFFFFF, 0xFFFF
_END_RECORDS = _ZIP64_EOCD.size + _ZIP64_LOCATOR.size + _EOCD.size


class ZipMember(NamedTuple):
    """What the readers use of a `zipfile.ZipInfo`, under the same names."""

    filename: str
    header_offset: int
    file_size: int
    compress_size: int
    compress_type: int
    CRC: int
    flag_bits: int
    orig_filename: str


class ZipDirectory(NamedTuple):
    members: list[ZipMember]
    start_dir: int  # where the directory begins: what lies beyond is the zip's own records
    end: int  # the file's size


def _pread(fh: BinaryIO, offset: int, length: int) -> bytes:
    """Exactly these bytes (not a buffer's worth around them: the bytes of a tensor that is never
    read stay on disk, `tests/checkpoint/test_readahead.py`)."""
    return os.pread(fh.fileno(), length, offset)


def read_directory(fh: BinaryIO) -> ZipDirectory | None:
    """The members of the zip file `fh`, or None when it is not laid out as torch writes it."""
    end = fh.seek(0, os.SEEK_END)
    if end < _EOCD.size:
        return None
    tail_start = max(0, end - _END_RECORDS)
    tail = _pread(fh, tail_start, end - tail_start)
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != b"PK\x05\x06" or comment or disk or cd_disk or n_disk != n_total:
        return None
    cd_end = end - _EOCD.size
    locator = cd_end - _ZIP64_LOCATOR.size
    if locator >= tail_start and tail[locator - tail_start : locator - tail_start + 4] == b"PK\x06\x07":
        _, z64_disk, z64_offset, disks = _ZIP64_LOCATOR.unpack_from(tail, locator - tail_start)
        if z64_disk or disks != 1 or z64_offset + _ZIP64_EOCD.size != locator or z64_offset < tail_start:
            return None
        sig, _size, _made, _needed, disk, cd_disk, n_disk, n_total, cd_size, cd_offset = _ZIP64_EOCD.unpack_from(
            tail, z64_offset - tail_start
        )
        if sig != b"PK\x06\x06" or disk or cd_disk or n_disk != n_total:
            return None
        cd_end = z64_offset
    elif _FULL32 in (cd_size, cd_offset) or n_total == _FULL16:
        return None  # zip64 values without the zip64 records
    if cd_offset + cd_size != cd_end:
        return None  # bytes before the archive or between its parts: zipfile knows those
    if cd_offset >= tail_start:
        cd = tail[cd_offset - tail_start : cd_end - tail_start]
    else:
        cd = _pread(fh, cd_offset, cd_size)
    members = _entries(cd, n_total)
    return None if members is None else ZipDirectory(members, cd_offset, end)


def _entries(cd: bytes, count: int) -> list[ZipMember] | None:
    out, pos = [], 0
    while pos < len(cd):
        if pos + _ENTRY.size > len(cd):
            return None
        (sig, _made, needed, flags, method, _t, _d, crc, csize, usize, nlen, elen, clen, disk, _ia, _ea, offset) = (
            _ENTRY.unpack_from(cd, pos)
        )
        name_at = pos + _ENTRY.size
        pos = name_at + nlen + elen + clen
        if sig != b"PK\x01\x02" or pos > len(cd) or flags & 0x1:  # 0x1: encrypted
            return None
        # zipfile refuses a member needing a newer zip version, and a malformed extra field
        if needed & 0xFF > zipfile.MAX_EXTRACT_VERSION or not _well_formed(cd[name_at + nlen : name_at + nlen + elen]):
            return None
        if _FULL32 in (usize, csize, offset) or disk == _FULL16:
            sizes = _zip64_extra(cd[name_at + nlen : name_at + nlen + elen], usize, csize, offset, disk)
            if sizes is None:
                return None
            usize, csize, offset, disk = sizes
        if disk:
            return None
        full = cd[name_at : name_at + nlen].decode("utf-8" if flags & 0x800 else "cp437")
        # as zipfile.ZipInfo names a member: up to a NUL, the name as stored kept beside
        out.append(ZipMember(full.split("\0", 1)[0], offset, usize, csize, method, crc, flags, full))
    return out if len(out) == count else None


def _well_formed(extra: bytes) -> bool:
    """An extra field is a chain of (tag, length, body) records that ends where the field ends."""
    pos = 0
    while pos + 4 <= len(extra):
        pos += 4 + struct.unpack_from("<H", extra, pos + 2)[0]
    return pos <= len(extra)


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int, disk: int) -> tuple[int, ...] | None:
    """The 64-bit values of the zip64 extra field (id 1), in the order the header's full fields take."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        pos += 4 + size
        if tag != 1:
            continue
        values, at = [], 0
        for value, width in ((usize, 8), (csize, 8), (offset, 8), (disk, 4)):
            full = _FULL16 if width == 4 else _FULL32
            if value == full:
                if at + width > len(body):
                    return None
                value = int.from_bytes(body[at : at + width], "little")
                at += width
            values.append(value)
        return tuple(values)
    return None


def read_stored(fh: BinaryIO, member: ZipMember) -> bytes:
    """The bytes of a stored member, checked as zipfile checks them when it reads one: the local
    header's signature and name, the length, the CRC-32. zipfile.BadZipFile otherwise."""
    header = _pread(fh, member.header_offset, _LOCAL.size)
    if len(header) != _LOCAL.size:
        raise zipfile.BadZipFile(f"truncated local header of {member.filename}")
    sig, _needed, flags, method, _t, _d, _crc, _cs, _us, nlen, elen = _LOCAL.unpack(header)
    if sig != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header of {member.filename}")
    name = _pread(fh, member.header_offset + _LOCAL.size, nlen)
    if name != member.orig_filename.encode("utf-8" if member.flag_bits & 0x800 else "cp437"):
        raise zipfile.BadZipFile(f"file name in directory {member.orig_filename!r} and header {name!r} differ")
    if method != zipfile.ZIP_STORED or member.compress_type != zipfile.ZIP_STORED or flags & 0x1:
        raise zipfile.BadZipFile(f"{member.filename} is compressed or encrypted")
    data = _pread(fh, member.header_offset + _LOCAL.size + nlen + elen, member.compress_size)
    if len(data) != member.compress_size or member.compress_size != member.file_size:
        raise zipfile.BadZipFile(f"{member.filename} ends early")
    if zlib.crc32(data) != member.CRC:
        raise zipfile.BadZipFile(f"bad CRC-32 for {member.filename}")
    return data
