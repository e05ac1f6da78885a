"""The optional plotting dependency (the `report` extra), checked before a command writes.

matplotlib stays optional because the trace side runs on training hosts where it may be
absent (DESIGN.md 5); commands that draw call `require_matplotlib` first, so a missing package
is one sentence and exit 2, never a traceback after half the outputs are written.
"""

from __future__ import annotations

from mcore_proxy.core.optional import MissingDependency, install_command


def require_matplotlib(option: str) -> None:
    """Import matplotlib with the file-only Agg backend; MissingDependency (a ProxyError, exit 2)
    naming `option` if absent (`mcore_proxy.core.optional` holds the other optional packages)."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency(
            f"{option} draws PNGs with matplotlib, which is not installed; install it "
            f"with {install_command(['report'])} (or `pip install matplotlib`), "
            f"or leave out {option}",
            ("matplotlib",),
            ("report",),
        ) from None
    matplotlib.use("Agg")
