"""densetrain.generate."""
