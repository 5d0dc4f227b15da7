"""Export training runs, checkpoints and model directories to other ecosystems' formats."""

from densetrain.export.sources import ExportSource, open_source
from densetrain.export.to_hf import export_to_hf

__all__ = ["ExportSource", "export_to_hf", "open_source"]
