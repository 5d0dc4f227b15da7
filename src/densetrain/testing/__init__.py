"""Test helpers: real gloo ranks under pytest, tiny configs, comparison helpers."""

from densetrain.testing.distributed import DistributedTestError, run_distributed
from densetrain.testing.jobs import TINY_OVERRIDES, tiny_job_overrides

__all__ = ["TINY_OVERRIDES", "DistributedTestError", "run_distributed", "tiny_job_overrides"]
