"""What attention is asked to compute, below every engine and every cost formula.

The spec (:class:`~headlab.spec.attention_spec.AttentionSpec`: shapes, scale, mask, score mod, causality),
mask functions (:mod:`headlab.spec.masks`), score mods, feature maps, which key each query sees
(:mod:`headlab.spec.visibility`), block maps and tile states (which tiles a tiled kernel may skip), and the
memory guard. ``headlab.costs`` reads this package to predict a backend's cost; the engines in
``headlab.attention`` (the backends, statistics, the functional core and the module) sit above ``costs``.
Earlier versions kept these modules in ``headlab.attention``; import them from here (``headlab.spec.masks``).

This file imports nothing, so that any module here can be imported alone.
"""
