"""Read every canonical tensor of a checkpoint, one at a time, as `convert` does: `python bench/read_all.py CKPT`."""

import sys
import time

from mcore_proxy.checkpoint import open_checkpoint

view = open_checkpoint(sys.argv[1])
start, total = time.perf_counter(), 0
for name in view.names():
    t = view.get(name)
    total += t.numel() * t.element_size()
    del t
print(f"read {total / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")
