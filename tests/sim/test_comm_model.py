"""Unit tests of the communication model (agoractl.sim.comm_model): pure arithmetic, no I/O."""

import pytest

from agoractl.sim.comm_model import CommModel


def test_transfer_and_collectives():
    comm = CommModel(bandwidth_mbps=100, latency_ms=50)
    payload = 6e9                                     # 1.5B fp32 parameters
    assert comm.transfer_s(payload) == pytest.approx(480.0)
    # Butterfly all-reduce over 8 peers: each sends and receives 2 * 7/8 of the payload.
    assert comm.collective_s("global", payload, 8) == pytest.approx(840.0 + 0.1)
    assert comm.collective_s("local", payload, 8) == pytest.approx(480.0 + 0.05)
    assert comm.collective_s("none", payload, 8) == 0.0
    assert comm.collective_s("global", payload, 1) == 0.0          # nobody to average with
    assert CommModel(200).collective_s("global", payload, 8) == pytest.approx(420.0)


def test_all_to_all_global_mixing():
    # Gossip accounting (seed 002): global averaging is an exchange with each of the M-1 others, so a
    # pairwise exchange costs 1/(M-1) of it instead of the butterfly's M/(2(M-1)).
    comm = CommModel(bandwidth_mbps=100, latency_ms=50, global_mixing="all-to-all")
    payload = 6e9
    assert comm.collective_s("global", payload, 8) == pytest.approx(7 * 480.0 + 0.05)
    assert comm.collective_s("local", payload, 8) == pytest.approx(480.0 + 0.05)
    assert comm.collective_s("global", payload, 2) == pytest.approx(comm.collective_s("local", payload, 2))
    butterfly = CommModel(bandwidth_mbps=100, latency_ms=0)
    assert butterfly.collective_s("global", payload, 2) == pytest.approx(butterfly.collective_s("local", payload, 2))
    assert comm.collective_s("global", payload, 1) == 0.0


def test_blocking_stalls_and_overlap_hides():
    comm = CommModel(100)
    blocking = comm.round_time(500.0, blocking_s=300.0)
    assert blocking.wall_s == pytest.approx(800.0)
    assert blocking.utilization == pytest.approx(500 / 800)
    hidden = comm.round_time(500.0, overlapped_s=300.0)
    assert hidden.wall_s == pytest.approx(500.0) and hidden.utilization == pytest.approx(1.0)
    partly = comm.round_time(500.0, overlapped_s=700.0, blocking_s=100.0)
    assert partly.overlap_stall_s == pytest.approx(200.0)
    assert partly.wall_s == pytest.approx(800.0)


def test_bandwidth_halves_transfer_time():
    assert CommModel(200).transfer_s(1e9) == pytest.approx(CommModel(100).transfer_s(1e9) / 2)


@pytest.mark.parametrize("kwargs", [{"bandwidth_mbps": 0}, {"bandwidth_mbps": 100, "latency_ms": -1},
                                    {"bandwidth_mbps": 100, "global_mixing": "ring"}])
def test_invalid_links(kwargs):
    with pytest.raises(ValueError):
        CommModel(**kwargs)


def test_unknown_mixing():
    with pytest.raises(ValueError, match="unknown mixing"):
        CommModel(100).collective_s("ring", 1.0, 4)
