"""An atlas phase's value as JSON and back: what a run keeps of each finished phase (its unit), so that a
resumed run reads the same numbers back.

Tensors become ``{"__tensor__": rows, "dtype": ...}`` (NaN as None; floats through float64, which holds a
float32 or float64 value exactly), dicts and lists are walked, everything else is kept as it is (numbers,
strings, booleans, None).

    >>> import torch
    >>> value = {"grid": torch.tensor([[0.5, float("nan")]], dtype=torch.float64), "notes": ["a"]}
    >>> back = decode(encode(value))
    >>> torch.equal(back["grid"].nan_to_num(-1), value["grid"].nan_to_num(-1)), back["notes"]
    (True, ['a'])
"""

from __future__ import annotations

import hashlib
import json
import math

import torch


def fingerprint(obj) -> str:
    """A short stable digest of JSON-able data (or token-id sequences): what a kept phase was computed from."""

    def norm(x):
        if hasattr(x, "tolist"):
            return x.tolist()
        if isinstance(x, (list, tuple)):
            return [norm(y) for y in x]
        return x

    return hashlib.sha256(json.dumps(norm(obj), sort_keys=True, default=str).encode()).hexdigest()[:16]


def encode(value):
    """JSON-able form of a phase's value: tensors become ``{"__tensor__": rows, "dtype": ...}`` (NaN as None)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        rows = t.double().tolist() if t.is_floating_point() else t.tolist()
        if t.is_floating_point():
            rows = _nan_to_none(rows)
        return {"__tensor__": rows, "dtype": str(t.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value):
    """The inverse of :func:`encode`."""
    if isinstance(value, dict) and "__tensor__" in value:
        rows = _none_to_nan(value["__tensor__"])
        return torch.tensor(rows, dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _nan_to_none(x):
    if isinstance(x, list):
        return [_nan_to_none(y) for y in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def _none_to_nan(x):
    if isinstance(x, list):
        return [_none_to_nan(y) for y in x]
    return float("nan") if x is None else x


__all__ = ["decode", "encode", "fingerprint"]
