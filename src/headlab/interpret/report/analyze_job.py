"""The main job: :func:`analyze` a text with a model and write a report folder::

    from headlab.interpret.report.analyze import analyze
    r = analyze("The cat sat on the mat.", out_dir="report")   # loads the default model, MiniLM
    r.html, r.pngs[0], r.interesting()                        # report.html, layer_00.png, [(label, record)]

The folder holds

- ``report.html``: one self-contained page (no network: CSS, script and data inline). Pick a layer
  and head in the grid, see its heatmap and beside it its norm map ``||alpha_ij f_h(x_j)||``, hover a
  token to see where it attends (its row) and what attends to it (its column); under them the rollout
  (full map, or past the full-map length the first and last token's rows); the per-head table last.
- ``layer_00.png`` ... : one picture per layer, a grid of every head's map with token labels.
- ``heads.csv`` and ``heads.json``: the per-head table (:class:`~headlab.interpret.heads.labels.HeadRecord`:
  entropy, mean attended distance, mass on [CLS] / [SEP] or the first token for decoders, the most
  attended token, pattern labels with their evidence). ``heads.json`` also carries the tokens, the
  model, the mode and the thresholds.

The report is a list of sections (:mod:`headlab.interpret.report.sections`: the heads table and maps,
the saliency strip, the norm maps and rollout). The model runs once for all of them: each section says
which capture sites it needs, one :func:`headlab.capture` records them, and each section computes its
result from that recording (saliency's gradients need passes of their own). :func:`analyze` runs the
phases in a row; they are public (:func:`check_request`, :func:`prepare_out_dir`, :func:`plan`,
:func:`record_once`, :func:`compute`, :func:`write_report`) so that ``headlab analyze``, a study-runner row
(:mod:`headlab.interpret.report.instrument`), can let the runner make the recording.

Long inputs. Up to ``max_full_tokens`` tokens (default :data:`MAX_FULL_TOKENS` = 256) every map is
captured and drawn. Beyond it the table comes from the streaming statistics
(:func:`headlab.attention_stats`, run inside each layer's forward with the model's own mask and
scale: memory linear in the length, no ``n x n`` map held), and maps are drawn only for chosen heads (``heads=[(layer, head), ...]``, or by
default the :data:`DRAWN_HEADS` heads whose rows most often point at a fixed offset); the report,
the JSON and the command line say so. Why 256: the page embeds 2 bytes per map cell, so all 72 maps
of MiniLM at 256 tokens already make a 12 MB page, and token labels stop being readable long before.
"""

from __future__ import annotations

import csv
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from headlab._version import __version__
from headlab.errors import InputError, MemoryBudgetError
from headlab.interpret import shell
from headlab.interpret.capture import capture
from headlab.interpret.heads.labels import HeadRecord, LabelThresholds
from headlab.interpret.heads.naming import check_heads_in_config  # public here too
from headlab.interpret.report.html import render_html
from headlab.interpret.report.sections import Job, Section, registered
from headlab.interpret.report.sections.heads import HeadsTable, initial_head, memory_hint
from headlab.interpret.report.selection import (  # noqa: F401  (public here too)
    DRAWN_HEADS,
    MAX_EMBEDDED_BYTES,
    check_head,
    default_drawn_heads,
    embeddable,
    heads_text,
    interesting_heads,
    parse_heads,
)
from headlab.progress import Progress, messages, reporter
from headlab.results import Unwritable, check_output_dir, envelope
from headlab.results import write_json as _write_json

MAX_FULL_TOKENS = 256  # above this many tokens: streaming statistics, maps for chosen heads only
REPORT_FILES = ("report.html", "heads.csv", "heads.json")
_PNG_GLOB = "layer_*.png"


