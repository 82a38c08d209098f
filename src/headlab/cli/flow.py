"""``headlab flow TEXT``: attention rollout, attention flow and value-aware norms of one text."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from headlab.cli.app import (app, check_at_least, check_output_dir, check_output_file, check_text, console, err_console,
                             print_json)
from headlab.errors import ConfigError, InputError
from headlab.progress import reporter
from headlab.results import write_json

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


MODES = ("attention", "residual")
SOLVERS = ("scipy", "networkx")


def _check_out(out: Path | None, method: str) -> None:
    """The folder (created when missing; other files in it are kept) and the file written into it."""
    if out is None:
        return
    folder = check_output_dir(out, "--out", allow_existing=True)
    if (folder / f"{method}.json").is_dir():
        raise InputError(f"--out {str(out)!r}: {method}.json in it is a folder, where the result would go; move it "
                         "away or choose another folder")
    if folder.is_dir():
        check_output_file(folder / f"{method}.json", "--out", force=True)  # an earlier result is replaced


def _check_loaded(loaded, text: str, layer: int, rows: list[int] | None) -> None:
    """--layer against the model's layers and --rows against the text's tokens, before the work."""
    from headlab.models.loader import resolve

    n = resolve(loaded)[0].n_layers
    if not -n <= layer < n:
        raise ConfigError(f"--layer {layer} is out of range: {loaded.name} has {n} layers (0..{n - 1}, or -1 for the last)")
    tok = getattr(loaded, "tokenizer", None)
    if tok is None:
        return
    t = len(tok(text, verbose=False)["input_ids"])
    limit = getattr(loaded, "max_positions", None)
    if limit is not None and t > limit:
        raise InputError(f"TEXT is {t} tokens long (special tokens included) but {loaded.name} reads at most {limit}; "
                         "shorten it")
    if rows is None:
        return
    bad = [r for r in rows if not -t <= r < t]
    if bad:
        raise ConfigError(f"--rows {','.join(map(str, bad))} is out of range: the text is {t} tokens (0..{t - 1}, "
                          "negatives count from the end)")


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
    mode: str = typer.Option(None, "--mode", help="norms: attention (Kobayashi 2020, the default) or residual (2021)"),
    solver: str = typer.Option(None, "--solver", help="flow: scipy (fast, certified; the default) or networkx (the paper's)"),
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
    for option, value, choices, used_by in (("--mode", mode, MODES, "norms"), ("--solver", solver, SOLVERS, "flow")):
        if value is not None and value not in choices:
            raise ConfigError(f"unknown {option} {value!r}; choose one of {', '.join(choices)}")
        if value is not None and method != used_by:
            raise ConfigError(f"{option} acts only with --method {used_by}; drop it, or add --method {used_by} "
                              f"(--method {method} would ignore it)")
    mode, solver = mode or MODES[0], solver or SOLVERS[0]
    check_at_least("--top", top, 1)
    check_text(text, "TEXT")
    row_pos = parse_rows(rows)
    if method == "flow" and row_pos is not None and len(row_pos) > 1:
        raise ConfigError(f"--rows {rows}: --method flow follows one source token; give one position (e.g. --rows cls)")
    _check_out(out, method)
    loaded = load(model)
    _check_loaded(loaded, text, layer, row_pos)
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
        with reporter(True, transient=True) as say:
            res = attention_flow(loaded, text, source=source, layer=layer, solver=solver, progress=say)
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
        write_json(path, payload, indent=None)
        err_console.print(f"wrote {path}", highlight=False)
    if as_json:
        print_json(payload)
        return
    render()
