"""``explain``: attention against saliency for one prediction, or the corpus study over a dataset, as an instrument.

The computations are the saliency room's: :func:`~headlab.interpret.saliency.explain` for one text (attention,
gradient, grad x input, integrated gradients, leave-one-out, rollout, norm-based rollout, attention flow, the
norm map, and their agreement) and :func:`~headlab.interpret.saliency.study` for ``--dataset`` (Jain and
Wallace's corpus tables and the ERASER measures). This file declares the options of ``headlab explain``,
checks them before the model loads, and shows the result.

**One text** is one unit; its page, PNG and JSON go to ``--out`` (a new or empty folder, or ``--force``).

**The study**: every dataset row is a unit (keyed ``line:sha1`` of its text), whose value is the row's record
(:func:`~headlab.interpret.saliency.corpus_study.row_value`); ``finish`` makes the corpus tables from them
(:func:`~headlab.interpret.saliency.corpus_study.conclude`, what :func:`~headlab.interpret.saliency.study`
computes). The runner does the rest: the ``explain`` stage on its display, the rows split over torchrun's ranks
(on a model sharded by heads, over the tensor-parallel groups) and gathered on rank 0, and on Ctrl-C the
finished rows kept in ``OUT/instances.json`` (the result file: the records under ``"units"``), from which
``--resume`` runs only the rest. ``--max-minutes`` stops starting rows: those left are not kept, so a
``--resume`` explains them.
"""

from __future__ import annotations

import math
import time
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
from headlab.interpret.saliency.explanation import DEFAULT_METHODS, METHODS
from headlab.results import print_json

SHORT = {
    "attention": "attention",
    "gradient": "gradient",
    "grad_x_input": "grad*input",
    "integrated_gradients": "IG",
    "leave_one_out": "LOO",
    "rollout": "rollout",
    "norm_rollout": "norm roll",
    "attention_flow": "flow",
    "attention_norm": "norm",
}  # the column heads of the terminal tables
STUDY_ONLY = (("limit", "--limit"), ("max_minutes", "--max-minutes"), ("no_counterfactual", "--no-counterfactual"))


def _ig_steps(value, option: Option, options: dict) -> None:
    from headlab.interpret.saliency.integrated import MAX_STEPS

    if value > MAX_STEPS:  # below 1: the library's own check says so
        raise ConfigError(
            f"--ig-steps must be at most {MAX_STEPS:,} (Gauss-Legendre converges in tens of steps; 50 "
            f"is the usual choice), got {value:,}"
        )


