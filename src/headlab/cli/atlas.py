"""The ``headlab atlas`` command (registered on the app when imported): every head's roles, checked causally."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer

from headlab.cli.app import app, console, print_json, stage_bar
from headlab.errors import ConfigError, InputError


def _read_texts(path: Path) -> list[str]:
    if not path.is_file():
        raise InputError(f"--texts {str(path)!r} does not exist; give a plain-text file (UTF-8)")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise InputError(f"--texts {str(path)!r} is empty")
    return [text]


def _ids_if_needed(loaded, texts: list[str]) -> list:
    """A model without a tokenizer reads the file as lines of space-separated token ids."""
    if getattr(loaded, "tokenizer", None) is not None:
        return texts
    from headlab.interpret.heads.examples import token_ids_if_needed

    return token_ids_if_needed(loaded, [ln for ln in texts[0].splitlines() if ln.strip()])


PARTIAL = "atlas.partial.json"  # the finished phases of an interrupted run; the same command resumes from it


@app.command("atlas")
def atlas_cmd(
    model: str = typer.Option("minilm", "--model", "-m", help="a known model name (minilm, smollm2) or a model folder"),
    kinds: str = typer.Option(None, "--kinds", "-k",
                              help="comma-separated kinds (default: all the model allows): previous_token, "
                                   "duplicate_token, induction, retrieval, sink, local, syntactic"),
    texts: Path = typer.Option(None, "--texts", help="natural text for sink/local/needle (default: a shipped "
                                                     "public-domain passage); token-id lines for a model without a tokenizer"),
    treebank: Path = typer.Option(None, "--treebank", "-t", help="a CoNLL-U file: adds the syntactic kind"),
    out: Path = typer.Option(..., "--out", "-o", help="folder for atlas.json and atlas.html"),
    force: bool = typer.Option(False, "--force", help="write into a non-empty --out folder"),
    checks: bool = typer.Option(True, "--checks/--no-checks", help="run the causal checks (gating heads)"),
    top_k: int = typer.Option(None, "--top-k", help="heads gated per check (default 5% of the heads, 1 to 10)"),
    draws: int = typer.Option(10, "--draws", help="random draws per check"),
    half: int = typer.Option(50, "--half", help="length of the repeated half of the random sequences"),
    n_texts: int = typer.Option(4, "--n-texts", help="natural-text pieces"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="tokens per natural-text piece"),
    needles: int = typer.Option(4, "--needles", help="needle-in-a-haystack trials"),
    haystack: int = typer.Option(256, "--haystack", help="haystack tokens per needle trial"),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Score every head on every head type of the literature and gate the top heads of each against random ones.

    Example: headlab atlas --model smollm2 --out atlas-smollm2

    Interrupted (Ctrl-C), the finished phases stay in DIR/atlas.partial.json; the same command resumes from them.
    Data-parallel with torchrun: `torchrun --nproc-per-node 2 -m headlab atlas ...` splits the needle trials and
    the checks' configurations across the processes; rank 0 shows the progress and writes the output.
    """
    from headlab.interpret.atlas import KINDS, atlas
    from headlab.interpret.atlas.page import render_page
    from headlab.interpret.probing.render import prepare_out_dir
    from headlab.models import load

    asked = None if kinds is None else [k.strip() for k in kinds.split(",") if k.strip()]
    if asked is not None:
        bad = [k for k in asked if k not in KINDS]
        if bad or not asked:
            raise ConfigError(f"--kinds: unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from {', '.join(KINDS)}")
    raw = _read_texts(texts) if texts is not None else None
    if treebank is not None and not treebank.is_file():
        raise InputError(f"--treebank {str(treebank)!r} does not exist; give a CoNLL-U file (.conllu)")
    from headlab.distributed.data import init_from_env, is_main

    init_from_env()  # under torchrun: the needle trials and the checks' configurations are split over the ranks
    main = is_main()
    partial = Path(out).expanduser() / PARTIAL
    if main:
        prepare_out_dir(out, force=force or (partial.is_file() and len(list(partial.parent.iterdir())) == 1))
    out_dir = Path(out).expanduser()
    loaded = load(model)
    progress, say = stage_bar()
    with progress if main else contextlib.nullcontext():
        a = atlas(loaded, kinds=asked, texts=None if raw is None else _ids_if_needed(loaded, raw), treebank=treebank,
                  checks=checks, k=top_k, n_draws=draws, half=half, n_texts=n_texts, max_tokens=max_tokens,
                  needle_trials=needles, haystack_tokens=haystack, seed=seed, progress=say if main else None,
                  resume=out_dir / PARTIAL)
    if not main:  # rank 0 writes and prints
        return
    (out_dir / "atlas.json").write_text(json.dumps(a.to_json(), indent=1) + "\n", encoding="utf-8")
    (out_dir / "atlas.html").write_text(render_page(a), encoding="utf-8")
    if as_json:
        print_json(a.summary())
        return
    console.print(f"{a.model} ({a.family}): {a.n_layers} layers x {a.n_heads} heads; "
                  f"{sum(a.seconds.values()):.1f} s", highlight=False, soft_wrap=True)
    console.print(f"{'kind':<16} {'heads':>5} {'share':>6}  {'check':<14} {'x random':>8}  heads with the role",
                  highlight=False)
    for kind, s in a.summary().items():
        v = a.verdicts.get(kind)
        times = "" if v is None or v["times_random"] is None else f"{v['times_random']:.1f}"
        console.print(f"{kind:<16} {s['count']:>5} {100 * s['share']:5.1f}%  {(s['verdict'] or '-'):<14} {times:>8}  "
                      f"{', '.join(s['heads'][:8]) or '-'}", highlight=False, soft_wrap=True)
    for k, r in a.skipped.items():
        console.print(f"[yellow]not run:[/] {k}: {r}", highlight=False, soft_wrap=True)
    console.print(f"[bold]wrote:[/] {out_dir / 'atlas.json'}, {out_dir / 'atlas.html'}", highlight=False, soft_wrap=True)
