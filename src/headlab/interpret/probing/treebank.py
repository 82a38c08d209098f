"""Gold dependency trees from a CoNLL-U file: :func:`read_treebank` returns a :class:`Treebank`.

CoNLL-U (https://universaldependencies.org/format.html) has one line per syntactic word with ten
tab-separated columns ``ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC``, comments starting
with ``#`` (``# sent_id = ...``, ``# text = ...``) and a blank line after each sentence. Two kinds of
lines are not syntactic words, as UD defines them:

- a multi-word token ``3-4 don't`` is the surface form of the words 3 and 4 (``do``, ``n't``). The
  text holds the surface form once; when the words' forms spell it (``do`` + ``n't``), each word
  gets its own part of the surface characters, otherwise (French ``du`` = ``de`` + ``le``) every
  word of the token gets the whole token.
- an empty node ``8.1`` exists only in the enhanced graph (column DEPS) and has no surface form:
  it is skipped. The basic tree (HEAD, DEPREL) never points at one.

Relation subtypes (``nmod:poss``, ``obl:tmod``) are kept; ``fold_subtypes=True`` folds them to the
base relation (``nmod``). A sentence whose HEAD column is not a tree (a cycle, no root, two roots,
a head outside the sentence) is skipped and counted with its id in :attr:`Treebank.skipped`; a
file that is not CoNLL-U raises :class:`~headlab.errors.TreebankError` naming the line and why.

    >>> import tempfile, os
    >>> text = '''# sent_id = s1
    ... # text = The cat sat.
    ... 1\\tThe\\tthe\\tDET\\t_\\t_\\t2\\tdet\\t_\\t_
    ... 2\\tcat\\tcat\\tNOUN\\t_\\t_\\t3\\tnsubj\\t_\\t_
    ... 3\\tsat\\tsit\\tVERB\\t_\\t_\\t0\\troot\\t_\\tSpaceAfter=No
    ... 4\\t.\\t.\\tPUNCT\\t_\\t_\\t3\\tpunct\\t_\\t_
    ...
    ... '''
    >>> path = os.path.join(tempfile.mkdtemp(), "t.conllu")
    >>> _ = open(path, "w").write(text)
    >>> tb = read_treebank(path)
    >>> s = tb.sentences[0]
    >>> s.words, s.heads.tolist(), s.relations, s.spans
    (('The', 'cat', 'sat', '.'), [1, 2, -1, 2], ('det', 'nsubj', 'root', 'punct'), ((0, 3), (4, 7), (8, 11), (11, 12)))
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from headlab.errors import TreebankError
from headlab.reading import Conllu, read_conllu

ROOT = "root"


def fold(relation: str) -> str:
    """``"nmod:poss" -> "nmod"``; a relation without a subtype is returned as is."""
    return relation.split(":", 1)[0]


@dataclass(frozen=True)
class Sentence:
    """One sentence's basic tree over its syntactic words (0-based indices).

    Attributes:
        sent_id: ``# sent_id`` (or ``"line N"`` when the file has none).
        text: the surface text (``# text``, or rebuilt from the forms and ``SpaceAfter=No``).
        words: the forms of the syntactic words, in order.
        heads: ``(n,)`` int, the index of each word's head; ``-1`` for the root.
        relations: each word's DEPREL (folded when the treebank was read with ``fold_subtypes``).
        upos: each word's universal part of speech (``PUNCT`` marks punctuation).
        spans: each word's ``(start, end)`` characters in ``text``.
        line: the line of the sentence's first word in the file.
    """

    sent_id: str
    text: str
    words: tuple[str, ...]
    heads: np.ndarray
    relations: tuple[str, ...]
    upos: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    line: int

    def __len__(self) -> int:
        return len(self.words)


@dataclass(frozen=True)
class Skipped:
    """A sentence left out of the study, and why."""

    sent_id: str
    reason: str


@dataclass
class Treebank:
    """The sentences of a CoNLL-U file whose basic trees are trees, and the ones skipped."""

    path: str
    sentences: list[Sentence]
    skipped: list[Skipped] = field(default_factory=list)
    fold_subtypes: bool = False

    def relation_counts(self) -> Counter:
        """How often each relation occurs (``root`` excluded: it has no head word)."""
        return Counter(r for s in self.sentences for r in s.relations if r != ROOT)


def _surface_spans(text: str | None, surface: list[tuple[str, bool]]) -> tuple[str, list[tuple[int, int]]]:
    """Find each surface token in ``text`` in order; rebuild the text from the forms when they are not
    all there (``surface``: ``(form, space_after)``)."""
    if text is not None:
        spans, pos = [], 0
        for form, _ in surface:
            i = text.find(form, pos)
            if i < 0 or text[pos:i].strip():
                break
            spans.append((i, i + len(form)))
            pos = i + len(form)
        else:
            return text, spans
    parts, spans, pos = [], [], 0
    for form, space in surface:
        spans.append((pos, pos + len(form)))
        parts.append(form + (" " if space else ""))
        pos += len(form) + (1 if space else 0)
    return "".join(parts).rstrip(), spans


def _tree_problem(heads: np.ndarray) -> str | None:
    """Why ``heads`` (-1 = root) is not a tree, or None."""
    n = len(heads)
    roots = np.flatnonzero(heads == -1)
    if len(roots) == 0:
        return "no root (no word has HEAD 0)"
    if len(roots) > 1:
        return f"{len(roots)} roots (words {', '.join(str(r + 1) for r in roots)} have HEAD 0)"
    bad = np.flatnonzero(heads >= n)
    if len(bad):
        return f"word {bad[0] + 1} has HEAD {heads[bad[0]] + 1}, outside the sentence's {n} words"
    for start in range(n):
        seen, w = set(), start
        while w != -1:
            if w in seen:
                return f"cycle through word {w + 1}"
            seen.add(w)
            w = int(heads[w])
    return None


def _sentence(path: str, block: list[tuple[int, str]], *, fold_subtypes: bool) -> Sentence | Skipped:
    import conllu

    comments = "\n".join(line for _, line in block if line.startswith("#"))
    body = [(n, line) for n, line in block if not line.startswith("#")]
    first = body[0][0] if body else block[0][0]
    meta_id = re.search(r"^# sent_id\s*=\s*(.+)$", comments, re.M)
    sent_id = meta_id.group(1).strip() if meta_id else f"line {first}"
    if not body:
        raise TreebankError(f"{path}:{block[0][0]}: not CoNLL-U: a sentence of comments only (no word lines)")
    try:
        tokens = conllu.parse("\n".join(line for _, line in block) + "\n\n")[0]
    except Exception as e:  # noqa: BLE001  (conllu raises ParseException and ValueError)
        raise TreebankError(f"{path}:{first}: not CoNLL-U: {e}") from None
    text = tokens.metadata.get("text")
    words: list[str] = []
    heads: list[int] = []
    rels: list[str] = []
    upos: list[str] = []
    parents: list[int] = []
    word_lines: list[int] = []
    surface: list[tuple[str, bool]] = []
    ranges: dict[int, tuple[int, int]] = {}  # first word -> (last word, surface index)
    lines = iter(body)
    for tok in tokens:
        lineno = next(lines)[0]
        tid, misc = tok["id"], tok["misc"] or {}
        space = misc.get("SpaceAfter") != "No"
        if isinstance(tid, tuple) and tid[1] == "-":
            ranges[tid[0]] = (tid[2], len(surface))
            surface.append((tok["form"], space))
            continue
        if isinstance(tid, tuple):  # empty node: enhanced graph only
            continue
        if tid != len(words) + 1:
            raise TreebankError(
                f"{path}:{lineno}: not CoNLL-U: word id {tid} follows word {len(words)} "
                "(word ids count 1, 2, 3, ... in each sentence)"
            )
        if tok["head"] is None:
            return Skipped(sent_id, f"word {tid} has no HEAD (the sentence has no basic tree)")
        inside = next((start for start, (end, _) in ranges.items() if start <= tid <= end), None)
        if inside is None:
            parents.append(len(surface))
            surface.append((tok["form"], space))
        else:
            parents.append(ranges[inside][1])
        words.append(tok["form"])
        heads.append(int(tok["head"]) - 1)
        rel = tok["deprel"] or "_"
        rels.append(fold(rel) if fold_subtypes else rel)
        upos.append(tok["upos"] or "_")
        word_lines.append(lineno)
    if not words:
        raise TreebankError(f"{path}:{first}: not CoNLL-U: a sentence without words (only ranges or empty nodes)")
    head_arr = np.asarray(heads, dtype=np.int64)
    problem = _tree_problem(head_arr)
    if problem is not None:
        return Skipped(sent_id, problem)
    text, sspans = _surface_spans(text, surface)
    spans = _word_spans(words, parents, surface, sspans)
    return Sentence(sent_id, text, tuple(words), head_arr, tuple(rels), tuple(upos), tuple(spans), first)


def _word_spans(words, parents, surface, sspans) -> list[tuple[int, int]]:
    """Each word's characters: its own surface token's, or its share of a multi-word token's."""
    spans: list[tuple[int, int] | None] = [None] * len(words)
    by_parent: dict[int, list[int]] = {}
    for w, p in enumerate(parents):
        by_parent.setdefault(p, []).append(w)
    for p, ws in by_parent.items():
        start, end = sspans[p]
        if len(ws) == 1:
            spans[ws[0]] = (start, end)
            continue
        if "".join(words[w] for w in ws).lower() == surface[p][0].lower():  # do + n't = don't
            pos = start
            for w in ws:
                spans[w] = (pos, pos + len(words[w]))
                pos += len(words[w])
        else:  # du = de + le: every word is the whole token
            for w in ws:
                spans[w] = (start, end)
    return spans  # type: ignore[return-value]  # every word's span is filled by the loop above


def read_treebank(
    path: str | os.PathLike | Conllu, *, fold_subtypes: bool = False, limit: int | None = None, option: str = ""
) -> Treebank:
    """Read the sentences of a CoNLL-U file (see the module docstring).

    Args:
        path: the ``.conllu`` file, or the file as :func:`headlab.reading.read_conllu` already read it (so a
            command that checked it before the load builds the trees without reading it again).
        fold_subtypes: ``nmod:poss`` -> ``nmod`` etc.
        limit: read at most this many sentences (skipped ones included), from the top.
        option: the option that named the file, for messages (``--treebank``).

    Raises:
        TreebankError: the file is missing, empty, or not CoNLL-U (the message names the line).
    """
    if limit is not None and limit < 1:
        raise TreebankError(f"limit must be at least 1 sentence, got {limit}")
    read = path if isinstance(path, Conllu) else read_conllu(path, option, limit=limit)
    where = os.fspath(read.path)
    sentences: list[Sentence] = []
    skipped: list[Skipped] = []
    for block in read.sentences[:limit]:
        got = _sentence(where, block, fold_subtypes=fold_subtypes)
        if isinstance(got, Sentence):
            sentences.append(got)
        else:
            skipped.append(got)
    if not sentences:
        raise TreebankError(
            f"{where}: none of its {len(skipped)} sentences has a valid tree; first: "
            f"{skipped[0].sent_id}: {skipped[0].reason}"
        )
    return Treebank(where, sentences, skipped, fold_subtypes)


__all__ = ["ROOT", "Sentence", "Skipped", "Treebank", "fold", "read_treebank"]
