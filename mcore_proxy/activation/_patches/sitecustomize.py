"""mcore-proxy activation for launch pipelines: put this file's folder on PYTHONPATH.

    export PYTHONPATH="$(mcore-proxy patches)${PYTHONPATH:+:$PYTHONPATH}"    # pip-installed
    export PYTHONPATH="<checkout>/patches${PYTHONPATH:+:$PYTHONPATH}"         # a checkout, the same

This file ships inside the package (`mcore_proxy/activation/_patches/sitecustomize.py`, package data of the
wheel), so a pip-installed mcore-proxy activates exactly as a checkout does; `mcore-proxy patches`
prints the folder. A checkout's `patches/sitecustomize.py` is a symbolic link to this file: one
source. The folder holds nothing else importable, so putting it on PYTHONPATH adds only this
`sitecustomize` module. (No `.pth` hook is installed: it would run in every interpreter of the
environment; see docs/install.md.)

- `MCORE_PROXY_TRACE_DIR=/path`: every Python process of the run (torchrun workers included)
  wraps megatron-core's `TopKRouter.forward` when megatron imports it, registers the same wrapper
  with MindSpeed's patch manager when mindspeed is present, and writes
  `/path/rank{R:05d}.safetensors` + `.json` every `MCORE_PROXY_TRACE_FLUSH_STEPS` forward passes
  (default 100) and at exit.
- `MCORE_PROXY_FAULTS="router_noise:std=0.05,layers=0-3;update_omission:every=2"`: the fault
  injectors of `mcore_proxy.faults` attach to every MoE layer, GPT model, transformers model and
  optimizer the run builds (see patches/README.md). A malformed value stops the process at start
  with exit code 2 and one line naming the variable, before any model is built.

Without those variables this file does nothing but chain (below): it does not import mcore_proxy.

Chaining: Python imports only the first `sitecustomize` on sys.path, so this one would hide an
existing one (a site-packages or distribution sitecustomize). It therefore looks for the next
`sitecustomize` on sys.path and executes it (as module `_mcore_proxy_chained_sitecustomize`),
before activating. Set `MCORE_PROXY_CHAIN_SITECUSTOMIZE=0` to skip that. If you maintain your own
sitecustomize, you can instead leave this folder off PYTHONPATH and add to yours:

    from mcore_proxy.activation import activate_from_env; activate_from_env()

Imports: the standard library here; torch only once megatron is imported anyway. If
`mcore_proxy` is not importable (a checkout that is not installed), the folder holding this
file's `mcore_proxy` package is appended to sys.path.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))  # the folder on PYTHONPATH (maybe the link's)
_REAL = os.path.realpath(__file__)  # .../mcore_proxy/activation/_patches/sitecustomize.py
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(_REAL))))  # holds mcore_proxy
# The variables of mcore_proxy.activation's features (a test keeps the two lists equal); checked
# here so that an inactive process does not even import mcore_proxy.
_ENV_VARS = ("MCORE_PROXY_TRACE_DIR", "MCORE_PROXY_FAULTS")
_CHAINED = "_mcore_proxy_chained_sitecustomize"


def _chain_next_sitecustomize():
    if os.environ.get("MCORE_PROXY_CHAIN_SITECUSTOMIZE", "1") == "0" or _CHAINED in sys.modules:
        return
    # skip every copy of this file (the checkout's link and the package's file may both be on the path)
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    while True:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
        if spec is None or spec.loader is None or not spec.origin:
            return
        if os.path.realpath(spec.origin) != _REAL:
            break
        found = os.path.dirname(os.path.abspath(spec.origin))
        paths = [p for p in paths if os.path.abspath(p or os.curdir) != found]
    module = importlib.util.module_from_spec(spec)
    sys.modules[_CHAINED] = module
    spec.loader.exec_module(module)


def _activate():
    if not any(os.environ.get(name) for name in _ENV_VARS):
        return
    if importlib.util.find_spec("mcore_proxy") is None:
        sys.path.append(_ROOT)
    from mcore_proxy.activation import activate_from_env
    from mcore_proxy.core.errors import ProxyError

    try:
        activate_from_env()
    except ProxyError as err:
        # An exception here would only be printed by site.py, and the run would go on without
        # what the user asked for; SystemExit is turned into a fatal-error traceback.
        sys.stderr.write(f"mcore-proxy: {err}\n")
        sys.stderr.flush()
        os._exit(2)


_chain_next_sitecustomize()
_activate()
