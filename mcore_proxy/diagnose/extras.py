"""Optional packages of the diagnose commands, and the one sentence that says how to install them.

The `diagnose` extra (`pip install 'mcore-proxy[diagnose]'`) brings scipy and ruptures (signatures),
tensorboard (the TensorBoard reader) and matplotlib (report figures). The W&B and SwanLab offline
readers need those packages themselves. A missing one is bad setup, not a bug: it is a
`MissingPackage` (a `ProxyError`, exit 2) naming what to install.
"""
from __future__ import annotations

import functools
import importlib

from mcore_proxy.errors import ProxyError

EXTRA_INSTALL = "pip install 'mcore-proxy[diagnose]'"
DIAGNOSE_EXTRA = ("scipy", "ruptures", "tensorboard", "matplotlib")
# packages the readers of some formats need, outside the extra: package -> install command
READER_PACKAGES = {"wandb": "pip install wandb", "swanlab": "pip install swanlab"}


class MissingPackage(ProxyError):
    """An optional package a command needs is not installed. Not a LogError: `watch` waits for a log
    that is not readable yet, but not for a package to appear."""


def install_hint(package: str) -> str:
    top = package.split(".")[0]
    if top in READER_PACKAGES:
        return READER_PACKAGES[top]
    return EXTRA_INSTALL


def missing_sentence(package: str, what: str, err: BaseException | None = None) -> str:
    top = package.split(".")[0]
    why = "is not installed" if err is None or isinstance(err, ModuleNotFoundError) else \
        f"cannot be imported ({err})"
    return f"{what} needs the Python package {top}, which {why}: {install_hint(top)}"


def require(module: str, what: str):
    """Import `module` (e.g. "scipy.stats") or raise MissingPackage saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingPackage(missing_sentence(module, what, err)) from None


def optional_package(err: BaseException) -> str | None:
    """The optional package (top-level name) an ImportError is about, or None."""
    if not isinstance(err, ImportError):
        return None
    top = (err.name or "").split(".")[0]
    return top if top in DIAGNOSE_EXTRA or top in READER_PACKAGES else None


def missing_packages_are_bad_setup(command: str):
    """Decorator of a command function: an ImportError of an optional package anywhere below it
    becomes one sentence and exit 2 (MissingPackage), instead of an internal error."""
    def wrap(func):
        @functools.wraps(func)
        def run(args):
            try:
                return func(args)
            except ImportError as err:
                package = optional_package(err)
                if package is None:
                    raise
                raise MissingPackage(missing_sentence(package, command, err)) from None
        return run
    return wrap
