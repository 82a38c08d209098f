"""``generate`` and ``train-gates``: decoding with a KV cache shaped per head, and learning which heads keep it, as
instruments.

They live in the decode layer because their library is here (:func:`headlab.decode.generate.generate`,
:func:`headlab.decode.train.train_gates`); the registry they join is interpret's
(:mod:`headlab.interpret.instruments.base`), which decode may import. The command table (``headlab.cli.table``) makes them rows.

- :class:`Generate` continues one prompt: one unit (a generation cannot be kept half done). Its options are
  checked before anything is read or loaded, the ``--kv-from`` file is read (:func:`read_policy_file`) before
  the load, and the policy is built against the loaded model (:func:`build_policy`) before the first token.
  :func:`~headlab.decode.generate.generate` draws its own bar over the steps (none with ``--json``).
- :class:`TrainGates` trains DuoAttention's gates: one unit per optimiser step
  (:class:`~headlab.decode.train.GateTrainer`), so the runner owns the progress, Ctrl-C and resume: an
  interrupted run keeps its finished steps in ``--out`` (each step's loss, and the gates and Adam's state of the
  latest), exits 130, and the same command with ``--resume`` continues from the last kept step to the gates an
  uninterrupted run ends with.

Both read a model's positions from its config files before the load
(:func:`headlab.models.peek.peek_max_positions`); when the config does not say, the same check runs on the loaded
model, still before any work.
"""

from __future__ import annotations

import time
import zipfile
from pathlib import Path

from headlab.errors import ConfigError, InputError
from headlab.interpret.instruments.base import (
    REQUIRED,
    Context,
    Instrument,
    InstrumentResult,
    Option,
    Output,
    Unit,
    at_least,
    register,
)
from headlab.results import print_json

POLICY_FILE = "a policy JSON, an atlas JSON (headlab atlas) or trained gates (GateTraining.save)"


def read_policy_file(path: Path) -> dict:
    """A policy file (``{"heads": ...}``, from ``Policy.to_json``), an atlas JSON (``{"scores": ...}``) or trained
    gates (``{"gates": ...}``, from ``GateTraining.save``), read by :func:`headlab.reading.read_json_file` and
    checked. Messages keep this option's words: "is not a file", "is not readable JSON: <the reader's reason>"."""
    from headlab.reading import read_json_file

    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"--kv-from {str(p)!r} is not a file; give {POLICY_FILE}")
    try:
        data = read_json_file(p, what=POLICY_FILE)
    except InputError as e:  # the reader's line is "'FILE' is not JSON: WHY": keep WHY
        why = str(e).removeprefix(repr(str(p)) + " ").removeprefix("is ").removeprefix("not JSON: ")
        raise InputError(f"--kv-from {str(p)!r} is not readable JSON: {why}") from None
    if not isinstance(data, dict) or not ({"heads", "scores", "gates"} & set(data)):
        raise InputError(f"--kv-from {str(p)!r}: expected a policy ({{\"heads\": ...}}), an atlas ({{\"scores\": ...}}) "
                         "or trained gates ({\"gates\": ...})")
    if "heads" in data:  # a policy; or heads.json of headlab analyze, whose "heads" is its per-head table
        from headlab.decode.rule_checks import check_policy_data

        check_policy_data(data, f"--kv-from {str(p)!r}")
    return data


def build_policy(loaded, policy: str, kv_from: Path | None, keep: float | None, data: dict | None):
    """The policy the options describe: ``--policy`` alone is uniform; with an atlas (or trained gates), the
    split keeps ``--keep`` of the kv heads full and gives the rest ``--policy``'s window."""
    from headlab.decode import kv

    rule = kv.as_rule(policy)
    keep = 0.5 if keep is None else keep
    if data is None:
        return kv.Policy.uniform(rule)
    assert kv_from is not None  # data is read from it
    if "heads" in data:
        if policy.strip().lower() != "full":
            raise ConfigError(f"--kv-from {kv_from} is a whole policy; drop --policy {policy} (it would be ignored)")
        return kv.Policy.load(kv_from)
    if "gates" in data:
        gates = kv.GateTraining.load(kv_from)

        def split(rest, kept=None):
            return kv.Policy.from_gates(loaded, gates, keep=keep, rest=rest, kept=kept)
    else:
        def split(rest, kept=None):
            return kv.Policy.from_atlas(loaded, data, keep=keep, rest=rest, kept=kept)
    if rule.kind == "window":  # the split's windowed heads take --policy's window, the kept ones stay full
        return split(rule)
    if rule.kind == "full" and rule.bits != 16:  # a split on quantized KV: --policy's precision everywhere
        return split(kv.window(4, 256, bits=rule.bits), rule)
    return split(kv.window(4, 256) if "gates" not in data else None)


