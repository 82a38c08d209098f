"""The text form of masks (``headlab pattern``, ``--pattern`` options): :func:`from_string`, and
the one table of pattern names, :func:`pattern_names`."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from headlab.errors import ConfigError
from headlab.spec.masks.algebra import MaskFn, causal, causal_lower_right, full, padding
from headlab.spec.masks.layouts import bigbird, documents, global_tokens
from headlab.spec.masks.patterns import dilated_window, fixed, sliding_window, strided

__all__ = ["from_string", "pattern", "pattern_names"]

_PATTERNS: dict[str, Callable[..., MaskFn]] = {
    "full": full,
    "causal": causal,
    "causal_lower_right": causal_lower_right,
    "padding": padding,
    "sliding_window": sliding_window,
    "dilated_window": dilated_window,
    "strided": strided,
    "fixed": fixed,
    "global_tokens": global_tokens,
    "bigbird": bigbird,
    "documents": documents,
}


def pattern_names() -> list[str]:
    """Names :func:`from_string` understands (``block_layout`` needs a tensor, so it is not one)."""
    return list(_PATTERNS)


def pattern(name: str) -> Callable[..., MaskFn]:
    """The constructor of the pattern called ``name`` (the one table the text form and the CLI read).

    >>> from headlab import masks
    >>> masks.pattern("sliding_window") is masks.sliding_window
    True
    """
    try:
        return _PATTERNS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown mask pattern {name!r}; known patterns: {', '.join(_PATTERNS)} "
            "(or a spec such as 'sliding_window:4&causal')"
        ) from None


def _parse_arg(text: str, spec: str):
    t = text.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        if "," in t:
            return [int(x) for x in t.split(",") if x.strip() != ""]
        return int(t)
    except ValueError:
        raise ConfigError(
            f"cannot read {text!r} in mask spec {spec!r}: arguments are integers, "
            "comma-separated integer lists, true/false or name=value"
        ) from None


def _build_term(term: str, spec: str) -> MaskFn:
    parts = [p.strip() for p in term.split(":")]
    name = parts[0]
    if name not in _PATTERNS:
        raise ConfigError(f"unknown mask pattern {name!r} in {spec!r}; known patterns: {', '.join(_PATTERNS)}")
    ctor = _PATTERNS[name]
    params = inspect.signature(ctor).parameters
    args, kwargs = [], {}
    for p in parts[1:]:
        if "=" in p:
            key, _, val = p.partition("=")
            kwargs[key.strip()] = _parse_arg(val, spec)
        elif p in params and params[p].default is False:  # a bare flag such as "causal"
            kwargs[p] = True
        else:
            args.append(_parse_arg(p, spec))
    try:
        inspect.signature(ctor).bind(*args, **kwargs)
    except TypeError as e:
        usage = ":".join([name, *params])
        raise ConfigError(
            f"mask spec {term!r} does not fit {name}({', '.join(params)}): {e}; write it as {usage}"
        ) from None
    return ctor(*args, **kwargs)


def from_string(text: str) -> MaskFn:
    """Build a mask from a command-line spec.

    Grammar: a pattern is ``name`` followed by ``:``-separated arguments in the order of the
    constructor's parameters (integers, comma lists such as ``0,5,9``, ``true``/``false``,
    ``name=value``, or a bare flag name such as ``causal``). Patterns combine with ``&``
    (both), ``|`` (either) and ``~`` (not); ``&`` binds tighter than ``|``; parentheses group.
    Spaces are ignored.

        sliding_window:256            |i - j| <= 256
        sliding_window:256:causal     0 <= i - j <= 256   (same as sliding_window:256&causal)
        dilated_window:128:2          Longformer dilated window
        strided:64   fixed:64:4       Sparse Transformer patterns (causal, as in the paper)
        bigbird:64:3:2:2:0            block, window_blocks, global_blocks, random_blocks, seed
        sliding_window:128|global_tokens:0,1
        documents:100,200,300&causal

        >>> from headlab import masks
        >>> m = masks.from_string("sliding_window:1 & causal")
        >>> m.dense(q_len=4)[0, 0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 1, 1, 0],
                [0, 0, 1, 1]], dtype=torch.int32)
        >>> masks.from_string("banana:3")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        headlab.errors.ConfigError: unknown mask pattern 'banana' in 'banana:3'; known patterns: full, causal, ...
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"a mask spec must be a non-empty string such as 'sliding_window:256', got {text!r}")
    spec = text
    tokens: list[str] = []
    buf = ""
    for ch in text.replace(" ", ""):
        if ch in "&|~()":
            if buf:
                tokens.append(buf)
                buf = ""
            tokens.append(ch)
        else:
            buf += ch
    if buf:
        tokens.append(buf)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        tok = peek()
        pos += 1
        return tok

    def expr():
        m = conj()
        while peek() == "|":
            take()
            m = m | conj()
        return m

    def conj():
        m = unary()
        while peek() == "&":
            take()
            m = m & unary()
        return m

    def unary():
        tok = take()
        if tok == "~":
            return ~unary()
        if tok == "(":
            m = expr()
            if take() != ")":
                raise ConfigError(f"unbalanced parentheses in mask spec {spec!r}")
            return m
        if tok is None or tok in "&|)":
            raise ConfigError(f"mask spec {spec!r} is missing a pattern (near {tok or 'the end'!r})")
        return _build_term(tok, spec)

    m = expr()
    if pos != len(tokens):
        raise ConfigError(f"unexpected {tokens[pos]!r} in mask spec {spec!r}; combine patterns with & | ~")
    return m
