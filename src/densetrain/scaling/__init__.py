"""densetrain.scaling."""