@dataclass
class ReportResult:
    """What :func:`analyze` wrote and found."""

    out_dir: Path
    html: Path
    csv: Path
    json: Path
    pngs: list[Path]
    records: list[HeadRecord]  # one per (layer, head), layer-major
    tokens: list[str]
    mode: str  # "full" (every map captured and drawn) or "streaming" (statistics; chosen heads drawn)
    drawn: list[tuple[int, int]]  # heads whose maps are in the page and the pictures
    model: str
    family: str
    n_layers: int
    n_heads: int  # the largest count of any layer (layers of a pruned model may have fewer)
    notes: list[str] = field(default_factory=list)  # what the reader must know (long input, truncation)

    def record(self, layer: int, head: int) -> HeadRecord:
        for r in self.records:
            if (r.layer, r.head) == (layer, head):
                return r
        raise InputError(f"no head {layer}.{head} in this report (heads per layer: {self.layer_heads})")

    @property
    def layer_heads(self) -> list[int]:
        """Heads of every layer (they differ in a pruned model)."""
        return [sum(r.layer == i for r in self.records) for i in range(self.n_layers)]

    def interesting(self) -> list[tuple[str, HeadRecord]]:
        """The clearest example of each pattern label, as ``(label, record)``."""
        return interesting_heads(self.records)

    def _repr_html_(self) -> str:
        """The report page inline in a notebook (the page itself, in a sandboxed frame; no network)."""
        return shell.inline(self.html.read_text(encoding="utf-8"), height=900)


# ---- small pure helpers ---------------------------------------------------------------------------


def check_out_dir(out_dir: str | os.PathLike, *, force: bool) -> Path:
    """Refuse, before any work and without touching the disk, a folder that cannot take a report
    (:func:`headlab.results.check_output_dir`, in the report's words): a kernel filesystem, a file in its
    place or above it, a place where nothing can be written, or files already there (unless ``force``)."""
    path = Path(out_dir).expanduser()
    resolved = path.resolve()
    if resolved.parts[1:2] in (("proc",), ("sys",)):
        raise InputError(f"the output folder {str(path)!r} is under /{resolved.parts[1]}, a kernel filesystem that "
                         "takes no files; choose a folder on disk with --out")
    try:
        check_output_dir(path, "the output path", force=force)
    except Unwritable as e:
        raise _unwritable(path, e.reason) from None
    except OSError as e:
        raise _unwritable(path, e.strerror or str(e)) from None
    return path


def _unwritable(path: Path, reason: str) -> InputError:
    return InputError(f"cannot write the report into {str(path)!r}: {reason}; choose a writable folder with --out")


def prepare_out_dir(out_dir: str | os.PathLike, *, force: bool) -> Path:
    """Check (before any work) that ``out_dir`` can take a report (:func:`check_out_dir`) and create it;
    with ``force``, remove the files a previous report left there (only those: ``report.html``,
    ``heads.csv``, ``heads.json``, ``layer_*.png``)."""
    path = check_out_dir(out_dir, force=force)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(path, e.strerror or str(e)) from None
    if force:
        for name in REPORT_FILES:
            (path / name).unlink(missing_ok=True)
        for png in path.glob(_PNG_GLOB):
            png.unlink(missing_ok=True)  # under torchrun every rank prepares the folder
    return path


def backend_provenance(backend: str | None, mode: str) -> tuple[dict, str | None]:
    """What computed what: ``{"model_backend", "model_backend_exact", "statistics"}`` and a warning
    when the backend is approximate (it changes the q and k of later layers and the outputs)."""
    from headlab.attention.backends import is_exact

    name = backend or "auto"
    exact = is_exact(name)
    stats = ("attention maps captured on the reference computation (exact softmax)" if mode == "full" else
             f"exact softmax statistics (streaming) of the q and k computed while the model ran on {name!r}")
    warning = None if exact else (
        f"backend {name!r} is approximate, but capturing every map runs each layer on the reference computation: "
        f"the maps and the table are those of the exact model, and {name!r} was not used" if mode == "full" else
        f"backend {name!r} is approximate (not softmax attention): the model ran on it, so the q and k of every "
        f"layer after the first, and the model's outputs, differ from the exact model; this report shows {stats}")
    return {"model_backend": name, "model_backend_exact": exact, "statistics": stats}, warning


def write_csv(records: Sequence[HeadRecord], path: str | os.PathLike) -> Path:
    """The per-head table as CSV: one row per head, the columns of :class:`HeadRecord`
    (``labels`` joined by ``;``, ``evidence`` by `` | ``, ``None`` as an empty cell)."""
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=HeadRecord.columns())
        w.writeheader()
        for r in records:
            d = r.as_dict()
            d["labels"] = ";".join(r.labels)
            d["evidence"] = " | ".join(r.evidence)
            w.writerow({k: ("" if v is None else v) for k, v in d.items()})
    return path


