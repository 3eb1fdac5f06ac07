"""Stage placement (pure): least-provisioned allowed stage first, capable nodes to the heavier stages, caps."""

from agoractl.auth.placement import StageSlot, place


def slots(counts, caps=None, layers=(1, 1, 3, 1, 1)):
    names = ["head", "body-1", "body-2", "body-3", "tail"]
    roles = ["head", "body", "body", "body", "tail"]
    caps = caps or {}
    return [StageSlot(n, r, layer, counts.get(n, 0), caps.get(n)) for n, r, layer in zip(names, roles, layers)]


def test_least_provisioned_allowed_stage():
    assert place(slots({"head": 0, "body-1": 1, "body-2": 1, "body-3": 0}), ["body-1", "body-2", "body-3"],
                 capable=False) == "body-3"


def test_capable_nodes_take_the_heaviest_of_equals():
    s = slots({})
    assert place(s, ["body-1", "body-2", "body-3"], capable=True) == "body-2"
    assert place(s, ["body-1", "body-2", "body-3"], capable=False) == "body-1"


def test_caps_and_full():
    assert place(slots({"head": 0, "body-1": 2}, caps={"head": 0}), [], capable=False) == "body-3"
    assert place(slots({"body-1": 1}, caps={"body-1": 1}), ["body-1"], capable=True) is None


def test_twenty_contributors_on_three_bodies_within_one():
    counts: dict = {}
    for i in range(20):
        stage = place(slots(counts), ["body-1", "body-2", "body-3"], capable=bool(i % 2))
        counts[stage] = counts.get(stage, 0) + 1
    assert set(counts) == {"body-1", "body-2", "body-3"} and max(counts.values()) - min(counts.values()) <= 1