def kv_heads_text(counts: dict) -> str:
    """``"12 kv heads full, 78 windowed, 0 dropped"`` (and ``", 6 by token budget"`` for SnapKV / Ada-KV heads).

    >>> kv_heads_text({"full": 1, "window": 3, "drop": 0})
    '1 kv heads full, 3 windowed, 0 dropped'
    """
    text = f"{counts.get('full', 0)} kv heads full, {counts.get('window', 0)} windowed, {counts.get('drop', 0)} dropped"
    return text + (f", {counts['snap']} by token budget" if counts.get("snap") else "")


def _rule(value, option, options) -> None:
    from headlab.decode import kv

    kv.as_rule(value)


def _keep(value, option, options) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"--keep {value}: give the fraction of kv heads kept full, in [0, 1]")
    if options.get("kv_from") is None:
        raise ConfigError(f"--keep {value} acts only with --kv-from (an atlas or trained gates); add --kv-from FILE "
                          "or drop --keep")


def _temperature(value, option, options) -> None:
    if not 0 < value < float("inf"):
        raise ConfigError(f"--temperature must be a number > 0 for sampling, got {value}")


def _prompt(value, option, options) -> None:
    from headlab.reading import read_text

    if not value.strip():
        raise InputError("the prompt is empty; give a text to continue")
    read_text(value, "PROMPT")  # not UTF-8: the byte and where


def _window(value, option, options) -> None:
    from headlab.decode import kv

    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--window {value!r}: write SINK,RECENT, e.g. 4,256")
    kv.as_rule(f"streaming:{value}")


class _Decoding(Instrument):
    """What both share: the model's positions, peeked before the load (the runner's display shows their progress)."""

    # stderr holds the decoding (or training) progress and the runner's one line on Ctrl-C, without a "loading
    # model" line: a log of many prompts reads as one line per prompt (tests/test_row_generate.py)
    announce = False

    def positions(self, ctx: Context) -> int | None:
        """The model's positions: peeked before the load, or the loaded model's."""
        if ctx.loaded is not None:
            return getattr(ctx.loaded, "max_positions", None)
        from headlab.models.peek import peek_max_positions

        return peek_max_positions(ctx.options["model"])


MODEL = Option("model", "--model", str, "smollm2", "a known causal LM name (smollm2) or a model folder", short="-m")


def _count(high: int, why: str):
    """An Option check: an integer from 1 to ``high`` (10**12 steps or contexts loaded the model, then listed them
    without end)."""
    def check(value, option: Option, options: dict) -> None:
        at_least(1)(value, option, options)
        if value > high:
            raise ConfigError(f"{option.label} must be at most {high:,} ({why}), got {value:,}")
    return check