def write_json(records: Sequence[HeadRecord], path: str | os.PathLike, **meta) -> Path:
    """The per-head table as JSON: ``{**meta, "heads": [record, ...]}``, in the result envelope (kind
    ``analyze``, :mod:`headlab.results`)."""
    settings = {k: meta[k] for k in ("backend", "max_full_tokens", "thresholds") if k in meta}
    doc = envelope("analyze", {**meta, "heads": [r.as_dict() for r in records]}, model=meta.get("model"),
                   settings=settings)
    return _write_json(path, doc, ensure_ascii=False)


# ---- the job --------------------------------------------------------------------------------------


def _separator_positions(loaded, ids: Sequence[int], causal: bool) -> list[int] | None:
    """Positions of [SEP] (or the tokenizer's separator) for encoders; ``None`` for decoders."""
    if causal:
        return None
    sep = getattr(loaded.tokenizer, "sep_token_id", None)
    return [i for i, t in enumerate(ids) if sep is not None and t == sep and i != 0]


def check_request(text, *, max_full_tokens: int, backend: str | None) -> None:
    """The arguments that alone decide, checked before the output folder and the model: a text with a word
    in it, ``max_full_tokens >= 1``, and a registered backend (naming the registered ones)."""
    from headlab.attention import backends as _backends

    if not isinstance(text, str) or not text.strip():
        raise InputError("the text is empty (or only whitespace): give at least one word to analyse")
    if max_full_tokens < 1:
        raise InputError(f"max_full_tokens must be at least 1, got {max_full_tokens}")
    if backend is not None and backend != "auto":
        _backends.get(backend)  # UnknownBackendError naming the registered ones, before any work


def plan(loaded, text: str, out: Path, *, backend: str | None = None, max_full_tokens: int = MAX_FULL_TOKENS,
         heads: str | Sequence[tuple[int, int]] | None = None, truncate: bool = False,
         thresholds: LabelThresholds = LabelThresholds(),
         annotations: Mapping[tuple[int, int], str | Sequence[str]] | None = None, flow: bool = False,
         say=lambda _m: None) -> tuple[Job, list[Section], list[str]]:
    """The job on the loaded model, before the recording: the heads and annotations checked against the model,
    the text encoded (a text past the model's positions refused, or cut with ``truncate``), the mode, and the
    active sections. Returns ``(job, sections, notes)`` (``notes``: what the encoding warned of)."""
    adapter = loaded.adapter
    n_layers, counts = adapter.n_layers, adapter.layer_heads
    chosen = parse_heads(heads, n_layers, counts)
    for layer, head in (annotations or {}):
        if not (0 <= layer < n_layers and 0 <= head < counts[layer]):
            raise InputError(f"an annotation names head {layer}.{head}, which {loaded.name} does not have "
                             f"(layers 0..{n_layers - 1}, heads per layer {heads_text(counts)}): was the study run "
                             "on another model?")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs = loaded.encode(text, truncate=truncate)
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    ids = inputs["input_ids"][0].tolist()
    tokens = (loaded.tokenizer.convert_ids_to_tokens(ids) if loaded.tokenizer is not None else [str(i) for i in ids])
    n = len(tokens)
    if n == 0:  # the model would fail on an empty sequence with a bare reshape error
        raise InputError(f"{loaded.name}'s tokenizer turns this text into no tokens (none of its words is in the "
                         "vocabulary, or the tokenizer class does not match the saved vocabulary): give text the "
                         "tokenizer knows")
    causal = adapter.causal
    job = Job(loaded, text, inputs, tokens, causal, _separator_positions(loaded, ids, causal),
              "full" if n <= max_full_tokens else "streaming", max_full_tokens, out, backend=backend, chosen=chosen,
              thresholds=thresholds, annotations=annotations, write_flow=flow, say=say)
    return job, [s for s in registered() if s.active(job)], notes


def mode_line(job: Job) -> str:
    """What the recording is about to hold, as the progress step says it."""
    if job.mode == "full":
        return (f"capturing attention maps: {job.n} tokens, {job.adapter.n_layers} layers x "
                f"{heads_text(job.adapter.layer_heads)} heads")
    return f"{job.n} tokens > {job.max_full_tokens}: streaming statistics, no n x n maps"


