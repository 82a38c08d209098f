"""Self-repair: how much of a head's direct effect the components downstream of it undo, and which ones.

Ablate head ``h`` (its output ``head_out[h] = z_h @ W_O[h]`` replaced by its value on the corrupted run, the mean of
that over the corrupted examples, zero, or another pair's corrupted run) on the clean run, and compare the metric's
mean ``m`` with the clean run's (Wang et al. 2022's backup name movers; McGrath et al. 2023, "The Hydra effect";
Rushing and Nanda 2024, "Explorations of self-repair in language models", ICML)::

    total(h)        = m(h ablated, everything downstream recomputes)            - m(clean)
    direct(h)       = m(only the edge h->logits carries h's ablated output)      - m(clean)
    self_repair(h)  = total(h) - direct(h)
    comp(h, k)      = m(only the edge k->logits carries k's output on the h-ablated run) - m(clean)
    other(h)        = self_repair(h) - sum_k comp(h, k)

- ``total`` is the node effect of :func:`headlab.patch` (site ``z``, raw) for ``ablation="patch"``.
- ``direct`` is the score of edge ``a{l}.h{h}->logits`` of :func:`~headlab.interpret.circuits.edge_patch`: the final
  stream gets ``ablated_h - out_h`` and goes through the model's own final norm and unembedding, **the norm's scale
  recomputed** (as exact patching does). Rushing and Nanda freeze that scale at the clean run instead, so the norm's
  response to removing h's own write counts as self-repair there (their "LayerNorm" share) and as part of the direct
  effect here.
- ``self_repair`` follows Rushing and Nanda's code (``self_repair = logit_diffs - (ablated_direct_effects -
  direct_effects)`` in starship006/backup_research, ``FINAL_figure_files/GOOD_self_repair_noisy.py``): the change of
  the metric minus the change of h's direct effect. With effects read as ``m_ablated - m_clean`` it is ``total -
  direct``: of the sign opposite to ``direct`` when downstream components repair (**positive** for a head that
  raises the metric, ``direct < 0``, whose loss downstream pulls back up); 0 when nothing repairs (``total ==
  direct``). The sign-free fraction of the direct effect that is undone is ``undone = self_repair / -direct = 1 -
  total / direct`` (1: fully repaired, above 1: over-corrected, below 0: ablating h moves the metric further than
  its direct path alone).
- ``comp(h, k)`` is the change of k's direct effect when h is ablated, ``DE_k(h ablated) - DE_k(clean)``, with
  ``DE_k`` measured exactly: the metric with only the edge ``k->logits`` switched to k's output on the h-ablated run,
  everything else clean, the final norm recomputed (``DE_k(clean)`` is then 0). Every head of a later layer and every
  MLP that reads h (its own layer's MLP in a sequential block, every later one) is a downstream component ``k``. The
  *backup* components of h are the k with the largest compensation in the direction that undoes h's direct effect
  (positive ``comp`` when ``direct < 0``). ``other`` is what the per-component edges do not add up to: the final
  norm's rescaling, and the non-additivity of edges read through that norm.
- ``pair``: for the strongest compensator ``k*``, the metric's change when h and k* are ablated together, beside
  ``partner_alone``, k* ablated alone (the joint ablation of :mod:`headlab.interpret.heads.ablation`, REFERENCES
  section 6: a small single effect is either unused or redundant, told apart by removing two components together).

The verdict of each head follows the rules of :mod:`headlab.interpret.circuits.repair_result` (unused,
irreplaceable, duplicated, compensated, unmeasured), whose names this module re-exports.

Cost: one stacked forward of ``C`` copies of the B clean examples per ``max_rows // B`` heads (every sender's output
recorded: ``S x max_rows x L x E`` floats), the final norm and unembedding of ``B`` rows per (head, downstream
component), and one stacked forward for the pairs.

    >>> import torch
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> from headlab.interpret.patching import logit_diff
    >>> _ = torch.manual_seed(0)
    >>> m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    >>> r = self_repair(m, torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]]), logit_diff(2, 5),
    ...                 ["a0.h1", (1, 0)])
    >>> [h.head for h in r.heads], r.kind
    (['a0.h1', 'a1.h0'], 'circuit_self_repair')
    >>> abs(r["a0.h1"].self_repair - (r["a0.h1"].total - r["a0.h1"].direct)) < 1e-12
    True
    >>> sorted(r["a0.h1"].compensation)  # the components downstream of a0.h1
    ['a1.h0', 'a1.h1', 'm0', 'm1']
"""

