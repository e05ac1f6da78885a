"""mcore-proxy activation for launch pipelines: `PYTHONPATH=<repo>/patches:$PYTHONPATH`.

- `MCORE_PROXY_TRACE_DIR=/path`: every Python process of the run (torchrun workers included)
  wraps megatron-core's `TopKRouter.forward` when megatron imports it, registers the same wrapper
  with MindSpeed's patch manager when mindspeed is present, and writes
  `/path/rank{R:05d}.safetensors` + `.json` every `MCORE_PROXY_TRACE_FLUSH_STEPS` forward passes
  (default 100) and at exit.
- `MCORE_PROXY_FAULTS="router_noise:std=0.05,layers=0-3;update_omission:every=2"`: the fault
  injectors of `mcore_proxy.faults` attach to every MoE layer, GPT model and optimizer the run
  builds (see patches/README.md). A malformed value stops the process at start with exit code 2
  and one line naming the variable, before any model is built.

Without those variables this file does nothing but chain (below).

Chaining: Python imports only the first `sitecustomize` on sys.path, so this one would hide an
existing one (a site-packages or distribution sitecustomize). It therefore looks for the next
`sitecustomize` on sys.path and executes it (as module `_mcore_proxy_chained_sitecustomize`),
before activating. Set `MCORE_PROXY_CHAIN_SITECUSTOMIZE=0` to skip that. If you maintain your own
sitecustomize, you can instead leave this folder off PYTHONPATH and add to yours:

    from mcore_proxy.activation import activate_from_env; activate_from_env()

Imports: the standard library here; torch only once megatron is imported anyway. If
`mcore_proxy` is not installed, the checkout this folder lives in is appended to sys.path.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# The variables of mcore_proxy.activation's features (a test keeps the two lists equal); checked
# here so that an inactive process does not even import mcore_proxy.
_ENV_VARS = ("MCORE_PROXY_TRACE_DIR", "MCORE_PROXY_FAULTS")


def _chain_next_sitecustomize():
    if os.environ.get("MCORE_PROXY_CHAIN_SITECUSTOMIZE", "1") == "0":
        return
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_mcore_proxy_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


def _activate():
    if not any(os.environ.get(name) for name in _ENV_VARS):
        return
    if importlib.util.find_spec("mcore_proxy") is None:
        sys.path.append(os.path.dirname(_HERE))
    from mcore_proxy.activation import activate_from_env
    from mcore_proxy.errors import ProxyError

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
