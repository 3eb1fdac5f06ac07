"""The in-process simulator: replicas of a model in one process, FGDiLoCo variants and SPARTA
ablations as scenarios, and the communication model that turns bytes into simulated time."""
