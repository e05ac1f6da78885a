"""Read-ahead of exactly the bytes a conversion reads next (`ModelView.prefetch`): after the page
cache of the rank files is emptied, prefetching a kept expert brings its pages in, and a dropped
expert stored right after it stays on disk (the files are opened POSIX_FADV_RANDOM, so the
kernel's own readahead does not pull neighbours in)."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import pytest

from mcore_proxy.checkpoint import open_checkpoint, write_checkpoint
from mcore_proxy.checkpoint.target import resolve_target
from mcore_proxy.testing.synthetic import SyntheticMoEView, synthetic_args

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p


def resident(path, offset: int, length: int) -> float:
    """Fraction of the pages of bytes [offset, offset+length) of `path` in the page cache (mincore
    on a read-only shared mapping, which maps the page cache itself)."""
    first, last = offset // PAGE * PAGE, -(-(offset + length) // PAGE) * PAGE
    vec = (ctypes.c_ubyte * ((last - first) // PAGE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(
            None, ctypes.c_size_t(last - first), mmap.PROT_READ, mmap.MAP_SHARED, fd, ctypes.c_long(first)
        )
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(last - first), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(last - first))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / len(vec)


def evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore (Linux)")
def test_prefetch_reads_ahead_only_the_bytes_asked_for(tmp_path):
    view = SyntheticMoEView(synthetic_args(num_layers=1, hidden=256, experts=4, ffn=512, heads=4, vocab=256))
    ckpt = open_checkpoint(
        write_checkpoint(view, tmp_path / "ckpt", resolve_target(view, tp=1, pp=1, ep=1), progress=False)
    )
    kept, dropped = (f"decoder.layers.0.mlp.experts.{e}.linear_fc1.weight" for e in (1, 2))
    ((path, k_off, k_len),) = ckpt.byte_ranges(kept)
    ((path2, d_off, d_len),) = ckpt.byte_ranges(dropped)
    assert path == path2 and k_len == d_len == 1024 * 256 * 2 and d_off > k_off + k_len - PAGE
    evict(path)
    if resident(path, k_off, k_len) > 0.1:
        pytest.skip("this file system keeps the pages cached after POSIX_FADV_DONTNEED")
    ckpt.prefetch([kept])
    deadline = time.monotonic() + 10
    while resident(path, k_off, k_len) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert resident(path, k_off, k_len) == 1.0
    assert resident(path, d_off + PAGE, d_len - 2 * PAGE) == 0.0  # its neighbour, whole pages only
    assert ckpt.get(kept).shape == (1024, 256)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore (Linux)")
def test_opening_a_rank_file_reads_no_tensor_bytes(tmp_path):
    """The zip index and data.pkl go through zipfile's own descriptor; advised like the pread one,
    it does not pull the tensor bytes behind data.pkl into the page cache (at DeepSeek-V3 scale,
    256 rank files, that readahead was most of what `inspect` read: bench/RESULTS.md)."""
    import torch

    from mcore_proxy.checkpoint.torchfile import LazyTensor, TorchFile

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": {"n": list(range(100))}, "w": torch.randn(1 << 20)}, path)
    evict(path)
    if resident(path, 0, path.stat().st_size) > 0.1:
        pytest.skip("this file system keeps the pages cached after POSIX_FADV_DONTNEED")
    f = TorchFile(path)
    w = f.obj["w"]
    assert isinstance(w, LazyTensor)
    offset, length = f.byte_range(w.storage, 0, 1 << 20)
    assert resident(path, offset + PAGE, length - 2 * PAGE) == 0.0  # whole pages of the tensor only
    f.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore (Linux)")
def test_a_long_range_is_read_ahead_whole(tmp_path):
    """Linux reads about one readahead window per POSIX_FADV_WILLNEED call, so a tensor of tens of
    MiB asked for in one call came in by its first few MiB only; `will_need` asks in pieces."""
    from mcore_proxy.checkpoint.descriptors import will_need

    path, size = tmp_path / "long.bin", 64 << 20
    path.write_bytes(os.urandom(size))
    evict(path)
    if resident(path, 0, size) > 0.1:
        pytest.skip("this file system keeps the pages cached after POSIX_FADV_DONTNEED")
    fd = os.open(path, os.O_RDONLY)
    try:
        will_need(fd, PAGE, size - 2 * PAGE)
        deadline = time.monotonic() + 20
        while resident(path, PAGE, size - 2 * PAGE) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resident(path, PAGE, size - 2 * PAGE) == 1.0
    finally:
        os.close(fd)


def wait_resident(path, offset: int, length: int, seconds: float = 10) -> float:
    deadline = time.monotonic() + seconds
    while resident(path, offset, length) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return resident(path, offset, length)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore (Linux)")
def test_metadata_read_ahead_asks_for_heads_and_tails_a_bounded_number_of_files_ahead(tmp_path):
    """Indexing many rank files (`torchfile.open_many`) asks for each file's first 64 KiB (data.pkl)
    and last 32 KiB (the zip directory) from a background thread, `depth` files ahead of the
    parse: the middle of a file stays on disk, and the files beyond the depth wait their turn."""
    from mcore_proxy.checkpoint.descriptors import HEAD_BYTES, TAIL_BYTES, MetadataReadAhead

    size = 1 << 20
    paths = [tmp_path / f"rank{i}.pt" for i in range(4)]
    for p in paths:
        p.write_bytes(os.urandom(size))
        evict(p)
    if max(resident(p, 0, size) for p in paths) > 0.1:
        pytest.skip("this file system keeps the pages cached after POSIX_FADV_DONTNEED")
    ahead = MetadataReadAhead(paths, depth=2)
    try:
        for p in paths[:2]:
            assert wait_resident(p, 0, HEAD_BYTES) == 1.0
            assert wait_resident(p, size - TAIL_BYTES, TAIL_BYTES) == 1.0
            assert resident(p, HEAD_BYTES + PAGE, size - HEAD_BYTES - TAIL_BYTES - 2 * PAGE) == 0.0
        time.sleep(0.2)
        assert resident(paths[2], 0, HEAD_BYTES) == 0.0  # two files ahead of a reader that read none
        ahead.consumed()
        ahead.consumed()
        assert wait_resident(paths[3], 0, HEAD_BYTES) == 1.0
    finally:
        ahead.close()
