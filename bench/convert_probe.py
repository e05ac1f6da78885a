"""`mcore-proxy` with wall time per convert phase, and optional diagnostic patches (bench only).

    python bench/convert_probe.py convert SRC --plan plan.json -o OUT ...    (any mcore-proxy arguments)

Prints one line `PHASES {json}` on stderr: import, open views, write units (of which pread of
source bytes and the zip writer's record writes), manifest (which hashed every output file again
before issue 9; now the hashes come from the writers), total (seconds, this process;
with --workers > 1 the writing happens in worker processes and is not broken down).
With MCORE_PROXY_PROBE_FADVISE=1 every source rank file gets posix_fadvise(POSIX_FADV_RANDOM)
(no kernel readahead), to measure how many bytes readahead adds to the kept bytes. This patches
nothing on disk; the library is unchanged.
"""

import os
import sys
import time

t_start = time.perf_counter()
import json  # noqa: E402 (timed from interpreter start)

from mcore_proxy.checkpoint import torchfile  # noqa: E402
from mcore_proxy.convert import pipeline  # noqa: E402

T = {"import": time.perf_counter() - t_start}


def timed(owner, names: tuple[str, ...], key: str) -> None:
    """Time every call of the first of `names` the (possibly older, pinned) library has."""
    for name in names:
        original = getattr(owner, name, None)
        if original is None:
            continue

        def wrapper(*args, _original=original, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                T[key] = T.get(key, 0.0) + time.perf_counter() - t

        setattr(owner, name, wrapper)
        return


timed(pipeline, ("open_views",), "open views")
timed(pipeline, ("_write_units", "write_legacy_units"), "write units")
timed(torchfile.TorchFile, ("read_elements",), "pread")
timed(torchfile.TorchFileWriter, ("add_pieces", "add"), "write_record")
timed(pipeline, ("write_manifest",), "manifest (+ sha256 before issue 9)")

if os.environ.get("MCORE_PROXY_PROBE_FADVISE") == "1":
    _init = torchfile.TorchFile.__init__

    def _init_random(self, path):
        _init(self, path)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    torchfile.TorchFile.__init__ = _init_random

from mcore_proxy.cli import main  # noqa: E402

rc = main()
T["total"] = time.perf_counter() - t_start
print("PHASES " + json.dumps({k: round(v, 2) for k, v in T.items()}), file=sys.stderr)
sys.exit(rc)