@register
class Explain(Instrument):
    """Attention versus saliency for one prediction (or over a dataset), with their agreement."""

    name = "explain"
    summary = """Attention versus gradient, grad x input, integrated gradients and leave-one-out (Jain and Wallace 2019),
rollout, norm-based rollout, attention flow and the norm map (Abnar and Zuidema 2020; Kobayashi et al. 2020).

Examples: headlab explain "a gripping , funny film" --model ~/.cache/headlab/minilm-sst2 --out ex/
          headlab explain "a gripping , funny film" --model PATH --methods rollout,attention_flow,gradient
          headlab explain --dataset validation.tsv --model ~/.cache/headlab/minilm-sst2 --out study/
          torchrun --nproc-per-node 2 -m headlab explain --dataset validation.tsv --model PATH --out study/
          (data-parallel: each process explains every 2nd row; rank 0 writes the files and prints)"""
    options = (
        Option(
            "text",
            None,
            str,
            None,
            "the text whose prediction to explain (omit with --dataset)",
            metavar="TEXT",
            reads="text",
        ),
        Option(
            "model", "--model", str, REQUIRED, "a model folder (e.g. the SST-2 classifier) or known name", short="-m"
        ),
        Option(
            "methods",
            "--methods",
            str,
            ",".join(DEFAULT_METHODS),
            "comma-separated, of: " + ", ".join(METHODS) + " (default: all but attention_flow)",
        ),
        Option("target", "--target", int, None, "class (or next-token id) to explain; default the prediction"),
        Option("ig_steps", "--ig-steps", int, 50, "integrated-gradients steps", check=_ig_steps),
        Option("backend", "--backend", str, "auto", "attention backend for every pass (sdpa, tiled, ...)"),
        Option("loo", "--loo", str, "delete", "leave-one-out: delete, mask or unk"),
        Option(
            "compare_to",
            "--compare-to",
            str,
            None,
            "for a model with no head: explain cosine similarity to this text",
            reads="text",
        ),
        Option("truncate", "--truncate", bool, False, "cut text longer than the model's positions (warned)"),
        Option("dataset", "--dataset", Path, None, "TSV (sentence, label): run the corpus study instead"),
        Option("limit", "--limit", int, None, "with --dataset: only the first N rows", setting=False),
        Option(
            "no_counterfactual",
            "--no-counterfactual",
            bool,
            False,
            "with --dataset: skip permutation and adversarial tests",
        ),
        Option(
            "max_minutes",
            "--max-minutes",
            float,
            None,
            "with --dataset: stop starting new rows after this long (--resume runs the rest)",
            setting=False,
        ),
        Option(
            "out",
            "--out",
            Path,
            None,
            "folder for the HTML page + PNG (or the study's files)",
            short="-o",
            setting=False,
        ),
        Option(
            "force",
            "--force",
            bool,
            False,
            "write into a non-empty --out folder (a study starts again; --resume continues it)",
            setting=False,
        ),
        Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
    )
    # the study's units are kept in OUT/instances.json (its records); one text writes its page beside
    output = Output("out", folder=True, file="instances.json", force="force")
    resumable = True  # --resume: the study's rows already in OUT/instances.json are kept
    stage = "explain"
    reads_text = True  # a model folder without a tokenizer is refused before the load

    def resumes(self, ctx: Context) -> bool:
        """Only the corpus study keeps units (its rows); one explanation has nothing to resume."""
        return ctx.options["dataset"] is not None

    def check(self, ctx: Context) -> None:
        """The options alone, in the order the command has always checked them."""
        o = ctx.options
        if o["target"] is not None:
            at_least(0, " (a class or token id)")(o["target"], self.option("target"), o)
        if o["dataset"] is None:  # the study's options would be ignored silently
            alone = [flag for name, flag in STUDY_ONLY if o[name] is not None and o[name] is not False]
            if alone:
                raise InputError(
                    f"{', '.join(alone)}: {'it acts' if len(alone) == 1 else 'they act'} only with "
                    "--dataset FILE.tsv (the corpus study); drop it, or add --dataset"
                )
            if o["text"] is None:
                raise InputError("no text: give TEXT to explain, or --dataset FILE.tsv with --out DIR")
            return
        if o["text"] is not None:
            raise InputError("give either TEXT or --dataset, not both")
        if o["out"] is None:
            raise InputError("--dataset needs --out DIR (where the per-instance lines and tables go; reruns resume)")
        if o["limit"] is not None:
            at_least(1, " row")(o["limit"], self.option("limit"), o)
        if o["max_minutes"] is not None and not 0 < o["max_minutes"] < math.inf:
            raise ConfigError(f"--max-minutes must be a number > 0, got {o['max_minutes']}")

    def prepare(self, ctx: Context) -> None:
        """Before the load: the dataset file (not UTF-8, empty, no label column), then the methods and their
        settings, as :func:`~headlab.interpret.saliency.study` and :func:`~headlab.interpret.saliency.explain`
        check them."""
        from headlab.interpret.saliency.explanation import check_options

        o = ctx.options
        if o["dataset"] is not None and Path(o["dataset"]).is_file():
            from headlab.reading import read_file

            read_file(
                Path(o["dataset"]), "--dataset", "texts", what="a TSV file with a header row (columns sentence, label)"
            )
        methods = check_options(o["methods"], o["ig_steps"], o["backend"], o["loo"])
        if o["dataset"] is not None:
            from headlab.interpret.saliency import StudyOptions
            from headlab.tsv import read_dataset

            ctx.state["rows"] = read_dataset(o["dataset"], o["limit"])  # a missing column stops here
            ctx.state["study"] = StudyOptions(
                methods=tuple(methods),
                ig_steps=o["ig_steps"],
                backend=o["backend"],
                loo=o["loo"],
                counterfactual=not o["no_counterfactual"],
            )

    def check_loaded(self, ctx: Context) -> None:
        ctx.state["t0"] = time.perf_counter()  # --max-minutes counts from here

    def units(self, ctx: Context) -> list[Unit]:
        """One text: one unit; the study: one per dataset row, keyed by its line and text."""
        if ctx.options["dataset"] is None:
            return [Unit(self.name)]
        return [Unit(row.key, row) for row in ctx.state["rows"]]

    def run_unit(self, ctx: Context, unit, recording=None):
        o = ctx.options
        if o["dataset"] is None:
            from headlab.interpret.saliency import explain

            return explain(
                ctx.loaded,
                ctx.data["text"],
                target=o["target"],
                methods=o["methods"],
                ig_steps=o["ig_steps"],
                backend=o["backend"],
                loo=o["loo"],
                compare_to=ctx.data.get("compare_to"),
                truncate=o["truncate"],
            )
        from headlab.interpret.saliency import corpus_study

        row = unit.payload
        if self._over_budget(ctx):
            value = {"key": row.key, "line": row.line, "not_run": True}
        else:
            value = corpus_study.row_value(ctx.loaded, row, ctx.state["study"])
        return value

    @staticmethod
    def _over_budget(ctx: Context) -> bool:
        """--max-minutes spent; the ranks of a tensor-parallel group agree (they run each row together)."""
        budget = ctx.options["max_minutes"]
        over = budget is not None and time.perf_counter() - ctx.state["t0"] > 60 * budget
        place = ctx.loaded.adapter.placement
        if budget is not None and place.sharded:
            import torch

            over = bool(place.sum_group(torch.tensor([float(over)], dtype=torch.float64))[0] > 0)
        return over

    def unit_to_json(self, value):
        return value.to_json() if hasattr(value, "to_json") else value  # one text's Explanation; a row's record

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        o = ctx.options
        if o["dataset"] is None:
            return InstrumentResult.of(values[self.name])
        from headlab.interpret.saliency.corpus_study import conclude

        rows = list(values.values())  # in the dataset's order
        left = sum("not_run" in v for v in rows)
        skipped = (
            [
                f"time budget of {60 * o['max_minutes']:.0f} s reached: {left} of {len(rows)} rows not run yet "
                "(run again with --resume to explain them)"
            ]
            if left
            else []
        )
        study = conclude(
            ctx.loaded,
            o["dataset"],
            Path(o["out"]).expanduser(),
            rows,
            ctx.state["study"],
            skipped,
            settings=ctx.settings,
        )
        return InstrumentResult.of(study)

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        if ctx.options["dataset"] is not None:  # finish wrote the records, the tables and the figures
            return [path.parent / f for f in result.native.files]
        from headlab.interpret.saliency.html import write_explanation

        ctx.state["paths"] = paths = write_explanation(result.native, path.parent)  # path: OUT/instances.json
        return list(paths.values())

    def render(self, ctx: Context, outcome, console, err) -> None:
        r, o = outcome.result.native, ctx.options
        if o["as_json"]:
            if o["dataset"] is None:
                j = r.to_json()
                doc = {k: j[k] for k in ("tokens", "target", "probs", "scores", "agreement", "completeness_gap")} | {
                    "special": j["special"],
                    "kind": j["kind"],
                    "notes": j["notes"],
                    "files": {k: str(v) for k, v in ctx.state.get("paths", {}).items()},
                }
            else:
                doc = r.to_json()
            print_json(doc)
            return
        if o["dataset"] is not None:
            render_study(r, console)
            return
        render_explanation(r, console)
        paths = ctx.state.get("paths")
        if paths:
            err.print(f"wrote {paths['html']} and {paths['png'].name}", highlight=False, soft_wrap=True)


