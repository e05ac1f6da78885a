"""Writing one rank file: torch's zip writer against mcore-proxy's (`checkpoint/zipwrite.py`).

    python bench/bench_zipwrite.py [--out bench/out] [--gib 1] [--repeat 5]

The same in-memory tensors (bf16, 64 MiB each, --gib in total) are written to one file, synced
to disk (fsync) inside the timing, interleaved and repeated --repeat times, the file deleted
after each run:

  floor        os.writev of the tensors' bytes, no zip layout, no hash
  torch.save   torch's C++ writer (PyTorchFileWriter: CRC-32 and a copy in the writing thread)
  torch.save + sha256
               what a manifest cost before issue 9: the file read back and hashed in a second pass
  zipwrite     TorchFileWriter: tensors straight from memory (os.writev), CRC-32 and sha256 in a
               helper thread while the next tensor is written; size and sha256 known at close

Prints medians of wall and CPU seconds (all threads) and the ratio to the floor, as markdown.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from mcore_proxy.checkpoint.torchfile import TorchFileWriter, file_sha256

HERE = Path(__file__).resolve().parent
MIB = 2**20


def floor(tensors, path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.view(torch.uint8).numpy())
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(tensors, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save({f"t{i}": t for i, t in enumerate(tensors)}, fh)
        fh.flush()
        os.fsync(fh.fileno())


def torch_save_sha(tensors, path: Path) -> None:
    torch_save(tensors, path)
    file_sha256(path)


def zipwrite(tensors, path: Path) -> None:
    w = TorchFileWriter(path)
    records = {f"t{i}": w.add(t) for i, t in enumerate(tensors)}
    w.close(records)
    assert w.sha256 is not None


VARIANTS = {
    "floor (os.writev + fsync)": floor,
    "torch.save + fsync": torch_save,
    "torch.save + fsync + sha256 pass": torch_save_sha,
    "zipwrite (sha256 while writing) + fsync": zipwrite,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    tmp = Path(a.out) / "zipwrite-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n = max(1, int(a.gib * 1024 / 64))
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(32 * MIB // 1024, 1024, generator=g).bfloat16() for _ in range(n)]  # 64 MiB each
    nbytes = sum(t.numel() * 2 for t in tensors)
    samples = {k: [] for k in VARIANTS}
    for r in range(a.repeat):
        for label, fn in VARIANTS.items():
            path = tmp / "rank.pt"
            os.sync()
            w0, c0 = time.perf_counter(), time.process_time()
            fn(tensors, path)
            samples[label].append((time.perf_counter() - w0, time.process_time() - c0))
            if r == 0 and label != next(iter(VARIANTS)):
                back = torch.load(path, weights_only=True, mmap=True)
                assert all(torch.equal(back[f"t{i}"], t) for i, t in enumerate(tensors)), label
            path.unlink()
            print(
                f"[{r + 1}/{a.repeat}] {label}: {samples[label][-1][0]:.2f} s wall, {samples[label][-1][1]:.2f} s CPU",
                file=sys.stderr,
                flush=True,
            )
    shutil.rmtree(tmp, ignore_errors=True)
    base = [w for w, _ in samples[next(iter(VARIANTS))]]
    print(
        f"{nbytes / 2**30:.2f} GiB in {n} bf16 tensors, one file, fsync inside the timing; medians of {a.repeat}; "
        f"ratio = median over repetitions of wall / wall of the floor in the same repetition"
    )
    print("| writer | wall s | GiB/s | / floor | CPU s (all threads) |")
    print("|---|---|---|---|---|")
    for label, xs in samples.items():
        wall = statistics.median(w for w, _ in xs)
        cpu = statistics.median(c for _, c in xs)
        ratio = statistics.median(w / b for (w, _), b in zip(xs, base))
        print(f"| {label} | {wall:.2f} | {nbytes / 2**30 / wall:.2f} | {ratio:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
