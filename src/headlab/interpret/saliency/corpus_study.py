"""The corpus study: every method over a labelled dataset, Jain and Wallace's tables, ERASER faithfulness.

    result = study(loaded_or_path, "validation.tsv", "out/")     # resumable; see :func:`study`

Per instance (one JSON line in ``out/instances.jsonl``, appended as soon as it is done, so an
interrupted run resumes where it stopped): the tokens, label, prediction, every method's scores,
Kendall tau (and p) of attention with each other method, the completeness gap, the permutation
test, the adversarial-attention search (:mod:`.counterfactual`) and the ERASER measures
(:mod:`.faithfulness`). The corpus tables (:mod:`.tables`) are computed from those lines and
written to ``out/study.json``, with figures (``tau_hist.png``, ``permutation.png``,
``adversarial.png``).

The dataset is a TSV file with a header: a text column (``sentence`` or ``text``) and a ``label``
column (an integer class). It is checked completely before the first model call.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from headlab.distributed.comm import world
from headlab.distributed.data import any_rank, gather_objects
from headlab.errors import InputError
from headlab.tsv import TEXT_COLUMNS, Row, read_dataset  # noqa: F401  (public here too)
from headlab.interpret.saliency.counterfactual import adversarial_attention, permutation_test
from headlab.interpret.saliency.explanation import DEFAULT_METHODS, check_options, explain, resolve_model
from headlab.interpret.saliency.faithfulness import eraser
from headlab.interpret.saliency.objective import make_objective
from headlab.progress import Progress, reporter
from headlab.results import check_output_dir, envelope, write_json

INSTANCES = "instances.jsonl"


@dataclass
class StudyOptions:
    """How the study runs (all but ``limit`` recorded with the results)."""

    methods: tuple = DEFAULT_METHODS  # attention_flow is known but not a default (slow on long inputs)
    ig_steps: int = 50
    backend: str = "auto"
    loo: str = "delete"
    permutations: int = 100  # Jain and Wallace's count
    adversarial_steps: int = 20  # Adam steps of the adversarial search
    adversarial_restarts: int = 2  # rows searched in parallel
    tvd_budget: float = 0.01  # the output change an adversarial row may cause
    bootstrap: int = 1000  # resamples for the confidence intervals
    seed: int = 0
    counterfactual: bool = True  # run the permutation and adversarial tests

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class StudyResult:
    """The corpus tables (see :mod:`.tables`) and where the files are."""

    tables: dict
    out: Path
    instances: int
    skipped: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return envelope("saliency_study", {"instances": self.instances, "out": str(self.out), "skipped": self.skipped,
                                           "files": self.files, **self.tables},
                        model=self.tables.get("model"), settings=self.tables.get("options"))


def instance(loaded, row: Row, opts: StudyOptions) -> dict:
    """Everything measured on one row (a JSON-ready dict)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gap is recorded per instance and summarised
        ex = explain(loaded, row.text, methods=opts.methods, ig_steps=opts.ig_steps, backend=opts.backend,
                     loo=opts.loo, warn=False)
    agr = ex.agreement()
    rec = {"key": row.key, "line": row.line, "label": row.label, "pred": ex.target, "probs": ex.probs,
           "tokens": ex.tokens, "special": ex.special, "scores": ex.scores,
           "completeness_gap": ex.completeness_gap,
           "tau": {f"{p.a}|{p.b}": [p.kendall_tau, p.kendall_p] for p in agr.pairs.values()}}
    enc = loaded.encode(row.text)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    adapter = loaded.adapter
    with adapter.use_backend(opts.backend):
        obj, _ = make_objective(loaded, enc, ex.target, None)
        rec["eraser"] = {m: f.to_json() for m, f in
                         eraser(obj, ids, mask, ex.special, ex.scores, seed=opts.seed + row.line).items()}
        if opts.counterfactual and ex.attention_layers is not None:
            row_att = ex.attention_layers[-1].to(ids.device)  # (H, L)
            perm = permutation_test(obj, ids, mask, row_att, n=opts.permutations, seed=opts.seed + row.line)
            rec["permutation"] = {"median_tvd": perm.median_tvd, "max_attention": perm.max_attention}
            adv = adversarial_attention(obj, ids, mask, row_att, budget=opts.tvd_budget, steps=opts.adversarial_steps,
                                        restarts=opts.adversarial_restarts, seed=opts.seed + row.line)
            rec["adversarial"] = {"max_jsd": adv.max_jsd, "tvd": adv.tvd}
    return _clean(rec)


