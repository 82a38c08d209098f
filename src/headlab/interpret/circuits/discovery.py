"""Circuit discovery: choose the edges of a model's graph that carry a task, three ways.

- ``"top-n"``: the ``n_edges`` edges with the largest ``|score|`` (EAP-IG by default), then pruned to the edges on
  a path from the input to the logits (:meth:`~headlab.interpret.circuits.circuit.Circuit.prune`); MIB's
  ``apply_topn(n, absolute=True, prune=True)``.
- ``"greedy"`` (Hanna et al. 2024, ``Graph.apply_greedy``): grow from the logits backwards. The candidates are the
  edges into a node already in the circuit (the logits at first); take the highest-``|score|`` candidate, and when
  its sender is new to the circuit, its own input edges become candidates. Every chosen edge is connected to the
  logits by construction; pruning then drops those whose sender is never reached from the input.
- ``"acdc"`` (Conmy et al. 2023, Automatic Circuit DisCovery): start from every edge; visit the receivers in
  reverse topological order (the logits first, then layer by layer down to layer 0: the MLP, then each head's
  v, k and q inputs), and each receiver's senders latest first; remove an edge when removing it (ablating it,
  with everything already removed) grows the criterion ``D`` by at most ``threshold``::

      criterion="kl"      D(C) = mean over pairs of KL(p_full || p_C) at the last real position
                          (Conmy et al.'s default); remove e if D(C - e) - D(C) <= threshold
      criterion="metric"  remove e if |m(C - e) - m(C)| <= threshold (their abs-value form with the task metric)

  Each try is one exact forward (:func:`~headlab.interpret.circuits.patching.patched_metric`), so ACDC costs a
  forward per edge and refuses graphs over ``acdc_max_edges`` (2,000) edges. Edges into a receiver whose nodes
  no longer reach the logits are removed without a forward (they cannot change the output). Conmy et al. remove
  on a strict ``<``; ``<=`` makes ``threshold=0`` mean "drop exactly the edges that change nothing" and differs
  only on exact ties.

Every argument is checked (typed :class:`~headlab.errors.ConfigError`) before the model runs.

    >>> import torch
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> from headlab.interpret.patching import logit_diff
    >>> _ = torch.manual_seed(0)
    >>> m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    >>> c = discover(m, torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]]), logit_diff(2, 5),
    ...              n_edges=8, score_method="eap")
    >>> c.method, c.n_edges <= 8, c.nodes[0], c.nodes[-1]
    ('top-n', True, 'input', 'logits')
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, InputError
from headlab.interpret.circuits import nodes
from headlab.interpret.circuits.circuit import Circuit, on_paths, receiver_nodes
from headlab.interpret.circuits.graph import Graph
from headlab.interpret.circuits.graph import graph as build_graph
from headlab.interpret.circuits.patching import ABLATIONS, ablated_outputs, patched_metric
from headlab.interpret.circuits.result import EdgeScores
from headlab.interpret.patching import runs
from headlab.interpret.patching.metrics import evaluate, logits_of
from headlab.progress import Progress, reporter

METHODS = ("top-n", "greedy", "acdc")
CRITERIA = ("kl", "metric")
SCORE_METHODS = ("eap", "eap-ig", "exact")
ACDC_MAX_EDGES = 2000  # one forward per edge (of K = 2 + H + 2 Hkv copies of the pairs): 2,000 forwards


# ---- shared checks and runs (faithfulness uses them too) -----------------------------------------------------


def check_ablation(ablation) -> str:
    if ablation not in ABLATIONS:
        raise ConfigError(
            f"ablation={ablation!r}: choose from {', '.join(ABLATIONS)} (what an edge outside the "
            "circuit carries: the corrupted run's sender output, its mean, another pair's, or zero)"
        )
    return ablation


def check_int(name: str, value, low: int, high: int | None = None, why: str = "") -> int:
    """:func:`headlab.checks.int_at_least` (``high`` None) or :func:`~headlab.checks.int_in_range`, in the
    circuits' words: ``"n_edges=0: give a whole number of 1 or more"``."""
    span = f"from {low} to {high}" if high is not None else f"of {low} or more"
    message = "{name}={value!r}: give a whole number " + f"{span}{why}".replace("{", "{{").replace("}", "}}")
    if high is None:
        return checks.int_at_least(name, value, low, message=message)
    return checks.int_in_range(name, value, low, high, message=message)


