"""densetrain.config."""
