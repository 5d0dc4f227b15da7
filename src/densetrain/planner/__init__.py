"""densetrain.planner."""
