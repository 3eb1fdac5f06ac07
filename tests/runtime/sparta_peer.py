"""A SPARTA averaging peer for the averaging tests: one process, its own DHT node, one StageAverager.

Run as ``python -m tests.runtime.sparta_peer --initial-peer MADDR ...``. It prints ``ready`` once
its averager runs and it sees ``--expected`` peers in the DHT, then reads one command per round
on stdin, ``go WEIGHT VALUE EXPECTED [FAULT]``: it averages ``--size`` values all equal to VALUE
with that weight, EXPECTED peers expected, FAULT (send/reduce) armed, and prints the round's
result as one JSON line: the record, the first and last averaged values, how many did not return.

With ``--authority-key KEY`` the peer plays an admitted worker of stage ``stage`` of run ``test``: it signs
its own credential with KEY (the Authorizer's part), renews it every ``--ttl``/3 seconds, runs the DHT's
credential validator and an :class:`~agoractl.runtime.averaging_auth.AdmittedAverager` with the ban list
``--ban``, built as a worker builds it; ``ready`` is then followed by its peer id and multiaddrs, and ``stats``
on stdin prints its admission summary (credentials checked, refusals by surface and reason) as one JSON line.
"""

import argparse
import json
import sys
import time

import torch

READY_WAIT_S = 240.0
"""Seconds a peer waits for the others to appear before it exits (the test waits 180 s per peer for "ready")."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--initial-peer", action="append", default=[])
    p.add_argument("--role", choices=["operator", "contributor"], default="operator")
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--expected", type=int, default=3)
    p.add_argument("--window", type=float, default=20.0)  # the longest wait: a group forms once all joined
    p.add_argument("--allreduce-timeout", type=float, default=60.0)  # sparta.allreduce_timeout_s
    p.add_argument("--chunk-bytes", type=int, default=1024)
    p.add_argument("--wire", default="fp32")
    p.add_argument("--part-multiple", type=float, default=None)  # validation.part_multiple (None: finiteness only)
    p.add_argument("--authority-key", default=None)  # admission on: sign this peer's own credentials with it
    p.add_argument("--ttl", type=float, default=12.0)  # credential lifetime, s (renewed every ttl/3)
    p.add_argument("--ban", action="append", default=[])  # node ids and accounts on the ban list
    args = p.parse_args()
    torch.set_num_threads(1)

    import hivemind
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from agoractl.runtime.averaging import StageAverager

    dht = hivemind.DHT(initial_peers=args.initial_peer, start=True, client_mode=args.role == "contributor",
                       startup_timeout=120)
    kwargs = dict(prefix="test_stage_sparta", capacity=args.size + 7, client_mode=args.role == "contributor",
                  matchmaking_timeout_s=args.window, allreduce_timeout_s=args.allreduce_timeout, chunk_timeout_s=5,
                  chunk_bytes=args.chunk_bytes, wire_dtype=args.wire, part_multiple=args.part_multiple)
    adm = None
    if args.authority_key:
        averager, adm = admitted(dht, args, kwargs)
    else:
        averager = StageAverager(dht, **kwargs)
    # Ready once every expected peer is visible in the DHT: the first round then finds its group.
    dht.store("test_peers", subkey=str(dht.peer_id), value=True, expiration_time=get_dht_time() + 600)
    deadline = time.monotonic() + READY_WAIT_S
    while len((dht.get("test_peers", latest=True) or ValueWithExpiration({}, 0)).value) < args.expected:
        if time.monotonic() > deadline:  # the test gave up on this swarm (or died): do not linger
            dht.shutdown()
            sys.exit(f"sparta_peer: {args.expected} peers not visible within {READY_WAIT_S} s")
        time.sleep(0.2)
    if args.authority_key:
        print("ready", dht.peer_id.to_base58(), *map(str, dht.get_visible_maddrs()), flush=True)
    else:
        print("ready", flush=True)
    r = -1
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "stats":
            from agoractl.runtime.admission import summary

            print(json.dumps(summary(adm)), flush=True)
            continue
        if not cmd or cmd[0] != "go":
            break
        r += 1
        weight, value, expected = float(cmd[1]), float(cmd[2]), int(cmd[3])
        values = torch.full((args.size,), value)
        pending = averager.begin_round(r, r % 4, values, weight, expected, fault=cmd[4] if len(cmd) > 4 else None)
        average, averaged, rec = pending.result(timeout=120)
        out = rec.as_dict()
        if average is not None:
            out["first"], out["last"] = float(average[0]), float(average[-1])
            out["not_averaged"] = int((~averaged).sum())
        print(json.dumps(out), flush=True)
    averager.shutdown()
    dht.shutdown()


def admitted(dht, args, kwargs):
    """The worker's own wiring (:func:`agoractl.runtime.averaging_auth.admitted_averager` on an
    :class:`~agoractl.runtime.admission.Admitted`), on a DHT with the credential validator; the renewals that
    the Authorizer would grant are minted here, in a thread. `kwargs` become the manifest's sparta section."""
    import threading

    from agoractl.auth import credential, keys
    from agoractl.manifest.loader import load_manifest
    from agoractl.runtime import peer_auth
    from agoractl.runtime.admission import Admitted
    from agoractl.runtime.averaging_auth import admitted_averager
    from tests.conftest import MANIFESTS

    key = keys.load_private(args.authority_key)
    public, peer = keys.public_text(key), dht.peer_id.to_base58()
    bans = frozenset(args.ban)

    def mint() -> str:
        return credential.issue(key, run="test", node_id=f"{args.role}-{peer[-6:]}", account="test", role="worker",
                                stage="stage", peer_id=peer, ttl_s=args.ttl, serial=1)

    sparta = {"matchmaking_timeout_s": kwargs["matchmaking_timeout_s"],
              "allreduce_timeout_s": kwargs["allreduce_timeout_s"], "chunk_timeout_s": 5,
              "chunk_bytes": kwargs["chunk_bytes"], "wire_dtype": kwargs["wire_dtype"]}
    bound = kwargs["part_multiple"]
    checks = ["validation.enabled=false"] if bound is None else [f"validation.part_multiple={bound}"]
    run = load_manifest(MANIFESTS / "local-cpu.yaml", ["metadata.name=test", "data_parallel.method=sparta", *checks,
                                                       *(f"data_parallel.sparta.{k}={v}" for k, v in sparta.items())])
    dht.add_validators([peer_auth.CredentialValidator("test", public, ["stage"])])
    adm = Admitted(url="", node_id=f"{args.role}-{peer[-6:]}", peer_id=peer, stage="stage", token=mint(),
                   expires_at=time.time() + args.ttl, auth=peer_auth.PeerAuth("test", public), dht=dht)
    adm.auth.bans = bans
    adm.publish(adm.token, bans)
    averager = admitted_averager(run, "stage", args.role, dht, kwargs["capacity"], adm)
    assert averager.prefix == kwargs["prefix"], averager.prefix

    def renew() -> None:
        while True:
            time.sleep(args.ttl / 3)
            adm.token = mint()
            adm.publish(adm.token, bans)

    threading.Thread(target=renew, daemon=True).start()
    return averager, adm


if __name__ == "__main__":
    main()
