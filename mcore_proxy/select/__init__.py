"""Expert selection (DESIGN.md 1, 4.2): views -> fusion -> K-Medoids -> representatives -> plan.

Importing this package pulls in numpy only; `kmedoids` and matplotlib load inside the
functions that cluster or draw.
"""

from mcore_proxy.select.plan import Cluster, LayerPlan, RouterSettings, SelectionPlan, SourceInfo, load_plan
from mcore_proxy.select.selector import METHODS, VIEW_METHODS, run_selection, select_experts

__all__ = [
    "select_experts",
    "run_selection",
    "SelectionPlan",
    "LayerPlan",
    "Cluster",
    "SourceInfo",
    "RouterSettings",
    "load_plan",
    "METHODS",
    "VIEW_METHODS",
]
