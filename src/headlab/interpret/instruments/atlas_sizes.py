"""``headlab atlas``: the atlas's sizes against what the model allows, checked in the command's names before any
phase runs.

Two steps of the command's checks (:mod:`headlab.interpret.instruments.atlas` runs them): before the load,
:func:`check_positions` against the model's positions as its config files tell them; once it is loaded,
:func:`check_loaded` against what only the weights tell (its positions when the config did not say, a tokenizer or
none, its vocabulary, its heads, the tokens a needle trial adds to its haystack, the pieces its text gives).
``headlab.atlas()`` keeps its own checks (:class:`~headlab.interpret.atlas.run.AtlasRun`, in its arguments' names).
"""

from __future__ import annotations

from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas.kinds import KINDS


def kinds_reading(*inputs: str) -> list[str]:
    """The kinds that read these inputs (``Kind.reads``): "repeated" is sized by --half, "text" and "needles"
    by --max-tokens and --haystack."""
    return [name for name, kd in KINDS.items() if kd.reads in inputs]


def kinds_checked_on(task: str) -> list[str]:
    """The kinds whose causal check runs the task of this name ("text": the natural-text pieces)."""
    return [name for name, kd in KINDS.items() if kd.task is not None and kd.task.name == task]


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
    if (todo is None or todo & set(kinds_reading("repeated"))) and 2 * half + (specials or 0) > limit:
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
    if (todo is None or todo & set(kinds_reading("text", "needles"))) and max_tokens > limit:
        raise ConfigError(
            f"--max-tokens {max_tokens} is past the {limit:,} positions of {model}; give --max-tokens {limit} or less"
        )
    if haystack is not None and (todo is None or todo & set(kinds_reading("needles"))) and haystack + room > limit:
        raise ConfigError(
            f"--haystack {haystack}: a needle trial adds {room} tokens to it (the needle, the question "
            f"and the answer), past the {limit:,} positions of {model}; give --haystack "
            f"{limit - room} or less"
        )


def needle_room(adapter, loaded, texts, needles: int, seed: int) -> int | None:
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
    text_kinds = kinds_reading("text", "needles")
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
    needles_run = adapter.causal and (kinds is None or bool(set(kinds) & set(kinds_reading("needles"))))
    room = needle_room(adapter, loaded, texts, needles, seed) if needles_run and limit is not None else None
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
    on_text = kinds_checked_on("text")
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
        names = " and ".join(kinds_checked_on("needle"))
        raise ConfigError(
            f"--needles {needles}: the {names} check needs at least 2 trials for its bootstrap interval; "
            "give --needles 2 or more, or --no-checks"
        )
    total = sum(adapter.layer_heads)
    if top_k is not None and top_k >= total:
        raise ConfigError(f"--top-k {top_k}: {model} has {total} heads; gate at most {total - 1} per check")


__all__ = ["check_loaded", "check_positions", "kinds_checked_on", "kinds_reading", "needle_room"]
