"""densetrain.parallel: one device mesh and one ordered ``parallelize()`` for every layout.

``parallel.parallelize.parallelize`` applies TP/SP → CP → (pipeline split) → activation
checkpointing → compile → FSDP/DDP; see docs/parallelism.md.
"""

from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.mesh import ParallelDims

__all__ = ["ParallelConfig", "ParallelDims"]
