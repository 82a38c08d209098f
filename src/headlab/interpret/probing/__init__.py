"""Heads that track linguistic relations: Clark et al. (2019), "What Does BERT Look At?", on gold trees.

    import headlab
    r = headlab.probe(headlab.load("minilm"), "en_ewt-ud-dev.conllu")
    r.best_head("det")        # BestHead(relation='det', direction='dep->head', layer=..., accuracy=..., ...)
    r.summary()               # the `headlab probe --json` document

Rooms inside: :mod:`.treebank` (CoNLL-U, multi-word tokens, empty nodes, subtypes), :mod:`.align`
(tokens to words from a fast tokenizer's offsets; word-level attention), :mod:`.gold` (cases,
visibility for decoders, fixed-offset baselines), :mod:`.measures` (attention to [CLS]/[SEP]/
punctuation/neighbours, entropy, the gradient test, the Jensen-Shannon head map), :mod:`.study`
(:func:`probe`), :mod:`.result` (:class:`ProbeResult`, :func:`head_annotations`), :mod:`.render`
(the PNGs and the HTML page).
"""

from headlab.interpret.probing.head_scores import probe
from headlab.interpret.probing.probe_result import BestHead, ProbeResult, head_annotations
from headlab.interpret.probing.treebank import Sentence, Treebank, read_treebank

__all__ = ["BestHead", "ProbeResult", "Sentence", "Treebank", "head_annotations", "probe", "read_treebank"]