def render_explanation(ex, console) -> None:
    """One explanation on the terminal: the target, a token x method table, IG's gap, the agreement, notes."""
    from rich.table import Table

    from headlab.interpret.saliency.tables import fmt

    what = {
        "classifier": f"class {ex.target}" + (f" ({ex.target_label})" if ex.target_label else ""),
        "next_token": f"next token id {ex.target}",
        "similarity": "cosine similarity",
    }[ex.kind]
    console.print(
        f"explaining {what}: y = {ex.y:.4g}"
        + ("" if ex.probs is None else "  probs " + ", ".join(f"{p:.3f}" for p in ex.probs)),
        highlight=False,
        soft_wrap=True,
    )
    t = Table(show_edge=False)
    t.add_column("#", justify="right")
    t.add_column("token")
    for m in ex.methods:
        t.add_column(SHORT[m], justify="right")
    for i, tok in enumerate(ex.tokens):
        style = "dim" if ex.special[i] else None
        t.add_row(str(i), tok, *(f"{ex.scores[m][i]:.4g}" for m in ex.methods), style=style)
    console.print(t)
    if ex.completeness_gap is not None:
        console.print(
            f"IG completeness gap: {100 * ex.completeness_gap:.3f}% of y(x) - y(baseline) = "
            f"{ex.y - ex.y_baseline:.4g} ({ex.ig_steps} steps)",
            highlight=False,
        )
    if len(ex.methods) > 1:
        agr = ex.agreement()
        a = Table(title="Kendall tau over |scores|, special tokens excluded (* p < 0.05)", show_edge=False)
        a.add_column("")
        for m in ex.methods:
            a.add_column(SHORT[m], justify="right")
        for x in ex.methods:
            cells = []
            for y in ex.methods:
                p = agr[x, y] if x != y else None
                star = "*" if p is not None and p.kendall_p == p.kendall_p and p.kendall_p < 0.05 else ""
                cells.append("1" if p is None else f"{fmt(p.kendall_tau, 2)}{star}")
            a.add_row(SHORT[x], *cells)
        console.print(a)
    for n in ex.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False, soft_wrap=True)


