"""densetrain.optim."""
