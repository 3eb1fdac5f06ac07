"""Operations on a run's artefacts: the checkpoint store (tensor files, optimizer state; below the
runtime, which writes and reads it) and analysis (divergence, JS and L2 distances, predictions, plots)."""
