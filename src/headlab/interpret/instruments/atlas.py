"""``atlas``: every head's roles (the kinds of :data:`~headlab.interpret.atlas.kinds.KINDS`), checked causally.

The computation is the atlas room's :func:`~headlab.interpret.atlas.atlas`; this file declares the options of
``headlab atlas``, checks them in the CLI's names and shows the result. The checks come in three steps, each
as early as what it needs allows:

1. options alone (:meth:`HeadAtlas.check` and each :class:`Option`'s check): the kinds asked for, the counts;
2. before the load (:meth:`HeadAtlas.prepare`): ``--texts`` and ``--treebank`` read, and the sizes against the
   model's positions as its config files tell them (:func:`headlab.models.peek.peek_max_positions`, no weights read);
3. once the model is loaded (:meth:`HeadAtlas.check_loaded`): what only the weights tell (its positions when the
   config did not say, a tokenizer or none, its vocabulary, its heads, the needle trial's own tokens).

**The units are the atlas's phases** (:class:`~headlab.interpret.atlas.run.AtlasRun`: repeated tokens, OV
copying, natural text, each kind with its own input, each task's causal checks, the evidence maps). A unit
reads the values of the units before it (``ctx.kept``: a check gates the top heads of the scores), and every
value is JSON, so the runner keeps the finished phases on Ctrl-C (``--out/atlas.json`` says
``"interrupted"``) and ``--resume`` runs only the rest, to the numbers of a run in one go (every random choice
is seeded from ``--seed`` where it is made).

**Why every rank runs every unit** (``parallel = "inside"``): the causal checks and the evidence maps read the
scores of every earlier phase on every rank (each rank gates its share of a check's configurations on the top
heads), while the runner's split gathers the units' values on rank 0 only, at the end; and on a model sharded
by tensor parallelism each score phase is a collective of its group. So under torchrun each unit splits its own
work over the ranks (the needle trials, the checks' configurations: :mod:`headlab.interpret.atlas.run`).
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas.kinds import KINDS
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
from headlab.models.peek import peek_max_positions
from headlab.results import print_json

MAX_DRAWS = 1000  # --draws: random head sets gated per check


def _reading(*inputs: str) -> list[str]:
    """The kinds that read these inputs (``Kind.reads``): "repeated" is sized by --half, "text" and "needles"
    by --max-tokens and --haystack."""
    return [name for name, kd in KINDS.items() if kd.reads in inputs]


def _checked_on(task: str) -> list[str]:
    """The kinds whose causal check runs the task of this name ("text": the natural-text pieces)."""
    return [name for name, kd in KINDS.items() if kd.task is not None and kd.task.name == task]


def parse_kinds(spec: str | None) -> list[str] | None:
    """``--kinds "induction, sink"`` -> ``["induction", "sink"]`` (None: every kind the model allows); an
    unknown kind or an empty list is refused, naming the kinds there are."""
    if spec is None:
        return None
    asked = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in asked if k not in KINDS]
    if bad or not asked:
        raise ConfigError(
            f"--kinds: unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from {', '.join(KINDS)}"
        )
    return asked


def _draws(value, option: Option, options: dict) -> None:
    at_least(1)(value, option, options)
    if value > MAX_DRAWS:  # 10**12 loaded the model, then gated random head sets without end
        raise ConfigError(
            f"{option.label} must be at most {MAX_DRAWS:,} (random draws per check, a forward each; "
            f"10 is the default), got {value:,}"
        )


def _check_kinds(value, option: Option, options: dict) -> None:
    kinds = parse_kinds(value)
    assert kinds is not None  # a given --kinds (validate skips None)
    on_treebank = [k for k in kinds if k in _reading("treebank")]
    if on_treebank and options.get("treebank") is None:
        raise ConfigError(
            f"--kinds {on_treebank[0]} needs --treebank FILE.conllu (the dependency trees it is checked on)"
        )


def check_positions(
    model: str,
    limit: int | None,
    kinds: list[str] | None,
    *,
    half: int,
    max_tokens: int,
    haystack: int | None = None,
    room: int = 0,
    specials: int | None = None,
) -> None:
    """Sizes past the model's positions, refused with the limit (``limit`` None: not known yet).
    ``specials``: the special tokens around a sequence (None before the load: the tokenizer is not read
    yet, so only what is past the limit without them is refused, and the advice leaves room for 2)."""
    if limit is None:
        return
    todo = set(kinds) if kinds is not None else None
    if (todo is None or todo & set(_reading("repeated"))) and 2 * half + (specials or 0) > limit:
        more = (
            " plus the special tokens"
            if specials is None
            else f" plus {specials} special token{'s' if specials > 1 else ''}"
            if specials
            else ""
        )
        raise ConfigError(
            f"--half {half}: the repeated sequences are 2 x {half} tokens{more}, past the {limit:,} "
            f"positions of {model}; give --half {(limit - (2 if specials is None else specials)) // 2} "
            "or less"
        )
    if (todo is None or todo & set(_reading("text", "needles"))) and max_tokens > limit:
        raise ConfigError(
            f"--max-tokens {max_tokens} is past the {limit:,} positions of {model}; give --max-tokens {limit} or less"
        )
    if haystack is not None and (todo is None or todo & set(_reading("needles"))) and haystack + room > limit:
        raise ConfigError(
            f"--haystack {haystack}: a needle trial adds {room} tokens to it (the needle, the question "
            f"and the answer), past the {limit:,} positions of {model}; give --haystack "
            f"{limit - room} or less"
        )


def _check_treebank(path: Path) -> None:
    """The treebank read now (it is small next to a model), so a bad file stops the command before the load.
    Read by the probing room's reader (over :mod:`headlab.reading`), whose messages name the file's line."""
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


def _ids_if_needed(loaded, texts: list[str]) -> list:
    """A model without a tokenizer reads the file as lines of space-separated token ids."""
    if getattr(loaded, "tokenizer", None) is not None:
        return texts
    from headlab.interpret.heads.examples import token_ids_if_needed

    try:
        return token_ids_if_needed(loaded, [ln for ln in texts[0].splitlines() if ln.strip()])
    except InputError as e:
        raise InputError(f"--texts: {e}") from None


def _needle_room(adapter, loaded, texts, needles: int, seed: int) -> int | None:
    """Tokens a needle trial adds to its haystack (needle, question, answer), measured on the trials the
    atlas will build with a haystack of 8; None when they cannot be built (the atlas then says why)."""
    from headlab.errors import HeadlabError
    from headlab.interpret.atlas import scores as S
    from headlab.interpret.atlas import tasks as T

    try:
        vocab = S.embeddings(adapter.model)[0].shape[0]
        trials = T.needles(
            getattr(loaded, "tokenizer", None), texts=texts, n=needles, haystack_tokens=8, seed=seed, vocab=vocab
        )
    except HeadlabError:
        return None
    return max(len(t.ids) + len(t.answer) for t in trials) - 8  # the check reads the prompt and the whole answer


def check_loaded(
    loaded,
    model: str,
    kinds,
    *,
    texts,
    checks: bool,
    half: int,
    max_tokens: int,
    n_texts: int,
    haystack: int,
    needles: int,
    top_k,
    seed: int,
) -> None:
    """What only the loaded model tells (its positions when the config did not say, decoder or not, its
    heads), checked in the CLI's names before the work."""
    from headlab.interpret.atlas import scores as S
    from headlab.interpret.atlas import tasks as T
    from headlab.models.loader import resolve

    adapter, _ = resolve(loaded)
    text_kinds = _reading("text", "needles")
    if getattr(loaded, "tokenizer", None) is None and texts is None and (kinds is None or set(kinds) & set(text_kinds)):
        raise InputError(
            f"{model} has no tokenizer: give --texts FILE with lines of space-separated token ids (the "
            f"natural text of {', '.join(text_kinds)}), or --kinds without those"
        )
    if texts is not None and texts and not isinstance(texts[0], str):  # token-id lines: inside the vocabulary
        V = S.embeddings(adapter.model)[0].shape[0]
        for i, ids in enumerate(texts):
            bad = [x for x in ids if not 0 <= x < V]
            if bad:
                raise InputError(
                    f"--texts example {i + 1}: token id {bad[0]} is outside the vocabulary of {model} (0..{V - 1})"
                )
    limit = getattr(loaded, "max_positions", None)
    needles_run = adapter.causal and (kinds is None or bool(set(kinds) & set(_reading("needles"))))
    room = _needle_room(adapter, loaded, texts, needles, seed) if needles_run and limit is not None else None
    specials = sum(map(len, T._specials(getattr(loaded, "tokenizer", None))))
    check_positions(
        model,
        limit,
        kinds,
        half=half,
        max_tokens=max_tokens,
        haystack=haystack if room is not None else None,
        room=room or 0,
        specials=specials,
    )
    on_text = _checked_on("text")
    if checks and (kinds is None or set(on_text) & set(kinds)):
        pieces = len(T.natural(getattr(loaded, "tokenizer", None), texts, max_tokens=max_tokens, n=n_texts))
        if pieces < 2:
            raise InputError(
                f"the {' and '.join(on_text)} checks need at least 2 pieces of text for their bootstrap; "
                f"{'--texts' if texts is not None else 'the shipped passage'} gives {pieces} of at most "
                f"--max-tokens {max_tokens} tokens with --n-texts {n_texts}: give more text, a smaller "
                "--max-tokens, --n-texts 2 or more, or --no-checks"
            )
    if checks and needles_run and needles < 2:
        names = " and ".join(_checked_on("needle"))
        raise ConfigError(
            f"--needles {needles}: the {names} check needs at least 2 trials for its bootstrap interval; "
            "give --needles 2 or more, or --no-checks"
        )
    total = sum(adapter.layer_heads)
    if top_k is not None and top_k >= total:
        raise ConfigError(f"--top-k {top_k}: {model} has {total} heads; gate at most {total - 1} per check")


