"""Test helpers: real gloo ranks under pytest, tiny configs, comparison helpers."""

from densetrain.testing.distributed import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
