"""PNG plots of ``agoractl simulate`` results (matplotlib, Agg backend: no display needed).

The file is written to a temporary name and renamed, so a crash never leaves a truncated PNG.
"""

from __future__ import annotations

import os
from pathlib import Path


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    scenario = result["scenario"]
    if scenario == "fgdiloco":
        bws = [f"{b:g}" for b in result["bandwidths_mbps"]]
        fig, axes = plt.subplots(1, 2 + len(bws), figsize=(5 * (2 + len(bws)), 4))
        for name, v in result["variants"].items():
            axes[0].plot(_smooth(v["loss"], 10), label=name)
            for ax, b in zip(axes[1:], bws):
                ax.plot(v["hours"][b], v["round_loss_all"], marker=".", label=name)
            axes[-1].plot([c["round"] for c in v["consensus"]], [c["js_mean"] for c in v["consensus"]], label=name)
        axes[0].set(title="training loss per step (mean of replicas)", xlabel="inner step", ylabel="loss")
        for ax, b in zip(axes[1:], bws):
            ax.set(title=f"loss per simulated hour at {b} Mbit/s", xlabel="hours", ylabel="round mean loss")
        axes[-1].set(title="consensus: mean pairwise JS distance", xlabel="round", ylabel="JS distance")
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, v in result["variants"].items():
            axes[0].plot(_smooth(v["loss"], 10), label=name)
            axes[1].plot(*zip(*v["eval_loss"]), marker=".", label=name)
        if scenario == "sparta-participation":
            lo, hi = result["settings"]["phases"]["failure"]
            for ax in axes:
                ax.axvspan(lo, hi, color="grey", alpha=0.15, label=None)
        axes[0].set(title="training loss per step (smoothed)", xlabel="step", ylabel="loss")
        axes[1].set(title="eval loss over routes", xlabel="step", ylabel="eval loss")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"agoractl simulate --scenario {scenario}")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path