def record_once(job: Job, sections: Sequence[Section]):
    """The one run of the model: every site the sections need, in one :func:`headlab.capture` (with the
    statistics' sink positions, on the job's backend). The full mode's memory refusal says how to stream."""
    sites = sorted({s for sec in sections for s in sec.sites(job)})
    stats = sorted({s for sec in sections for s in sec.stats(job)})
    kwargs = {"key_positions": job.sinks, "stats": stats} if stats else None
    try:
        return capture(job.loaded, job.inputs, sites=sites, backend=job.backend, stats_kwargs=kwargs)
    except MemoryBudgetError as e:
        if job.mode != "full":
            raise
        raise memory_hint(e, job.n) from None


def compute(job: Job, sections: Sequence[Section], cache) -> dict[str, object]:
    """Every section's result from the one recording ``cache``, in page order (a section may read the results
    of the sections before it), by section name."""
    results: dict[str, object] = {}
    for sec in sections:
        results[sec.name] = sec.compute(job, cache, results)
    return results


def write_report(job: Job, sections: Sequence[Section], results: Mapping[str, object],
                 notes: Sequence[str] = ()) -> ReportResult:
    """Write the folder from the sections' results: their files, ``heads.csv``, ``heads.json`` and
    ``report.html``; ``notes``: what :func:`plan` found (the sections' notes are added after them)."""
    loaded, out, tokens, causal, n = job.loaded, job.out, job.tokens, job.causal, job.n
    n_layers, n_heads, counts = job.adapter.n_layers, job.adapter.n_heads, job.adapter.layer_heads
    notes = list(notes)
    provenance, approx_warning = backend_provenance(job.backend, job.mode)
    table = cast(HeadsTable, results["heads"])  # the heads section runs first, always
    notes += table.notes
    if approx_warning:
        notes.append(approx_warning)
    parts = {}
    for sec in sections:
        notes += sec.write(job, results[sec.name], results)
        parts[sec.name] = part = sec.page(job, results[sec.name], results)
        notes += part.notes

    job.say("writing the table")
    records, drawn = table.records, table.drawn
    csv_path = write_csv(records, out / "heads.csv")
    thresholds = job.thresholds
    json_path = write_json(
        records, out / "heads.json", headlab_version=__version__, model=loaded.name, family=loaded.family,
        text=job.text, tokens=tokens, causal=causal, separator_positions=job.separators, mode=job.mode,
        max_full_tokens=job.max_full_tokens, backend=job.backend, **provenance,
        drawn_heads=[f"{a}.{b}" for a, b in drawn], notes=notes,
        thresholds={"positional": thresholds.positional, "sink": thresholds.sink, "broad": thresholds.broad},
        n_layers=n_layers, n_heads=n_heads, layer_heads=counts)

    job.say("writing the page")
    first_label = "mass first token" if causal else "mass [CLS]"
    text = job.text
    summary = [f"model: {loaded.name} ({loaded.family}, {n_layers} layers x {heads_text(counts)} heads"
               f"{', causal' if causal else ''})", f"backend: {provenance['model_backend']}"
               f"{'' if provenance['model_backend_exact'] else ' (approximate)'}; shown: {provenance['statistics']}",
               f"{n} tokens: {text if len(text) <= 300 else text[:297] + '...'}"]
    embedded = table.embedded
    page = render_html(
        title=f"headlab analyze: {loaded.name}", tokens=tokens, records=records,
        maps={d: table.maps[d] for d in embedded}, n_layers=n_layers, n_heads=counts, summary_lines=summary,
        banner=" ".join(notes) or None, first_label=first_label, initial=initial_head(table, job.chosen),
        sections=[p.html for p in parts.values() if p.html],
        extra_data={k: v for p in parts.values() for k, v in p.data.items()},
        undrawn_note=(f"Long input ({n} tokens): this head's map is not in the page"
                      + (" (too large to embed; see the layer PNGs)." if embedded != drawn else
                         "; only its statistics were computed. Draw it with --heads LAYER.HEAD.")
                      if job.mode == "streaming" else ""))
    html_path = out / "report.html"
    html_path.write_text(page, encoding="utf-8")
    return ReportResult(out_dir=out, html=html_path, csv=csv_path, json=json_path, pngs=table.pngs, records=records,
                        tokens=tokens, mode=job.mode, drawn=drawn, model=loaded.name, family=loaded.family,
                        n_layers=n_layers, n_heads=n_heads, notes=notes)


