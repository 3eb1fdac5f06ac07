"""Stage state for joining workers (agoractl.runtime.join): in-memory, no network."""

import torch
from hivemind.utils import MSGPackSerializer

from agoractl.manifest.schema import Run
from agoractl.ops.checkpoint import Checkpoint
from agoractl.runtime.join import apply_state, load_stage_state, pack_state, unpack_state
from agoractl.model.build import build_stage
from agoractl.algorithms.optim import make_optimizer


def trained_stage(run, steps):
    torch.manual_seed(0)
    module = build_stage(run, 1)
    opt = make_optimizer(list(module.parameters()), run)
    for _ in range(steps):
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return module, opt


def test_state_round_trips_through_msgpack_into_a_fresh_replica():
    run = Run()
    src, src_opt = trained_stage(run, 3)
    meta, tensors = pack_state(list(src.named_parameters()), src_opt, "body-1", 42)
    meta = MSGPackSerializer.loads(MSGPackSerializer.dumps(meta))  # what crosses the wire
    dst = build_stage(run, 1)
    dst_opt = make_optimizer(list(dst.parameters()), run)
    assert apply_state(unpack_state(meta, tensors), dst, dst_opt) == 42
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a, b), n
    sa, sb = src_opt.state_dict()["state"], dst_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    # Both replicas now take the same step from the same gradients.
    for a, b in zip(src.parameters(), dst.parameters()):
        a.grad = b.grad = torch.ones_like(a)
    src_opt.step()
    dst_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))


def test_operators_ask_peers_first_contributors_the_store():
    peer = Checkpoint({}, None, {"step": 10})
    store = Checkpoint({}, None, {"step": 5})

    def broken():
        raise ConnectionError("peer gone")

    assert load_stage_state("operator", lambda: peer, lambda: store) == (peer, "peer")
    assert load_stage_state("contributor", lambda: peer, lambda: store) == (store, "store")
    assert load_stage_state("operator", broken, lambda: store) == (store, "store")
    assert load_stage_state("contributor", lambda: None, lambda: None) == (None, "init")
