"""Resuming an interrupted atlas: each finished phase is kept in one JSON file, keyed by the run's settings.

The atlas runs in phases (the repeated-token scores, the natural-text scores, the needle trials, the
probe, one causal check per task). With ``resume=PATH``, each phase's result is written to ``PATH`` as
soon as it is done (a temporary file, then a rename, so an interrupt never leaves half a file); a later
call with the same model, kinds, sizes, texts and seed reads the finished phases back and runs only the
rest. A file written for other settings is ignored and replaced (:attr:`Checkpoint.stale` says so).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "atlas.partial.json"
    >>> Checkpoint(p, {"seed": 0}).put("repeated", {"x": [1]})
    >>> Checkpoint(p, {"seed": 0}).get("repeated"), Checkpoint(p, {"seed": 1}).get("repeated")
    ({'x': [1]}, None)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

from headlab.distributed.data import is_main
from headlab.results import write_json


def fingerprint(obj) -> str:
    """A short stable digest of JSON-able data (or token-id sequences), for the checkpoint's key."""
    def norm(x):
        if hasattr(x, "tolist"):
            return x.tolist()
        if isinstance(x, (list, tuple)):
            return [norm(y) for y in x]
        return x
    return hashlib.sha256(json.dumps(norm(obj), sort_keys=True, default=str).encode()).hexdigest()[:16]


def encode(value):
    """JSON-able form of a phase's result: tensors become ``{"__tensor__": rows, "dtype": ...}`` (NaN as None)."""
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


def finished_phases(path: str | os.PathLike) -> list[str]:
    """The phases a checkpoint file holds, in the order they finished (none: no file, or not a checkpoint),
    so that an interrupted run can say what it kept.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "atlas.partial.json"
    >>> Checkpoint(p, {"seed": 0}).put("repeated", {"x": [1]})
    >>> finished_phases(p), finished_phases(p.parent / "none.json")
    (['repeated'], [])
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
    except (ValueError, OSError):
        return []
    phases = data.get("phases") if isinstance(data, dict) else None
    return list(phases) if isinstance(phases, dict) else []


class Checkpoint:
    """Finished phases of one atlas run, in ``path`` (None: keep nothing)."""

    def __init__(self, path: str | os.PathLike | None, key: dict) -> None:
        self.path = None if path is None else Path(path)
        self.key = json.loads(json.dumps(key, default=str))
        self.done: dict = {}
        self.stale = False
        if self.path is not None and self.path.is_file():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (ValueError, OSError):
                data = {}
            if data.get("key") == self.key:
                self.done = dict(data.get("phases", {}))
            else:
                self.stale = True
        self.resumed = list(self.done)  # the phases read back from the file (empty on a fresh run)

    def get(self, phase: str):
        return self.done.get(phase)

    def run(self, phase: str, compute):
        """``compute()``'s value, read back when this phase finished before, else computed and kept."""
        if phase in self.done:
            return decode(self.done[phase])
        value = compute()
        self.put(phase, encode(value))
        return value

    def put(self, phase: str, value) -> None:
        self.done[phase] = value
        if self.path is None or not is_main():  # under torchrun every rank reads the file, rank 0 writes it
            return
        write_json(self.path, {"key": self.key, "phases": self.done}, indent=None)  # atomic: a kill keeps the last

    def finish(self) -> None:
        """The run is complete: remove the file."""
        if self.path is not None and self.path.is_file() and is_main():
            self.path.unlink()


__all__ = ["Checkpoint", "decode", "encode", "finished_phases", "fingerprint"]
