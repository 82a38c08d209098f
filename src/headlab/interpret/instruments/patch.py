"""``patch``: activation patching of every head for one clean/corrupted prompt pair, as an instrument.

The computations are the patching room's (:func:`~headlab.interpret.patching.exact.sweep`, exact;
:func:`~headlab.interpret.patching.attribution_patch`, its first-order estimate;
:func:`~headlab.interpret.patching.compare`, their agreement); this file declares the options of
``headlab patch``, checks them and splits the work.

**From Python.** :func:`headlab.patch` runs here too (the runner's
:func:`~headlab.interpret.study.runner.call`): it hands over the inputs as they are (``inputs``: texts, ids or
dicts) and their ``metric`` instead of the four texts, and its sweep is one unit, ``exact`` (every kind's
configurations stacked, as one call always measured them; Ctrl-C in it keeps the measured ones, the rest NaN).

**Checks.** The options alone (``--method``, ``--sites``, ``--positions``, ``--top``, the suffix of ``--out``),
then the output file, then the four texts (read by :mod:`headlab.reading`: empty or not UTF-8), then the
degenerate pairs whose every effect would be 0/0 (``--answer`` equal to ``--wrong``, ``--clean`` equal to
``--corrupted``): all before the model loads. Once it has loaded, :func:`~headlab.interpret.patching.prompt_pair`
tokenises the prompts (single-token answers, equal lengths, prompts that tokenise alike) and ``--positions`` is
checked against their length, before any patched run.

**Units.** Exact patching is one unit per site kind (``exact z``, ``exact v``, ...: each a sweep over every
layer x head, and every position with ``--positions``; splitting by kind costs one clean and one corrupted
forward per kind, against the ``layers x heads`` patched rows of its sweep); attribution patching is one unit
(``attribution``: one forward and one backward give every kind at once). Ctrl-C keeps the finished units: an
exact sweep interrupted half-way is not one of them (the library keeps its measured configurations and marks
the rest NaN, for a caller of :func:`~headlab.interpret.patching.patch`; the command stops with the runner's
line instead of ranking heads from a partial grid). Each sweep reports its own stage through the runner's
display: ``patching`` for one kind, as before, ``patching z``, ``patching v``, ... for several. The command's
view is :mod:`headlab.cli.views.patch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import headlab.checks as checks
from headlab.errors import ConfigError, InputError
from headlab.interpret.study.base import (
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

METHODS = ("exact", "attribution", "both")


def _rows(value, option: Option, options: dict) -> None:
    """``max_rows``, in the words of the sweep's own check (before any run)."""
    checks.positive_int("max_rows (rows per forward)", value)


def parse_positions(spec: str | None):
    """None (all positions at once), ``"each"`` or the list of positions of ``--positions``.

    >>> parse_positions("3,5,-1"), parse_positions("each"), parse_positions(None)
    ([3, 5, -1], 'each', None)
    """
    if spec is None or spec.strip() == "each":
        return None if spec is None else "each"
    try:
        got = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        got = []
    if not got:
        raise ConfigError(f"--positions takes 'each' or comma-separated positions (3,5,-1); got {spec!r}")
    return got


def parse_sites(sites: str, method: str) -> list[str]:
    """The site kinds of ``--sites``, in the option's name (the library's message says ``sites=``)."""
    from headlab.interpret.patching.runs import HEAD_KINDS, RESID_KINDS

    kinds = [s.strip() for s in sites.split(",") if s.strip()]
    allowed = HEAD_KINDS + RESID_KINDS if method == "exact" else HEAD_KINDS
    if not kinds or any(k not in allowed for k in kinds):
        why = (
            "k and v per kv head; resid_pre, resid_post and mlp_out per layer"
            if method == "exact"
            else f"--method {method}: attribution patching reads gradients at the head sites only"
        )
        raise ConfigError(f"--sites {sites!r}: choose from the kinds {', '.join(allowed)} ({why})")
    return kinds


@dataclass
class PatchRun:
    """What ``headlab patch`` computed: each method's :class:`~headlab.interpret.patching.PatchResult`, their
    agreement per kind (method ``both``), and the document the command prints and writes."""

    results: dict  # {"exact": PatchResult, "attribution": PatchResult}, those asked for
    kinds: list[str]
    doc: dict = field(default_factory=dict)  # {method: its JSON, "agreement": {kind: compare(...)}}

    @property
    def main(self):
        """The result the page and the header line show: exact when it ran, else attribution."""
        return self.results.get("exact") or self.results["attribution"]


def merge(parts: list):
    """One exact :class:`~headlab.interpret.patching.PatchResult` from the per-kind ones (same pair, same
    metric, so the same clean and corrupted values): their grids side by side, their times added."""
    from headlab.interpret.patching import PatchResult

    first = parts[0]
    notes = list(dict.fromkeys(n for p in parts for n in p.notes))
    return PatchResult(
        model=first.model,
        method=first.method,
        metric=first.metric,
        n_examples=first.n_examples,
        clean=first.clean,
        corrupted=first.corrupted,
        effects={k: v for p in parts for k, v in p.effects.items()},
        raw={k: v for p in parts for k, v in p.raw.items()},
        positions=first.positions,
        receivers=first.receivers,
        seconds=sum(p.seconds for p in parts),
        notes=notes,
    )


