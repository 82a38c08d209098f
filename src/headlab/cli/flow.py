"""``headlab flow TEXT``: attention rollout, attention flow and value-aware norms of one text."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from headlab.progress import progress
from rich.table import Table

from headlab.cli.app import app, console, err_console, print_json
from headlab.errors import ConfigError, InputError

METHODS = ("rollout", "norm-rollout", "flow", "norms")
_NAMED_ROWS = {"cls": 0, "first": 0, "bos": 0, "last": -1, "sep": -1}


def parse_rows(spec: str | None) -> list[int] | None:
    """``"cls"`` -> [0], ``"last"`` -> [-1], ``"0,5,-1"`` -> [0, 5, -1]."""
    if spec is None:
        return None
    out = []
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        if part in _NAMED_ROWS:
            out.append(_NAMED_ROWS[part])
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise ConfigError(f"--rows takes token positions or names ({', '.join(_NAMED_ROWS)}), "
                              f"comma-separated; got {spec!r}") from None
    if not out:
        raise ConfigError("--rows is empty; give e.g. --rows cls or --rows 0,5")
    return out


def _check_out(out: Path | None) -> None:
    if out is not None and out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a folder (created when missing)")


def _table(title: str, rows, header=("pos", "token", "value")) -> Table:
    t = Table(title=title, title_justify="left")
    for h in header:
        t.add_column(h)
    for r in rows:
        t.add_row(*(f"{x:.4f}" if isinstance(x, float) else str(x) for x in r))
    return t


@app.command("flow")
def flow_cmd(
    text: str = typer.Argument(..., help="the text (quote it)"),
    method: str = typer.Option("rollout", "--method", help="rollout | norm-rollout | flow | norms"),
    rows: str = typer.Option(None, "--rows", help="output tokens: cls, last, or positions 0,5 (flow: the source)"),
    layer: int = typer.Option(-1, "--layer", help="the top layer (default the last)"),
    model: str = typer.Option("minilm", "--model", "-m", help="a known model name (minilm) or a model folder"),
    mode: str = typer.Option("attention", "--mode", help="norms: attention (Kobayashi 2020) or residual (2021)"),
    solver: str = typer.Option("scipy", "--solver", help="flow: scipy (fast, certified) or networkx (the paper's)"),
    top: int = typer.Option(10, "--top", help="tokens shown per row"),
    out: Path = typer.Option(None, "--out", "-o", help="write <method>.json into this folder"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """How much of each input token reaches an output token: rollout, flow (Abnar and Zuidema 2020) or
    value-aware norms (Kobayashi et al. 2020, 2021).

    Example: headlab flow "The cat sat on the mat." --method flow --rows cls
    """
    from headlab.interpret.flow.views import key_shares, ranked
    from headlab.models import load

    if method not in METHODS:
        raise ConfigError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    row_pos = parse_rows(rows)
    _check_out(out)
    loaded = load(model)
    if method in ("rollout", "norm-rollout"):
        from headlab.interpret.flow.rollout import rollout

        res = rollout(loaded, text, method="norm" if method == "norm-rollout" else "mean", rows=row_pos, layer=layer)
        shown = res.rows if res.rows is not None else res.maps[-1][:1]
        labels = res.row_positions if res.row_positions is not None else [0]
        render = lambda: [console.print(_table(f"{method} through layer {res.layer}, row {p} ({res.tokens[p] if res.tokens else p})",  # noqa: E731
                                               ranked(v, res.tokens, top))) for p, v in zip(labels, shown)]
    elif method == "flow":
        from headlab.interpret.flow.maxflow import attention_flow

        source = row_pos[0] if row_pos else 0
        with progress(TextColumn("max flow"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task("max flow", total=None)
            res = attention_flow(loaded, text, source=source, layer=layer, solver=solver,
                                 progress=lambda k: bar.update(task, advance=k))
        render = lambda: console.print(_table(  # noqa: E731
            f"flow from token {res.source} at layer {res.layer} ({res.solver}, {res.seconds:.2f} s, gap {res.gap:.1e})",
            ranked(res.flow, res.tokens, top)))
    else:
        from headlab.interpret.flow.norms import attention_norms

        res = attention_norms(loaded, text, mode=mode, stream=True, rows=row_pos,
                              key_positions=[0, -1])
        def render():
            t = Table(title=f"share on the first / last token per layer ({mode} norms, mean of heads and queries)",
                      title_justify="left")
            for h in ("layer", "weight first", "norm first", "weight last", "norm last"):
                t.add_column(h)
            for l, s in res.summaries.items():
                ks = key_shares(s)
                t.add_row(str(l), *(f"{v:.3f}" for v in (ks["weight"][0], ks["norm"][0], ks["weight"][1], ks["norm"][1])))
            console.print(t)
    payload = res.to_json()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{method}.json"
        path.write_text(json.dumps(payload) + "\n")
        err_console.print(f"wrote {path}", highlight=False)
    if as_json:
        print_json(payload)
        return
    render()