def check_progress(progress) -> None:
    if not (progress is None or isinstance(progress, bool | int) or callable(progress)):
        raise ConfigError(
            f"progress must be True, False or a callable progress(stage, done, total), got {type(progress).__name__}"
        )


def check_scores(scores: EdgeScores, g: Graph) -> torch.Tensor:
    """The scores' values as ``(n_edges,)`` float64, after checking they are of this graph and complete."""
    if list(scores.edges) != list(g.edges):
        raise InputError(
            f"the edge scores are of a graph of {len(scores.edges)} edges ({scores.model}); this "
            f"model's graph has {g.n_edges}: score this model (edge_scores) and pass those"
        )
    v = scores.values.double()
    bad = torch.isnan(v).nonzero().flatten()
    if bad.numel():
        raise InputError(
            f"{bad.numel()} of {g.n_edges} edge scores are NaN (not measured), e.g. "
            f"{g.edges[int(bad[0])]!r}; score every edge (edge_scores with edges=None)"
        )
    return v


@dataclass
class Runs:
    """The clean and corrupted runs of a pair: sender outputs ``(S, B, L, E)``, clean logits, metric means."""

    clean_out: torch.Tensor
    corrupt_out: torch.Tensor
    clean_logits: torch.Tensor
    m_clean: float
    m_corrupt: float


def record_runs(pair, g: Graph, metric, backend=None) -> Runs:
    with torch.no_grad():
        clean_out, clean_run = nodes.record(pair, g, pair.clean, backend)
        corrupt_out, corrupt_run = nodes.record(pair, g, pair.corrupted, backend)
        logits = logits_of(clean_run).detach()
        m_clean = float(evaluate(metric, logits, pair.n).mean())
        m_corrupt = float(evaluate(metric, logits_of(corrupt_run), pair.n).mean())
    runs.check_gap(m_clean, m_corrupt)
    return Runs(clean_out, corrupt_out, logits, m_clean, m_corrupt)


def last_positions(pair) -> torch.Tensor:
    """``(B,)`` the last real position of each clean example (the attention mask's last 1; else ``L - 1``)."""
    x = pair.clean
    if isinstance(x, dict) and isinstance(x.get("attention_mask"), torch.Tensor):
        m = x["attention_mask"].bool()
        L = m.shape[1]
        return (L - 1 - torch.flip(m, [1]).float().argmax(1)).long()
    return torch.full((pair.n,), pair.length - 1, dtype=torch.long)


def kl_metric(reference: torch.Tensor, position: torch.Tensor):
    """``metric(logits) -> (B,)``: ``KL(p_ref || p)`` of the next-token distributions at ``position``."""
    B = reference.shape[0]
    rows = torch.arange(B)
    ref = torch.log_softmax(reference[rows, position.to(reference.device)].double(), -1)  # (B, V)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(logits[rows.to(logits.device), position.to(logits.device)].double(), -1)
        r = ref.to(lp.device)
        return (r.exp() * (r - lp)).sum(-1)

    metric.__name__ = "kl"
    return metric


# ---- choosing edges from scores ------------------------------------------------------------------------------


def top_n(values: torch.Tensor, n: int) -> torch.Tensor:
    """``(n_edges,)`` bool: the ``n`` largest ``|values|`` (ties: the earlier edge in graph order)."""
    order = torch.sort(-values.abs(), stable=True).indices[:n]
    mask = torch.zeros(values.shape[0], dtype=torch.bool)
    mask[order] = True
    return mask


