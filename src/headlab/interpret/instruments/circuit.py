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
without its curve, and the runner keeps the units themselves in ``circuit.partial.json`` beside them, which the
same command with ``--resume`` reads back (it runs only the rest, to the files an uninterrupted run writes). A
unit whose library caught Ctrl-C itself and returned a partial result (exact scoring keeps NaN for the edges it
did not reach; ACDC keeps the edges it had not tried) is not a finished unit. A later run with other options can
reuse the edge scores with ``--scores DIR/scores.json`` (the scoring unit is then read, not computed).

**Torchrun.** ``parallel = "inside"``: the three units depend on each other in order (the circuit reads every
pair's scores, the curve the circuit), so the runner cannot deal them to ranks; the scoring, the one costly step
that splits, deals the pairs over the data ranks itself (the model's ``Placement``) and adds their scores weighted
by pairs (:func:`~headlab.interpret.circuits.result.added_over_ranks`), then every rank runs the circuit and the
curve alike and rank 0 writes. The terminal's view is :mod:`headlab.cli.views.circuit`.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import ConfigError, InputError
from headlab.interpret.circuits.options import OPTIONS
from headlab.interpret.circuits.sizes import DEFAULT_EDGES, edges_for, parse_edges
from headlab.interpret.study.base import (
    Context,
    Instrument,
    InstrumentResult,
    Output,
    Unit,
    register,
)

EXACT_MAX_EDGES = 20_000  # --method exact on a larger graph is refused with its cost (SmolLM2: 70,651 edges)
FILES = ("scores.json", "circuit.json", "faithfulness.json", "circuit.html")


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
    summary = (
        "Find the circuit of a task: score every edge, choose the circuit, measure its faithfulness.\n\n"
        "The task's clean/corrupted pairs and metric (ioi, greater-than, induction, retrieval); every edge of "
        "the model's graph scored by EAP-IG, EAP or exact edge patching (score = m_patched - m_clean of the "
        "edge alone); a circuit chosen from them (top-n, greedy, or ACDC with --threshold); its faithfulness "
        "f = (m(circuit) - m(empty)) / (m(model) - m(empty)) over circuit sizes, against random circuits. "
        "--out DIR writes scores.json, circuit.json, faithfulness.json and circuit.html.\n\n"
        "Pre-norm decoders only (GPT-2, Llama, Qwen, SmolLM2, ...): a post-norm encoder such as MiniLM is "
        "refused.\n\n"
        "Example: headlab circuit --task ioi --pairs 16 --edges 1% --out ioi-circuit"
    )
    options = OPTIONS
    output = Output("out", folder=True, file=None, force="force")
    sharded = "the circuit's patched forwards split pairs and copies, not heads"
    # under torchrun the scoring splits the pairs across the ranks and adds their scores, weighted by pairs (every
    # score is a mean over pairs); the circuit and the curve, which need the scores of every pair, then run alike
    # on every rank and rank 0 writes. The three units depend on each other in order: the runner cannot deal them.
    parallel = "inside"
    resumable = True  # Ctrl-C: the finished units' files, and the units in circuit.partial.json for --resume
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
                raise ConfigError(
                    "--discover acdc needs --threshold (remove an edge when the criterion grows by at "
                    "most that; Conmy et al. sweep 1e-4 to 1e-1)"
                )
            if o["scores"] is not None:
                raise ConfigError(
                    "--scores: ACDC measures each edge itself and reads no scores; drop --scores or "
                    "use --discover top-n or greedy"
                )
        else:
            for name in ("threshold", "criterion"):
                if o[name] is not None:
                    raise ConfigError(
                        f"--{name} is ACDC's (--discover acdc); --discover {o['discover']} chooses by --edges"
                    )
        ctx.state["size"] = parse_edges(o["edges"] if o["edges"] is not None or acdc else DEFAULT_EDGES)
        if o["ablation"] == "resample" and o["pairs"] < 2:
            raise ConfigError(
                "--ablation resample gives each pair another pair's corrupted run: give --pairs 2 or more"
            )

    def prepare(self, ctx: Context) -> None:
        """``--atlas`` (an atlas result) and ``--scores`` (edge scores), read before the load."""
        if ctx.options["atlas"] is not None:
            from headlab.interpret.atlas import Atlas

            try:
                ctx.state["atlas"] = Atlas.from_json(ctx.data["atlas"])
            except (InputError, KeyError, TypeError) as e:
                raise InputError(
                    f"--atlas {str(ctx.options['atlas'])!r}: not an atlas headlab wrote "
                    f"({e}); give the atlas.json of `headlab atlas --out DIR`"
                ) from None
        if ctx.options["scores"] is not None:
            from headlab.interpret.circuits.result import EdgeScores

            path = ctx.options["scores"]
            try:
                ctx.state["given"] = EdgeScores.load(path)
            except (InputError, KeyError, TypeError, ValueError) as e:
                raise InputError(
                    f"--scores {str(path)!r}: {e}; give the scores.json of `headlab circuit --out DIR`"
                ) from None

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
            raise ConfigError(
                f"--discover acdc runs one forward per edge and the graph of {o['model']} has "
                f"{g.n_edges:,} edges (it takes {ACDC_MAX_EDGES:,}); use --discover top-n or greedy"
            )
        if o["method"] == "exact" and g.n_edges > EXACT_MAX_EDGES:
            per = max(1, 256 // o["pairs"])  # edges per stacked forward (edge_patch's max_rows)
            raise ConfigError(
                f"--method exact patches every edge in a copy of its own: the graph of {o['model']} has "
                f"{g.n_edges:,} edges, about {2 * -(-g.n_edges // per):,} stacked forwards at --pairs "
                f"{o['pairs']} (the command takes {EXACT_MAX_EDGES:,} edges); score with --method eap-ig "
                "and check chosen edges exactly with headlab.circuits.edge_patch(..., edges=[...])"
            )
        if o["discover"] != "acdc":
            n = edges_for(ctx.state["size"], g.n_edges)
            if n > g.n_edges:
                raise ConfigError(
                    f"--edges {o['edges']}: the graph of {o['model']} has {g.n_edges:,} edges; give at "
                    "most that, or a percentage"
                )
            ctx.state["n_edges"] = n
        given = ctx.state.get("given")
        if given is not None and list(given.edges) != list(g.edges):
            raise InputError(
                f"--scores {str(o['scores'])!r} scores a graph of {len(given.edges):,} edges "
                f"({given.model}); the graph of {o['model']} has {g.n_edges:,}: score this model"
            )
        atlas = ctx.state.get("atlas")
        if atlas is not None and (atlas.n_layers, atlas.n_heads) != (g.n_layers, max(g.heads)):
            raise InputError(
                f"--atlas: the atlas is of a model of {atlas.n_layers} layers x {atlas.n_heads} heads; "
                f"{o['model']} has {g.n_layers} x {max(g.heads)}: give the atlas of this model"
            )
        if ctx.world > 1 and o["pairs"] < ctx.world and given is None:
            raise ConfigError(
                f"--pairs {o['pairs']}: the scoring splits the pairs across the {ctx.world} ranks "
                f"torchrun started; give at least {ctx.world} pairs"
            )
        ctx.state["pairs"] = task(o["task"], ctx.loaded, n=o["pairs"], seed=o["seed"])

    # ---- units -------------------------------------------------------------------------------------------------
    def units(self, ctx: Context) -> list[Unit]:
        return [Unit("scores"), Unit("circuit")] + ([Unit("faithfulness")] if ctx.options["faithfulness"] else [])

    def run_unit(self, ctx: Context, unit: Unit, recording=None):
        return getattr(self, f"_{unit.key}")(ctx)

    def _scores(self, ctx: Context):
        from headlab.interpret.circuits.eap import edge_scores
        from headlab.interpret.circuits.result import added_over_ranks

        o, p = ctx.options, ctx.state["pairs"]
        if ctx.state.get("given") is not None:
            return ctx.state["given"]
        seen: dict = {}
        place = ctx.loaded.adapter.placement
        mine = p if place.alone else p.subset(place.examples(len(p)))  # torchrun: this rank's share of the pairs
        s = edge_scores(
            ctx.loaded,
            mine.clean,
            mine.corrupted,
            mine.metric,
            method=o["method"],
            steps=o["steps"],
            progress=_progress(ctx, seen),
        )
        if _unfinished(seen):  # exact patching caught Ctrl-C and kept NaN for the rest: not a finished unit
            raise KeyboardInterrupt
        return s if place.alone else added_over_ranks(s, len(p), place)

    def _circuit(self, ctx: Context):
        from headlab.interpret.circuits.discovery import discover

        o, p = ctx.options, ctx.state["pairs"]
        seen: dict = {}
        if o["discover"] == "acdc":
            c = discover(
                ctx.loaded,
                p.clean,
                p.corrupted,
                p.metric,
                method="acdc",
                threshold=o["threshold"],
                criterion=o["criterion"] or "kl",
                ablation=o["ablation"],
                seed=o["seed"],
                progress=_progress(ctx, seen),
            )
        else:
            c = discover(
                ctx.loaded,
                p.clean,
                p.corrupted,
                p.metric,
                method=o["discover"],
                n_edges=ctx.state["n_edges"],
                scores=ctx.kept["scores"],
                ablation=o["ablation"],
                seed=o["seed"],
                absolute=o["rank"] == "abs",
                progress=_progress(ctx, seen),
            )
        if _unfinished(seen):  # ACDC caught Ctrl-C and kept the edges it had not tried: not a finished unit
            raise KeyboardInterrupt
        return c

    def _faithfulness(self, ctx: Context):
        from headlab.interpret.circuits.evaluation import faithfulness

        o, p = ctx.options, ctx.state["pairs"]
        seen: dict = {}
        f = faithfulness(
            ctx.loaded,
            ctx.kept["scores"],
            p.clean,
            p.corrupted,
            p.metric,
            ablation=o["ablation"],
            random=o["random"],
            seed=o["seed"],
            templates=p.template,
            absolute=o["rank"] == "abs",
            progress=_progress(ctx, seen),
        )
        if _unfinished(seen):
            raise KeyboardInterrupt
        return f

    def unit_to_json(self, value):
        """A finished unit as its result's JSON (edge scores, the circuit, the curve: each a kind of its own)."""
        return value.to_result().to_json()

    def unit_from_json(self, data):
        from headlab.interpret.circuits.circuit import Circuit
        from headlab.interpret.circuits.faithfulness_result import Faithfulness
        from headlab.interpret.circuits.result import EdgeScores
        from headlab.results import Result

        r = Result.from_json(data)
        kinds = {c.kind: c for c in (EdgeScores, Circuit, Faithfulness)}
        if r.kind not in kinds:
            raise InputError(f"--resume: a kept unit holds a {r.kind!r} result, not one of circuit's; drop --resume")
        return kinds[r.kind].from_result(r)

    # ---- the result --------------------------------------------------------------------------------------------
    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        from headlab.results import envelope

        scores, circuit, faith = values.get("scores"), values.get("circuit"), values.get("faithfulness")
        assert scores is not None and circuit is not None  # both units always run
        p, o = ctx.state["pairs"], ctx.options
        doc = {
            "task": o["task"],
            "description": p.description,
            "n_pairs": len(p),
            "metric": scores.metric,
            "clean": scores.clean,
            "corrupted": scores.corrupted,
            "n_graph_edges": len(scores.edges),
            "scores": {
                "method": scores.method,
                "steps": scores.steps,
                "seconds": scores.seconds,
                "top": [[e, v] for e, v in scores.top(o["top"])],
            },
            "circuit": circuit.to_result().to_json(),
            "faithfulness": None if faith is None else result_json(faith),
        }
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
            files.append(
                faith.save(path / "faithfulness.json")
                if hasattr(faith, "save")
                else write_json(path / "faithfulness.json", result_json(faith))
            )
        if circuit is not None:
            files.append(page.write(path / "circuit.html", circuit, faith, ctx.state.get("atlas")))
        return files


def result_json(obj) -> dict:
    """A library result as its JSON dict (``to_json``, or ``to_result().to_json()``)."""
    if hasattr(obj, "to_json"):
        return obj.to_json()
    return obj.to_result().to_json()


__all__ = ["DEFAULT_EDGES", "EXACT_MAX_EDGES", "FILES", "CircuitStudy", "edges_for", "parse_edges", "result_json"]
