"""An optimizer ``state_dict()`` as safetensors (its tensors) plus JSON (everything else), and back.

A torch AdamW state dict is ``{"state": {0: {"step": T, "exp_avg": T, "exp_avg_sq": T}, ...},
"param_groups": [{"lr": ..., "betas": (...), "params": [0, ...], ...}]}``: nested dicts with int
keys, tuples, scalars and tensors. :func:`encode` moves every tensor into a flat dict keyed by its
dotted path and leaves a ``{"__tensor__": key}`` marker in a JSON-able tree; dicts with non-string
keys become ``{"__items__": [[key, value], ...]}`` and tuples ``{"__tuple__": [...]}`` so that
:func:`decode` restores the exact structure ``load_state_dict`` expects.
"""

from __future__ import annotations

from typing import Any

import torch

_MARKERS = ("__tensor__", "__items__", "__tuple__")


def encode(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """A JSON-able tree for `obj`; its tensors are added to `tensors` (contiguous CPU copies)."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: encode(v, tensors, f"{prefix}.{k}" if prefix else k) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"optimizer state key {k!r} at {prefix or '<root>'} is not a plain value")
            items.append([k, encode(v, tensors, f"{prefix}.{k}" if prefix else str(k))])
        return {"__items__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"optimizer state value at {prefix or '<root>'} has unsupported type {type(obj).__name__}")


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            key = tree["__tensor__"]
            if key not in tensors:
                raise KeyError(f"optimizer state refers to tensor {key!r}, missing from its safetensors file")
            return tensors[key]
        if set(tree) == {"__items__"}:
            return {k: decode(v, tensors) for k, v in tree["__items__"]}
        if set(tree) == {"__tuple__"}:
            return tuple(decode(v, tensors) for v in tree["__tuple__"])
        return {k: decode(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    return tree
