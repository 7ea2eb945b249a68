"""Training state: Optax on sharded parameters, state dicts, Orbax checkpoints onto any mesh."""