@register
class Generate(_Decoding):
    """Continue a prompt with a per-head KV cache."""

    name = "generate"
    reads_text = True  # a model folder without a tokenizer is refused before the load
    kind = "generation"
    summary = """Continue PROMPT with a per-head KV cache; print the text, the cache's bytes against the full cache's, and speed.

Example (StreamingLLM: 4 sink tokens and the last 256 on every head):
headlab generate "The capital of France is" --policy streaming:4,256 --max-new-tokens 16"""
    options = (
        Option("prompt", None, str, REQUIRED, "the text to continue", check=_prompt),
        MODEL,
        Option("policy", "--policy", str, "full", "full, drop, streaming:SINK,RECENT, snapkv:BUDGET or adakv:BUDGET, "
               "each with optional ,bits=N (every kv head)", short="-p", check=_rule, aliases=("--kv-policy",)),
        Option("kv_from", "--kv-from", Path, None, "a policy JSON (Policy.to_json), an atlas JSON (its retrieval and "
               "non-local heads stay full, the rest get --policy's window) or trained gates (kv.Policy.train / "
               "GateTraining.save: the highest gates stay full)"),
        Option("keep", "--keep", float, None, "with --kv-from (an atlas or gates): the fraction of kv heads kept "
               "full (default 0.5)", check=_keep),
        Option("max_new_tokens", "--max-new-tokens", int, 32, "tokens to generate", short="-n", check=at_least(1)),
        Option("sample", "--sample", bool, False, "sample instead of greedy decoding"),
        Option("temperature", "--temperature", float, None, "with --sample: divides the logits (default 1.0)",
               check=_temperature),
        Option("top_k", "--top-k", int, None, "with --sample: sample among the k most likely tokens",
               check=at_least(1)),
        Option("seed", "--seed", int, None, "with --sample: the sampling seed (default 0)"),
        Option("out", "--out", Path, None, "also write the result as JSON here", short="-o", setting=False),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
        Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
    )
    output = Output("out", folder=False, force="force")

    def check(self, ctx: Context) -> None:
        o = ctx.options
        given = [flag for name, flag in (("temperature", "--temperature"), ("top_k", "--top-k"), ("seed", "--seed"))
                 if o[name] is not None]
        if given and not o["sample"]:
            it = "it acts" if len(given) == 1 else "they act"
            raise ConfigError(f"{', '.join(given)}: {it} only on sampling; add --sample (greedy decoding, the default, "
                              f"would ignore {'it' if len(given) == 1 else 'them'})")
        self.check_positions(ctx)

    def check_positions(self, ctx: Context) -> None:
        n, limit = ctx.options["max_new_tokens"], self.positions(ctx)
        if limit is not None and n >= limit:
            raise ConfigError(f"--max-new-tokens {n}: with the prompt it must fit in the {limit:,} positions "
                              f"of {ctx.options['model']}; give at most {limit - 1}")

    def prepare(self, ctx: Context) -> None:
        kv_from = ctx.options["kv_from"]
        ctx.state["policy_file"] = read_policy_file(kv_from) if kv_from is not None else None

    def check_loaded(self, ctx: Context) -> None:
        """The positions against the loaded model, and the policy built on it (a head it lacks, an encoder)."""
        from headlab.decode.heads import check_decoder

        self.check_positions(ctx)
        o, loaded = ctx.options, ctx.loaded
        ctx.state["policy"] = build_policy(loaded, o["policy"], o["kv_from"], o["keep"], ctx.state["policy_file"])
        adapter = getattr(loaded, "adapter", None)
        if adapter is not None:
            check_decoder(adapter, getattr(loaded, "name", None) or type(adapter.model).__name__)

    def run_unit(self, ctx: Context, unit, recording=None):
        from headlab.decode.generate import generate

        o = ctx.options
        return generate(ctx.loaded, o["prompt"], policy=ctx.state["policy"], max_new_tokens=o["max_new_tokens"],
                        sample=o["sample"], temperature=1.0 if o["temperature"] is None else o["temperature"],
                        top_k=o["top_k"], seed=(o["seed"] or 0) if o["sample"] else None,
                        progress=None if o["as_json"] else ctx.progress)

    def unit_to_json(self, value):
        return value.to_json()

    def document(self, ctx: Context, g) -> dict:
        """What ``--out`` holds and ``--json`` prints: the model, the prompt and the generation's envelope."""
        return {"model": getattr(ctx.loaded, "name", None), "prompt": ctx.options["prompt"], **g.to_json()}

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        g = values[self.name]
        return InstrumentResult.of(g, self.document(ctx, g))

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.results import write_json

        return [write_json(path, self.document(ctx, result.native))]

    def render(self, ctx: Context, outcome, console, err) -> None:
        from headlab.units import human_bytes

        g = outcome.result.native
        if ctx.options["as_json"]:
            print_json(self.document(ctx, g))
            return
        console.print(f"{ctx.options['prompt']}[bold]{g.text}[/]", highlight=False, soft_wrap=True)
        err.print(
            f"{ctx.loaded.name}, policy {g.policy.name} ({kv_heads_text(g.counts)}): "
            f"KV cache {human_bytes(g.kv_bytes)} vs {human_bytes(g.kv_bytes_full)} full "
            f"({g.kv_bytes / g.kv_bytes_full:.1%})"
            + (f", per rank {' + '.join(human_bytes(b) for b in g.kv_bytes_per_rank)}" if g.kv_bytes_per_rank else "")
            + f" at {g.prompt_tokens + g.ids.shape[1] - 1} tokens; prefill "
            f"{g.prefill_seconds:.2f} s, {g.tokens_per_second:.1f} tokens/s", highlight=False, soft_wrap=True)


