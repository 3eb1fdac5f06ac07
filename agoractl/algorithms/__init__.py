"""Pure algorithms, shared by the networked runtime and the simulator: SPARTA, FGDiLoCo mixing and
outer step, the stage optimizer step and clipping, the balancer, sync phases, self-termination rules,
progress and consensus measures. No hivemind, no networking, no file I/O."""
