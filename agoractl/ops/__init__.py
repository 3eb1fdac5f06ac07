"""Operations on a run's outputs: the checkpoint store, divergence analysis, later the services."""
