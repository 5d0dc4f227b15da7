"""densetrain.train."""
