"""The manifest's ``workers`` section: what every worker does with its requests (coalescing, the wire dtype, the
activation cache), how often it announces itself, when it leaves on its own (report §3.3.1.6), and whether
whole-model replicas read their own samples (``self_feed``) instead of being fed by trainers.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from agoractl.manifest.section import Section


class SelfTermination(Section):
    allreduce_failures: int = Field(2, gt=0)
    """Failed averaging rounds, within the last window_rounds, that make a worker exit (report: 2)."""
    window_rounds: int = Field(3, gt=0)
    """Window of recent rounds for allreduce_failures (report: 3)."""
    max_ram_fraction: float = Field(0.95, gt=0, le=1)
    """Exit when host RAM use exceeds this fraction."""
    dht_unreachable_s: float = Field(60.0, gt=0)
    """Exit when the DHT (peer-to-peer connectivity, the run's progress) stays unreachable this long, in seconds."""
    refused_outputs: int = Field(3, gt=0)
    """Exit when trainers refused this many of the worker's outputs within refused_window_s (rule refused_outputs)."""
    refused_window_s: float = Field(300.0, gt=0)
    """Window of the refused_outputs rule, in seconds."""
    refused_min_trainers: int = Field(2, gt=0)
    """Distinct trainers the refusals must come from (one hostile trainer cannot make a worker leave)."""


class Workers(Section):
    max_microbatch: int = Field(16, gt=0)
    """Coalescing cap: most samples merged into one compute pass (report §3.3.1.3)."""
    announce_period_s: float = Field(5.0, gt=0)
    """Seconds between DHT re-announcements; records expire after 3 periods."""
    wire_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype of activations and activation gradients crossing stage boundaries (SSN coordinates)."""
    activation_cache_mb: float = Field(256.0, ge=0)
    """MiB of forward activations (autograd graphs) a head or body worker keeps so that the backward of the
    same samples skips the recompute; oldest evicted first. 0: stateless, every backward recomputes (§3.3.1.4).
    A backward that lands on another replica, or after the weights changed, recomputes either way."""
    forward_hold_s: float = Field(1.0, ge=0)
    """Seconds at most a forward waits for its stage's step when it belongs to the next step's batch: this replica's
    cache already holds the forwards of its share of the rest of the current one (with replicas, the missing
    samples times its share of the samples the stage's live replicas ran), so computed now its cached graph would be
    stale by the time its backward came, and the backward would recompute. 0: never wait.
    Only with ``activation_cache_mb`` > 0 (without the cache every backward recomputes anyway)."""
    progress_push: bool = False
    """With replicas in a stage, each also pushes its sample count straight to the others whenever it changes
    (:mod:`agoractl.runtime.progress_push`), so that they step on the stage's count at once rather than up to a DHT
    read (0.5 s) late. On local-cpu with 2 workers per stage (a step of about 0.25 s) it lowered the final loss from
    2.661 to 2.532 (medians of 15 and 29 runs). Off by default: with it on, runs with stretches of 12 s or more
    without a step came more often (7 of about 50 against 1 of 23; the two examined had a SPARTA round that failed
    to form its group), one of them 300 s long, and the cause is not settled."""
    self_termination: SelfTermination = SelfTermination()
    self_feed: bool = False
    """Whole-model replicas stepping on their own counts (one stage of role whole, ``data_parallel.fgdiloco.replicas``
    set) read their own samples: replica of rank r (its place among the stage's sorted peer ids) trains block r of
    every global batch of the run's sample stream, the batch of step s for step s, with no trainer and no request
    over the network (seed 002's replicas each read their own data). Needs ``local.trainers: 0``."""


def workers_errors(w: Workers, roles: list[str], replica_batch: Optional[int],
                   local_trainers: int) -> list[tuple[str, str]]:
    """Cross-field rules of the section, as (dotted path, message) pairs (see the schema's cross_field_errors)."""
    out: list[tuple[str, str]] = []
    st = w.self_termination
    if st.allreduce_failures > st.window_rounds:
        out.append(("workers.self_termination.allreduce_failures",
                    f"cannot exceed window_rounds ({st.window_rounds}); got {st.allreduce_failures}"))
    if w.self_feed and (roles != ["whole"] or replica_batch is None):
        out.append(("workers.self_feed", "needs whole-model replicas on their own counts: one stage of role whole, "
                                         "data_parallel.method fgdiloco and data_parallel.fgdiloco.replicas set; "
                                         "else set it to false and local.trainers to 1 (trainers feed the workers)"))
    elif w.self_feed and local_trainers:
        out.append(("local.trainers", f"must be 0 with workers.self_feed (the replicas read their own samples); "
                                      f"got {local_trainers}"))
    elif not w.self_feed and not local_trainers:
        out.append(("local.trainers", "must be at least 1: only self-fed replicas (workers.self_feed) train without "
                                      "trainers"))
    return out
