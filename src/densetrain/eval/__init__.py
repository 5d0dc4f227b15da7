"""densetrain.eval."""