def render_study(r, console) -> None:
    """The corpus tables on the terminal: Kendall tau per method, the permutation test, the adversarial search,
    ERASER faithfulness, and what was skipped."""
    from rich.table import Table

    from headlab.interpret.saliency.tables import fmt, fmt_ci

    tb = r.tables
    console.print(
        f"{tb['n']} instances -> {r.out}/ ({', '.join(r.files)})"
        + (f"; accuracy {tb['accuracy']:.4f}" if "accuracy" in tb else ""),
        highlight=False,
        soft_wrap=True,
    )
    if tb.get("kendall"):
        t = Table(title="Kendall tau of attention with each method (per instance)", show_edge=False)
        for c in (
            "method",
            "mean",
            "std",
            "median",
            "significant",
            *[f"mean | pred {k}" for k in next(iter(tb["kendall"].values()))["by_class"]],
        ):
            t.add_column(c, justify="right")
        for m, d in tb["kendall"].items():
            t.add_row(
                m,
                fmt(d.get("mean")),
                fmt(d.get("std")),
                fmt(d.get("q50")),
                fmt(d.get("significant")),
                *(fmt(c.get("mean")) for c in d["by_class"].values()),
            )
        console.print(t)
    if tb.get("permutation"):
        p = tb["permutation"]
        t = Table(title="permutation test: median output TVD over 100 permutations", show_edge=False)
        for c in ("max attention", "instances", "median TVD"):
            t.add_column(c, justify="right")
        for b in p["bins"]:
            t.add_row(f"{b['max_attention'][0]:.2f}-{b['max_attention'][1]:.2f}", str(b["n"]), fmt(b["median_tvd"], 4))
        console.print(t)
    if tb.get("adversarial"):
        a = tb["adversarial"]
        console.print(
            f"adversarial attention (output TVD <= {a['tvd_budget']}): max JSD mean {fmt(a['max_jsd'].get('mean'))}, "
            f"median {fmt(a['max_jsd'].get('q50'))}, share > 0.5: {fmt(a['share_above_0.5'])}",
            highlight=False,
        )
    if tb.get("faithfulness"):
        t = Table(
            title="ERASER faithfulness: mean [95% bootstrap CI]; comprehensiveness up, sufficiency down",
            show_edge=False,
        )
        cols = [c for c in next(iter(tb["faithfulness"].values()))]
        t.add_column("method")
        for c in cols:
            t.add_column(c.replace("comprehensiveness", "comp").replace("sufficiency", "suff"), justify="right")
        for m, d in tb["faithfulness"].items():
            t.add_row(m, *(fmt_ci(d[c]) for c in cols))
        console.print(t)
    for s in r.skipped:
        console.print(f"[yellow]skipped:[/] {s}", highlight=False, soft_wrap=True)


__all__ = ["Explain", "SHORT", "render_explanation", "render_study"]
