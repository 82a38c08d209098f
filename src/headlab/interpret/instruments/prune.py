"""``heads prune``: remove heads physically and save the smaller model, with the pruning curve if asked, as an
instrument.

The computations are the heads room's and the models layer's: the heads to remove are given (``--heads``) or
are the ``--fraction`` least important (:func:`~headlab.interpret.heads.importance.head_importance`, normalised
per layer, ranked by :func:`~headlab.interpret.heads.prune.order_heads`); :func:`~headlab.models.pruned.prune_heads`
cuts them out; :func:`~headlab.interpret.heads.prune.pruning_curve` measures the metric as 0%, 10%, ... of
the heads go. The work is the runner's units: with ``--fraction``, importance one batch at a time (``heads
importance``'s own units, :class:`~headlab.interpret.heads.units.ImportanceUnits`), then ``model`` (the choice
and the surgery) and, with ``--curve``, ``curve`` (ranked by the same importance; its steps on the runner's
display). The units build on each other (``chained``): under torchrun the first rank runs them, as one process.
``--out`` must be a new or empty folder: it receives the pruned model (reloadable with ``headlab.load``) and,
with ``--curve``, curve.json, curve.png and heads.html. On Ctrl-C the runner keeps the finished units in
``OUT/heads-prune.partial.json`` (and the pruned model, once made, is saved into the folder); ``--resume`` on that
folder runs only the rest (the surgery is made again from the kept choice of heads: it is exact and quick).
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import ConfigError, InputError
from headlab.interpret.heads.naming import check_heads_in_config
from headlab.interpret.instruments.heads import BATCH, DATA, JSON, LIMIT, LOSS, MODEL, read_examples
from headlab.interpret.study.base import (
    REQUIRED,
    Context,
    Instrument,
    InstrumentResult,
    Option,
    Output,
    Unit,
    register,
)

DATA_FILE = "a .tsv with a 'sentence' column, a .conllu or a .txt"


def parse_heads(spec: str) -> dict[int, list[int]]:
    """``"0.3,2.5,0.1"`` -> ``{0: [3, 1], 2: [5]}``: the heads to remove, by layer (checked against a model
    before the load by :func:`~headlab.interpret.heads.naming.check_heads_in_config`, and after it by the surgery).

    >>> parse_heads("0.3, 2.5, 0.1")
    {0: [3, 1], 2: [5]}
    """
    heads: dict[int, list[int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            l, h = (int(x) for x in part.split("."))
        except ValueError:
            raise ConfigError(f"--heads expects LAYER.HEAD,... (e.g. 0.3,2.5); got {part!r}") from None
        heads.setdefault(l, []).append(h)
    if not heads:
        raise ConfigError("--heads is empty; give LAYER.HEAD,... (e.g. 0.3,2.5)")
    return heads


def _check_gqa(value, option, options) -> None:
    if value not in ("pad", "strict"):
        raise ConfigError(f"--gqa {value!r} is not a choice; use pad (uneven GQA groups kept exact) or strict")


@register
class Prune(Instrument):
    """Remove heads physically and save the smaller model."""

    name = "heads-prune"
    command = "heads prune"
    kind = "head_pruning"
    summary = "Remove heads physically and save the smaller model (reloads with headlab.load)."
    options = (
        MODEL,
        Option("out", "--out", Path, REQUIRED, "new folder for the pruned model", short="-o", setting=False),
        Option("heads", "--heads", str, None, "heads to remove, LAYER.HEAD,... e.g. 0.3,2.5"),
        Option(
            "fraction", "--fraction", float, None, "remove this share of heads, least important first (needs --data)"
        ),
        DATA,
        LOSS,
        LIMIT,
        BATCH,
        Option("curve", "--curve", bool, False, "also the pruning curve on --data (PNG, JSON)"),
        Option("recompute", "--recompute", bool, False, "curve: recompute importance at each step"),
        Option("allow_empty_layers", "--allow-empty-layers", bool, False, "allow removing every head of a layer"),
        Option("gqa", "--gqa", str, "pad", "pad (uneven GQA groups kept exact) | strict", check=_check_gqa),
        JSON,
    )
    # a new or empty folder (checked in check(), in prune's words: it has no --force); the runner's check then
    # refuses a file in the way, FILE/sub and an unwritable place
    output = Output("out", folder=True, file=None, allow_existing=True)
    resumable = True  # the units an interrupted run kept (OUT/heads-prune.partial.json): --resume runs the rest
    chained = True  # the surgery reads every importance unit, the curve the same ranking: in order, on one rank
    sharded = (
        "the pruned model is written by PrunedModel.save, which saves one process's whole model, not the "
        "shards of a model sharded by heads; prune on one process"
    )

    def check(self, ctx: Context) -> None:
        o = ctx.options
        if (o["heads"] is None) == (o["fraction"] is None):
            raise ConfigError("give exactly one of --heads LAYER.HEAD,... and --fraction F")
        if o["fraction"] is not None and not 0 < o["fraction"] < 1:
            raise ConfigError(f"--fraction must lie in (0, 1), got {o['fraction']}")
        out = Path(o["out"])
        kept = out / f"{self.name}.partial.json"  # what an interrupted run kept (the runner's partial_path)
        if ctx.resume and out.is_dir() and any(out.iterdir()) and not kept.is_file():
            raise InputError(f"--resume: --out {out} holds no interrupted prune ({kept.name}); drop --resume")
        if not ctx.resume and out.is_dir() and any(out.iterdir()):  # no --force: a new or empty folder only
            again = "; or add --resume to finish the interrupted prune in it" if kept.is_file() else ""
            raise InputError(f"--out {out} exists and is not an empty folder; choose a new one{again}")
        ctx.state["heads"] = parse_heads(o["heads"]) if o["heads"] is not None else None
        check_heads_in_config(o["model"], o["heads"])  # from the config files alone: no weights read
        if o["recompute"] and not o["curve"]:
            raise InputError(
                "--recompute acts only with --curve (it recomputes importance at each step of the "
                "curve); add --curve, or drop --recompute"
            )
        if o["data"] is None and (o["fraction"] is not None or o["curve"]):
            raise InputError("--data FILE is required: a .tsv, .conllu or .txt of examples")

    def prepare(self, ctx: Context) -> None:
        """``--data`` read before the load (missing, a folder, not UTF-8, empty: one line), when given."""
        from headlab.reading import read_file

        o = ctx.options
        ctx.data["texts"] = ctx.data["labels"] = None
        if o["data"] is not None:
            read_file(Path(o["data"]), "--data", "texts", what=DATA_FILE)
            ctx.data["texts"], ctx.data["labels"] = read_examples(o["data"], limit=o["limit"])

    def check_loaded(self, ctx: Context) -> None:
        from headlab.interpret.heads.examples import token_ids_if_needed

        o = ctx.options
        ctx.state["importance"] = None
        if ctx.data["texts"] is not None:
            ctx.data["texts"] = token_ids_if_needed(ctx.loaded, ctx.data["texts"])
        if o["fraction"] is not None:  # the ranking: head importance, one batch a unit (as heads importance)
            from headlab.interpret.heads.units import ImportanceUnits

            ctx.state["importance"] = ImportanceUnits(
                ctx.loaded,
                ctx.data["texts"],
                ctx.data["labels"],
                loss=o["loss"],
                batch_size=o["batch_size"],
                confidence=False,
            )

    def units(self, ctx: Context) -> list[Unit]:
        work = ctx.state["importance"]
        batches = [Unit(f"importance {k}") for k in work.keys()] if work is not None else []
        return batches + [Unit("model")] + ([Unit("curve")] if ctx.options["curve"] else [])

    def _ranking(self, ctx: Context):
        """The normalised importance of every head from the importance units (None with --heads)."""
        work = ctx.state["importance"]
        if work is None:
            return None
        return work.grid([ctx.kept[f"importance {k}"] for k in work.keys()], normalize=True)

    def run_unit(self, ctx: Context, unit: Unit, recording=None):
        o, texts, labels = ctx.options, ctx.data["texts"], ctx.data["labels"]
        if unit.key.startswith("importance "):
            i = int(unit.key.split()[-1])
            return ctx.state["importance"].run(i, ctx.kept.get(f"importance batch {i - 1}"))
        if unit.key == "curve":
            from headlab.interpret.heads.prune import pruning_curve

            # local: this rank runs the curve alone (the runner's chained units), so its importance is not split
            return pruning_curve(
                ctx.loaded,
                texts,
                labels,
                loss=o["loss"],
                importance=self._ranking(ctx),
                recompute=o["recompute"],
                batch_size=o["batch_size"],
                progress=ctx.progress,
                local=True,
            )
        from headlab.interpret.heads.prune import order_heads, prune_heads

        spec = ctx.state["heads"]
        if spec is None:
            order = order_heads(self._ranking(ctx))
            spec = {}
            for l, h in order[: int(round(o["fraction"] * len(order)))]:
                spec.setdefault(l, []).append(h)
        # the pruned model stays with the rank that made it (the runner's values travel between ranks as JSON-able
        # objects); the unit's value is what was removed and what is left
        pruned = ctx.state["pruned"] = prune_heads(
            ctx.loaded, spec, allow_empty_layers=o["allow_empty_layers"], gqa=o["gqa"]
        )
        return {
            "heads_per_layer": pruned.adapter.layer_heads,
            "removed": {str(k): v for k, v in spec.items()},
            "notes": pruned.notes,
        }

    def unit_to_json(self, value):
        if isinstance(value, dict):  # the model unit's summary, or an importance batch's sums
            from headlab.interpret.heads.units import ImportanceUnits

            return value if "removed" in value else ImportanceUnits.unit_to_json(value)
        return value.to_json()

    def unit_from_json(self, data):
        from headlab.interpret.heads.units import ImportanceUnits

        if "removed" in data:  # the model unit's summary
            return data
        if "importance" in data:  # an importance batch's sums
            return ImportanceUnits.unit_from_json(data)
        from headlab.interpret.heads.prune import PruningCurve

        return PruningCurve.from_json(data)

    def _pruned(self, ctx: Context, summary: dict):
        """The pruned model: this run's, or (a resumed run that kept the model unit) the same surgery made again
        from the heads it removed, on the same model."""
        if "pruned" not in ctx.state:
            from headlab.interpret.heads.prune import prune_heads

            spec = {int(l): hs for l, hs in summary["removed"].items()}
            o = ctx.options
            ctx.state["pruned"] = prune_heads(
                ctx.loaded, spec, allow_empty_layers=o["allow_empty_layers"], gqa=o["gqa"]
            )
        return ctx.state["pruned"]

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        pruned = self._pruned(ctx, values["model"])  # rank 0 ran the chained units
        summary = {"out": str(Path(ctx.options["out"])), **values["model"]}
        curve = values.get("curve")
        if curve is not None:
            summary["curve"] = curve.summary()
        return InstrumentResult(
            self.result_kind,
            model=getattr(ctx.loaded, "name", None),
            settings=ctx.settings,
            figures=summary,
            native=(pruned, curve),
        )

    def write_kept(self, ctx: Context, values: dict, path: Path) -> list[Path]:
        """Interrupted in the curve: the pruned model is finished, so it is saved, as the command always did."""
        return [self._pruned(ctx, values["model"]).save(path, force=ctx.resume)] if "model" in values else []

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        """The pruned model into ``path`` (the --out folder); with a curve, curve.json, curve.png, heads.html."""
        from headlab.interpret.heads.page import render_page
        from headlab.results import write_json

        pruned, curve = result.native
        files = [pruned.save(path, force=ctx.resume)]  # resumed: over what the interrupted run kept
        if curve is not None:
            files.append(write_json(path / "curve.json", curve.to_json()))
            files.append(curve.plot(path / "curve.png"))
            files.append(path / "heads.html")
            files[-1].write_text(render_page(title=f"pruning: {curve.model}", curve=curve, curve_png=files[-2]))
        return files


__all__ = ["Prune", "parse_heads"]
