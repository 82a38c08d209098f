"""``train-gates``: DuoAttention's gates (:mod:`headlab.decode.train`) trained as an instrument of the study runner.

One unit per optimiser step (:class:`~headlab.decode.train.GateTrainer`), so the runner owns the progress, Ctrl-C
and resume: an interrupted run keeps its finished steps in ``--out`` (each step's loss and seconds, and the gates
and Adam's state of the newest two), exits 130, and the same command with ``--resume`` continues from the last kept
step to the gates an uninterrupted run ends with. A finished file keeps its steps too, so ``--resume`` with more
``--steps`` trains on from it.

:func:`headlab.decode.train.train_gates` runs the same instrument (:func:`headlab.interpret.study.runner.call`):
its in-memory contexts (``data``), its window (``rest``) and its checkpoint's pace (``save_every``) are Python-only
options; its ``checkpoint=PATH`` is this instrument's output file, resumed when it exists.
"""

from __future__ import annotations

import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from headlab.decode.instrument import MODEL, DecodingInstrument
from headlab.errors import ConfigError, InputError
from headlab.interpret.study.base import REQUIRED, Context, InstrumentResult, Option, Output, Unit, at_least, register

if TYPE_CHECKING:
    from headlab.decode.rules import Window


def _window(value, option, options) -> None:
    from headlab.decode import kv

    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--window {value!r}: write SINK,RECENT, e.g. 4,256")
    kv.as_rule(f"streaming:{value}")


def _rest(value, option, options) -> None:
    """``train_gates(rest=...)``: a plain window (no quantization, no compensation)."""
    if getattr(value, "kind", None) != "window" or value.bits != 16 or value.compensate:
        raise ConfigError(f"rest={value!r}: gates are trained against a plain window, e.g. kv.window(4, 256)")


def _budget(value, option, options) -> None:
    """``--seconds``: at least 1; from Python (``train_gates(seconds=...)``, named without a flag) any budget > 0."""
    if option.flag is not None:
        at_least(1)(value, option, options)
    elif not 0 < value < float("inf"):
        raise ConfigError(f"seconds={value!r}: a time budget in seconds, > 0")


def _count(high: int, why: str):
    """An Option check: an integer from 1 to ``high`` (10**12 steps or contexts loaded the model, then listed them
    without end)."""

    def check(value, option: Option, options: dict) -> None:
        at_least(1)(value, option, options)
        if value > high:
            raise ConfigError(f"{option.label} must be at most {high:,} ({why}), got {value:,}")

    return check


