"""The head atlas: every published head type scored by its paper's definition, each label checked causally.

:func:`atlas` returns an :class:`Atlas`: ``scores[kind]`` a ``(layers, heads)`` tensor for each kind,
``verdicts[kind]`` the causal check, ``to_json()`` / ``Atlas.from_json``, and a page (``_repr_html_``,
:func:`~headlab.interpret.atlas.page.render_page`).

Each kind is one record in :data:`KINDS` (page order), built and registered by its own module under
``kinds/``: its score, threshold, causal task, role name, letter and colour, and its definition with its
paper in the module's docstring (previous_token, duplicate_token, induction, retrieval, sink, local,
syntactic; ``docs/atlas.md`` tabulates them). Every other part of the atlas reads the record, so adding a
kind is one module that calls :func:`register` (:func:`unregister` takes it off again).

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

from headlab.interpret.atlas.kinds import KINDS, ROLE, Kind, Task, register, unregister
from headlab.interpret.atlas.result import Atlas, Thresholds
from headlab.interpret.atlas.run import atlas

__all__ = ["KINDS", "ROLE", "Atlas", "Kind", "Task", "Thresholds", "atlas", "register", "unregister"]
