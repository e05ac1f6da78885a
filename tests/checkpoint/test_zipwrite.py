"""The pure-Python torch zip writer (`checkpoint/zipwrite.py`): what it writes loads in torch
(plain, `weights_only`, `mmap`), passes zip tools' CRC checks, and hashes to the sha256 of the
bytes on disk. Zip64 records are exercised with a lowered threshold: a real >4 GiB member is not
affordable in CI, and the code paths are the same ones a large tensor takes."""

from __future__ import annotations

import hashlib
import io
import shutil
import struct
import subprocess
import zipfile

import pytest
import torch

from mcore_proxy.checkpoint import zipwrite
from mcore_proxy.checkpoint.torchfile import TorchFile, TorchFileWriter, file_sha256, save_object
from mcore_proxy.checkpoint.zipwrite import HashingSink

ZIP64_EXTRA = 0x0001


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "iteration": 3,
        "model": {
            "a": torch.randn(33, 17, generator=g).bfloat16(),
            "b": torch.arange(1000, dtype=torch.int64),
            "c": torch.randn(5, generator=g),
            "empty": torch.zeros(0, 4),
        },
    }


def _assert_loads_everywhere(path, state) -> None:
    for kwargs in ({}, {"weights_only": True}, {"weights_only": True, "mmap": True}):
        back = torch.load(path, map_location="cpu", **kwargs)
        assert back["iteration"] == state["iteration"]
        for k, v in state["model"].items():
            assert back["model"][k].dtype == v.dtype and torch.equal(back["model"][k], v), (kwargs, k)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC-32 right
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    lazy = TorchFile(path)  # our own reader: offsets found, bytes right
    assert torch.equal(lazy.obj["model"]["a"].load(), state["model"]["a"])
    lazy.close()
    if shutil.which("unzip"):
        run = subprocess.run(["unzip", "-tq", str(path)], capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr


def _zip64_fields(path) -> tuple[int, bool]:
    """(central directory entries carrying a zip64 extra field, whether a zip64 end record exists)."""
    with zipfile.ZipFile(path) as zf:
        entries = 0
        for info in zf.infolist():
            extra, i = info.extra, 0
            while i + 4 <= len(extra):
                tag, n = struct.unpack_from("<HH", extra, i)
                entries += tag == ZIP64_EXTRA
                i += 4 + n
    return entries, b"PK\x06\x06" in path.read_bytes()[-200:]


def test_a_file_loads_in_torch_and_zip_tools_and_hashes_while_written(tmp_path):
    state, path = _state(), tmp_path / "f.pt"
    writer = save_object(state, path)
    data = path.read_bytes()
    assert (
        (writer.size, writer.sha256)
        == (len(data), hashlib.sha256(data).hexdigest())
        == (path.stat().st_size, file_sha256(path))
    )
    _assert_loads_everywhere(path, state)
    assert _zip64_fields(path) == (0, False)  # small file: plain zip records only
    with zipfile.ZipFile(path) as zf:  # storages aligned for torch.load(mmap=True)
        for info in zf.infolist():
            if "/data/" in info.filename:
                start = (
                    info.header_offset
                    + 30
                    + len(info.filename.encode())
                    + struct.unpack_from("<H", data, info.header_offset + 28)[0]
                )
                assert start % zipwrite.ALIGNMENT == 0, info.filename


def test_zip64_records_when_sizes_and_offsets_pass_the_threshold(tmp_path, monkeypatch):
    """Threshold 512 bytes: the int64 storage (8000 bytes) and the bf16 one get zip64 sizes, the
    members after the first ones zip64 offsets, and the directory a zip64 end record."""
    monkeypatch.setattr(zipwrite, "ZIP64_LIMIT", 512)
    state, path = _state(), tmp_path / "f64.pt"
    writer = save_object(state, path)
    assert writer.sha256 == file_sha256(path)
    entries, end64 = _zip64_fields(path)
    assert end64 and entries >= 7
    _assert_loads_everywhere(path, state)


def test_zip64_end_record_for_a_directory_past_the_threshold_only(tmp_path, monkeypatch):
    """Every member below the threshold but the directory's start above it: only the end records
    switch to zip64."""
    monkeypatch.setattr(zipwrite, "ZIP64_LIMIT", 9000)
    state, path = _state(), tmp_path / "end64.pt"
    save_object(state, path)
    assert _zip64_fields(path)[1]
    _assert_loads_everywhere(path, state)


def test_several_archives_in_one_file_each_load_from_their_offset(tmp_path, monkeypatch):
    """A torch_dist data file holds one archive per chunk, offsets relative to each archive."""
    monkeypatch.setattr(zipwrite, "ZIP64_LIMIT", 512)
    path, spans = tmp_path / "__0_0.distcp", []
    tensors = [torch.randn(40, 9), torch.arange(300, dtype=torch.int16), torch.ones(3, dtype=torch.bool)]
    with HashingSink(path) as sink:
        for t in tensors:
            start = sink.position
            save_object(t, sink=sink)
            spans.append((start, sink.position - start))
        size, digest = sink.close()
    data = path.read_bytes()
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    for t, (start, length) in zip(tensors, spans):
        blob = io.BytesIO(data[start : start + length])
        assert torch.equal(torch.load(blob, weights_only=True), t)


def test_glu_pieces_are_stored_as_their_concatenation(tmp_path):
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    w = TorchFileWriter(tmp_path / "glu.pt")
    rec = w.add_pieces([gate, up[:, :]])
    w.close({"w": rec})
    assert torch.equal(torch.load(tmp_path / "glu.pt", weights_only=True)["w"], torch.cat([gate, up]))


def test_a_write_error_is_an_oserror_and_the_writer_stops(tmp_path):
    """/dev/full: every write fails with ENOSPC, a real failure of the real system call."""
    w = TorchFileWriter.__new__(TorchFileWriter)
    sink = HashingSink("/dev/full")
    TorchFileWriter.__init__(w, sink=sink)
    with pytest.raises(OSError) as err:
        for _ in range(64):
            w.add(torch.zeros(1 << 20))
        w.close({})
        sink.close()
    assert err.value.errno == 28
    sink.abort()
