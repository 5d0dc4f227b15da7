"""densetrain.checkpoint."""
