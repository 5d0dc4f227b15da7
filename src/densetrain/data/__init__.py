"""densetrain.data."""