@register
class Patch(Instrument):
    """Patch each head's activation from the corrupted prompt into the clean one and rank the heads."""

    name = "patch"
    reads_text = True  # a model folder without a tokenizer is refused before the load
    summary = """Patch each head's activation from the corrupted prompt into the clean one and rank the heads.

The metric is the logit difference answer - wrong at the last token; an effect is
(m_patched - m_clean) / (m_corrupted - m_clean): 0 = no change, 1 = the whole gap."""
    options = (
        Option(
            "clean",
            "--clean",
            str,
            REQUIRED,
            "the clean prompt, e.g. \"When Mary and John went to the store, John gave a drink to\"",
            reads="text",
        ),
        Option(
            "corrupted", "--corrupted", str, REQUIRED, "the same prompt with other names (as many tokens)", reads="text"
        ),
        Option(
            "answer", "--answer", str, REQUIRED, "the right next token, with its leading space: \" Mary\"", reads="text"
        ),
        Option("wrong", "--wrong", str, REQUIRED, "the wrong next token: \" John\"", reads="text"),
        Option("model", "--model", str, "smollm2", "a known model name or a model folder", short="-m"),
        Option(
            "sites",
            "--sites",
            str,
            "z",
            "comma-separated: z, q, k, v, pattern (per head); resid_pre, resid_post, mlp_out (per layer, exact only)",
        ),
        Option("positions", "--positions", str, None, "'each' (every position separately) or 3,5,-1"),
        Option("method", "--method", str, "exact", "exact | attribution | both (with their rank correlation)"),
        Option("top", "--top", int, 10, "how many heads to list", setting=False),
        Option(
            "out",
            "--out",
            Path,
            None,
            "write the result: FILE.json (data) or FILE.html (page)",
            short="-o",
            setting=False,
        ),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
        Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
        # headlab.patch's: the inputs as they are and their metric (in place of the four texts), and its settings
        Option(
            "inputs",
            None,
            object,
            None,
            "(clean, corrupted): texts with a loaded model, input_ids (B, L) or dicts, of the same shape",
            python=True,
            setting=False,
        ),
        Option("metric", None, object, None, "metric(logits (B, L, V)) -> (B,)", python=True, setting=False),
        Option("layers", None, object, None, "the layers to patch (default all)", python=True),
        Option("max_rows", None, int, 256, "rows per forward (configurations x examples)", python=True, check=_rows),
        Option("backend", None, str, None, "the attention backend of every run", python=True),
    )
    output = Output("out", folder=False, force="force")
    resumable = True  # each site kind's sweep and attribution are units: --resume runs those not kept
    keeps_units = False  # a finished file is the result (every unit's grids are in it already)

    def check(self, ctx: Context) -> None:
        """The options alone, in the order the command has always checked them (a load takes time); from
        :func:`headlab.patch`, its sites and positions as the library takes them (a list, ``"each"``)."""
        o = ctx.options
        if o["method"] not in METHODS:
            raise ConfigError(f"--method {o['method']!r}: choose one of {', '.join(METHODS)}")
        if o["metric"] is None:  # the command's four texts
            texts = ("clean", "corrupted", "answer", "wrong")
            missing = [n if ctx.python else self.option(n).label for n in texts if o[n] is None]
            if missing:
                raise InputError(f"{', '.join(missing)}: give the texts, or the inputs and their metric")
            ctx.state["kinds"] = parse_sites(o["sites"], o["method"])
            ctx.state["positions"] = parse_positions(o["positions"])
        else:
            from headlab.interpret.patching.runs import HEAD_KINDS, RESID_KINDS, check_kinds

            if not isinstance(o["inputs"], tuple | list) or len(o["inputs"]) != 2:
                raise InputError("inputs: give the pair (clean, corrupted) the metric is measured on")
            ctx.state["kinds"] = check_kinds(o["sites"], HEAD_KINDS + (RESID_KINDS if o["method"] == "exact" else ()))
            ctx.state["positions"] = o["positions"]
        at_least(1)(o["top"], self.option("top"), o)
        if o["out"] is not None and Path(o["out"]).suffix not in (".json", ".html"):
            raise InputError(f"--out {o['out']}: give a file ending in .json (the data) or .html (the page)")

    def prepare(self, ctx: Context) -> None:
        """The degenerate pairs, refused before the load: every effect would be 0/0."""
        d = ctx.data
        if ctx.options["metric"] is not None:  # inputs handed over: the library's checks, once loaded
            return
        if d["answer"] == d["wrong"]:
            raise InputError(
                f"--answer and --wrong are both {d['answer']!r}: their logit difference is 0 on every "
                "run, so every effect would be 0/0; give the right and a wrong next token"
            )
        if d["clean"] == d["corrupted"]:
            raise InputError(
                "--clean and --corrupted are the same text: patching one into the other changes "
                "nothing (every effect would be 0/0); give a corrupted prompt with other names"
            )

    def load(self, ctx: Context):
        """The model by name; one handed over as it is, a module through its adapter (which knows the ranks that
        hold its heads)."""
        model = ctx.options["model"]
        if isinstance(model, str | Path):
            return super().load(ctx)
        from headlab.models.loaded_model import resolve

        adapter, loaded = resolve(model)
        return loaded if loaded is not None else adapter

    def check_loaded(self, ctx: Context) -> None:
        """The prompts through the tokenizer (single tokens, equal lengths, not alike) and --positions against
        their length, before any patched run; inputs handed over, the library's checks of the pair."""
        from headlab.interpret.patching.prompts import prompt_pair
        from headlab.interpret.patching.runs import check_positions, prepare

        if ctx.options["metric"] is not None:
            clean, corrupted = ctx.options["inputs"]
            check_positions(ctx.state["positions"], prepare(ctx.loaded, clean, corrupted).length)
            ctx.state["pair"] = (clean, corrupted, ctx.options["metric"])
            return
        d = ctx.data
        a, b, metric = prompt_pair(ctx.loaded, d["clean"], d["corrupted"], d["answer"], d["wrong"])
        try:
            check_positions(ctx.state["positions"], a["input_ids"].shape[1])
        except ConfigError as e:
            raise ConfigError(f"--positions {ctx.options['positions']}: {e}") from None
        ctx.state["pair"] = (a, b, metric)

    def units(self, ctx: Context) -> list[Unit]:
        method, kinds = ctx.options["method"], ctx.state["kinds"]
        if ctx.options["metric"] is not None:  # headlab.patch: one sweep over every kind, as one call always was
            exact = [Unit("exact", kinds)] if method in ("exact", "both") else []
        else:
            exact = [Unit(f"exact {k}", k) for k in kinds] if method in ("exact", "both") else []
        return exact + ([Unit("attribution", kinds)] if method in ("attribution", "both") else [])

    def run_unit(self, ctx: Context, unit: Unit, recording=None):
        from headlab.interpret.patching import attribution_patch
        from headlab.interpret.patching.exact import sweep

        a, b, metric = ctx.state["pair"]
        pos, o = ctx.state["positions"], ctx.options
        if unit.key == "attribution":
            return attribution_patch(ctx.loaded, a, b, metric, sites=unit.payload, positions=pos)
        seen = {"done": 0, "total": 0}
        whole = unit.key == "exact"  # headlab.patch's one sweep over every kind
        alone = whole or len(ctx.state["kinds"]) == 1  # one sweep: its stage is "patching", as it always was

        def progress(stage, done, total):  # the runner's display (a bar per kind), and whether the sweep ended
            seen.update(done=done, total=total)
            ctx.progress(stage if alone else f"{stage} {unit.payload}", done, total)

        kinds = unit.payload if whole else [unit.payload]
        r = sweep(
            ctx.loaded,
            a,
            b,
            metric,
            sites=kinds,
            positions=pos,
            layers=o["layers"],
            max_rows=o["max_rows"],
            backend=o["backend"],
            progress=progress,
        )
        if seen["done"] < seen["total"] and not whole:  # the sweep caught Ctrl-C and kept a partial grid: not a
            raise KeyboardInterrupt  # finished unit of the command (headlab.patch returns it, the rest NaN)
        return r

    def unit_to_json(self, value):
        return value.to_json()

    def unit_from_json(self, data):
        from headlab.interpret.patching.result import PatchResult

        return PatchResult.from_json(data)

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        from headlab.interpret.patching import compare
        from headlab.results import envelope

        kinds = ctx.state["kinds"]
        results = {}
        exact = [values[k] for k in values if k.split(" ")[0] == "exact"]
        if exact:
            results["exact"] = exact[0] if len(exact) == 1 else merge(exact)
        if "attribution" in values:
            results["attribution"] = values["attribution"]
        run = PatchRun(results, kinds, {name: r.to_json() for name, r in results.items()})
        if len(results) == 2:
            run.doc["agreement"] = {k: compare(results["exact"], results["attribution"], k) for k in kinds}
        o = ctx.options
        payload = envelope(
            "patch",
            run.doc,
            model=run.main.model,
            settings={"method": o["method"], "sites": kinds, "positions": o["positions"]},
        )
        return InstrumentResult.of(run, payload)

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.results import write_json, write_text

        if path.suffix == ".html":
            return [write_text(path, result.native.main.page())]
        return [write_json(path, result.to_json())]


__all__ = ["METHODS", "Patch", "PatchRun", "merge", "parse_positions", "parse_sites"]
