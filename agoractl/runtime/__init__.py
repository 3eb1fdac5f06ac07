"""Networked nodes only: the DHT node and its records, the stage transport, the data-parallel
averaging transport over hivemind, worker and trainer nodes, the local swarm launcher, join, faults,
replica writes. Everything here starts or talks to a network node; the maths it runs lives in
:mod:`agoractl.algorithms`, :mod:`agoractl.model` and :mod:`agoractl.training`."""
