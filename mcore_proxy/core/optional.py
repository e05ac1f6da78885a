"""Optional dependencies: a command that needs a package the install lacks says so in one sentence
naming the extra that brings it, and exits 2 (never "internal error: ModuleNotFoundError").

`pip install mcore-proxy` installs what the conversion path needs (torch, numpy, safetensors,
kmedoids, tqdm). The rest comes with extras (setup.py `extras_require`):

    hf        transformers, tokenizers, accelerate        collect, fidelity, verify --functional (HF)
    diagnose  tensorboard, ruptures, scipy, matplotlib    compare, watch --baseline, campaign
    report    matplotlib                                   select --report, stats show --png, fidelity -o

megatron-core, torch_npu and mindspeed belong to the user's training stack (their versions must be
the stack's), and wandb / swanlab only read those trackers' offline runs: no extra installs them,
and the sentence says how to get them.

Use, in a command before it starts work (so nothing is half written):

    from mcore_proxy.core.optional import check, require

    stats = require("scipy.stats", why="compare")           # the module, or MissingDependency
    check("scipy", "ruptures", why="campaign")               # all installed? (imports nothing)
    require("matplotlib", why="compare -o", extra="diagnose")   # name another extra than PACKAGES'
    check("transformers", "matplotlib", why="fidelity -o")    # one sentence: [hf,report]

`MissingDependency` is a `ProxyError`: the CLI prints `mcore-proxy CMD: error: <sentence>` and
exits 2. Its message, e.g.:

    compare needs scipy, which is not installed; install it with `pip install 'mcore-proxy[diagnose]'`
    (or `pip install scipy`)

`from_import_error(err)` turns a `ModuleNotFoundError` of a known optional package that is absent
into the same error; `mcore_proxy.cli.main` applies it to anything a command lets escape, so an
import no command checked still ends in one sentence and exit 2. Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

from mcore_proxy.core.errors import ProxyError


@dataclass(frozen=True)
class Package:
    """An optional dependency: its import name, pip name, and the mcore-proxy extra that installs it
    (None: it belongs to the training stack and `hint` says how to get it)."""

    module: str
    dist: str
    extra: str | None
    hint: str = ""


PACKAGES: dict[str, Package] = {
    p.module: p
    for p in (
        Package("transformers", "transformers", "hf"),
        Package("tokenizers", "tokenizers", "hf"),
        Package("accelerate", "accelerate", "hf"),
        Package("tensorboard", "tensorboard", "diagnose"),
        Package("ruptures", "ruptures", "diagnose"),
        Package("scipy", "scipy", "diagnose"),
        Package("matplotlib", "matplotlib", "report"),
        Package(
            "megatron",
            "megatron-core",
            None,
            "install the megatron-core of your training stack (`pip install megatron-core`)",
        ),
        # readers of W&B and SwanLab offline runs (compare, watch, campaign logs): not in any extra
        Package("wandb", "wandb", None, "install it with `pip install wandb`"),
        Package("swanlab", "swanlab", None, "install it with `pip install swanlab`"),
        Package("torch_npu", "torch_npu", None, "install torch_npu from your Ascend stack"),
        Package("mindspeed", "mindspeed", None, "install MindSpeed from your Ascend stack"),
    )
}


class MissingDependency(ProxyError):
    """A command needs optional packages that are not installed (exit 2).

    modules: the top-level import names that are missing; extras: the extras that install them."""

    def __init__(self, message: str, modules: tuple[str, ...] = (), extras: tuple[str, ...] = ()):
        super().__init__(message)
        self.modules, self.extras = modules, extras


def _top(module: str) -> str:
    return module.split(".")[0]


def _package(module: str, extra: str | None = None) -> Package:
    top = _top(module)
    known = PACKAGES.get(top, Package(top, top, None, f"install it with `pip install {top}`"))
    return known if extra is None else Package(known.module, known.dist, extra, known.hint)


def install_command(extras) -> str:
    """`pip install 'mcore-proxy[hf,report]'` for the extras given."""
    return f"`pip install 'mcore-proxy[{','.join(sorted(set(extras)))}]'`"


def missing_message(modules, why: str, extras: dict | None = None, reason: str = "") -> str:
    """The one sentence for the packages of `modules` that `why` (a command, an option) lacks.
    extras: top-level module -> extra, overriding `PACKAGES` (matplotlib comes with `diagnose` too);
    reason: what is wrong with them (default: not installed)."""
    packages = [_package(m, (extras or {}).get(_top(m))) for m in modules]
    names = [p.dist for p in packages]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    reason = reason or ("which is not installed" if len(names) == 1 else "which are not installed")
    ours = [p for p in packages if p.extra]
    fixes = []
    if ours:
        target = (
            "it" if len(packages) == 1 else "them" if len(ours) == len(packages) else " and ".join(p.dist for p in ours)
        )
        fixes.append(
            f"install {target} with {install_command(p.extra for p in ours)} "
            f"(or `pip install {' '.join(p.dist for p in ours)}`)"
        )
    fixes += [p.hint for p in packages if not p.extra]
    return f"{why} needs {listed}, {reason}; {' and '.join(fixes)}"


def available(module: str) -> bool:
    """Whether the top-level package of `module` is installed (found, not imported)."""
    try:
        return importlib.util.find_spec(_top(module)) is not None
    except (ImportError, ValueError):
        return False


def check(*modules: str, why: str, extras: dict | None = None) -> None:
    """MissingDependency naming every package of `modules` that is not installed, without importing
    any (cheap: for a check before a long run)."""
    absent = [m for m in modules if not available(m)]
    if absent:
        raise MissingDependency(
            missing_message(absent, why, extras),
            tuple(_top(m) for m in absent),
            tuple(p.extra for p in (_package(m, (extras or {}).get(_top(m))) for m in absent) if p.extra),
        )


def require(module: str, *, why: str, extra: str | None = None) -> ModuleType:
    """Import `module` (e.g. "scipy.stats") and return it; MissingDependency if its package is not
    installed, or is installed but does not import (a broken or incompatible install).
    extra: the extra to name when it is not the package's own in `PACKAGES`."""
    extras = {_top(module): extra} if extra else None
    try:
        return importlib.import_module(module)
    except ImportError as err:
        reason = (
            "" if not available(module) else f"which is installed but does not import ({' '.join(str(err).split())})"
        )
        package = _package(module, extra)
        raise MissingDependency(
            missing_message([module], why, extras, reason), (_top(module),), (package.extra,) if package.extra else ()
        ) from None


def from_import_error(
    err: BaseException, why: str = "this command", extras: dict | None = None
) -> MissingDependency | None:
    """The MissingDependency an ImportError stands for: a `ModuleNotFoundError` of a known optional
    package (`PACKAGES`) that is not installed. None for anything else (a missing module of our own
    or of a required dependency is a bug: internal error)."""
    name = getattr(err, "name", None)
    if not isinstance(err, ModuleNotFoundError) or not name or _top(name) not in PACKAGES or available(name):
        return None
    package = _package(name, (extras or {}).get(_top(name)))
    return MissingDependency(
        missing_message([name], why, extras), (_top(name),), (package.extra,) if package.extra else ()
    )
