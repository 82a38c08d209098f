"""``headlab heads importance|ablate|prune``: which heads matter, and removing the ones that do not."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import (app, check_at_least, check_heads_before_loading, check_output_dir, console, print_json,
                             read_text_file)
from headlab.cli.rows import row
from headlab.errors import ConfigError, InputError
from headlab.results import write_json

heads_app = typer.Typer(help="Which heads matter: importance, ablation verdicts, physical pruning.",
                        no_args_is_help=True)
app.add_typer(heads_app, name="heads")

MODEL = typer.Option(..., "--model", "-m", help="a known model name or a local model folder")
DATA = typer.Option(None, "--data", "-d", help=".tsv (sentence[, label] header), .conllu (# text = lines) or .txt")
LOSS = typer.Option("auto", "--loss", help="task | lm | kl | cosine | auto")
LIMIT = typer.Option(None, "--limit", help="use only the first N examples")
BATCH = typer.Option(16, "--batch-size", help="examples per forward (and backward)")
JSON = typer.Option(False, "--json", help="print the result as JSON")


def _load(model: str, data: Path | None, limit: int | None, *, need_data: bool = True):
    from headlab.interpret.heads.examples import read_texts, token_ids_if_needed
    from headlab.models import load

    if data is None:
        if need_data:
            raise InputError("--data FILE is required: a .tsv, .conllu or .txt of examples")
        return load(model), None, None
    # before loading the model: missing, a folder, not UTF-8, empty
    read_text_file(Path(data), "--data", what="a .tsv with a 'sentence' column, a .conllu or a .txt")
    texts, labels = read_texts(data, limit=limit)
    loaded = load(model)
    return loaded, token_ids_if_needed(loaded, texts), labels


def _check_options(*, loss: str, batch_size: int, backend: str, limit: int | None) -> None:
    """The options prune's study takes, refused before the model loads."""
    from headlab.attention import backends
    from headlab.interpret.heads.examples import LOSSES

    if loss not in (*LOSSES, "auto"):
        raise ConfigError(f"--loss {loss!r} is not a loss; use one of {' | '.join(LOSSES)} | auto")
    check_at_least("--batch-size", batch_size, 1)
    check_at_least("--limit", limit, 1, what=" example")
    if backend != "auto" and backend not in backends.names():
        raise ConfigError(f"--backend {backend!r} is not a backend; use auto or one of {', '.join(backends.names())}")


def _parse_heads(spec: str) -> dict[int, list[int]]:
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


# importance and ablate are rows: their options, checks and rendering are instruments
# (headlab.interpret.instruments.heads), run by the study runner
row(heads_app, "importance", "heads-importance")
row(heads_app, "ablate", "heads-ablate")


@heads_app.command("prune")
def prune_cmd(model: str = MODEL, out: Path = typer.Option(..., "--out", "-o", help="new folder for the pruned model"),
              heads: str = typer.Option(None, "--heads", help="heads to remove, LAYER.HEAD,... e.g. 0.3,2.5"),
              fraction: float = typer.Option(None, "--fraction", help="remove this share of heads, least important "
                                                                       "first (needs --data)"),
              data: Path = DATA, loss: str = LOSS, limit: int = LIMIT, batch_size: int = BATCH,
              curve: bool = typer.Option(False, "--curve", help="also the pruning curve on --data (PNG, JSON)"),
              recompute: bool = typer.Option(False, "--recompute", help="curve: recompute importance at each step"),
              allow_empty_layers: bool = typer.Option(False, "--allow-empty-layers",
                                                      help="allow removing every head of a layer"),
              gqa: str = typer.Option("pad", "--gqa", help="pad (uneven GQA groups kept exact) | strict"),
              as_json: bool = JSON) -> None:
    """Remove heads physically and save the smaller model (reloads with headlab.load)."""
    from headlab.interpret.heads.importance import head_importance
    from headlab.interpret.heads.page import render_page
    from headlab.interpret.heads.prune import order_heads, prune_heads, pruning_curve

    if (heads is None) == (fraction is None):
        raise ConfigError("give exactly one of --heads LAYER.HEAD,... and --fraction F")
    if fraction is not None and not 0 < fraction < 1:
        raise ConfigError(f"--fraction must lie in (0, 1), got {fraction}")
    if gqa not in ("pad", "strict"):
        raise ConfigError(f"--gqa {gqa!r} is not a choice; use pad (uneven GQA groups kept exact) or strict")
    out = Path(out)
    if out.is_dir() and any(out.iterdir()):  # prune has no --force: a new or empty folder only
        raise InputError(f"--out {out} exists and is not an empty folder; choose a new one")
    check_output_dir(out, "--out", force=True)  # a file in the way, FILE/sub, an unwritable place
    _check_options(loss=loss, batch_size=batch_size, backend="auto", limit=limit)
    spec = _parse_heads(heads) if heads is not None else None
    check_heads_before_loading(model, heads)
    loaded, texts, labels = _load(model, data, limit, need_data=fraction is not None or curve)
    if spec is None:
        order = order_heads(head_importance(loaded, texts, labels, loss=loss, batch_size=batch_size,
                                            normalize=True, progress=True))
        spec = {}
        for l, h in order[: int(round(fraction * len(order)))]:
            spec.setdefault(l, []).append(h)
    p = prune_heads(loaded, spec, allow_empty_layers=allow_empty_layers, gqa=gqa)
    p.save(out)
    summary = {"out": str(out), "heads_per_layer": p.adapter.layer_heads, "removed": {str(k): v for k, v in spec.items()},
               "notes": p.notes}
    if curve:
        c = pruning_curve(loaded, texts, labels, loss=loss, recompute=recompute, batch_size=batch_size, progress=True)
        write_json(out / "curve.json", c.to_json())
        png = c.plot(out / "curve.png")
        (out / "heads.html").write_text(render_page(title=f"pruning: {c.model}", curve=c, curve_png=png))
        summary["curve"] = c.summary()
    if as_json:
        print_json(summary)
        return
    console.print(f"saved the pruned model to {out}/ (heads per layer {p.adapter.layer_heads})", highlight=False,
                  soft_wrap=True)
    for n in p.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False, soft_wrap=True)
    if curve:
        console.print(summary["curve"], highlight=False, soft_wrap=True)
