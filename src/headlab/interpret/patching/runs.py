"""What every patching method shares: a clean/corrupted pair of inputs, stacked runs, per-head edits.

A *pair* is two inputs of the same shape: the clean prompts and their corrupted twins (same length
token by token, same attention mask), so that position ``i`` of one is patched with position ``i`` of
the other. Configurations run *stacked*: ``C`` copies of the ``B`` clean examples form one batch of
``C * B`` rows, and the edit of a site replaces, in copy ``c``, exactly the heads (and positions) of
configuration ``c``. One forward measures ``C`` patches, as ablation batches its configurations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, InputError, ShapeError
from headlab.interpret.capture import capture
from headlab.interpret.capture.run import prepare_inputs
from headlab.interpret.patching.metrics import evaluate, logits_of
from headlab.models.loader import resolve

if TYPE_CHECKING:
    from headlab.models.base import ModelAdapter
    from headlab.models.loaded_model import LoadedModel

HEAD_KINDS = ("z", "q", "k", "v", "pattern")  # patchable per head; k and v count kv heads
RESID_KINDS = ("resid_pre", "resid_post", "mlp_out")  # patchable per layer: one "head" column


@dataclass
class Pair:
    """A clean and a corrupted input, prepared; ``B`` examples each."""

    adapter: ModelAdapter
    loaded: LoadedModel | None
    clean: dict | torch.Tensor
    corrupted: dict | torch.Tensor
    n: int  # B
    length: int  # L
    model_name: str


def _ids_of(x) -> Any:  # the ids tensor, or x itself (a dict without input_ids: checked by the caller)
    return x["input_ids"] if isinstance(x, dict) and "input_ids" in x else x


def prepare(model, clean, corrupted) -> Pair:
    """Both inputs tokenised/checked: same keys and shapes, same attention mask (positions must align)."""
    adapter, loaded = resolve(model)
    a, b = prepare_inputs(clean, loaded), prepare_inputs(corrupted, loaded)
    ta, tb = _ids_of(a), _ids_of(b)
    length = None
    if isinstance(a, dict) and isinstance(b, dict) and "input_ids" not in a and hasattr(adapter.model, "config"):
        from headlab.models.inputs import input_kind  # images, audio: the model's own input, positions from a run

        key = input_kind(adapter.model)
        ta, tb = a.get(key), b.get(key)
        if isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor) and ta.shape == tb.shape:
            q = capture(adapter, a, [adapter.site_name(0, "q")])[adapter.site_name(0, "q")]
            length = int(q.shape[2])
    if length is None and (not isinstance(ta, torch.Tensor) or not isinstance(tb, torch.Tensor) or ta.dim() != 2):
        raise InputError(
            "patching needs the model's inputs: input_ids tensors (B, L), dicts with input_ids (or the "
            "model's pixel_values / input_values / input_features), or text with a LoadedModel"
        )
    if ta.shape != tb.shape:
        raise ShapeError(
            f"clean inputs have shape {tuple(ta.shape)} and corrupted {tuple(tb.shape)}: patching "
            "replaces position i by position i, so both must tokenise to the same length (choose "
            "corrupted words with the same number of tokens)"
        )
    if isinstance(a, dict) != isinstance(b, dict) or (isinstance(a, dict) and set(a) != set(b)):
        raise InputError("clean and corrupted must be given the same way (both tensors, or dicts with the same keys)")
    if (
        isinstance(a, dict)
        and isinstance(b, dict)
        and "attention_mask" in a
        and not torch.equal(a["attention_mask"], b["attention_mask"])
    ):
        raise InputError(
            "clean and corrupted have different attention masks (padding); give prompts of equal "
            "token lengths so the same positions are real in both"
        )
    if torch.equal(ta, tb) and (
        not isinstance(a, dict)
        or all(
            not isinstance(v, torch.Tensor) or (isinstance(b[k], torch.Tensor) and torch.equal(v, b[k]))
            for k, v in a.items()
        )
    ):
        raise InputError(
            "clean and corrupted are the same input: patching one into the other changes nothing, "
            "and every effect would be 0/0; give a corrupted input that differs (other names, tokens)"
        )
    name = getattr(loaded, "name", None) or type(adapter.model).__name__
    return Pair(adapter, loaded, a, b, int(ta.shape[0]), int(ta.shape[1]) if length is None else length, name)


def check_gap(m_clean: float, m_corrupt: float) -> None:
    """Refuse, after the clean and corrupted runs and before the patched ones, a metric that is the same on
    both: every effect is normalised by their gap, so each would be 0/0."""
    if not (abs(m_corrupt - m_clean) >= 1e-9):  # NaN too
        raise InputError(
            f"the metric is {m_clean:.6g} on the clean run and {m_corrupt:.6g} on the corrupted one: "
            "with no gap between them every effect would be 0/0; choose a corrupted input (or a "
            "metric) that changes the metric"
        )


def repeat(inputs, copies: int):
    """``copies`` stacked copies of every tensor along the batch: ``(B, ...) -> (copies * B, ...)``."""
    if isinstance(inputs, dict):
        return {
            k: (v.repeat(copies, *[1] * (v.dim() - 1)) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
            for k, v in inputs.items()
        }
    return inputs.repeat(copies, *[1] * (inputs.dim() - 1))


def run_metric(pair: Pair, metric, inputs, copies: int, edits=None, sites=None, backend=None):
    """Run ``copies`` stacked copies of ``inputs`` with ``edits``; ``((copies, B) metric values, cache)``."""
    cache = capture(
        pair.adapter, repeat(inputs, copies) if copies > 1 else inputs, sites or [], edits=edits or {}, backend=backend
    )
    with torch.no_grad():
        values = evaluate(metric, logits_of(cache.outputs), pair.n)
    return values.detach().float(), cache


def check_kinds(sites, allowed: tuple[str, ...] = HEAD_KINDS + RESID_KINDS) -> list[str]:
    kinds = [sites] if isinstance(sites, str) else list(sites)
    bad = [k for k in kinds if k not in allowed]
    if bad or not kinds:
        per = (
            "k and v per kv head; resid_pre, resid_post and mlp_out per layer"
            if set(RESID_KINDS) <= set(allowed)
            else "attribution patching reads gradients at the head sites only"
        )
        raise ConfigError(f"sites={sites!r}: this method patches the kinds {', '.join(allowed)} ({per})")
    return kinds


def n_heads(kind: str, t: torch.Tensor) -> int:
    """Heads of a recorded site: ``t.shape[1]`` (B, heads, L, ...); 1 for the residual kinds ``(B, L, E)``."""
    return 1 if kind in RESID_KINDS else int(t.shape[1])


def patch_edit(kind: str, mask: torch.Tensor, n: int, source: torch.Tensor) -> Callable:
    """:func:`where_heads` for a head site, or for a residual site seen as one head."""
    if kind not in RESID_KINDS:
        return where_heads(mask, n, source)
    inner = where_heads(mask, n, source.unsqueeze(1))  # (B, 1, L, E)
    return lambda t, site: inner(t.unsqueeze(1), site).squeeze(1)


def check_positions(positions, length: int) -> list[int] | None:
    """None (every position at once), or the list of positions patched one at a time ("each": all)."""
    if positions is None:
        return None
    if isinstance(positions, str):
        if positions != "each":
            raise ConfigError(f"positions={positions!r}: give None (all at once), 'each', or a list of positions")
        return list(range(length))
    out = [
        checks.index("position", p, length, message="position {value!r} is not an index into {length} positions")
        for p in positions
    ]
    if not out:
        raise ConfigError("positions is empty; give None (all positions at once), 'each', or a list")
    return out


def where_heads(mask: torch.Tensor, n: int, source: torch.Tensor) -> Callable:
    """An edit that puts ``source (B, heads, L, ...)`` where ``mask (C, heads, L)`` is True, in every one of
    ``C`` stacked copies of ``n`` examples: ``t (C * n, heads, L, ...)``."""

    def edit(t: torch.Tensor, site: str) -> torch.Tensor:
        C = mask.shape[0]
        view = t.view(C, n, *t.shape[1:])  # (C, B, heads, L, ...)
        m = mask.to(t.device).view(C, 1, *mask.shape[1:], *[1] * (t.dim() - 3))  # (C, 1, heads, L, 1...)
        src = source.to(device=t.device, dtype=t.dtype).unsqueeze(0)  # (1, B, heads, L, ...)
        return torch.where(m, src, view).reshape(t.shape)

    return edit


def chunks(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def copies_per_forward(n: int, max_rows: int) -> int:
    return max(1, checks.positive_int("max_rows (rows per forward)", max_rows) // n)
