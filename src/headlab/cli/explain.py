"""``headlab explain``: attention against saliency for one prediction, or the study over a dataset."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from headlab.cli.app import (app, check_at_least, check_output_dir, check_text, console, err_console, print_json,
                             read_text_file)
from headlab.errors import ConfigError, InputError
from headlab.interpret.saliency import DEFAULT_METHODS, METHODS, StudyOptions, explain, study
from headlab.interpret.saliency.html import write_explanation
from headlab.interpret.saliency.tables import fmt, fmt_ci


SHORT = {"attention": "attention", "gradient": "gradient", "grad_x_input": "grad*input",
         "integrated_gradients": "IG", "leave_one_out": "LOO", "rollout": "rollout", "norm_rollout": "norm roll",
         "attention_flow": "flow", "attention_norm": "norm"}


def render_explanation(ex) -> None:
    what = {"classifier": f"class {ex.target}" + (f" ({ex.target_label})" if ex.target_label else ""),
            "next_token": f"next token id {ex.target}", "similarity": "cosine similarity"}[ex.kind]
    console.print(f"explaining {what}: y = {ex.y:.4g}" + ("" if ex.probs is None else
                  "  probs " + ", ".join(f"{p:.3f}" for p in ex.probs)), highlight=False, soft_wrap=True)
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
        console.print(f"IG completeness gap: {100 * ex.completeness_gap:.3f}% of y(x) - y(baseline) = "
                      f"{ex.y - ex.y_baseline:.4g} ({ex.ig_steps} steps)", highlight=False)
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


def render_study(r) -> None:
    tb = r.tables
    console.print(f"{tb['n']} instances -> {r.out}/ ({', '.join(r.files)})"
                  + (f"; accuracy {tb['accuracy']:.4f}" if "accuracy" in tb else ""), highlight=False, soft_wrap=True)
    if tb.get("kendall"):
        t = Table(title="Kendall tau of attention with each method (per instance)", show_edge=False)
        for c in ("method", "mean", "std", "median", "significant", *[f"mean | pred {k}" for k in
                                                                       next(iter(tb["kendall"].values()))["by_class"]]):
            t.add_column(c, justify="right")
        for m, d in tb["kendall"].items():
            t.add_row(m, fmt(d.get("mean")), fmt(d.get("std")), fmt(d.get("q50")), fmt(d.get("significant")),
                      *(fmt(c.get("mean")) for c in d["by_class"].values()))
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
        console.print(f"adversarial attention (output TVD <= {a['tvd_budget']}): max JSD mean {fmt(a['max_jsd'].get('mean'))}, "
                      f"median {fmt(a['max_jsd'].get('q50'))}, share > 0.5: {fmt(a['share_above_0.5'])}", highlight=False)
    if tb.get("faithfulness"):
        t = Table(title="ERASER faithfulness: mean [95% bootstrap CI]; comprehensiveness up, sufficiency down",
                  show_edge=False)
        cols = [c for c in next(iter(tb["faithfulness"].values()))]
        t.add_column("method")
        for c in cols:
            t.add_column(c.replace("comprehensiveness", "comp").replace("sufficiency", "suff"), justify="right")
        for m, d in tb["faithfulness"].items():
            t.add_row(m, *(fmt_ci(d[c]) for c in cols))
        console.print(t)
    for s in r.skipped:
        console.print(f"[yellow]skipped:[/] {s}", highlight=False, soft_wrap=True)


@app.command("explain")
def explain_cmd(
    text: str = typer.Argument(None, help="the text whose prediction to explain (omit with --dataset)"),
    model: str = typer.Option(..., "--model", "-m", help="a model folder (e.g. the SST-2 classifier) or known name"),
    methods: str = typer.Option(",".join(DEFAULT_METHODS), "--methods",
                                help="comma-separated, of: " + ", ".join(METHODS) + " (default: all but attention_flow)"),
    target: int = typer.Option(None, "--target", help="class (or next-token id) to explain; default the prediction"),
    ig_steps: int = typer.Option(50, "--ig-steps", help="integrated-gradients steps"),
    backend: str = typer.Option("auto", "--backend", help="attention backend for every pass (sdpa, tiled, ...)"),
    loo: str = typer.Option("delete", "--loo", help="leave-one-out: delete, mask or unk"),
    compare_to: str = typer.Option(None, "--compare-to", help="for a model with no head: explain cosine similarity to this text"),
    truncate: bool = typer.Option(False, "--truncate", help="cut text longer than the model's positions (warned)"),
    dataset: Path = typer.Option(None, "--dataset", help="TSV (sentence, label): run the corpus study instead"),
    limit: int = typer.Option(None, "--limit", help="with --dataset: only the first N rows"),
    no_counterfactual: bool = typer.Option(False, "--no-counterfactual", help="with --dataset: skip permutation and adversarial tests"),
    max_minutes: float = typer.Option(None, "--max-minutes", help="with --dataset: stop starting new rows after this long (rerun resumes)"),
    out: Path = typer.Option(None, "--out", "-o", help="folder for the HTML page + PNG (or the study's files)"),
    force: bool = typer.Option(False, "--force", help="write into a non-empty --out folder (one explanation)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Attention versus gradient, grad x input, integrated gradients and leave-one-out (Jain and Wallace 2019),
    rollout, norm-based rollout, attention flow and the norm map (Abnar and Zuidema 2020; Kobayashi et al. 2020).

    Examples: headlab explain "a gripping , funny film" --model ~/.cache/headlab/minilm-sst2 --out ex/
              headlab explain "a gripping , funny film" --model PATH --methods rollout,attention_flow,gradient
              headlab explain --dataset validation.tsv --model ~/.cache/headlab/minilm-sst2 --out study/
              torchrun --nproc-per-node 2 -m headlab explain --dataset validation.tsv --model PATH --out study/
              (data-parallel: each process explains every 2nd row; rank 0 writes the files and prints)
    """
    check_at_least("--target", target, 0, what=" (a class or token id)")
    if dataset is None:  # the study's options would be ignored silently
        alone = [o for o, v in (("--limit", limit), ("--max-minutes", max_minutes),
                                ("--no-counterfactual", no_counterfactual or None)) if v is not None]
        if alone:
            raise InputError(f"{', '.join(alone)}: {'it acts' if len(alone) == 1 else 'they act'} only with "
                             "--dataset FILE.tsv (the corpus study); drop it, or add --dataset")
    if dataset is not None:
        if text is not None:
            raise InputError("give either TEXT or --dataset, not both")
        if out is None:
            raise InputError("--dataset needs --out DIR (where the per-instance lines and tables go; reruns resume)")
        check_at_least("--limit", limit, 1, what=" row")
        if max_minutes is not None and not 0 < max_minutes < float("inf"):
            raise ConfigError(f"--max-minutes must be a number > 0, got {max_minutes}")
        if Path(dataset).is_file():  # not UTF-8 or empty: one line naming the option, before the model
            read_text_file(Path(dataset), "--dataset", what="a TSV file with a header row (columns sentence, label)")
        check_output_dir(out, "--out", allow_existing=True)  # reruns resume in it
        opts = StudyOptions(methods=tuple(m.strip() for m in methods.split(",") if m.strip()), ig_steps=ig_steps,
                            backend=backend, loo=loo, counterfactual=not no_counterfactual)
        from headlab.distributed.data import init_from_env

        init_from_env()  # under torchrun: the rows are split across the processes; rank 0 writes and prints
        r = study(model, dataset, out, limit=limit, options=opts, progress=not as_json,
                  max_seconds=None if max_minutes is None else 60 * max_minutes)
        if r is None:  # another rank than 0
            return
        if as_json:
            print_json(r.to_json())
        else:
            render_study(r)
        return
    if text is None:
        raise InputError("no text: give TEXT to explain, or --dataset FILE.tsv with --out DIR")
    check_text(text, "TEXT")
    if compare_to is not None:
        check_text(compare_to, "--compare-to")
    if out is not None:  # checked before the work: a non-empty folder is kept unless --force
        check_output_dir(out, "--out", force=force)
    ex = explain(model, text, target=target, methods=methods, ig_steps=ig_steps, backend=backend, loo=loo,
                 compare_to=compare_to, truncate=truncate)
    paths = write_explanation(ex, out) if out is not None else None
    if as_json:
        j = ex.to_json()
        print_json({k: j[k] for k in ("tokens", "target", "probs", "scores", "agreement", "completeness_gap")}
                   | {"special": j["special"], "kind": j["kind"], "notes": j["notes"],
                      "files": {k: str(v) for k, v in (paths or {}).items()}})
        return
    render_explanation(ex)
    if paths:
        err_console.print(f"wrote {paths['html']} and {paths['png'].name}", highlight=False, soft_wrap=True)
