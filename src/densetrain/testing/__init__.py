"""Test helpers: real gloo ranks under pytest, tiny configs, comparison helpers, the ops a
call dispatches."""

from densetrain.testing.distributed import DistributedTestError, run_distributed
from densetrain.testing.jobs import TINY_OVERRIDES, tiny_job_overrides
from densetrain.testing.ops import OpNames, TracedOps

__all__ = ["TINY_OVERRIDES", "DistributedTestError", "OpNames", "TracedOps",
           "run_distributed", "tiny_job_overrides"]