from __future__ import annotations

import math
import time

import torch

from headlab.errors import ConfigError
from headlab.interpret.capture import capture
from headlab.interpret.circuits import nodes
from headlab.interpret.circuits.graph import Graph
from headlab.interpret.circuits.graph import graph as build_graph
from headlab.interpret.circuits.graph import head as head_name
from headlab.interpret.circuits.graph import mlp as mlp_name
from headlab.interpret.circuits.patching import ABLATIONS, ablated_outputs
from headlab.interpret.circuits.repair_result import KIND, VERDICTS, HeadRepair, Rules, SelfRepair, compensators, judge
from headlab.interpret.patching import runs
from headlab.interpret.patching.metrics import evaluate, logits_of
from headlab.models.readout import readout_of
from headlab.progress import Progress, reporter


def _layer_of(name: str) -> int:
    return int(name[1:].split(".")[0])


def check_heads(g: Graph, heads) -> list[str]:
    """Head names (``"a{l}.h{h}"``) from names or ``(layer, head)`` pairs; ConfigError for anything else."""
    one_pair = isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(x, int) for x in heads)
    if isinstance(heads, str) or one_pair:
        heads = [heads]
    try:
        items = list(heads)
    except TypeError:
        raise ConfigError(
            f"heads must be a list of head names ('a1.h2') or (layer, head) pairs, got {heads!r}"
        ) from None
    if not items:
        raise ConfigError(
            "heads is empty: give the heads to ablate, as names ('a1.h2') or (layer, head) pairs, e.g. "
            "the heads of a circuit"
        )
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            name = item
        else:
            try:
                l, h = item
                if isinstance(l, bool) or isinstance(h, bool) or int(l) != l or int(h) != h:
                    raise TypeError
                name = head_name(int(l), int(h))
            except (TypeError, ValueError):
                raise ConfigError(
                    f"heads: {item!r} is neither a head name ('a1.h2') nor a (layer, head) pair"
                ) from None
        if not name.startswith("a") or name not in g.senders:
            raise ConfigError(
                f"heads: {item!r} is not a head of this model ({g.n_layers} layers of "
                f"{max(g.heads, default=0)} heads): name heads 'a{{layer}}.h{{head}}', e.g. "
                f"{head_name(g.n_layers - 1, 0)!r}, or give (layer, head) pairs"
            )
        if name in out:
            raise ConfigError(f"heads: {name!r} is listed twice; give each head once")
        out.append(name)
    return out


def downstream(g: Graph, name: str) -> list[str]:
    """The senders that read head ``name``'s output: its layer's MLP in a sequential block, every later head and MLP."""
    l = _layer_of(name)
    out = [] if g.parallel[l] else [mlp_name(l)]
    for l2 in range(l + 1, g.n_layers):
        out += [head_name(l2, h) for h in range(g.heads[l2])] + [mlp_name(l2)]
    return out


def _replace(C: int, n: int, items: dict[int, list[tuple[int | None, torch.Tensor]]]):
    """An edit putting ``value (B, L, E)`` into copy ``c`` of a ``head_out`` (head ``h``) or ``mlp_out`` (None) site."""

    def edit(t: torch.Tensor, site: str) -> torch.Tensor:
        out = t.clone()
        view = out.view(C, n, *t.shape[1:])
        for c, pairs in items.items():
            for h, value in pairs:
                if h is None:
                    view[c] = value.to(t)
                else:
                    view[c, :, h] = value.to(t)
        return out

    return edit


def _ablated_run(pair, g: Graph, metric, configs: list[list[int]], ablated: torch.Tensor, record: bool, backend):
    """``(C, B)`` metric values of the clean run with each configuration's senders (indices) set to their ablated
    outputs, everything downstream recomputed; with ``record``, every sender's output ``(S, C, B, L, E)`` too."""
    a, C, n = pair.adapter, len(configs), pair.n
    by_site: dict[str, dict[int, list]] = {}
    for c, senders in enumerate(configs):
        for s in senders:
            name = g.senders[s]
            l = _layer_of(name)
            if name.startswith("a"):
                site, h = a.site_name(l, "head_out"), int(name.split(".h")[1])
            else:
                site, h = a.site_name(l, "mlp_out"), None
            by_site.setdefault(site, {}).setdefault(c, []).append((h, ablated[s]))
    edits = {site: _replace(C, n, items) for site, items in by_site.items()}
    vals, cache = runs.run_metric(
        pair, metric, pair.clean, C, edits=edits, sites=nodes.sites(a, g) if record else None, backend=backend
    )
    outs = None
    if record:
        outs = nodes.stack(a, g, cache)
        outs = outs.view(outs.shape[0], C, n, *outs.shape[2:])
    return vals, outs


