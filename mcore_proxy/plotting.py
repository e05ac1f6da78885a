"""The optional plotting dependency (the `report` extra), checked before a command writes.

matplotlib stays optional because the trace side runs on training hosts where it may be
absent (DESIGN.md 5); commands that draw call `require_matplotlib` first, so a missing package
is one sentence and exit 2, never a traceback after half the outputs are written.
"""
from __future__ import annotations

from mcore_proxy.errors import ProxyError


def require_matplotlib(option: str) -> None:
    """Import matplotlib with the file-only Agg backend; ProxyError naming `option` if absent."""
    try:
        import matplotlib
    except ImportError:
        raise ProxyError(f"{option} draws PNGs with matplotlib, which is not installed; install it "
                         "with `pip install 'mcore-proxy[report]'` (or `pip install matplotlib`), "
                         f"or leave out {option}") from None
    matplotlib.use("Agg")