@register
class TrainGates(_Decoding):
    """Train DuoAttention's gates, one per kv head: one unit per optimiser step (see above)."""

    name = "train-gates"
    kind = "kv_gates"
    summary = """Train DuoAttention's gates (one per kv head) on synthetic passkey contexts; write them for --kv-from.

Example (then decode with the half of kv heads whose gates are highest kept full):
headlab train-gates --out gates.json --steps 50 --seconds 1800
headlab generate "..." --kv-from gates.json --keep 0.5

Interrupted (Ctrl-C), --out keeps the finished steps; the same command with --resume continues from them."""
    options = (
        Option("out", "--out", Path, REQUIRED, "where to write the gates (JSON; --kv-from reads it)", short="-o",
               setting=False),
        MODEL,
        Option("window", "--window", str, "4,256", "SINK,RECENT: the window the gates choose against", check=_window),
        Option("steps", "--steps", int, 100, "optimiser steps, one training context each",
               check=_count(1_000_000, "optimiser steps, a forward and backward each; --seconds bounds the time")),
        Option("seconds", "--seconds", float, None, "a time budget: stop (and save) after this long",
               check=at_least(1)),
        Option("tokens", "--tokens", int, 512, "tokens per training context"),
        Option("contexts", "--contexts", int, 16, "training contexts (cycled through)",
               check=_count(10_000, "contexts built before the first step and cycled through")),
        Option("keys", "--keys", int, 4, "passkeys hidden in each context", check=at_least(1)),
        Option("lr", "--lr", float, 0.05, "Adam's learning rate", check=at_least(1e-9)),
        Option("l1", "--l1", float, 0.05, "the weight of the L1 pull towards the window", check=at_least(0)),
        Option("seed", "--seed", int, 0, "draws the contexts", check=at_least(0)),
        Option("checkpoint", "--checkpoint", Path, None, "start from this checkpoint of train_gates(checkpoint=...) "
               "(the Python API's torch.save file; an interrupted train-gates continues with --resume instead)",
               setting=False),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
    )
    output = Output("out", folder=False, force="force")
    resumable = True  # the steps are units: --resume continues from the last one kept in --out
    stage = "training gates"
    # the steps follow one another (each starts from the gates the one before left): the runner gives them all to
    # rank 0, which trains as one process would
    chained = True
    sharded = ("its gates mix each head's full and windowed attention in an attention function of its own, written "
               "for a whole model on one process; train the gates on one process and use them with generate")

    def check(self, ctx: Context) -> None:
        from headlab.decode import kv

        o = ctx.options
        ctx.state["rule"] = rule = kv.as_rule(f"streaming:{o['window']}")
        low = rule.sink + rule.recent + 64  # type: ignore[attr-defined]  # a streaming rule: a Window
        if o["tokens"] < low:
            raise ConfigError(f"--tokens must be at least {low} (the window's sink + recent + 64), got {o['tokens']}")
        self.check_positions(ctx)
        ck = o["checkpoint"]
        if ck is None:
            return
        if ck.exists() and not ck.is_file():
            raise InputError(f"--checkpoint {str(ck)!r} is not a file")
        if not ck.exists():
            raise InputError(f"--checkpoint {str(ck)!r} does not exist; give the file train_gates(checkpoint=...) "
                             "wrote, or drop --checkpoint")
        if not zipfile.is_zipfile(ck):  # torch.save writes a zip archive; a text file is not one
            raise InputError(f"--checkpoint {str(ck)!r} is not a train-gates checkpoint (a torch.save file); give "
                             "the checkpoint an interrupted run wrote, or another path to start afresh")

    def check_positions(self, ctx: Context) -> None:
        tokens, limit = ctx.options["tokens"], self.positions(ctx)
        if limit is not None and tokens > limit:
            raise ConfigError(f"--tokens {tokens}: {ctx.options['model']} reads at most {limit:,} positions")

    def check_loaded(self, ctx: Context) -> None:
        """The positions against the loaded model, then the trainer (its own checks: a decoder, the contexts), and
        a --checkpoint to start from."""
        from headlab.decode.train import GateTrainer

        self.check_positions(ctx)
        o = ctx.options
        ctx.state["trainer"] = tr = GateTrainer(ctx.loaded, rest=ctx.state["rule"], steps=o["steps"],
                                                seconds=o["seconds"], tokens=o["tokens"], contexts=o["contexts"],
                                                keys=o["keys"], lr=o["lr"], l1=o["l1"], seed=o["seed"])
        if o["checkpoint"] is not None:
            tr.load_checkpoint(o["checkpoint"])
        ctx.state["base"] = (tr.state.steps, list(tr.state.losses), tr.state.seconds)  # before the first unit
        ctx.state["at"] = tr.state.steps  # the steps the trainer holds now
        ctx.state["recent"] = []  # the values of the latest steps (the newest two keep the trainer's state)

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(str(i + 1), i) for i in range(ctx.state["base"][0], ctx.options["steps"])]

    def _catch_up(self, ctx: Context, i: int) -> None:
        """A resumed run: the trainer continues from the state the kept step ``i`` (1-based key) left in --out."""
        from headlab.interpret.instruments.runner import UNITS_KEY
        from headlab.results import Result

        kept = Result.load(ctx.path).figures.get(UNITS_KEY, {}) if ctx.path is not None and ctx.path.is_file() else {}
        last = kept.get(str(i))
        if not isinstance(last, dict) or "state" not in last:
            raise InputError(f"--resume: {ctx.path} does not keep the state after step {i}; drop --resume to start "
                             "again")
        losses = [kept[str(k)].get("loss") for k in range(ctx.state["base"][0] + 1, i + 1)]
        ctx.state["trainer"].restore(last["state"], steps=i, seconds=last["seconds"],
                                     losses=ctx.state["base"][1] + [x for x in losses if x is not None])
        ctx.state["at"] = i

    def run_unit(self, ctx: Context, unit, recording=None):
        i, tr, o = unit.payload, ctx.state["trainer"], ctx.options
        if ctx.state["at"] != i:
            self._catch_up(ctx, i)
        if o["seconds"] is not None and tr.state.seconds >= o["seconds"]:  # the time budget is spent
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
        return value

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        import torch

        from headlab.decode.train import GateTraining

        tr, (steps, losses, seconds) = ctx.state["trainer"], ctx.state["base"]
        ordered = [values[k] for k in sorted(values, key=int)]
        ran = [v for v in ordered if v.get("loss") is not None]
        with_state = [v for v in ran if "state" in v]
        gates = torch.tensor(with_state[-1]["state"]["gates"]) if with_state else tr.param.detach().clone()
        g = GateTraining(gates, tr.rule, losses + [v["loss"] for v in ran], steps + len(ran),
                         ordered[-1]["seconds"] if ordered else seconds,
                         "seconds" if len(ran) < len(ordered) else "steps", dict(tr.state.settings), tr.state.model)
        return InstrumentResult.of(g)

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        return [result.native.save(path)]

    def render(self, ctx: Context, outcome, console, err) -> None:
        t = outcome.result.native
        g = t.gates.clamp(0, 1)
        first, last = (f"{t.losses[0]:.4f}", f"{t.losses[-1]:.4f}") if t.losses else ("-", "-")
        err.print(f"{ctx.loaded.name}: {t.steps} steps in {t.seconds:.0f} s ({t.stopped}); loss {first} -> "
                  f"{last}; {int((g > 0.5).sum())} of {g.numel()} kv heads above 0.5. Wrote {ctx.options['out']}",
                  highlight=False, soft_wrap=True)


__all__ = ["Generate", "TrainGates", "build_policy", "kv_heads_text", "read_policy_file"]
