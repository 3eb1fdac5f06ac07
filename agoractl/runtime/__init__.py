"""The runtime: model and stage partition, boundary codec, workers, trainers, balancer, the
data-parallel algorithms (SPARTA, FGDiLoCo) and their transport over hivemind, local swarm, simulator."""
