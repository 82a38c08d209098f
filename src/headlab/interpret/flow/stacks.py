"""An answer for each stack of an encoder-decoder: :class:`PerStack`.

Rollout and attention flow chain a stack's self-attention maps with the identity added for the residual, so they
are defined within one stack. Asked about an encoder-decoder (T5, BART, Whisper ...) without ``stack=``,
:func:`headlab.rollout` and :func:`headlab.attention_flow` answer for each stack that chains, the encoder's and the
decoder's self-attention, each exactly what naming that stack gives; cross-attention maps decoder tokens onto
encoder tokens and is left out (the result's ``notes`` say so).
"""

from __future__ import annotations

from collections.abc import Callable

from headlab.results import envelope

CHAINING = ("encoder", "decoder")  # the stacks whose self-attention maps chain (cross-attention does not)


class PerStack(dict):
    """``{stack name: result}``, one result per stack of an encoder-decoder, in the model's order (``"encoder"``,
    ``"decoder"``); ``stacks`` names them, ``layers`` gives each stack's attention layers (the model's numbering,
    as gates use) and ``notes`` says what was left out and why."""

    def __init__(self, results: dict, layers: dict[str, list[int]], notes: list[str]) -> None:
        super().__init__(results)
        self.layers = layers
        self.notes = notes

    @property
    def stacks(self) -> list[str]:
        return list(self)

    def to_json(self) -> dict:
        """Each stack's own JSON under its name, with the stacks' layers and the notes (kind ``per_stack``)."""
        return envelope(
            "per_stack",
            {
                "stacks": self.stacks,
                "layers": {k: list(v) for k, v in self.layers.items()},
                "results": {k: r.to_json() for k, r in self.items()},
                "notes": list(self.notes),
            },
        )


def several_stacks(adapter) -> bool:
    """Does the model have stacks that chain apart (an encoder-decoder)?"""
    return sum(1 for s in adapter.stacks if s in CHAINING) > 1


def each_stack(adapter, run: Callable[[str], object], what: str) -> PerStack:
    """``run(stack)`` for each stack that chains, as a :class:`PerStack` whose notes say so."""
    names = [s for s in adapter.stacks if s in CHAINING]
    layers = {s: list(adapter.stacks[s]) for s in names}
    notes = [
        f"{what} runs within one stack; this model has the stacks {', '.join(adapter.stacks)}: answered for "
        + ", ".join(f"{s} (layers {v[0]}..{v[-1]})" for s, v in layers.items())
        + ", each as stack= that name gives"
    ]
    if "cross" in adapter.stacks:
        cross = adapter.stacks["cross"]
        notes.append(
            f"cross-attention (layers {cross[0]}..{cross[-1]}) maps decoder tokens onto encoder tokens, so its maps "
            "do not chain: left out"
        )
    return PerStack({s: run(s) for s in names}, layers, notes)


__all__ = ["CHAINING", "PerStack", "each_stack", "several_stacks"]
