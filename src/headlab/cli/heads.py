"""``headlab heads importance|ablate|prune``: which heads matter, and removing the ones that do not."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import (app, check_at_least, check_heads_before_loading, check_output_dir, console, print_json,
                             read_text_file)
from headlab.errors import ConfigError, InputError
from headlab.results import envelope, write_json

heads_app = typer.Typer(help="Which heads matter: importance, ablation verdicts, physical pruning.",
                        no_args_is_help=True)
app.add_typer(heads_app, name="heads")

MODEL = typer.Option(..., "--model", "-m", help="a known model name or a local model folder")
DATA = typer.Option(None, "--data", "-d", help=".tsv (sentence[, label] header), .conllu (# text = lines) or .txt")
LOSS = typer.Option("auto", "--loss", help="task | lm | kl | cosine | auto")
OUT = typer.Option(None, "--out", "-o", help="folder for the JSON result and the HTML page")
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


def _out_dir(out: Path | None) -> Path | None:
    if out is None:
        return None
    out = check_output_dir(Path(out), "--out", allow_existing=True)  # its files are written beside others
    out.mkdir(parents=True, exist_ok=True)
    return out


def _check_options(*, loss: str, batch_size: int, backend: str, limit: int | None) -> None:
    """The options every study takes, refused before the model loads."""
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


@heads_app.command("importance")
def importance_cmd(model: str = MODEL, data: Path = DATA, loss: str = LOSS, out: Path = OUT, limit: int = LIMIT,
                   batch_size: int = BATCH, backend: str = typer.Option("auto", "--backend"),
                   confidence: bool = typer.Option(True, "--confidence/--no-confidence",
                                                   help="also Voita's confidence (streaming statistics)"),
                   as_json: bool = JSON) -> None:
    """Michel et al.'s importance E|dL/dxi| of every head (one backward per batch), and confidence.

    Data-parallel with torchrun: `torchrun --nproc-per-node 2 -m headlab heads importance ...` splits the
    examples across the processes and adds their sums; rank 0 shows the progress and writes the output.
    """
    from headlab.distributed.data import init_from_env, is_main
    from headlab.interpret.heads.importance import importance_study
    from headlab.interpret.heads.page import render_page

    _check_options(loss=loss, batch_size=batch_size, backend=backend, limit=limit)
    init_from_env()
    out = _out_dir(out) if is_main() else None
    loaded, texts, labels = _load(model, data, limit)
    r = importance_study(loaded, texts, labels, loss=loss, batch_size=batch_size, backend=backend,
                         confidence=confidence, progress=True)
    if not is_main():
        return
    if out is not None:
        write_json(out / "importance.json", envelope("head_importance", r.to_json(), model=r.model,
                                                     settings={"loss": r.loss}))
        (out / "heads.html").write_text(render_page(title=f"head importance: {r.model}", importance=r))
    if as_json:
        print_json(r.to_json())
        return
    rank = r.ranking()
    console.print(f"{r.model}: importance ({r.loss} loss) of {len(rank)} heads over {r.n_examples} examples, "
                  f"{r.seconds:.1f} s", highlight=False, soft_wrap=True)
    console.print("least important: " + ", ".join(f"{l}.{h}" for l, h in rank[:8]), highlight=False)
    console.print("most important:  " + ", ".join(f"{l}.{h}" for l, h in rank[::-1][:8]), highlight=False)
    for k, v in r.correlations.items():
        console.print(f"Spearman {k}: {'n/a' if v is None else f'{v:.3f}'}", highlight=False)
    if out is not None:
        console.print(f"wrote {out}/importance.json, {out}/heads.html", highlight=False, soft_wrap=True)


@heads_app.command("ablate")
def ablate_cmd(model: str = MODEL, data: Path = DATA, loss: str = LOSS, out: Path = OUT, limit: int = LIMIT,
               batch_size: int = BATCH, kind: str = typer.Option("zero", "--kind", help="zero | mean | resample | uniform"),
               k: int = typer.Option(16, "--k", help="pairs among the k lowest single effects"),
               boot: int = typer.Option(1000, "--boot", help="bootstrap resamples"),
               keep_one: bool = typer.Option(True, "--keep-one/--no-keep-one", help="each layer reduced to one head"),
               backend: str = typer.Option("auto", "--backend"), as_json: bool = JSON) -> None:
    """Single, pair and keep-one ablation effects with intervals, and the verdicts unused / redundant / unique."""
    from headlab.interpret.heads.ablation import ablate, check_bootstrap
    from headlab.interpret.heads.edits import KINDS
    from headlab.interpret.heads.page import render_page

    if kind not in KINDS:  # the options first: a load can take minutes
        raise ConfigError(f"--kind {kind!r} is not an ablation kind; use one of {', '.join(KINDS)}")
    check_bootstrap(boot, 0.05)
    check_at_least("--k", k, 0)
    _check_options(loss=loss, batch_size=batch_size, backend=backend, limit=limit)
    out = _out_dir(out)
    loaded, texts, labels = _load(model, data, limit)
    r = ablate(loaded, texts, labels, kind=kind, loss=loss, k=k, keep_one=keep_one, batch_size=batch_size,
               n_boot=boot, backend=backend, progress=True)
    if out is not None:
        write_json(out / "ablation.json", envelope("head_ablation", r.to_json(), model=r.model,
                                                   settings={"kind": r.kind, "mean_over": r.mean_over, "loss": r.loss}))
        (out / "heads.html").write_text(render_page(title=f"head ablation: {r.model}", ablation=r))
    if as_json:
        print_json(r.to_json())
        return
    console.print(f"{r.model}: {r.kind} ablation, {r.loss} loss {r.baseline:.4g} unablated, {r.n_examples} examples; "
                  f"threshold {r.threshold:.3g} (noise floor {r.floor_text()})", highlight=False, soft_wrap=True)
    console.print("verdicts: " + ", ".join(f"{n} {c}" for c, n in r.counts().items()), highlight=False)
    for note in r.notes[1:]:  # the first says what the effects are; the others are cautions
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    for v in r.verdicts:
        if v.verdict == "redundant":
            console.print(f"  {v.layer}.{v.head} {v.label()}: {v.evidence}", highlight=False, soft_wrap=True)
    if out is not None:
        console.print(f"wrote {out}/ablation.json, {out}/heads.html", highlight=False, soft_wrap=True)


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
