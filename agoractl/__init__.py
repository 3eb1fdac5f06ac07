"""agoractl: a manifest-driven toolkit for decentralized LLM pre-training (the Agora system).

The package is laid out by job: ``manifest`` (the run manifest), ``data`` (corpus, shards, reader),
``runtime`` (model, workers, trainers, averaging algorithms, swarm), ``ops`` (checkpoints and
analytics) and ``cli`` (the ``agoractl`` command line).
"""

__version__ = "0.1.0"
