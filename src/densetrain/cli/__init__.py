"""densetrain.cli."""