def _readout_means(readout, metric, x_final: torch.Tensor, deltas: torch.Tensor, n: int, max_rows: int) -> torch.Tensor:
    """``(K,)``: the metric's mean over examples with the final stream ``x_final (B, L, E)`` plus ``deltas[k]``
    ``(K, B, L, E)``, read out by the model's own final norm (its scale recomputed) and unembedding."""
    out = []
    per = runs.copies_per_forward(n, max_rows)
    with torch.no_grad():
        for i in range(0, deltas.shape[0], per):
            d = deltas[i : i + per]
            x = (x_final.unsqueeze(0) + d.to(x_final)).reshape(-1, *x_final.shape[1:])  # (k * B, L, E)
            out.append(evaluate(metric, readout.logits(x), n).double().mean(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def self_repair(
    model,
    clean,
    corrupted,
    metric,
    heads,
    *,
    ablation: str = "patch",
    rules: Rules = Rules(),
    max_rows: int = 64,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> SelfRepair:
    """Total and direct effect, self-repair, compensating components and a verdict for each of ``heads``.

    Args:
        model: a LoadedModel, an ``nn.Module`` of a served family, or an adapter: a pre-norm decoder (or parallel
            blocks) whose logits are ``norm(x) @ W_U^T + b_U`` of its last block's output.
        clean, corrupted: as :func:`headlab.patch` takes them (text with a LoadedModel, ``input_ids (B, L)`` or dicts;
            the same shape and padding).
        metric: ``metric(logits (B, L, V)) -> (B,)``, e.g. :func:`~headlab.interpret.patching.logit_diff`; every
            effect is a change of its mean over the B examples.
        heads: names ``"a{layer}.h{head}"`` or ``(layer, head)`` pairs (e.g. the heads of a circuit).
        ablation: what an ablated output becomes: ``"patch"`` (its value on the corrupted run), ``"mean"`` (its mean
            over the corrupted examples), ``"zero"``, or ``"resample"`` (another pair's corrupted run).
        rules: the verdicts' thresholds (:class:`Rules`).
        max_rows: rows per forward (copies x B); each ablated forward records every sender's output.
        progress: a bar (True), nothing (False) or ``progress(stage, done, total)``. Interrupted (Ctrl-C), the
            heads measured so far keep their numbers; the others are ``unmeasured``.

    Returns:
        :class:`SelfRepair` (see the module docstring for the definitions and an example).
    """
    t0 = time.perf_counter()
    if ablation not in ABLATIONS:
        raise ConfigError(f"ablation={ablation!r}: choose from {', '.join(ABLATIONS)}")
    if not isinstance(rules, Rules):
        raise ConfigError(f"rules must be a headlab.interpret.circuits.selfrepair.Rules, got {type(rules).__name__}")
    runs.copies_per_forward(1, max_rows)  # a positive int, or a ConfigError
    pair = runs.prepare(model, clean, corrupted)
    g = build_graph(pair.adapter)
    names = check_heads(g, heads)
    if ablation == "resample" and pair.n < 2:
        raise ConfigError("ablation='resample' takes another pair's corrupted run: give at least 2 pairs")
    a, n = pair.adapter, pair.n
    readout = readout_of(a)  # refuses, typed, a model whose logits are not norm(x) @ W_U^T + b_U
    last = a.site_name(g.n_layers - 1, "resid_post")
    with torch.no_grad():
        cache = capture(a, pair.clean, nodes.sites(a, g) + [last], backend=backend)
        clean_out, x_final = nodes.stack(a, g, cache), cache[last]
        corrupt_out, corrupt_run = nodes.record(pair, g, pair.corrupted, backend)
        m_clean = float(evaluate(metric, logits_of(cache.outputs), n).double().mean())
        m_corrupt = float(evaluate(metric, logits_of(corrupt_run), n).double().mean())
    runs.check_gap(m_clean, m_corrupt)
    ablated = ablated_outputs(clean_out, corrupt_out, ablation)
    idx = [g.sender_index(h) for h in names]
    with torch.no_grad():
        direct = (
            _readout_means(readout, metric, x_final, ablated[idx] - clean_out[idx], n, max_rows) - m_clean
        ).tolist()
    nan = math.nan
    total = [nan] * len(names)
    comps: list[dict[str, float]] = [{} for _ in names]
    partners: list[str | None] = [None] * len(names)
    pairs, alone = [nan] * len(names), [nan] * len(names)
    alone_of: dict[str, float] = {}
    per = runs.copies_per_forward(n, max_rows)
    done = 0
    try:
        with reporter(progress) as say, torch.no_grad():
            say("self-repair: heads", 0, len(names))
            for start in range(0, len(names), per):
                chunk = list(range(start, min(start + per, len(names))))
                vals, outs = _ablated_run(pair, g, metric, [[idx[i]] for i in chunk], ablated, True, backend)
                for c, i in enumerate(chunk):
                    total[i] = float(vals[c].double().mean()) - m_clean
                    down = downstream(g, names[i])
                    rows = [g.sender_index(k) for k in down]
                    deltas = outs[rows, c] - clean_out[rows]
                    values = _readout_means(readout, metric, x_final, deltas, n, max_rows) - m_clean
                    comps[i] = dict(zip(down, values.tolist()))
                    best = compensators(comps[i], direct[i])
                    partners[i] = best[0][0] if best else None
                configs: list[list[int]] = []
                owners: list[str | int] = []  # a partner's name (alone) or the index of a pair
                for i in chunk:
                    k = partners[i]
                    if k is None:
                        continue
                    if k not in alone_of and k not in owners:
                        configs.append([g.sender_index(k)])
                        owners.append(k)
                    configs.append([idx[i], g.sender_index(k)])
                    owners.append(i)
                if configs:
                    vals, _ = _ablated_run(pair, g, metric, configs, ablated, False, backend)
                    for c, who in enumerate(owners):
                        v = float(vals[c].double().mean()) - m_clean
                        if isinstance(who, str):
                            alone_of[who] = v
                        else:
                            pairs[who] = v
                for i in chunk:
                    if (k := partners[i]) is not None:
                        alone[i] = alone_of[k]
                done = chunk[-1] + 1
                say("self-repair: heads", done, len(names))
    except KeyboardInterrupt:  # keep what was measured: the rest is unmeasured, and the notes say so
        pass
    results = []
    gap = m_corrupt - m_clean
    for i, name in enumerate(names):
        if i >= done:
            t, comps[i], partners[i], pairs[i], alone[i] = nan, {}, None, nan, nan
        else:
            t = total[i]
        top = [k for k, _ in compensators(comps[i], direct[i])[: rules.top]]
        verdict, evidence = judge(
            t, direct[i], gap, rules, partner=partners[i], pair=pairs[i], partner_alone=alone[i], by=top
        )
        results.append(
            HeadRepair(
                name,
                t,
                direct[i],
                t - direct[i],
                comps[i],
                partners[i],
                pairs[i],
                alone[i],
                verdict,
                evidence,
                rules.top,
            )
        )
    notes = [
        f"total: the head's output replaced by its {ablation} ablation, everything downstream recomputed",
        "direct: only the edge head->logits carries the ablated output; the final norm's scale is recomputed, so "
        "the norm's response to the head's own removal is part of the direct effect (Rushing and Nanda freeze "
        "it at the clean run and count it as self-repair)",
        "self_repair = total - direct (Rushing and Nanda): opposite in sign to direct when downstream components "
        "repair; undone = self_repair / -direct is the fraction repaired",
        "compensation of k: only the edge k->logits carries k's output from the head-ablated run, everything "
        "else clean (k's clean direct effect is then 0); other = self_repair - sum of compensations (the final "
        "norm's rescaling, the edges' non-additivity through it)",
    ]
    if done < len(names):
        notes.append(f"interrupted after {done} of {len(names)} heads; the others are unmeasured")
    return SelfRepair(
        model=pair.model_name,
        metric=getattr(metric, "__name__", "metric"),
        ablation=ablation,
        n_examples=n,
        clean=m_clean,
        corrupted=m_corrupt,
        heads=results,
        rules=rules,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


__all__ = [
    "HeadRepair",
    "KIND",
    "Rules",
    "SelfRepair",
    "VERDICTS",
    "check_heads",
    "compensators",
    "downstream",
    "judge",
    "self_repair",
]