@register
class HeadAtlas(Instrument):
    """Every head scored on every kind of the literature, the top heads of each gated against random ones."""

    name = "atlas"
    kind = "head_atlas"
    summary = """Score every head on every head type of the literature and gate the top heads of each against random ones.

Example: headlab atlas --model smollm2 --out atlas-smollm2

Interrupted (Ctrl-C), the finished phases stay in DIR/atlas.json; the same command with --resume runs only
the rest. Data-parallel with torchrun: `torchrun --nproc-per-node 2 -m headlab atlas ...` splits the needle
trials and the checks' configurations across the processes; rank 0 shows the progress and writes the output."""
    options = (
        Option("model", "--model", str, "minilm", "a known model name (minilm, smollm2) or a model folder", short="-m"),
        Option(
            "kinds",
            "--kinds",
            str,
            None,
            f"comma-separated kinds (default: all the model allows): {', '.join(KINDS)}",
            short="-k",
            check=_check_kinds,
        ),
        # read whole by prepare (not reads="texts", one text per line): the atlas cuts its pieces from the file's
        # text as it is, and a model without a tokenizer reads its lines as token ids
        Option(
            "texts",
            "--texts",
            Path,
            None,
            "natural text for sink/local/needle (default: a shipped "
            "public-domain passage); token-id lines for a model without a tokenizer",
        ),
        Option("treebank", "--treebank", Path, None, "a CoNLL-U file: adds the syntactic kind", short="-t"),
        Option("out", "--out", Path, REQUIRED, "folder for atlas.json and atlas.html", short="-o", setting=False),
        Option("force", "--force", bool, False, "write into a non-empty --out folder", setting=False),
        Option("checks", "--checks", bool, True, "run the causal checks (gating heads)", off="--no-checks"),
        Option(
            "top_k", "--top-k", int, None, "heads gated per check (default 5% of the heads, 1 to 10)", check=at_least(1)
        ),
        Option("draws", "--draws", int, 10, "random draws per check", check=_draws),
        Option("half", "--half", int, 50, "length of the repeated half of the random sequences", check=at_least(2)),
        Option("n_texts", "--n-texts", int, 4, "natural-text pieces", check=at_least(1)),
        Option("max_tokens", "--max-tokens", int, 128, "tokens per natural-text piece", check=at_least(8)),
        Option("needles", "--needles", int, 4, "needle-in-a-haystack trials", check=at_least(1)),
        Option("haystack", "--haystack", int, 256, "haystack tokens per needle trial", check=at_least(8)),
        Option("seed", "--seed", int, 0, check=at_least(0)),
        Option("as_json", "--json", bool, False, "print the summary as JSON", setting=False),
    )
    output = Output("out", folder=True, file="atlas.json", force="force")
    resumable = True  # Ctrl-C keeps the finished phases in atlas.json; --resume runs the rest
    # every rank runs every phase, and a phase splits its needle trials and check configurations over the ranks:
    # the checks read every earlier phase's scores on every rank (see the module's docstring)
    parallel = "inside"
    stage = "atlas phases"  # the runner's count of the phases, beside each phase's own progress

    def check(self, ctx: Context) -> None:
        ctx.state["kinds"] = parse_kinds(ctx.options["kinds"])

    def prepare(self, ctx: Context) -> None:
        from headlab.reading import read_file

        o = ctx.options
        ctx.data["texts"] = (
            None
            if o["texts"] is None
            else [read_file(o["texts"], "--texts", "texts", what="a plain-text file (UTF-8)")]
        )
        if o["treebank"] is not None:
            _check_treebank(o["treebank"])
        limit = peek_max_positions(o["model"])  # from the config files alone: no weights read
        check_positions(o["model"], limit, ctx.state["kinds"], half=o["half"], max_tokens=o["max_tokens"])

    def check_loaded(self, ctx: Context) -> None:
        o, raw = ctx.options, ctx.data["texts"]
        ctx.state["texts"] = texts = None if raw is None else _ids_if_needed(ctx.loaded, raw)
        check_loaded(
            ctx.loaded,
            o["model"],
            ctx.state["kinds"],
            texts=texts,
            checks=o["checks"],
            half=o["half"],
            max_tokens=o["max_tokens"],
            n_texts=o["n_texts"],
            haystack=o["haystack"],
            needles=o["needles"],
            top_k=o["top_k"],
            seed=o["seed"],
        )
        from headlab.interpret.atlas.run import AtlasRun  # looked up at call time

        ctx.state["atlas"] = AtlasRun(
            ctx.loaded,
            kinds=ctx.state["kinds"],
            texts=texts,
            treebank=o["treebank"],
            checks=o["checks"],
            k=o["top_k"],
            n_draws=o["draws"],
            half=o["half"],
            n_texts=o["n_texts"],
            max_tokens=o["max_tokens"],
            needle_trials=o["needles"],
            haystack_tokens=o["haystack"],
            seed=o["seed"],
            say=ctx.progress,
        )
        ctx.state["ran"] = []  # the phases this run computes (the others are resumed)

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(key) for key in ctx.state["atlas"].units()]

    def _same_inputs(self, ctx: Context, values: dict) -> None:
        """Phases kept by an earlier run on other inputs (the --texts or --treebank file, or the model's weights,
        changed; the runner has compared the options) are refused."""
        foreign = ctx.state["atlas"].foreign(values)
        if foreign:
            raise InputError(
                f"--resume: {ctx.path} keeps phases ({', '.join(foreign)}) computed from other inputs "
                "(a changed --texts or --treebank file, or other weights); drop --resume to start again"
            )

    def run_unit(self, ctx: Context, unit: Unit, recording=None):
        if not ctx.state["ran"]:
            self._same_inputs(ctx, ctx.kept)
        ctx.state["ran"].append(unit.key)
        return ctx.state["atlas"].unit(unit.key, ctx.kept)  # JSON already: the file keeps it as it is

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        run = ctx.state["atlas"]
        self._same_inputs(ctx, values)
        resumed = [k for k in run.units() if k not in ctx.state["ran"]]
        return InstrumentResult.of(run.finish(values, resumed=resumed, source=ctx.path))

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.interpret.atlas.page import render_page
        from headlab.results import write_json

        a = result.native
        page = path.parent / "atlas.html"
        files = [write_json(path, a.to_json())]
        page.write_text(render_page(a), encoding="utf-8")
        return [*files, page]

    def render(self, ctx: Context, outcome, console, err) -> None:
        a = outcome.result.native
        if ctx.options["as_json"]:
            print_json(a.summary())
            return
        console.print(
            f"{a.model} ({a.family}): {a.n_layers} layers x {a.n_heads} heads; {sum(a.seconds.values()):.1f} s",
            highlight=False,
            soft_wrap=True,
        )
        console.print(
            f"{'kind':<16} {'heads':>5} {'share':>6}  {'check':<14} {'x random':>8}  heads with the role",
            highlight=False,
        )
        for kind, s in a.summary().items():
            v = a.verdicts.get(kind)
            times = "" if v is None or v["times_random"] is None else f"{v['times_random']:.1f}"
            console.print(
                f"{kind:<16} {s['count']:>5} {100 * s['share']:5.1f}%  {(s['verdict'] or '-'):<14} "
                f"{times:>8}  {', '.join(s['heads'][:8]) or '-'}",
                highlight=False,
                soft_wrap=True,
            )
        for k, r in a.skipped.items():  # in the CLI's names
            r = r.replace("treebank=FILE.conllu", "--treebank FILE.conllu")
            console.print(f"[yellow]not run:[/] {k}: {r}", highlight=False, soft_wrap=True)
        if outcome.files:
            console.print(f"[bold]wrote:[/] {outcome.files[0]}, {outcome.files[1]}", highlight=False, soft_wrap=True)


__all__ = ["HeadAtlas", "check_loaded", "check_positions", "parse_kinds"]