def _clean(x):
    if isinstance(x, float):
        return x if x == x and x not in (float("inf"), float("-inf")) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def load_records(path: Path) -> list[dict]:
    """The JSON lines written so far (a torn last line, from an interrupted run, is dropped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def study(loaded_or_path, dataset: str | os.PathLike, out: str | os.PathLike, *, limit: int | None = None,
          options: StudyOptions | None = None, progress: bool | Progress = True, figures: bool = True,
          max_seconds: float | None = None) -> StudyResult | None:
    """Run the study (see the module docstring) and return the corpus tables.

    Args:
        loaded_or_path: a LoadedModel or a model name/folder (a classifier; decoders explain their next token).
        dataset: TSV with columns ``sentence`` (or ``text``) and ``label``.
        out: folder for ``instances.jsonl``, ``study.json`` and the figures (created; an existing
            ``instances.jsonl`` is resumed: rows already there are skipped).
        limit: only the first ``limit`` rows.
        options: :class:`StudyOptions`.
        progress: a bar on stderr (True), nothing (False) or ``progress(stage, done, total)``
            (:mod:`headlab.progress`); only rank 0 reports.
        max_seconds: stop starting new instances after this long (the tables cover what is done;
            a rerun resumes). The result's ``skipped`` says how many rows were left.

    Data-parallel under ``torchrun`` (a process group from :func:`headlab.distributed.data.init_from_env`):
    each rank explains every W-th row, rank 0 gathers the records, writes them and the tables and
    returns the result; the other ranks return None. On a model sharded by tensor parallelism the ranks of
    a tensor-parallel group explain the same rows together (a 2-D mesh: the groups split the rows).
    """
    from headlab.interpret.saliency.tables import summarize

    opts = options or StudyOptions()
    opts.methods = tuple(check_options(opts.methods, opts.ig_steps, opts.backend, opts.loo))
    rows = read_dataset(dataset, limit)
    outdir = check_output_dir(out, "--out", allow_existing=True)  # reruns resume in it
    loaded = resolve_model(loaded_or_path)
    outdir.mkdir(parents=True, exist_ok=True)
    jsonl = outdir / INSTANCES
    # a row is done when its record has every asked method (a resumed run with more methods redoes
    # the rows it has only some of: the tables never mix instances explained by different methods)
    done = {r.get("key") for r in load_records(jsonl) if set(opts.methods) <= set(r.get("scores", {}))}
    done = gather_objects(done)[0]  # rank 0's file decides (other nodes may not see it)
    todo = [r for r in rows if r.key not in done]
    skipped: list[str] = []
    t0 = time.perf_counter()
    # under torchrun each rank explains every W-th row of a round; rank 0 gathers the records and writes
    # them (one file, resumable as with one process); rows are seeded by their line, so the records are
    # the ones one process would write
    rank, size = world()
    main = rank == 0
    tp = getattr(loaded.adapter, "tp", None)  # a model sharded by heads: a tensor-parallel group's ranks (consecutive)
    group = tp.world if tp is not None else 1  # explain the same row together, and one of them reports it
    rank, size = rank // group, size // group
    with (open(jsonl, "a", encoding="utf-8") if main else contextlib.nullcontext()) as f, \
            reporter(progress if main else False) as say:
        done_rows = len(rows) - len(todo)
        say("explain", done_rows, len(rows))
        for start in range(0, len(todo), size):
            if any_rank(max_seconds is not None and time.perf_counter() - t0 > max_seconds):
                skipped.append(f"time budget of {max_seconds:.0f} s reached: {len(todo) - start} of {len(rows)} rows "
                               "not run yet (run again to resume)")
                break
            rec, why = None, None
            if start + rank < len(todo):
                r = todo[start + rank]
                try:
                    rec = instance(loaded, r, opts)
                except InputError as e:  # e.g. a sentence longer than the model's positions
                    why = f"line {r.line}: {e}"
            for rec_j, why_j in gather_objects((rec, why))[::group]:
                if not main or (rec_j is None and why_j is None):
                    continue
                if why_j is not None:
                    skipped.append(why_j)
                else:
                    f.write(json.dumps(rec_j) + "\n")
                done_rows += 1
                say("explain", done_rows, len(rows))
            if main:
                f.flush()
    if not main:
        return None
    keys = {r.key for r in rows}
    latest = {r.get("key"): r for r in load_records(jsonl)}  # the last record of a key supersedes earlier ones
    records = [r for key, r in latest.items() if key in keys and set(opts.methods) <= set(r.get("scores", {}))]
    tables = summarize(records, opts)
    tables["options"] = opts.to_json()
    tables["model"] = loaded.name
    tables["dataset"] = str(dataset)
    files = [INSTANCES, "study.json"]
    if figures and records:
        from headlab.interpret.saliency.figures import study_figures

        files += study_figures(records, tables, outdir)
    result = StudyResult(tables, outdir, len(records), skipped, files)
    write_json(outdir / "study.json", result.to_json(), indent=2)
    return result

