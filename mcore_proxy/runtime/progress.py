"""Progress bars counted in bytes and shown in GiB (tqdm), for long reads and writes."""

from __future__ import annotations

import contextlib

from mcore_proxy.core.units import GIB


@contextlib.contextmanager
def byte_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar over `total` bytes shown in GiB; yields `update(nbytes)`. With `enabled` False
    nothing is drawn (the callable still accepts updates)."""
    from tqdm import tqdm

    with tqdm(
        total=total / GIB,
        unit="GiB",
        desc=desc,
        mininterval=1,
        disable=not enabled,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.2f}/{total:.2f} GiB [{elapsed}<{remaining}, {rate_fmt}]",
    ) as bar:
        yield lambda nbytes: bar.update(nbytes / GIB)
