"""``circuit``: score every edge of a model's graph on a task, choose a circuit, and measure its faithfulness.

The computations are the circuits room's: the task's clean/corrupted pairs and metric
(:func:`~headlab.interpret.circuits.tasks.task`), the edge scores (:func:`~headlab.interpret.circuits.edge_scores`:
EAP, EAP-IG or exact edge patching), the circuit (:func:`~headlab.interpret.circuits.discovery.discover`: top-n,
greedy or ACDC) and its faithfulness curve (:func:`~headlab.interpret.circuits.evaluation.faithfulness`); the
page is :mod:`headlab.interpret.circuits.page`. This file declares the options of ``headlab circuit``, checks them,
splits the work and shows the result.

**Checks.** The options alone (the choices, ``--edges``, the options that belong to one discovery method, ``--pairs``
against ``--ablation resample``), then ``--out``, then ``--atlas`` (read, and refused when it is not an atlas), all
before the model loads. Once it has loaded: its graph (:func:`~headlab.interpret.circuits.graph`: a post-norm
encoder such as MiniLM is refused, in one line, before any pair is built), ``--edges`` against the graph's size,
ACDC against the largest graph it takes, the atlas's heads against the model's, then the task's pairs.

**Units.** ``scores`` (every edge scored: the longest step of EAP-IG on a large graph), ``circuit`` (the discovery,
with the metric on the circuit alone and with every edge ablated) and ``faithfulness`` (the curve over circuit
sizes, with random circuits of the same sizes); each goes on from the previous one's value. Ctrl-C keeps the
finished units: ``--out`` then holds ``scores.json`` and, once the circuit is chosen, ``circuit.json`` and the page
without its curve. A unit whose library caught Ctrl-C itself and returned a partial result (exact scoring keeps
NaN for the edges it did not reach; ACDC keeps the edges it had not tried) is not a finished unit. The command is
not ``--resume``-able: its output is a folder of the room's own files, not one result file the runner keeps
units in; a later run can reuse the edge scores with ``--scores DIR/scores.json`` (the scoring unit is then read,
not computed).
"""

from __future__ import annotations

import math
from pathlib import Path

