"""densetrain: PyTorch-native pretraining of dense decoder-only language models."""

__version__ = "0.1.0"
