"""densetrain.parallel."""
