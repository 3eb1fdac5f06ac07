"""Plots of inter-replica divergence in the style of the report's figures 28 and 29 (PNG).

(a) variance against SPARTA segment, one line per snapshot step, coloured from early to late steps
(figure 28); (b) variance against step, one line per segment (figure 29). Drawn with matplotlib's
Agg backend, so no display is needed; the file is written to a temporary name and renamed.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from agoractl.errors import UsageError


def plot_divergence(result: dict[str, Any], path: str) -> str:
    """Write the two-panel figure for an ``analyze_divergence`` result to `path` (PNG)."""
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path}: the plot is a PNG; give a path ending in .png")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [str(s) for s in result["steps"]]
    segments = result["segments"]
    table = result["segment_variance"]
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for k, step in enumerate(steps):
        colour = cmap(k / max(1, len(steps) - 1))
        ax_a.plot(range(segments), [v if v is not None else float("nan") for v in table[step]],
                  marker="o", markersize=3, linewidth=1, color=colour, label=f"step {step}")
    ax_a.set_xlabel("SPARTA segment")
    ax_a.set_ylabel("inter-replica variance")
    ax_a.set_title(f"(a) {result['stage']}: variance per segment, by step")
    ax_a.set_xticks(range(segments))
    if len(steps) <= 12:
        ax_a.legend(fontsize=7, ncol=2)
    else:
        sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(int(steps[0]), int(steps[-1])))
        fig.colorbar(sm, ax=ax_a, label="step")
    seg_cmap = plt.get_cmap("tab20" if segments <= 20 else "turbo")
    xs = [int(s) for s in steps]
    for s in range(segments):
        ys = [table[step][s] if table[step][s] is not None else float("nan") for step in steps]
        ax_b.plot(xs, ys, marker="o", markersize=3, linewidth=1,
                  color=seg_cmap(s % 20 if segments <= 20 else s / max(1, segments - 1)), label=f"segment {s}")
    ax_b.set_xlabel("step")
    ax_b.set_ylabel("inter-replica variance")
    ax_b.set_title(f"(b) {result['stage']}: variance per step, by segment")
    if segments <= 20:
        ax_b.legend(fontsize=6, ncol=2)
    for ax in (ax_a, ax_b):
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.grid(alpha=0.3)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp.png")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