def greedy(g: Graph, values: torch.Tensor, n: int) -> torch.Tensor:
    """``(n_edges,)`` bool: Hanna et al.'s greedy growth from the logits (module docstring), ``n`` edges."""
    S = len(g.senders)
    targets = receiver_nodes(g)
    feeds: dict[int, list[int]] = {}
    for i, t in enumerate(targets):
        for node in t:
            feeds.setdefault(node, []).append(i)
    offsets = g.offsets
    size = values.abs().tolist()
    heap: list[tuple[float, int, int]] = []
    opened: set[int] = set()
    pushed: set[int] = set()

    def open_node(node: int) -> None:
        opened.add(node)
        for i in feeds.get(node, []):
            if i not in pushed:
                pushed.add(i)
                for j in range(g.n_upstream(g.receivers[i])):
                    e = offsets[i] + j
                    heapq.heappush(heap, (-size[e], e, j))

    open_node(S)
    mask = torch.zeros(g.n_edges, dtype=torch.bool)
    taken = 0
    while taken < n and heap:
        _, e, j = heapq.heappop(heap)
        mask[e] = True
        taken += 1
        if j not in opened:
            open_node(j)
    return mask


# ---- discovery ------------------------------------------------------------------------------------------------


def discover(
    model,
    clean,
    corrupted,
    metric,
    *,
    method: str = "top-n",
    n_edges: int | None = None,
    scores: EdgeScores | None = None,
    score_method: str = "eap-ig",
    steps: int = 5,
    threshold: float | None = None,
    criterion: str = "kl",
    ablation: str = "patch",
    prune: bool = True,
    seed: int = 0,
    acdc_max_edges: int = ACDC_MAX_EDGES,
    absolute: bool = True,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> Circuit:
    """Find a circuit of ``model`` for the patch corrupted -> clean (the module docstring says how).

    Args:
        model, clean, corrupted, metric: as :func:`~headlab.interpret.circuits.eap.edge_scores` (token ids
            ``(B, L)`` or text; ``metric(logits (B, L, V)) -> (B,)``).
        method: ``"top-n"``, ``"greedy"`` or ``"acdc"``.
        n_edges: top-n and greedy: how many edges to choose (before pruning).
        scores: top-n and greedy: :class:`EdgeScores` of this model to choose by; None scores the edges with
            ``score_method`` (``"eap"``, ``"eap-ig"`` with ``steps``, or ``"exact"``).
        threshold, criterion: ACDC's (``"kl"`` or ``"metric"``); ``acdc_max_edges``: the largest graph it takes.
        ablation: what an edge outside the circuit carries (``"patch"``: the corrupted run's sender output;
            ``"mean"``, ``"resample"`` with ``seed``, ``"zero"``).
        prune: keep only edges on a path from the input to the logits (MIB prunes every circuit it scores).
        absolute: top-n ranks by ``|score|`` (True) or by the signed score towards the corrupted run (False: the
            edges whose patch alone moves the metric furthest towards the corrupted run's, MIB's CPR ranking).
        progress: a bar (True), nothing, or ``progress(stage, done, total)``. ACDC interrupted (Ctrl-C) keeps the
            edges it has not tried yet, and says so in the notes.

    Returns:
        :class:`~headlab.interpret.circuits.circuit.Circuit`, with the metric on the circuit alone
        (``circuit_metric``: every other edge ablated) and with everything ablated (``empty``).
    """
    t0 = time.perf_counter()
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: choose from {', '.join(METHODS)}")
    checks.boolean("absolute", absolute)
    check_ablation(ablation)
    check_int("seed", seed, 0)
    check_progress(progress)
    if criterion not in CRITERIA:
        raise ConfigError(
            f"criterion={criterion!r}: ACDC compares 'kl' (KL divergence to the full model) or "
            "'metric' (|change of the metric|)"
        )
    if method == "acdc":
        if n_edges is not None:
            raise ConfigError("n_edges is top-n's and greedy's; ACDC's size follows from threshold")
        if scores is not None:
            raise ConfigError("ACDC measures each edge itself and takes no scores; pass scores to 'top-n' or 'greedy'")
        checks.at_least(
            "threshold",
            threshold,
            0,
            message="threshold={value!r}: ACDC needs a number >= 0 (it removes "
            f"an edge when the {'KL divergence' if criterion == 'kl' else '|metric change|'} grows by at "
            "most that; Conmy et al. sweep 1e-4 to 1e-1)",
        )
        check_int("acdc_max_edges", acdc_max_edges, 1)
    else:
        if threshold is not None:
            raise ConfigError(f"threshold is ACDC's; {method} takes n_edges")
        if criterion != "kl":
            raise ConfigError(f"criterion is ACDC's; {method} chooses by |score|")
        check_int("n_edges", n_edges, 1, why=" (how many edges to choose)")
        if scores is None:
            if score_method not in SCORE_METHODS:
                raise ConfigError(f"score_method={score_method!r}: choose from {', '.join(SCORE_METHODS)}")
            if score_method == "eap-ig":
                check_int("steps", steps, 1, 1000, " (EAP-IG's interpolation steps; Hanna et al. use 5 to 100)")
        elif not isinstance(scores, EdgeScores):
            raise ConfigError(
                f"scores must be EdgeScores (edge_scores(...) or EdgeScores.load), got {type(scores).__name__}"
            )
    pair = runs.prepare(model, clean, corrupted)
    g = build_graph(pair.adapter)
    if ablation == "resample" and pair.n < 2:
        raise ConfigError("ablation='resample' takes another pair's corrupted run: give at least 2 pairs")
    if method == "acdc" and g.n_edges > acdc_max_edges:
        raise ConfigError(
            f"method='acdc' runs one forward per edge and this graph has {g.n_edges:,} edges (it takes "
            f"{acdc_max_edges:,}); score the edges with EAP-IG and use method='top-n' or 'greedy', or "
            f"pass acdc_max_edges={g.n_edges} to wait for {g.n_edges:,} forwards"
        )
    if method != "acdc" and n_edges is not None and n_edges > g.n_edges:  # checked above: given for these
        raise ConfigError(f"n_edges={n_edges}: this graph has {g.n_edges} edges")
    values = check_scores(scores, g) if scores is not None else None
    name = getattr(metric, "__name__", "metric")
    settings: dict = {"prune": prune}
    notes: list[str] = []

    if method == "acdc":
        recorded = record_runs(pair, g, metric, backend)
        ablated = ablated_outputs(recorded.clean_out, recorded.corrupt_out, ablation, seed=seed)
        assert threshold is not None  # checked above for acdc
        mask, tried, acdc_notes = _acdc(pair, g, metric, recorded, ablated, threshold, criterion, backend, progress)
        notes += acdc_notes
        chosen_scores = tried
        settings.update(threshold=float(threshold), criterion=criterion, tried=len(tried))
    else:
        if values is None:
            from headlab.interpret.circuits.eap import edge_scores

            scores = edge_scores(
                model, clean, corrupted, metric, method=score_method, steps=steps, backend=backend, progress=progress
            )
            values = check_scores(scores, g)
        recorded = record_runs(pair, g, metric, backend)
        ablated = ablated_outputs(recorded.clean_out, recorded.corrupt_out, ablation, seed=seed)
        assert scores is not None and n_edges is not None  # scored above; n_edges checked above
        towards = values * (1.0 if scores.corrupted >= scores.clean else -1.0)  # > 0: the patch moves m to corrupted
        if method == "top-n" and not absolute:
            mask = torch.zeros(values.shape[0], dtype=torch.bool)
            mask[torch.sort(-towards, stable=True).indices[:n_edges]] = True
        else:
            mask = top_n(values, n_edges) if method == "top-n" else greedy(g, values, n_edges)
        chosen_scores = {g.edges[i]: float(values[i]) for i in mask.nonzero().flatten().tolist()}
        settings.update(n_edges=n_edges, score_method=scores.method, steps=scores.steps, absolute=absolute)
        notes.append(
            f"chosen by {'|score|' if absolute or method != 'top-n' else 'signed score'} of {scores.method} edge scores (estimated m_patched - m_clean of each edge "
            "alone)" + (", grown greedily from the logits" if method == "greedy" else "")
        )
    chosen = int(mask.sum())
    if prune:
        kept = on_paths(g, mask)
        if int(kept.sum()) < chosen:
            notes.append(
                f"pruned {chosen - int(kept.sum())} of {chosen} chosen edges that lie on no path from the "
                "input to the logits"
            )
        mask = kept
    settings["chosen"] = chosen
    if ablation == "resample":
        settings["seed"] = seed
    with torch.no_grad():
        m_circuit = float(patched_metric(pair, g, metric, ~mask, ablated, backend).mean())
        m_empty = float(patched_metric(pair, g, metric, torch.ones_like(mask), ablated, backend).mean())
    c = Circuit.of(
        g,
        mask,
        model=pair.model_name,
        method=method,
        scores=chosen_scores,
        ablation=ablation,
        metric=name,
        clean=recorded.m_clean,
        corrupted=recorded.m_corrupt,
        empty=m_empty,
        circuit_metric=m_circuit,
        settings=settings,
        notes=notes,
    )
    c.seconds = time.perf_counter() - t0
    return c


def _acdc(pair, g: Graph, metric, recorded: Runs, ablated, threshold: float, criterion: str, backend, progress):
    """``(circuit mask, {edge: growth of the criterion when tried}, notes)``."""
    crit = kl_metric(recorded.clean_logits, last_positions(pair)) if criterion == "kl" else metric

    def value(in_circuit: torch.Tensor) -> float:
        with torch.no_grad():
            return float(patched_metric(pair, g, crit, ~in_circuit, ablated, backend).mean())

    S = len(g.senders)
    targets = receiver_nodes(g)
    offsets = g.offsets
    keep = torch.ones(g.n_edges, dtype=torch.bool)
    reaches = torch.zeros(S + 1, dtype=torch.bool)  # reaches the logits through kept edges (settled in reverse)
    reaches[S] = True
    tried: dict[str, float] = {}
    cut = forwards = 0
    notes = []
    with reporter(progress) as say:
        current = value(keep)
        say("acdc edges", 0, g.n_edges)
        done, pending = 0, None
        try:
            for i in range(len(g.receivers) - 1, -1, -1):
                n = g.n_upstream(g.receivers[i])
                live = bool(reaches[targets[i]].any())
                for j in range(n - 1, -1, -1):
                    e = offsets[i] + j
                    pending, keep[e] = e, False
                    if not live:
                        cut += 1
                    else:
                        new = value(keep)
                        forwards += 1
                        grow = new - current if criterion == "kl" else abs(new - current)
                        tried[g.edges[e]] = grow
                        if grow <= threshold:
                            current = new
                        else:
                            keep[e] = True
                    pending = None
                    done += 1
                    say("acdc edges", done, g.n_edges)
                if live:
                    reaches[:n] |= keep[offsets[i] : offsets[i] + n]
        except KeyboardInterrupt:
            if pending is not None:
                keep[pending] = True
            notes.append(
                f"interrupted after {done} of {g.n_edges} edges; the {g.n_edges - done} not tried stay in the circuit"
            )
    what = "KL(full || circuit) at the last real position" if criterion == "kl" else "|change of the metric's mean|"
    notes.append(f"ACDC: an edge was removed when {what} grew by at most {threshold:g}; {forwards} forwards")
    if cut:
        notes.append(f"{cut} edges into receivers no longer connected to the logits were removed without a forward")
    return keep, tried, notes


__all__ = [
    "ACDC_MAX_EDGES",
    "CRITERIA",
    "METHODS",
    "Runs",
    "check_ablation",
    "check_int",
    "check_scores",
    "discover",
    "greedy",
    "kl_metric",
    "last_positions",
    "record_runs",
    "top_n",
]
