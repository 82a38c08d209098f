"""A circuit's size as ``headlab circuit --edges`` says it: a whole number of edges or a percentage of the graph's."""

from __future__ import annotations

import math

from headlab.errors import ConfigError

DEFAULT_EDGES = "1%"  # circuit size: 1% of the graph's edges (SmolLM2-135M: about 700 of 70,000)


def parse_edges(spec: str | None) -> int | float | None:
    """``--edges``: a whole number of edges, or a percentage of the graph's edges (a float in (0, 1]).

    >>> parse_edges("200"), parse_edges("1%"), parse_edges("0.5%"), parse_edges(None)
    (200, 0.01, 0.005, None)
    """
    if spec is None:
        return None
    text = str(spec).strip()
    try:
        if text.endswith("%"):
            frac = float(text[:-1]) / 100
            if math.isfinite(frac) and 0 < frac <= 1:
                return frac
        else:
            n = int(text)
            if n >= 1:
                return n
    except ValueError:
        pass
    raise ConfigError(
        f"--edges {spec!r}: give a whole number of edges (200) or a percentage of the graph's edges "
        "above 0 and at most 100 (1%, 0.5%)"
    )


def edges_for(size: int | float, n_graph_edges: int) -> int:
    """How many edges ``--edges`` asks for on a graph of ``n_graph_edges`` (a percentage rounds up, at least 1).

    >>> edges_for(0.01, 70_000), edges_for(0.01, 37), edges_for(12, 37)
    (700, 1, 12)
    """
    return size if isinstance(size, int) else max(1, math.ceil(size * n_graph_edges - 1e-9))


__all__ = ["DEFAULT_EDGES", "edges_for", "parse_edges"]
