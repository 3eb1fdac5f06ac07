"""One GPU, central against the swarm: ``launch central --device cuda`` and ``launch swarm --device cuda`` (every
stage's worker on the same GPU, the trainers on the CPU) train the same tokens of a GPU-sized model under bf16
autocast (``training.precision: bf16``; master weights and AdamW moments stay fp32). Prints each run's tokens/s,
their ratio, final losses, and each run's model FLOPs utilization.

MFU = model FLOPs per second / the device's peak dense bf16 FLOPs, with the model FLOPs of a token
6 x (parameters that multiply: the embedding table excluded) + 12 x layers x d_model x seq_len (attention's
scores and values, forward and backward; the PaLM appendix's count, no recompute counted). The peak comes from
``--peak-tflops`` or, for the devices below, from the device's name; else MFU is null.

The shape is ``manifests/bench-cpu.yaml`` grown for a GPU (``GPU_SHAPE``: d_model 1024, 12 layers in 3 stages of
4, seq_len 512, global batch 64); ``--set`` overrides it further. Without CUDA it exits with code 2; ``--device
cpu`` rehearses the script on a small shape (no MFU without ``--peak-tflops``).

    python benchmarks/gpu_check.py --json
    python benchmarks/gpu_check.py --device cpu --set model.d_model=128 --set model.d_ff=352 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swarm_vs_central import ROOT, agoractl  # noqa: E402  (the same runner and /proc CPU accounting)

MANIFEST = ROOT / "manifests" / "bench-cpu.yaml"
GPU_SHAPE = ["model.d_model=1024", "model.n_layers=12", "model.n_heads=16", "model.n_kv_heads=8", "model.d_ff=2816",
             "model.seq_len=512", "model.ssn.rank=128",
             "stages=[{role: head, layers: 4}, {role: body, layers: 4}, {role: tail, layers: 4}]",
             "training.global_batch_size=64", "training.precision=bf16", "workers.max_microbatch=16",
             "trainers.microbatch=8", "trainers.in_flight=3", "workers.activation_cache_mb=16384"]
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0}
"""Dense bf16 tensor-core peaks (SXM parts; vendors' data sheets, without sparsity)."""


def flops_per_token(sets: list[str]) -> float:
    """Model FLOPs of one token, forward and backward, for the manifest with `sets`."""
    from agoractl.manifest.loader import load_manifest
    from agoractl.model.build import build_model

    run = load_manifest(MANIFEST, sets)
    model = build_model(run, "meta")
    dense = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "embed" not in n)
    m = run.model
    return 6.0 * dense + 12.0 * m.n_layers * m.d_model * m.seq_len


def device_peak(device: str, override: float | None) -> tuple[str, float | None]:
    """(device name, peak bf16 TFLOPS or None)."""
    if device == "cpu":
        return "cpu", override
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    if override:
        return name, override
    return name, next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu to rehearse the script (default cuda).")
    ap.add_argument("--steps", type=int, default=20, help="Optimizer steps of each run (training.max_steps).")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="Manifest override (repeatable).")
    ap.add_argument("--peak-tflops", type=float, default=None, help="The device's dense bf16 peak, TFLOPS.")
    ap.add_argument("--rows", type=int, default=20000, help="Documents in the generated sample corpus.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object on stdout.")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # no CUDA context here: the runs make theirs
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_check: --device {args.device}: CUDA is not available on this machine (use --device cpu "
                  f"to rehearse the script)", file=sys.stderr)
            return 2
    sets = GPU_SHAPE + [f"training.max_steps={args.steps}", "training.schedule.warmup_steps=2"] + args.sets
    name, peak = device_peak(args.device, args.peak_tflops)
    per_token = flops_per_token(sets)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        data = [f"data.source={tmp}/sample/*.parquet", f"data.output={tmp}/shards", "data.num_shards=4",
                f"local.run_dir={tmp}/run", f"checkpoints.store={tmp}/store", "checkpoints.every_steps=0"]
        agoractl("data", "sample", "--out", f"{tmp}/sample", "--rows", str(args.rows), "--files", "2")
        flags = [a for s in sets + data for a in ("--set", s)]
        agoractl("shard", str(MANIFEST), *flags)
        central = agoractl("launch", "central", str(MANIFEST), *flags, "--device", args.device, "--fresh", "--force")
        swarm = agoractl("launch", "swarm", str(MANIFEST), *flags, "--device", args.device, "--fresh", "--force")

    def mfu(tokens_per_s: float) -> float | None:
        return round(tokens_per_s * per_token / (peak * 1e12), 4) if peak else None

    result = {
        "device": name, "peak_bf16_tflops": peak, "model_flops_per_token": per_token, "overrides": sets,
        "central_tokens_per_s": round(central["tokens_per_s"], 1),
        "swarm_tokens_per_s": round(swarm["tokens_per_s"], 1),
        "ratio": round(swarm["tokens_per_s"] / central["tokens_per_s"], 3),
        "central_mfu": mfu(central["tokens_per_s"]), "swarm_mfu": mfu(swarm["tokens_per_s"]),
        "central_final_loss": central["final_loss"], "swarm_final_loss": swarm["final_loss"],
        "steps": swarm["steps"], "tokens": swarm["tokens"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{name}: {result['steps']} steps, {result['tokens']:,} tokens, {per_token / 1e9:.2f} GFLOP a token")
    for side in ("central", "swarm"):
        m = result[f"{side}_mfu"]
        print(f"{side:8} {result[f'{side}_tokens_per_s']:>10,.0f} tokens/s  final loss "
              f"{result[f'{side}_final_loss']:.4f}  MFU {'n/a' if m is None else f'{m:.1%}'}")
    print(f"swarm/central: {result['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