def analyze(
    text: str,
    *,
    model="minilm",
    out_dir: str | os.PathLike,
    backend: str | None = None,
    force: bool = False,
    max_full_tokens: int = MAX_FULL_TOKENS,
    heads: str | Sequence[tuple[int, int]] | None = None,
    truncate: bool = False,
    thresholds: LabelThresholds = LabelThresholds(),
    progress: bool | Progress | None = None,
    annotations: Mapping[tuple[int, int], str | Sequence[str]] | None = None,
    flow: bool = False,
) -> ReportResult:
    """Analyse every attention head of ``model`` on ``text`` and write the report folder.

    The phases are public, for callers that own the lifecycle (``headlab analyze`` runs them through the
    study runner, :mod:`headlab.interpret.report.instrument`): :func:`check_request`,
    :func:`prepare_out_dir`, the load, :func:`plan`, :func:`record_once` (or any recording of the sites the
    sections declare), :func:`compute` and :func:`write_report`.

    Args:
        text: the input; must not be empty.
        model: a known name (``"minilm"``), a local model folder, or an already loaded
            :class:`~headlab.models.loader.LoadedModel` (tests reuse one).
        out_dir: the report folder; created if missing; refused if it exists and is not empty,
            unless ``force``.
        backend: the attention backend the model runs on for long inputs (``None``: the model's
            own). Short inputs capture every map, and a captured layer runs on the reference
            computation whatever the backend.
        force: write into a non-empty folder (replacing a previous report's files).
        max_full_tokens: longest input whose maps are all captured and drawn; longer inputs use the
            streaming statistics and draw only ``heads``.
        heads: the heads to draw for long inputs (``"0.3,2.5"`` or pairs); with a short input, the
            ones listed first in the page. Default: :func:`default_drawn_heads`.
        truncate: for text longer than the model's positions, keep the first positions and say so
            in the notes (default: :class:`~headlab.errors.InputError`).
        thresholds: when a pattern label is given (see :mod:`headlab.interpret.heads.labels`).
        progress: a display on stderr (True), nothing (None, False) or ``progress(stage, done, total)``
            (:mod:`headlab.progress`), called with each step's name (``total`` 0: a step of unknown length)
            as it starts; the older ``progress(message)`` still works.
        annotations: findings of other studies per head, ``{(layer, head): text}`` (see
            :func:`~headlab.interpret.report.annotations.study_annotations`: a probe's relation heads,
            importance ranks and ablation verdicts); shown in the table, the head panel and
            ``heads.json`` (``notes``).
        flow: also write the norm maps and the rollout beside the page as PNGs and ``rollout.json``
            (the page shows them either way; :mod:`headlab.interpret.report.sections.flow`).

    Returns:
        A :class:`ReportResult`.
    """
    from headlab.models.loader import load

    with reporter(progress, legacy=messages) as report:  # the one display (headlab.progress)
        def say(message: str) -> None:  # each step a stage of unknown length
            report(message, 0, 0)

        check_request(text, max_full_tokens=max_full_tokens, backend=backend)
        out = prepare_out_dir(out_dir, force=force)
        if isinstance(model, str | os.PathLike):
            say(f"loading model {os.fspath(model)}")
            loaded = load(model)
        else:
            loaded = model
        job, sections, notes = plan(loaded, text, out, backend=backend, max_full_tokens=max_full_tokens, heads=heads,
                                    truncate=truncate, thresholds=thresholds, annotations=annotations, flow=flow,
                                    say=say)
        say(mode_line(job))
        cache = record_once(job, sections)
        results = compute(job, sections, cache)
        del cache
        return write_report(job, sections, results, notes)


__all__ = ["DRAWN_HEADS", "MAX_FULL_TOKENS", "ReportResult", "analyze", "backend_provenance", "check_head",
           "check_heads_in_config", "check_out_dir", "check_request", "compute", "default_drawn_heads", "heads_text", "interesting_heads",
           "mode_line", "parse_heads", "plan", "prepare_out_dir", "record_once", "write_csv", "write_json",
           "write_report"]