@register
class TrainGates(DecodingInstrument):
    """Train DuoAttention's gates, one per kv head: one unit per optimiser step (see above)."""

    name = "train-gates"
    kind = "kv_gates"
    summary = """Train DuoAttention's gates (one per kv head) on synthetic passkey contexts; write them for --kv-from.

Example (then decode with the half of kv heads whose gates are highest kept full):
headlab train-gates --out gates.json --steps 50 --seconds 1800
headlab generate "..." --kv-from gates.json --keep 0.5

Interrupted (Ctrl-C), --out keeps the finished steps; the same command with --resume continues from them."""
    options = (
        Option(
            "out",
            "--out",
            Path,
            REQUIRED,
            "where to write the gates (JSON; --kv-from reads it)",
            short="-o",
            setting=False,
        ),
        MODEL,
        Option("window", "--window", str, "4,256", "SINK,RECENT: the window the gates choose against", check=_window),
        # how far to train, not how a step computes: kept steps go on to more steps (--resume, checkpoint=)
        Option(
            "steps",
            "--steps",
            int,
            100,
            "optimiser steps, one training context each",
            setting=False,
            check=_count(1_000_000, "optimiser steps, a forward and backward each; --seconds bounds the time"),
        ),
        Option("seconds", "--seconds", float, None, "a time budget: stop (and save) after this long", check=_budget),
        Option("tokens", "--tokens", int, 512, "tokens per training context"),
        Option(
            "contexts",
            "--contexts",
            int,
            16,
            "training contexts (cycled through)",
            check=_count(10_000, "contexts built before the first step and cycled through"),
        ),
        Option("keys", "--keys", int, 4, "passkeys hidden in each context", check=at_least(1)),
        Option("lr", "--lr", float, 0.05, "Adam's learning rate", check=at_least(1e-9)),
        Option("l1", "--l1", float, 0.05, "the weight of the L1 pull towards the window", check=at_least(0)),
        Option("seed", "--seed", int, 0, "draws the contexts", check=at_least(0)),
        Option(
            "checkpoint",
            "--checkpoint",
            Path,
            None,
            "start from a torch.save checkpoint of an earlier "
            "headlab's train_gates(checkpoint=...) (an interrupted train-gates continues with --resume instead)",
            setting=False,
        ),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
        # from Python only (train_gates): the contexts themselves, the window as a rule, how often --out is saved
        Option("data", None, object, None, "[(ids (1, n), positions)] to train on", python=True, setting=False),
        Option(
            "rest",
            None,
            object,
            None,
            "the window the gates choose against (kv.window)",
            python=True,
            setting=False,
            check=_rest,
        ),
        Option(
            "save_every",
            None,
            int,
            None,
            "save the kept steps in the output file every N steps",
            python=True,
            setting=False,
            check=at_least(1),
        ),
    )
    output = Output("out", folder=False, force="force")
    resumable = True  # the steps are units: --resume continues from the last one kept in --out
    stage = "training gates"
    # the steps follow one another (each starts from the gates the one before left): the runner gives them all to
    # rank 0, which trains as one process would
    chained = True
    sharded = (
        "its gates mix each head's full and windowed attention in an attention function of its own, written "
        "for a whole model on one process; train the gates on one process and use them with generate"
    )

    def check(self, ctx: Context) -> None:
        from headlab.decode import kv

        o = ctx.options
        # a plain window: --window's (a streaming rule), or rest's (checked by its option)
        rule: Window = o["rest"] if o["rest"] is not None else kv.as_rule(f"streaming:{o['window']}")  # type: ignore[assignment]
        ctx.state["rule"] = rule
        if not ctx.python:  # the command's contexts; train_gates checks its own (or takes data) in GateTrainer
            low = rule.sink + rule.recent + 64
            if o["tokens"] < low:
                raise ConfigError(
                    f"--tokens must be at least {low} (the window's sink + recent + 64), got {o['tokens']}"
                )
            self.check_positions(ctx)
        ck = o["checkpoint"]
        if ck is None:
            return
        if ck.exists() and not ck.is_file():
            raise InputError(f"--checkpoint {str(ck)!r} is not a file")
        if not ck.exists():
            raise InputError(
                f"--checkpoint {str(ck)!r} does not exist; give the file train_gates(checkpoint=...) "
                "wrote, or drop --checkpoint"
            )
        if not zipfile.is_zipfile(ck):  # torch.save writes a zip archive; a text file is not one
            raise InputError(
                f"--checkpoint {str(ck)!r} is not a train-gates checkpoint (a torch.save file); give "
                "the checkpoint an interrupted run wrote, or another path to start afresh"
            )

    def check_positions(self, ctx: Context) -> None:
        tokens, limit = ctx.options["tokens"], self.positions(ctx)
        if limit is not None and tokens > limit:
            raise ConfigError(f"--tokens {tokens}: {ctx.options['model']} reads at most {limit:,} positions")

    def check_loaded(self, ctx: Context) -> None:
        """The positions against the loaded model, then the trainer (its own checks: a decoder, the contexts), and
        a --checkpoint to start from."""
        from headlab.decode.train import GateTrainer

        o = ctx.options
        if not ctx.python:
            self.check_positions(ctx)
        ctx.state["trainer"] = tr = GateTrainer(
            ctx.loaded,
            rest=ctx.state["rule"],
            data=o["data"],
            steps=o["steps"],
            seconds=o["seconds"],
            tokens=o["tokens"],
            contexts=o["contexts"],
            keys=o["keys"],
            lr=o["lr"],
            l1=o["l1"],
            seed=o["seed"],
        )
        if o["checkpoint"] is not None:
            tr.load_checkpoint(o["checkpoint"])
        ctx.state["base"] = (tr.state.steps, list(tr.state.losses), tr.state.seconds)  # before the first unit
        ctx.state["at"] = tr.state.steps  # the steps the trainer holds now
        ctx.state["recent"] = []  # the values of the latest steps (the newest two keep the trainer's state)
        ctx.progress(self.stage, tr.state.steps, o["steps"])

    def units(self, ctx: Context) -> list[Unit]:
        ctx.state["units"] = units = [Unit(str(i + 1), i) for i in range(ctx.state["base"][0], ctx.options["steps"])]
        return units

    def _catch_up(self, ctx: Context, i: int) -> None:
        """A resumed run: the trainer continues from the state the kept step ``i`` (1-based key) left."""
        last = ctx.kept.get(str(i))
        if not isinstance(last, dict) or "state" not in last:
            raise InputError(
                f"--resume: {ctx.path} does not keep the state after step {i}; drop --resume to start again"
            )
        losses = [ctx.kept[str(k)].get("loss") for k in range(ctx.state["base"][0] + 1, i + 1)]
        ctx.state["trainer"].restore(
            last["state"],
            steps=i,
            seconds=last["seconds"],
            losses=ctx.state["base"][1] + [x for x in losses if x is not None],
        )
        ctx.state["at"] = i

    def run_unit(self, ctx: Context, unit, recording=None):
        i, tr, o = unit.payload, ctx.state["trainer"], ctx.options
        if ctx.state["at"] != i:
            self._catch_up(ctx, i)
        if o["seconds"] is not None and tr.state.seconds >= o["seconds"]:  # the time budget is spent: so for the rest
            ctx.state["at"] = i + 1
            return {"loss": None, "seconds": tr.state.seconds, "stopped": "seconds"}
        t0 = time.perf_counter()
        with tr.frozen():
            loss = tr.step()
        tr.state.seconds += time.perf_counter() - t0
        ctx.state["at"] = i + 1
        ctx.progress(self.stage, i + 1, o["steps"])
        value = {"loss": loss, "seconds": tr.state.seconds, "state": tr.snapshot()}
        recent = ctx.state["recent"]
        recent.append(value)
        if len(recent) > 2:  # a kept file holds the state of its newest steps only (two: one may be cut by Ctrl-C)
            recent.pop(0).pop("state", None)
        every = o["save_every"]
        if every is not None and ctx.path is not None and ctx.main and (i + 1) % every == 0:
            self._save_kept(ctx, {**ctx.kept, unit.key: value})
        return value

    def _save_kept(self, ctx: Context, values: dict) -> None:
        """The runner's checkpoint of the steps so far, written before the run ends (as Ctrl-C would write it), so
        that a run killed outright resumes from it too."""
        from headlab.interpret.study.checkpoint import partial_path, partial_result

        partial_result(ctx, values, len(ctx.state["units"])).save(partial_path(ctx))

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        import torch

        from headlab.decode.train import GateTraining

        tr, (steps, losses, seconds) = ctx.state["trainer"], ctx.state["base"]
        ordered = [values[k] for k in sorted(values, key=int)]
        ran = [v for v in ordered if v.get("loss") is not None]
        if ran and "state" not in ran[-1]:  # resumed from a file that went further than this run's steps
            asked = f"steps={ctx.options['steps']}" if ctx.python else f"--steps {ctx.options['steps']}"
            raise InputError(f"{ctx.path} keeps more steps than {asked} asks for; ask for as many or more")
        gates = torch.tensor(ran[-1]["state"]["gates"]) if ran else tr.param.detach().clone()
        g = GateTraining(
            gates,
            tr.rule,
            losses + [v["loss"] for v in ran],
            steps + len(ran),
            ordered[-1]["seconds"] if ordered else seconds,
            "seconds" if len(ran) < len(ordered) else "steps",
            dict(tr.state.settings),
            tr.state.model,
        )
        return InstrumentResult.of(g)

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        """The gates (``GateTraining.save``'s file) with the steps the runner keeps beside them (``"units"``), so
        that a finished file goes on to more steps too."""
        return [result.save(path)]


__all__ = ["TrainGates"]
