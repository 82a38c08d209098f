"""The head atlas: every published head type scored by its paper's definition, each label checked causally.

:func:`atlas` returns an :class:`Atlas`: ``scores[kind]`` a ``(layers, heads)`` tensor for each kind,
``verdicts[kind]`` the causal check, ``to_json()`` / ``Atlas.from_json``, and a page (``_repr_html_``,
:func:`~headlab.interpret.atlas.page.render_page`).

================  ==========================================================  =================================
kind              score (a head's mean over the rows named)                   causal task
================  ==========================================================  =================================
previous_token    ``A[i, i-1]``                                               loss on the repeated half
duplicate_token   on random tokens repeated once (T each): ``A[i, i-T]``,     loss on the repeated half
                  second-half rows (Olsson et al. 2022)
induction         ``A[i, i-T+1]``, the same rows; with the OV copying score   loss on the repeated half
retrieval         Wu et al. 2024: share of the needle's answer a head copies  needle accuracy
                  during greedy decoding (top-1 key inside the needle and
                  holding the generated token)
sink              mass on the first token ([CLS] and [SEP] for encoders)      log-perplexity of real text
local             mass within the last w keys (DuoAttention's streaming)      log-perplexity of real text
syntactic         best accuracy margin over the fixed-offset baseline         loss on the dependents of the
                  (the probe, Clark et al. 2019), with a treebank             top heads' relations (decoders)
================  ==========================================================  =================================

Scores come from the map-free statistics (see :mod:`.scores`); the checks gate off the top-k heads of a
kind and k random heads, at least 10 draws, and call a label causal when the targeted effect is at least
3x the random mean and its bootstrap interval clears the random draws' (:mod:`.causal`).

    >>> import torch, headlab
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, causal=True)).eval()
    >>> a = headlab.atlas(m, texts=[list(range(1, 40))], checks=False, half=6, n_repeated=2, needle_trials=1,
    ...                   haystack_tokens=20)
    >>> a.kinds, tuple(a.scores["induction"].shape)
    (['previous_token', 'duplicate_token', 'induction', 'retrieval', 'sink', 'local'], (2, 4))
"""

from headlab.interpret.atlas.result import KINDS, Atlas, Thresholds
from headlab.interpret.atlas.run import atlas

__all__ = ["KINDS", "Atlas", "Thresholds", "atlas"]
