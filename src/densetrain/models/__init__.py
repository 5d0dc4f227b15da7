"""densetrain.models."""
