"""How faithful are circuits: the faithfulness curve over circuit sizes, MIB's CPR and CMD, and their spread.

For a circuit ``C`` (its edges keep the clean run's values, every other edge carries the ablated value), ``m(C)``
is the metric's mean over the pairs and its *normalised faithfulness* is (MIB, Mueller et al. 2025)::

    f(C) = (m(C) - m(empty)) / (m(full) - m(empty))        1: the circuit keeps the behaviour, 0: as if all ablated

with ``m(full)`` no edge ablated and ``m(empty)`` every edge ablated, both through the same one-forward
machinery as ``m(C)`` (:func:`~headlab.interpret.circuits.patching.patched_metric`), so ``f(full) = 1`` and
``f(empty) = 0`` exactly. Given :class:`EdgeScores`, :func:`faithfulness` evaluates, for each size ``k``, the
``k`` edges ranked highest (by ``|score|``, MIB's ``absolute=True``), pruned to the edges on a path from the input
to the logits (MIB's ``apply_topn(k, absolute, prune=True)``). The default sizes are MIB's fractions of all edges,
``k = int(fraction * n_edges)`` for ``fraction`` in 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.

**CPR and CMD** (MIB's circuit performance ratio and circuit-model distance) follow MIB's
``evaluate_area_under_curve`` in ``MIB_circuit_track/evaluation.py`` of the MIB circuit-track code
(github.com/hannamw/MIB-circuit-track; read here in its forks cisnlp/, gsarti/ and mwmlo/MIB-circuit-track, which
agree), called by ``scripts/run_evaluation.py`` with its defaults, whose tables (``scripts/print_results.py``) print
``area_under`` as CPR and ``area_from_1`` as CMD: trapezoids between consecutive points of the curve on a *linear* x
axis of the fractions themselves (``log_scale=False``; x runs from the first fraction, 0.001, to 1, not from 0; the
fraction asked for, not the edge count left after pruning), ``f`` not clipped::

    CPR = sum_i (x_{i+1} - x_i) * (f_i + f_{i+1}) / 2                       higher is better (ideal: 1 - x_0)
    CMD = sum_i (x_{i+1} - x_i) * (|1 - f_i| + |1 - f_{i+1}|) / 2           lower is better (ideal: 0)

(MIB's table reads CPR from circuits ranked by the signed score, where a method has one, and CMD from circuits
ranked by ``|score|``;
``absolute=False`` ranks edges by how far patching each alone moves the metric towards the corrupted run,
``score * sign(m_corrupted - m_clean)``, MIB's signed ranking in headlab's sign convention.) With sizes given as
edge counts, ``x = k / n_edges``.

**Baselines and spread.** ``random`` circuits of each size, ``k`` edges drawn uniformly without replacement
(seeded) and then pruned like the scored ones, give a mean and a sample standard deviation of ``f`` (MIB's random
method: random scores, top-k, prune). ``templates`` (one id per pair, e.g. ``TaskPairs.template``) gives ``f`` per
template group (means over that group's pairs in each of the four terms). ``ablation="resample"`` with
``seeds > 1`` evaluates every circuit under ``seeds`` pairings (seeds ``seed, seed + 1, ...``): ``f`` is their mean
and ``seed_sd`` their standard deviation; random circuits use the first pairing only.

    >>> mib_areas([0.0, 0.5, 1.0], [0.0, 1.0, 1.0])  # (0.5 * 0.5) + (0.5 * 1.0), and (0.5 * 0.5) + 0
    (0.75, 0.25)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, InputError, ShapeError
from headlab.interpret.circuits.circuit import Circuit, on_paths
from headlab.interpret.circuits.discovery import check_ablation, check_int, check_progress, check_scores, record_runs
from headlab.interpret.circuits.faithfulness_result import Faithfulness
from headlab.interpret.circuits.graph import graph as build_graph
from headlab.interpret.circuits.patching import ablated_outputs, patched_metric
from headlab.interpret.circuits.result import EdgeScores
from headlab.interpret.patching import runs
from headlab.progress import Progress, reporter

MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def mib_areas(fractions: Sequence[float], f: Sequence[float]) -> tuple[float, float]:
    """``(CPR, CMD)`` of a faithfulness curve ``f`` at ``fractions`` (increasing): MIB's trapezoids (module
    docstring), on the fractions as given, ``f`` unclipped."""
    if len(fractions) != len(f) or len(f) < 2:
        raise ConfigError(
            f"an area needs at least two points and one f per fraction; got {len(fractions)} fractions "
            f"and {len(f)} values"
        )
    cpr = cmd = 0.0
    for i in range(len(f) - 1):
        dx = fractions[i + 1] - fractions[i]
        cpr += dx * (f[i] + f[i + 1]) / 2
        cmd += dx * (abs(1.0 - f[i]) + abs(1.0 - f[i + 1])) / 2
    return cpr, cmd


def _sd(xs: list[float]) -> float:
    """Sample standard deviation (n - 1); 0 for one value."""
    if len(xs) < 2:
        return 0.0
    return float(torch.tensor(xs, dtype=torch.float64).std(unbiased=True))


def faithfulness(
    model,
    circuit_or_scores: Circuit | EdgeScores,
    clean,
    corrupted,
    metric,
    *,
    sizes: Sequence[int] | None = None,
    ablation: str = "patch",
    random: int = 5,
    seed: int = 0,
    seeds: int = 1,
    absolute: bool = True,
    templates: Sequence | None = None,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> Faithfulness:
    """The faithfulness of circuits of ``model`` (module docstring): a curve over sizes for :class:`EdgeScores`,
    one point for a :class:`~headlab.interpret.circuits.circuit.Circuit`.

    Args:
        model, clean, corrupted, metric: as :func:`~headlab.interpret.circuits.eap.edge_scores`; ``B`` pairs.
        circuit_or_scores: edge scores of this model (ranked, top-k, pruned at each size) or a circuit of it
            (evaluated as it is; ``sizes`` must then be None).
        sizes: edge counts ``k``, increasing, from 0 to ``n_edges``; None: MIB's fractions (module docstring).
        ablation: ``"patch"``, ``"mean"``, ``"resample"`` (``seeds`` pairings from ``seed``) or ``"zero"``.
        random: random circuits per size for the baseline (0: none); ``seed`` seeds their draws.
        absolute: rank by ``|score|`` (True) or by the signed score towards the corrupted run (False).
        templates: one template id per pair (``B`` of them): ``f`` per template group.
        progress: a bar (True), nothing, or ``progress(stage, done, total)``; interrupted (Ctrl-C), the result
            holds the sizes done.

    Forwards: 2 recordings, 1 + ``seeds`` for full and empty, then per size ``seeds`` + ``random`` (a circuit
    pruned to nothing costs none: it is the empty one).

        >>> import torch
        >>> from headlab.models.transformer import Transformer, TransformerConfig
        >>> from headlab.interpret.patching import logit_diff
        >>> from headlab.interpret.circuits.eap import edge_scores
        >>> _ = torch.manual_seed(0)
        >>> m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
        >>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> s = edge_scores(m, clean, corrupted, logit_diff(2, 5))
        >>> r = faithfulness(m, s, clean, corrupted, logit_diff(2, 5), sizes=[0, 10, len(s.edges)],
        ...                  random=2)
        >>> r.f[0], r.f[-1], r.cpr is not None
        (0.0, 1.0, True)
    """
    t0 = time.perf_counter()
    if not isinstance(circuit_or_scores, Circuit | EdgeScores):
        raise ConfigError(
            f"circuit_or_scores must be EdgeScores (edge_scores(...)) or a Circuit (discover(...)), got "
            f"{type(circuit_or_scores).__name__}"
        )
    is_circuit = isinstance(circuit_or_scores, Circuit)
    if is_circuit and sizes is not None:
        raise ConfigError(
            "sizes ranks edges by their scores; a Circuit is evaluated as it is: pass its EdgeScores "
            "for a curve over sizes"
        )
    if sizes is not None:
        if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence) or not sizes:
            raise ConfigError(f"sizes must be a list of edge counts such as [10, 100, 1000], got {sizes!r}")
        for k in sizes:
            check_int("a size", k, 0, why=" (an edge count)")
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ConfigError(f"sizes={list(sizes)}: give edge counts in increasing order, each once")
    check_ablation(ablation)
    check_int("random", random, 0, why=" (random circuits per size for the baseline)")
    check_int("seed", seed, 0)
    check_int("seeds", seeds, 1)
    if seeds > 1 and ablation != "resample":
        raise ConfigError(
            f"seeds={seeds}: only ablation='resample' depends on a seed; '{ablation}' gives the same "
            "circuit values every time"
        )
    checks.boolean("absolute", absolute)
    if isinstance(templates, torch.Tensor):
        templates = templates.tolist()
    if templates is not None and (isinstance(templates, str | bytes) or not isinstance(templates, Sequence)):
        raise ConfigError(f"templates must be one template id per pair (a list), got {type(templates).__name__}")
    check_progress(progress)

    pair = runs.prepare(model, clean, corrupted)
    g = build_graph(pair.adapter)
    N = g.n_edges
    if templates is not None and len(templates) != pair.n:
        raise ShapeError(f"templates has {len(templates)} ids for {pair.n} pairs; give one per pair")
    if ablation == "resample" and pair.n < 2:
        raise ConfigError("ablation='resample' takes another pair's corrupted run: give at least 2 pairs")
    if isinstance(circuit_or_scores, Circuit):  # is_circuit
        fixed = circuit_or_scores.mask(g)
        sizes_, fractions = [int(fixed.sum())], [int(fixed.sum()) / N]
        source = f"{circuit_or_scores.method} circuit"
        order = None
    else:
        values = check_scores(circuit_or_scores, g)
        source = f"{circuit_or_scores.method} scores"
        if sizes is None:
            sizes_, fractions = [int(x * N) for x in MIB_FRACTIONS], list(MIB_FRACTIONS)
        else:
            if sizes[-1] > N:
                raise ConfigError(f"size {sizes[-1]}: this graph has {N} edges")
            sizes_, fractions = list(sizes), [k / N for k in sizes]
        fixed = None

    recorded = record_runs(pair, g, metric, backend)
    seed_list = [seed + s for s in range(seeds)]
    ablated = [ablated_outputs(recorded.clean_out, recorded.corrupt_out, ablation, seed=s) for s in seed_list]
    if not is_circuit:
        key = values.abs() if absolute else values * (1.0 if recorded.m_corrupt >= recorded.m_clean else -1.0)
        order = torch.sort(-key, stable=True).indices
    groups: dict[str, torch.Tensor] = {}
    if templates is not None:
        for t in dict.fromkeys(templates):
            groups[str(t)] = torch.tensor([i for i, x in enumerate(templates) if x == t])

    def run(mask_in: torch.Tensor, s: int) -> torch.Tensor:
        with torch.no_grad():
            return patched_metric(pair, g, metric, ~mask_in, ablated[s], backend).double()

    none = torch.zeros(N, dtype=torch.bool)
    full = run(torch.ones(N, dtype=torch.bool), 0)
    empty = [run(none, s) for s in range(seeds)]
    for e in empty:
        if abs(float(full.mean()) - float(e.mean())) < 1e-9:
            raise InputError(
                f"the metric is {float(full.mean()):.6g} with no edge ablated and {float(e.mean()):.6g} "
                f"with every edge ablated ('{ablation}'): f would be 0/0; choose another ablation or "
                "corrupted input"
            )

    def f_of(vals: torch.Tensor, s: int, idx: torch.Tensor | None = None) -> float:
        v, e, fu = (vals, empty[s], full) if idx is None else (vals[idx], empty[s][idx], full[idx])
        den = float(fu.mean()) - float(e.mean())
        return float("nan") if den == 0 else (float(v.mean()) - float(e.mean())) / den

    def evaluate(mask_in: torch.Tensor, s: int) -> torch.Tensor:
        return empty[s] if not bool(mask_in.any()) else run(mask_in, s)

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = dict(kept=[], values=[], f=[], rmean=[], rsd=[], sd=[], tmpl={k: [] for k in groups})
    notes: list[str] = []
    done = 0
    with reporter(progress) as say:
        say("faithfulness sizes", 0, len(sizes_))
        try:
            for k in sizes_:
                if fixed is not None:
                    mask = fixed
                else:
                    mask = torch.zeros(N, dtype=torch.bool)
                    assert order is not None  # scores: ranked above
                    mask[order[:k]] = True
                    mask = on_paths(g, mask)
                vals = [evaluate(mask, s) for s in range(seeds)]
                fs = [f_of(v, s) for s, v in enumerate(vals)]
                rand = []
                for _ in range(random):
                    r = torch.zeros(N, dtype=torch.bool)
                    r[torch.randperm(N, generator=gen)[:k]] = True
                    rand.append(f_of(evaluate(on_paths(g, r), 0), 0))
                out["kept"].append(int(mask.sum()))
                out["values"].append(sum(float(v.mean()) for v in vals) / seeds)
                out["f"].append(sum(fs) / seeds)
                out["sd"].append(_sd(fs))
                out["rmean"].append(sum(rand) / random if random else None)
                out["rsd"].append(_sd(rand) if random else None)
                for t, idx in groups.items():
                    out["tmpl"][t].append(sum(f_of(v, s, idx) for s, v in enumerate(vals)) / seeds)
                done += 1
                say("faithfulness sizes", done, len(sizes_))
        except KeyboardInterrupt:
            notes.append(f"interrupted after {done} of {len(sizes_)} sizes; the curve holds those")
    sizes_, fractions = sizes_[:done], fractions[:done]
    cpr = cmd = None
    if len(sizes_) >= 2:
        cpr, cmd = mib_areas(fractions, out["f"])
        if fractions[-1] < 1.0 or (sizes is not None and fractions[0] > 0):
            notes.append(f"CPR and CMD cover fractions {fractions[0]:.4g} to {fractions[-1]:.4g} of the edges only")
    if fixed is None:
        rank = "|score|" if absolute else "signed score towards the corrupted run"
        notes.append(
            f"circuits: the top k edges by {rank}, pruned to the edges on a path from the input to the "
            "logits (MIB's apply_topn)"
        )
    else:
        notes.append("the circuit evaluated as given (not pruned again)")
    if random:
        notes.append(
            f"random baseline: {random} circuits per size, k edges drawn uniformly (seed {seed}) and then "
            "pruned; sample sd" + (f"; under the first resample seed ({seed}) only" if seeds > 1 else "")
        )
    return Faithfulness(
        model=pair.model_name,
        metric=getattr(metric, "__name__", "metric"),
        source=source,
        ablation=ablation,
        n_examples=pair.n,
        n_graph_edges=N,
        sizes=sizes_,
        fractions=fractions,
        kept=out["kept"],
        values=out["values"],
        f=out["f"],
        random=random,
        random_mean=out["rmean"],
        random_sd=out["rsd"],
        full=float(full.mean()),
        empty=sum(float(e.mean()) for e in empty) / seeds,
        clean=recorded.m_clean,
        corrupted=recorded.m_corrupt,
        cpr=cpr,
        cmd=cmd,
        absolute=absolute,
        by_template=out["tmpl"] if groups else None,
        seed_sd=out["sd"] if seeds > 1 else None,
        seeds=seed_list,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


__all__ = ["MIB_FRACTIONS", "faithfulness", "mib_areas"]
