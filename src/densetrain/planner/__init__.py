"""densetrain.planner: memory, FLOPs, communication and step-time models of parallel layouts,
and a search that ranks every layout that fits (see docs/planner.md)."""

from densetrain.planner.hardware import (
    BUILTIN_CLUSTERS,
    ClusterSpec,
    get_cluster,
    load_cluster_file,
)
from densetrain.planner.layout import PRECISIONS, Layout, PlanSettings
from densetrain.planner.report import full_report
from densetrain.planner.run_plan import RunPlan, plan_run
from densetrain.planner.search import (
    NoFeasibleLayoutError,
    PlanResult,
    SearchSpace,
    evaluate_layout,
    search,
)

__all__ = [
    "BUILTIN_CLUSTERS",
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
