"""The ``headlab atlas`` command (registered on the app when imported): every head's roles, checked causally."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import (app, check_at_least, check_output_dir, console, peek_max_positions, print_json,
                             read_text_file)
from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas.kinds import KINDS
from headlab.progress import reporter
from headlab.results import write_json


def _reading(*inputs: str) -> list[str]:
    """The kinds that read these inputs (``Kind.reads``): "repeated" is sized by --half, "text" and "needles"
    by --max-tokens and --haystack."""
    return [name for name, kd in KINDS.items() if kd.reads in inputs]


def _checked_on(task: str) -> list[str]:
    """The kinds whose causal check runs the task of this name ("text": the natural-text pieces)."""
    return [name for name, kd in KINDS.items() if kd.task is not None and kd.task.name == task]


def _read_texts(path: Path) -> list[str]:
    return [read_text_file(path, "--texts", what="a plain-text file (UTF-8)")]


def _check_counts(*, draws, half, n_texts, max_tokens, needles, haystack, top_k, seed) -> None:
    """The sizes in the CLI's names, before anything is loaded (the library's names are n_draws, k, ...)."""
    for option, value, low in (("--draws", draws, 1), ("--half", half, 2), ("--n-texts", n_texts, 1),
                               ("--max-tokens", max_tokens, 8), ("--needles", needles, 1),
                               ("--haystack", haystack, 8), ("--top-k", top_k, 1), ("--seed", seed, 0)):
        check_at_least(option, value, low)


def _check_positions(model: str, limit: int | None, kinds: list[str] | None, *, half: int, max_tokens: int,
                     haystack: int | None = None, room: int = 0, specials: int | None = None) -> None:
    """Sizes past the model's positions, refused with the limit (``limit`` None: not known yet).
    ``specials``: the special tokens around a sequence (None before the load: the tokenizer is not read
    yet, so only what is past the limit without them is refused, and the advice leaves room for 2)."""
    if limit is None:
        return
    todo = set(kinds) if kinds is not None else None
    if (todo is None or todo & set(_reading("repeated"))) and 2 * half + (specials or 0) > limit:
        more = (" plus the special tokens" if specials is None else
                f" plus {specials} special token{'s' if specials > 1 else ''}" if specials else "")
        raise ConfigError(f"--half {half}: the repeated sequences are 2 x {half} tokens{more}, past the {limit:,} "
                          f"positions of {model}; give --half {(limit - (2 if specials is None else specials)) // 2} "
                          "or less")
    if (todo is None or todo & set(_reading("text", "needles"))) and max_tokens > limit:
        raise ConfigError(f"--max-tokens {max_tokens} is past the {limit:,} positions of {model}; give --max-tokens "
                          f"{limit} or less")
    if haystack is not None and (todo is None or todo & set(_reading("needles"))) and haystack + room > limit:
        raise ConfigError(f"--haystack {haystack}: a needle trial adds {room} tokens to it (the needle, the question "
                          f"and the answer), past the {limit:,} positions of {model}; give --haystack "
                          f"{limit - room} or less")


def _ids_if_needed(loaded, texts: list[str]) -> list:
    """A model without a tokenizer reads the file as lines of space-separated token ids."""
    if getattr(loaded, "tokenizer", None) is not None:
        return texts
    from headlab.interpret.heads.examples import token_ids_if_needed

    try:
        return token_ids_if_needed(loaded, [ln for ln in texts[0].splitlines() if ln.strip()])
    except InputError as e:
        raise InputError(f"--texts: {e}") from None


def _check_treebank(path: Path) -> None:
    """The treebank read now (it is small next to a model), so a bad file stops the command before the load."""
    from headlab.errors import TreebankError
    from headlab.interpret.probing.treebank import read_treebank

    p = Path(path).expanduser()
    if p.is_dir():
        raise InputError(f"--treebank {str(p)!r} is a folder; give a CoNLL-U file (.conllu)")
    if not p.is_file():
        why = "is not a regular file" if p.exists() else "does not exist"
        raise InputError(f"--treebank {str(p)!r} {why}; give a CoNLL-U file (.conllu)")
    try:
        read_treebank(p, limit=200)
    except TreebankError as e:
        raise InputError(f"--treebank: {e}") from None


def _needle_room(adapter, loaded, texts, needles: int, seed: int) -> int | None:
    """Tokens a needle trial adds to its haystack (needle, question, answer), measured on the trials the
    atlas will build with a haystack of 8; None when they cannot be built (the atlas then says why)."""
    from headlab.errors import HeadlabError
    from headlab.interpret.atlas import scores as S
    from headlab.interpret.atlas import tasks as T

    try:
        vocab = S.embeddings(adapter.model)[0].shape[0]
        trials = T.needles(getattr(loaded, "tokenizer", None), texts=texts, n=needles, haystack_tokens=8, seed=seed,
                           vocab=vocab)
    except HeadlabError:
        return None
    return max(len(t.ids) + len(t.answer) for t in trials) - 8  # the check reads the prompt and the whole answer


def _check_loaded(loaded, model: str, kinds, *, texts, checks: bool, half: int, max_tokens: int, n_texts: int,
                  haystack: int, needles: int, top_k, seed: int) -> None:
    """What only the loaded model tells (its positions when the config did not say, decoder or not, its
    heads), checked in the CLI's names before the work."""
    from headlab.models.loader import resolve

    adapter, _ = resolve(loaded)
    text_kinds = _reading("text", "needles")
    if getattr(loaded, "tokenizer", None) is None and texts is None and (kinds is None or set(kinds) & set(text_kinds)):
        raise InputError(f"{model} has no tokenizer: give --texts FILE with lines of space-separated token ids (the "
                         f"natural text of {', '.join(text_kinds)}), or --kinds without those")
    if texts is not None and texts and not isinstance(texts[0], str):  # token-id lines: inside the vocabulary
        from headlab.interpret.atlas import scores as S

        V = S.embeddings(adapter.model)[0].shape[0]
        for i, ids in enumerate(texts):
            bad = [x for x in ids if not 0 <= x < V]
            if bad:
                raise InputError(f"--texts example {i + 1}: token id {bad[0]} is outside the vocabulary of {model} "
                                 f"(0..{V - 1})")
    limit = getattr(loaded, "max_positions", None)
    needles_run = adapter.causal and (kinds is None or bool(set(kinds) & set(_reading("needles"))))
    room = _needle_room(adapter, loaded, texts, needles, seed) if needles_run and limit is not None else None
    from headlab.interpret.atlas import tasks as T

    specials = sum(map(len, T._specials(getattr(loaded, "tokenizer", None))))
    _check_positions(model, limit, kinds, half=half, max_tokens=max_tokens,
                     haystack=haystack if room is not None else None, room=room or 0, specials=specials)
    on_text = _checked_on("text")
    if checks and (kinds is None or set(on_text) & set(kinds)):
        pieces = len(T.natural(getattr(loaded, "tokenizer", None), texts, max_tokens=max_tokens, n=n_texts))
        if pieces < 2:
            raise InputError(f"the {' and '.join(on_text)} checks need at least 2 pieces of text for their bootstrap; "
                             f"{'--texts' if texts is not None else 'the shipped passage'} gives {pieces} of at most "
                             f"--max-tokens {max_tokens} tokens with --n-texts {n_texts}: give more text, a smaller "
                             "--max-tokens, --n-texts 2 or more, or --no-checks")
    if checks and needles_run and needles < 2:
        names = " and ".join(_checked_on("needle"))
        raise ConfigError(f"--needles {needles}: the {names} check needs at least 2 trials for its bootstrap interval; "
                          "give --needles 2 or more, or --no-checks")
    total = sum(adapter.layer_heads)
    if top_k is not None and top_k >= total:
        raise ConfigError(f"--top-k {top_k}: {model} has {total} heads; gate at most {total - 1} per check")


