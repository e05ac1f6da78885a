"""mcore-proxy trace activation for launch pipelines: `PYTHONPATH=<repo>/patches:$PYTHONPATH`.

With `MCORE_PROXY_TRACE_DIR=/path` set, every Python process of the run (torchrun workers
included) wraps megatron-core's `TopKRouter.forward` when megatron imports it, registers the
same wrapper with MindSpeed's patch manager when mindspeed is present, and writes
`/path/rank{R:05d}.safetensors` + `.json` every `MCORE_PROXY_TRACE_FLUSH_STEPS` forward passes
(default 100) and at exit. Without the variable this file does nothing but chain (below).

Chaining: Python imports only the first `sitecustomize` on sys.path, so this one would hide an
existing one (a site-packages or distribution sitecustomize). It therefore looks for the next
`sitecustomize` on sys.path and executes it (as module `_mcore_proxy_chained_sitecustomize`),
before activating. Set `MCORE_PROXY_CHAIN_SITECUSTOMIZE=0` to skip that. If you maintain your own
sitecustomize, you can instead leave this folder off PYTHONPATH and add to yours:

    from mcore_proxy.trace.activate import activate_from_env; activate_from_env()

Imports: the standard library here; torch only once megatron is imported anyway. If
`mcore_proxy` is not installed, the checkout this folder lives in is appended to sys.path.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


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
    if not os.environ.get("MCORE_PROXY_TRACE_DIR"):
        return
    if importlib.util.find_spec("mcore_proxy") is None:
        sys.path.append(os.path.dirname(_HERE))
    from mcore_proxy.trace.activate import activate_from_env

    activate_from_env()


_chain_next_sitecustomize()
_activate()
