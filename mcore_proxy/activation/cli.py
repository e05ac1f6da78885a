"""`mcore-proxy patches`: the folder to put on PYTHONPATH so that a launch traces or injects faults.

A pip-installed mcore-proxy has no checkout with `patches/`; the activation ships inside the
package instead (`mcore_proxy/activation/_patches/sitecustomize.py`, `mcore_proxy.activation.patches_dir`):

    export PYTHONPATH="$(mcore-proxy patches)${PYTHONPATH:+:$PYTHONPATH}"
    MCORE_PROXY_FAULTS="router_noise:std=0.05" bash your_launch_script.sh
"""

from __future__ import annotations

import os

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.cli_support.flags import add_command, emit


def register(subparsers) -> None:
    add_command(
        subparsers,
        "patches",
        run_patches,
        help="the folder to put on PYTHONPATH to trace or inject faults in a launch",
        description="Print the folder of mcore-proxy's activation (a sitecustomize.py inside the "
        "installed package). Put it on PYTHONPATH and set MCORE_PROXY_TRACE_DIR and/or "
        "MCORE_PROXY_FAULTS; every Python process of the launch then traces the MoE "
        "routers or injects the faults, with the launch script unchanged: "
        "export PYTHONPATH=\"$(mcore-proxy patches)${PYTHONPATH:+:$PYTHONPATH}\". "
        "Without those variables the folder only chains an existing sitecustomize.",
    )


def run_patches(args) -> int:
    from mcore_proxy.activation import SITECUSTOMIZE, env_vars, patches_dir

    folder = patches_dir()
    if not os.path.isfile(os.path.join(folder, SITECUSTOMIZE)):
        raise ProxyError(
            f"{folder}: holds no {SITECUSTOMIZE}; this mcore-proxy install is incomplete, "
            "reinstall it (pip install --force-reinstall mcore-proxy)"
        )
    variables = list(env_vars())
    emit(args, "patches", {"path": folder, "variables": variables}, folder)
    return 0
