"""densetrain.planner: memory, FLOPs, communication and step-time models of parallel layouts,
and a search that ranks every layout that fits (see docs/planner.md).

The planner runs without torch: it reads model configs and counts only (``model_imports``).
"""

from densetrain.planner.model_imports import defer_models_init

defer_models_init()

# ruff: noqa: E402  (the deferral must run before the imports that reach densetrain.models)

from densetrain.planner.hardware import (
    BUILTIN_CLUSTERS,
    ClusterSpec,
    get_cluster,
    load_cluster_file,
)
from densetrain.planner.layout import PRECISIONS, Layout, PlanSettings
from densetrain.planner.report import full_report
from densetrain.planner.run_plan import Allocation, RunPlan, plan_run
from densetrain.planner.search import (
    NoFeasibleLayoutError,
    PlanResult,
    SearchSpace,
    evaluate_layout,
    search,
)

__all__ = [
    "BUILTIN_CLUSTERS",
    "Allocation",
    "PRECISIONS",
    "ClusterSpec",
    "Layout",
    "NoFeasibleLayoutError",
    "PlanResult",
    "PlanSettings",
    "RunPlan",
    "SearchSpace",
    "evaluate_layout",
    "full_report",
    "get_cluster",
    "load_cluster_file",
    "plan_run",
    "search",
]