from headlab.errors import ConfigError, InputError
from headlab.interpret.circuits.discovery import METHODS as DISCOVER_METHODS
from headlab.interpret.circuits.eap import METHODS as SCORE_METHODS
from headlab.interpret.circuits.patching import ABLATIONS
from headlab.interpret.circuits.tasks import TASKS
from headlab.interpret.instruments.base import (
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

EXACT_MAX_EDGES = 20_000  # --method exact on a larger graph is refused with its cost (SmolLM2: 70,651 edges)
DEFAULT_EDGES = "1%"  # circuit size: 1% of the graph's edges (SmolLM2-135M: about 700 of 70,000)
FILES = ("scores.json", "circuit.json", "faithfulness.json", "circuit.html")
MAX_RANDOM = 1000  # --random: random circuits per size, one forward each


def parse_edges(spec: str | None) -> int | float | None:
    """``--edges``: a whole number of edges, or a percentage of the graph's edges (a float in (0, 1]).

    >>> parse_edges("200"), parse_edges("1%"), parse_edges("0.5%"), parse_edges(None)
    (200, 0.01, 0.005, None)
    """
    if spec is None:
        return None
    text = str(spec).strip()
    try:
        if text.endswith("%"):
            frac = float(text[:-1]) / 100
            if math.isfinite(frac) and 0 < frac <= 1:
                return frac
        else:
            n = int(text)
            if n >= 1:
                return n
    except ValueError:
        pass
    raise ConfigError(f"--edges {spec!r}: give a whole number of edges (200) or a percentage of the graph's edges "
                      "above 0 and at most 100 (1%, 0.5%)")


def edges_for(size: int | float, n_graph_edges: int) -> int:
    """How many edges ``--edges`` asks for on a graph of ``n_graph_edges`` (a percentage rounds up, at least 1).

    >>> edges_for(0.01, 70_000), edges_for(0.01, 37), edges_for(12, 37)
    (700, 1, 12)
    """
    return size if isinstance(size, int) else max(1, math.ceil(size * n_graph_edges - 1e-9))


def _pairs(value, option: Option, options: dict) -> None:
    from headlab.interpret.circuits.tasks.base import MAX_PAIRS

    at_least(1)(value, option, options)
    if value > MAX_PAIRS:
        raise ConfigError(f"{option.label} must be at most {MAX_PAIRS:,} (each pair is a row of every forward), "
                          f"got {value}")


def _steps(value, option: Option, options: dict) -> None:
    if not 1 <= value <= 1000:
        raise ConfigError(f"{option.label} must be from 1 to 1000 (EAP-IG's interpolation steps; Hanna et al. use 5 "
                          f"to 100), got {value}")


def _random(value, option: Option, options: dict) -> None:
    at_least(0)(value, option, options)
    if value > MAX_RANDOM:  # 10**12 loaded the model, then ran a forward per random circuit without end
        raise ConfigError(f"{option.label} must be at most {MAX_RANDOM} (random circuits per size, a forward each; "
                          f"the default 2 draws the baseline band), got {value:,}")


def _threshold(value, option: Option, options: dict) -> None:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{option.label} must be a number of 0 or more (ACDC removes an edge when the criterion "
                          f"grows by at most that; Conmy et al. sweep 1e-4 to 1e-1), got {value}")


def added_over_ranks(s, n_pairs: int, placement):
    """One rank's :class:`~headlab.interpret.circuits.result.EdgeScores` of its share of the pairs, made the scores
    of all ``n_pairs``: every figure is a mean over pairs, so the ranks' figures are added weighted by their pairs
    (``placement.sum_over_data``; the same result on every rank)."""
    import dataclasses

    import torch

    part = torch.cat([s.values * s.n_examples, torch.tensor([s.clean, s.corrupted], dtype=torch.float64) * s.n_examples,
                      torch.tensor([s.seconds], dtype=torch.float64)])
    total = placement.sum_over_data(part)
    values, clean, corrupted = total[:-3] / n_pairs, float(total[-3]) / n_pairs, float(total[-2]) / n_pairs
    return dataclasses.replace(s, values=values, clean=clean, corrupted=corrupted, n_examples=n_pairs,
                               notes=[*s.notes, f"pairs split across the ranks and their scores added (seconds: "
                                                f"the ranks' sum, {float(total[-1]):.1f})"])


def _progress(ctx: Context, seen: dict | None = None):
    """The runner's display for a library call; ``seen`` keeps the last (done, total) per stage, so that a call
    that caught Ctrl-C and returned early can be told from one that finished."""
    def progress(stage, done, total):
        if seen is not None:
            seen[stage] = (done, total)
        ctx.progress(stage, done, total)

    return progress


def _unfinished(seen: dict) -> bool:
    return any(total and done < total for done, total in seen.values())


@register
class CircuitStudy(Instrument):
    """Find the circuit of a task: score every edge, choose the circuit, measure its faithfulness."""

    name = "circuit"
    kind = "circuit_study"  # the circuit itself is circuit.json's kind ("circuit")
    summary = ("Find the circuit of a task: score every edge, choose the circuit, measure its faithfulness.\n\n"
               "The task's clean/corrupted pairs and metric (ioi, greater-than, induction, retrieval); every edge of "
               "the model's graph scored by EAP-IG, EAP or exact edge patching (score = m_patched - m_clean of the "
               "edge alone); a circuit chosen from them (top-n, greedy, or ACDC with --threshold); its faithfulness "
               "f = (m(circuit) - m(empty)) / (m(model) - m(empty)) over circuit sizes, against random circuits. "
               "--out DIR writes scores.json, circuit.json, faithfulness.json and circuit.html.\n\n"
               "Pre-norm decoders only (GPT-2, Llama, Qwen, SmolLM2, ...): a post-norm encoder such as MiniLM is "
               "refused.\n\n"
               "Example: headlab circuit --task ioi --pairs 16 --edges 1% --out ioi-circuit")
    options = (
        Option("task", "--task", str, "ioi", f"the task: {' | '.join(TASKS)}", choices=tuple(TASKS)),
        Option("pairs", "--pairs", int, 16, "clean/corrupted pairs of the task", check=_pairs),
        Option("model", "--model", str, "smollm2", "a known model name or a model folder (a pre-norm decoder)",
               short="-m"),
        Option("method", "--method", str, "eap-ig", f"edge scores: {' | '.join(SCORE_METHODS)} (exact: two forwards "
               "per edge, for small graphs)", choices=SCORE_METHODS),
        Option("steps", "--steps", int, 5, "EAP-IG's interpolation steps (Hanna et al. use 5 to 100)", check=_steps),
        Option("scores", "--scores", Path, None, "reuse the edge scores of an earlier run (its scores.json) instead "
               "of scoring again"),
        Option("discover", "--discover", str, "top-n", f"how the circuit is chosen: {' | '.join(DISCOVER_METHODS)}",
               choices=DISCOVER_METHODS),
        Option("edges", "--edges", str, None, f"top-n and greedy: the circuit's size, N edges or P% of the graph's "
               f"edges (default {DEFAULT_EDGES})"),
        Option("threshold", "--threshold", float, None, "acdc (required there): remove an edge when the criterion "
               "grows by at most this", check=_threshold),
        Option("criterion", "--criterion", str, None, "acdc: kl (KL divergence to the model, default) | metric "
               "(|change of the task's metric|)", choices=("kl", "metric")),
        Option("rank", "--rank", str, "signed", "how top-n and the curve rank edges: signed (the edges whose patch "
               "moves the metric furthest towards the corrupted run first; MIB's CPR ranking) or abs (|score|, "
               "MIB's CMD ranking)", choices=("signed", "abs")),
        Option("ablation", "--ablation", str, "patch", f"what an edge outside the circuit carries: "
               f"{' | '.join(ABLATIONS)}", choices=ABLATIONS),
        Option("faithfulness", "--faithfulness", bool, True, "measure the faithfulness curve over circuit sizes",
               off="--no-faithfulness"),
        Option("random", "--random", int, 2, "random circuits per size (the curve's baseline band; a forward each)",
               check=_random),
        Option("seed", "--seed", int, 0, "the pairs' draw, the random circuits and resample ablation",
               check=at_least(0)),
        Option("atlas", "--atlas", Path, None, "an atlas.json (headlab atlas --out) whose head roles label the page",
               reads="json", setting=False),
        Option("top", "--top", int, 10, "how many edges to list", check=at_least(1), setting=False),
        Option("out", "--out", Path, None, "a folder for scores.json, circuit.json, faithfulness.json, circuit.html",
               short="-o", setting=False),
        Option("force", "--force", bool, False, "write into a non-empty --out folder", setting=False),
        Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
    )
    output = Output("out", folder=True, file=None, force="force")
    sharded = "the circuit's patched forwards split pairs and copies, not heads"
    # under torchrun (without --tensor-parallel) the scoring splits the pairs across the ranks and adds their
    # scores, weighted by pairs (every score is a mean over pairs); the circuit and the curve, which need the
    # scores of every pair, then run alike on every rank and rank 0 writes. The three units depend on each
    # other in order, so the runner does not deal them out.
    parallel = "inside"
    stage = "circuit steps"

    # ---- checks ------------------------------------------------------------------------------------------------
    def check(self, ctx: Context) -> None:
        """The options alone: the size, and the options that belong to one discovery method."""
        o = ctx.options
        acdc = o["discover"] == "acdc"
        if acdc:
            if o["edges"] is not None:
                raise ConfigError("--edges is top-n's and greedy's: ACDC's size follows from --threshold; drop --edges")
            if o["threshold"] is None:
                raise ConfigError("--discover acdc needs --threshold (remove an edge when the criterion grows by at "
                                  "most that; Conmy et al. sweep 1e-4 to 1e-1)")
            if o["scores"] is not None:
                raise ConfigError("--scores: ACDC measures each edge itself and reads no scores; drop --scores or "
                                  "use --discover top-n or greedy")
        else:
            for name in ("threshold", "criterion"):
                if o[name] is not None:
                    raise ConfigError(f"--{name} is ACDC's (--discover acdc); --discover {o['discover']} chooses "
                                      "by --edges")
        ctx.state["size"] = parse_edges(o["edges"] if o["edges"] is not None or acdc else DEFAULT_EDGES)
        if o["ablation"] == "resample" and o["pairs"] < 2:
            raise ConfigError("--ablation resample gives each pair another pair's corrupted run: give --pairs 2 or "
                              "more")

    def prepare(self, ctx: Context) -> None:
        """``--atlas`` (an atlas result) and ``--scores`` (edge scores), read before the load."""
        if ctx.options["atlas"] is not None:
            from headlab.interpret.atlas import Atlas

            try:
                ctx.state["atlas"] = Atlas.from_json(ctx.data["atlas"])
            except (InputError, KeyError, TypeError) as e:
                raise InputError(f"--atlas {str(ctx.options['atlas'])!r}: not an atlas headlab wrote "
                                 f"({e}); give the atlas.json of `headlab atlas --out DIR`") from None
        if ctx.options["scores"] is not None:
            from headlab.interpret.circuits.result import EdgeScores

            path = ctx.options["scores"]
            try:
                ctx.state["given"] = EdgeScores.load(path)
            except (InputError, KeyError, TypeError, ValueError) as e:
                raise InputError(f"--scores {str(path)!r}: {e}; give the scores.json of `headlab circuit --out "
                                 "DIR`") from None

    def check_loaded(self, ctx: Context) -> None:
        """The model's graph (refused for post-norm models) and the sizes against it, before the pairs."""
        from headlab.errors import UnsupportedArchitectureError
        from headlab.interpret.circuits.discovery import ACDC_MAX_EDGES
        from headlab.interpret.circuits.graph import graph
        from headlab.interpret.circuits.tasks import task

        o = ctx.options
        try:
            g = graph(ctx.loaded)
        except UnsupportedArchitectureError as e:  # MiniLM and the other post-norm encoders: before any pair
            raise UnsupportedArchitectureError(f"--model {o['model']}: {e}") from None
        ctx.state["graph"] = g
        if o["discover"] == "acdc" and g.n_edges > ACDC_MAX_EDGES:
            raise ConfigError(f"--discover acdc runs one forward per edge and the graph of {o['model']} has "
                              f"{g.n_edges:,} edges (it takes {ACDC_MAX_EDGES:,}); use --discover top-n or greedy")
        if o["method"] == "exact" and g.n_edges > EXACT_MAX_EDGES:
            per = max(1, 256 // o["pairs"])  # edges per stacked forward (edge_patch's max_rows)
            raise ConfigError(f"--method exact patches every edge in a copy of its own: the graph of {o['model']} has "
                              f"{g.n_edges:,} edges, about {2 * -(-g.n_edges // per):,} stacked forwards at --pairs "
                              f"{o['pairs']} (the command takes {EXACT_MAX_EDGES:,} edges); score with --method eap-ig "
                              "and check chosen edges exactly with headlab.circuits.edge_patch(..., edges=[...])")
        if o["discover"] != "acdc":
            n = edges_for(ctx.state["size"], g.n_edges)
            if n > g.n_edges:
                raise ConfigError(f"--edges {o['edges']}: the graph of {o['model']} has {g.n_edges:,} edges; give at "
                                  "most that, or a percentage")
            ctx.state["n_edges"] = n
        given = ctx.state.get("given")
        if given is not None and list(given.edges) != list(g.edges):
            raise InputError(f"--scores {str(o['scores'])!r} scores a graph of {len(given.edges):,} edges "
                             f"({given.model}); the graph of {o['model']} has {g.n_edges:,}: score this model")
        atlas = ctx.state.get("atlas")
        if atlas is not None and (atlas.n_layers, atlas.n_heads) != (g.n_layers, max(g.heads)):
            raise InputError(f"--atlas: the atlas is of a model of {atlas.n_layers} layers x {atlas.n_heads} heads; "
                             f"{o['model']} has {g.n_layers} x {max(g.heads)}: give the atlas of this model")
        if ctx.world > 1 and o["pairs"] < ctx.world and given is None:
            raise ConfigError(f"--pairs {o['pairs']}: the scoring splits the pairs across the {ctx.world} ranks "
                              f"torchrun started; give at least {ctx.world} pairs")
        ctx.state["pairs"] = task(o["task"], ctx.loaded, n=o["pairs"], seed=o["seed"])

    # ---- units -------------------------------------------------------------------------------------------------
    def units(self, ctx: Context) -> list[Unit]:
        return [Unit("scores"), Unit("circuit")] + ([Unit("faithfulness")] if ctx.options["faithfulness"] else [])

    def run_unit(self, ctx: Context, unit: Unit, recording=None):
        return getattr(self, f"_{unit.key}")(ctx)

    def _scores(self, ctx: Context):
        from headlab.interpret.circuits.eap import edge_scores

        o, p = ctx.options, ctx.state["pairs"]
        if ctx.state.get("given") is not None:
            ctx.state["scores"] = ctx.state["given"]
            return ctx.state["scores"]
        seen: dict = {}
        place = ctx.loaded.adapter.placement
        mine = p if place.alone else p.subset(place.examples(len(p)))  # torchrun: this rank's share of the pairs
        s = edge_scores(ctx.loaded, mine.clean, mine.corrupted, mine.metric, method=o["method"], steps=o["steps"],
                        progress=_progress(ctx, seen))
        if _unfinished(seen):  # exact patching caught Ctrl-C and kept NaN for the rest: not a finished unit
            raise KeyboardInterrupt
        if not place.alone:
            s = added_over_ranks(s, len(p), place)
        ctx.state["scores"] = s
        return s

    def _circuit(self, ctx: Context):
        from headlab.interpret.circuits.discovery import discover

        o, p = ctx.options, ctx.state["pairs"]
        seen: dict = {}
        if o["discover"] == "acdc":
            c = discover(ctx.loaded, p.clean, p.corrupted, p.metric, method="acdc", threshold=o["threshold"],
                         criterion=o["criterion"] or "kl", ablation=o["ablation"], seed=o["seed"],
                         progress=_progress(ctx, seen))
        else:
            c = discover(ctx.loaded, p.clean, p.corrupted, p.metric, method=o["discover"],
                         n_edges=ctx.state["n_edges"], scores=ctx.state["scores"], ablation=o["ablation"],
                         seed=o["seed"], absolute=o["rank"] == "abs", progress=_progress(ctx, seen))
        if _unfinished(seen):  # ACDC caught Ctrl-C and kept the edges it had not tried: not a finished unit
            raise KeyboardInterrupt
        ctx.state["circuit"] = c
        return c

    def _faithfulness(self, ctx: Context):
        from headlab.interpret.circuits.evaluation import faithfulness

        o, p = ctx.options, ctx.state["pairs"]
        seen: dict = {}
        f = faithfulness(ctx.loaded, ctx.state["scores"], p.clean, p.corrupted, p.metric, ablation=o["ablation"],
                         random=o["random"], seed=o["seed"], templates=p.template, absolute=o["rank"] == "abs",
                         progress=_progress(ctx, seen))
        if _unfinished(seen):
            raise KeyboardInterrupt
        return f

    # ---- the result --------------------------------------------------------------------------------------------
    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        from headlab.results import envelope

        scores, circuit, faith = values.get("scores"), values.get("circuit"), values.get("faithfulness")
        assert scores is not None and circuit is not None  # both units always run
        p, o = ctx.state["pairs"], ctx.options
        doc = {"task": o["task"], "description": p.description, "n_pairs": len(p), "metric": scores.metric,
               "clean": scores.clean, "corrupted": scores.corrupted, "n_graph_edges": len(scores.edges),
               "scores": {"method": scores.method, "steps": scores.steps, "seconds": scores.seconds,
                          "top": [[e, v] for e, v in scores.top(o["top"])]},
               "circuit": circuit.to_result().to_json(),
               "faithfulness": None if faith is None else _json(faith)}
        settings = {**ctx.settings, "n_edges": ctx.state.get("n_edges")}
        payload = envelope(self.result_kind, doc, model=circuit.model, settings=settings)
        return InstrumentResult.of({"scores": scores, "circuit": circuit, "faithfulness": faith}, payload)

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        return self.write_kept(ctx, result.native, path)

    def write_kept(self, ctx: Context, values: dict, path: Path) -> list[Path]:
        """The files of the finished units: scores.json, then circuit.json and the page, then faithfulness.json
        (and the page with its curve)."""
        from headlab.interpret.circuits import page
        from headlab.results import write_json

        files = []
        if values.get("scores") is not None:
            files.append(values["scores"].save(path / "scores.json"))
        circuit, faith = values.get("circuit"), values.get("faithfulness")
        if circuit is not None:
            files.append(circuit.save(path / "circuit.json"))
        if faith is not None:
            files.append(faith.save(path / "faithfulness.json") if hasattr(faith, "save")
                         else write_json(path / "faithfulness.json", _json(faith)))
        if circuit is not None:
            files.append(page.write(path / "circuit.html", circuit, faith, ctx.state.get("atlas")))
        return files

    def render(self, ctx: Context, outcome, console, err) -> None:
        o = ctx.options
        if o["as_json"]:
            print_json(outcome.result.to_json())
            return
        v = outcome.result.native
        s, c, f = v["scores"], v["circuit"], v["faithfulness"]
        p = ctx.state["pairs"]
        say = lambda line: console.print(line, highlight=False, soft_wrap=True)
        say(f"{c.model}: task {o['task']}, {len(p)} pairs, metric {s.metric}: clean {s.clean:.4g}, corrupted "
            f"{s.corrupted:.4g}")
        how = f"{s.method}" + (f" ({s.steps} steps)" if s.method == "eap-ig" else "")
        say(f"edge scores: {how}, {len(s.edges):,} edges, {s.seconds:.1f} s"
            + (f" (read from {o['scores']})" if o["scores"] is not None else ""))
        chosen = c.settings.get("chosen")
        pruned = f" ({chosen:,} chosen, pruned to those on a path)" if chosen not in (None, c.n_edges) else ""
        say(f"circuit ({c.method}): {c.n_edges:,} edges{pruned}, {100 * c.n_edges / c.n_graph_edges:.3g}% of "
            f"{c.n_graph_edges:,}; {len(c.nodes)} nodes; ablation {c.ablation}: metric with the circuit alone "
            f"{_g(c.circuit_metric)}, with every edge ablated {_g(c.empty)}"
            + ("" if c.faithfulness is None else f"; f = {c.faithfulness:.3f}"))
        mine = set(c.edges)
        top = sorted(((e, x) for e, x in c.scores.items() if e in mine and x == x), key=lambda t: -abs(t[1]))
        say(f"top edges of the circuit ({'growth of the criterion' if c.method == 'acdc' else 'score'}):")
        for e, x in top[:o["top"]]:
            say(f"  {e:<28} {x:+.4g}")
        if f is not None:
            d = _json(f)
            parts = [f"{k.upper()} {d[k]:.3f}" for k in ("cpr", "cmd") if isinstance(d.get(k), (int, float))]
            say("faithfulness: " + (", ".join(parts) if parts else "measured") + " (CPR: area under f over sizes, "
                "higher is better; CMD: area between f and 1, lower is better)")
        if outcome.files:
            say("wrote: " + ", ".join(str(x) for x in outcome.files))


def _json(obj) -> dict:
    """A library result as its JSON dict (``to_json``, or ``to_result().to_json()``)."""
    if hasattr(obj, "to_json"):
        return obj.to_json()
    return obj.to_result().to_json()


def _g(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


__all__ = ["CircuitStudy", "DEFAULT_EDGES", "edges_for", "parse_edges"]