PARTIAL = "atlas.partial.json"  # the finished phases of an interrupted run; the same command resumes from it


@app.command("atlas")
def atlas_cmd(
    model: str = typer.Option("minilm", "--model", "-m", help="a known model name (minilm, smollm2) or a model folder"),
    kinds: str = typer.Option(None, "--kinds", "-k",
                              help=f"comma-separated kinds (default: all the model allows): {', '.join(KINDS)}"),
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
    from headlab.interpret.atlas import atlas
    from headlab.interpret.atlas.page import render_page
    from headlab.models import load

    asked = None if kinds is None else [k.strip() for k in kinds.split(",") if k.strip()]
    if asked is not None:
        bad = [k for k in asked if k not in KINDS]
        if bad or not asked:
            raise ConfigError(f"--kinds: unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from {', '.join(KINDS)}")
        on_treebank = [k for k in asked if k in _reading("treebank")]
        if on_treebank and treebank is None:
            raise ConfigError(f"--kinds {on_treebank[0]} needs --treebank FILE.conllu (the dependency trees it is "
                              "checked on)")
    _check_counts(draws=draws, half=half, n_texts=n_texts, max_tokens=max_tokens, needles=needles, haystack=haystack,
                  top_k=top_k, seed=seed)
    raw = _read_texts(texts) if texts is not None else None
    if treebank is not None:
        _check_treebank(treebank)
    partial = Path(out).expanduser() / PARTIAL
    resuming = partial.is_file() and len(list(partial.parent.iterdir())) == 1
    out_dir = check_output_dir(out, "--out", force=force or resuming)
    _check_positions(model, peek_max_positions(model), asked, half=half, max_tokens=max_tokens)
    from headlab.distributed.data import init_from_env, is_main

    init_from_env()  # under torchrun: the needle trials and the checks' configurations are split over the ranks
    main = is_main()
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
    loaded = load(model)
    given = None if raw is None else _ids_if_needed(loaded, raw)
    _check_loaded(loaded, model, asked, texts=given, checks=checks, half=half, max_tokens=max_tokens, n_texts=n_texts,
                  haystack=haystack, needles=needles, top_k=top_k, seed=seed)
    with reporter(main, transient=True) as say:  # a bar per phase, on rank 0
        a = atlas(loaded, kinds=asked, texts=given, treebank=treebank,
                  checks=checks, k=top_k, n_draws=draws, half=half, n_texts=n_texts, max_tokens=max_tokens,
                  needle_trials=needles, haystack_tokens=haystack, seed=seed, progress=say,
                  resume=out_dir / PARTIAL)
    if not main:  # rank 0 writes and prints
        return
    write_json(out_dir / "atlas.json", a.to_json())
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
    for k, r in a.skipped.items():  # in the CLI's names
        r = r.replace("treebank=FILE.conllu", "--treebank FILE.conllu")
        console.print(f"[yellow]not run:[/] {k}: {r}", highlight=False, soft_wrap=True)
    console.print(f"[bold]wrote:[/] {out_dir / 'atlas.json'}, {out_dir / 'atlas.html'}", highlight=False, soft_wrap=True)
