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
result from that recording (saliency's gradients need passes of their own). The phases are the
``analyze`` instrument's hooks (:mod:`headlab.interpret.report.instrument`), which the study runner runs for
``headlab analyze`` and for :func:`analyze` alike, making the one recording itself: :func:`check_request`,
:func:`plan`, :func:`record_once`, :func:`compute`, and the folder's (:mod:`headlab.interpret.report.folder`:
:func:`prepare_out_dir`, :func:`write_report`).

Long inputs. Up to ``max_full_tokens`` tokens (default :data:`MAX_FULL_TOKENS` = 256) every map is
captured and drawn. Beyond it the table comes from the streaming statistics
(:func:`headlab.attention_stats`, run inside each layer's forward with the model's own mask and
scale: memory linear in the length, no ``n x n`` map held), and maps are drawn only for chosen heads
(``heads=[(layer, head), ...]``, or by default the :data:`DRAWN_HEADS` heads whose rows most often point at a
fixed offset); the report, the JSON and the command line say so. Why 256: the page embeds 2 bytes per map cell,
so all 72 maps of MiniLM at 256 tokens already make a 12 MB page, and token labels stop being readable long
before.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from headlab.errors import InputError, MemoryBudgetError
from headlab.interpret.capture import capture
from headlab.interpret.heads.labels import LabelThresholds
from headlab.interpret.heads.naming import check_heads_in_config  # noqa: F401  (public here too)
from headlab.interpret.report.folder import (  # noqa: F401  (public here too)
    REPORT_FILES,
    ReportResult,
    backend_provenance,
    check_out_dir,
    prepare_out_dir,
    write_csv,
    write_json,
    write_report,
)
from headlab.interpret.report.sections import Job, Section, registered
from headlab.interpret.report.sections.heads import memory_hint
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

MAX_FULL_TOKENS = 256  # above this many tokens: streaming statistics, maps for chosen heads only


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


def plan(
    loaded,
    text: str,
    out: Path,
    *,
    backend: str | None = None,
    max_full_tokens: int = MAX_FULL_TOKENS,
    heads: str | Sequence[tuple[int, int]] | None = None,
    truncate: bool = False,
    thresholds: LabelThresholds = LabelThresholds(),
    annotations: Mapping[tuple[int, int], str | Sequence[str]] | None = None,
    flow: bool = False,
    say=lambda _m: None,
) -> tuple[Job, list[Section], list[str]]:
    """The job on the loaded model, before the recording: the heads and annotations checked against the model,
    the text encoded (a text past the model's positions refused, or cut with ``truncate``), the mode, and the
    active sections. Returns ``(job, sections, notes)`` (``notes``: what the encoding warned of)."""
    adapter = loaded.adapter
    n_layers, counts = adapter.n_layers, adapter.layer_heads
    chosen = parse_heads(heads, n_layers, counts)
    for layer, head in annotations or {}:
        if not (0 <= layer < n_layers and 0 <= head < counts[layer]):
            raise InputError(
                f"an annotation names head {layer}.{head}, which {loaded.name} does not have "
                f"(layers 0..{n_layers - 1}, heads per layer {heads_text(counts)}): was the study run "
                "on another model?"
            )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs = loaded.encode(text, truncate=truncate)
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    ids = inputs["input_ids"][0].tolist()
    tokens = loaded.tokenizer.convert_ids_to_tokens(ids) if loaded.tokenizer is not None else [str(i) for i in ids]
    n = len(tokens)
    if n == 0:  # the model would fail on an empty sequence with a bare reshape error
        raise InputError(
            f"{loaded.name}'s tokenizer turns this text into no tokens (none of its words is in the "
            "vocabulary, or the tokenizer class does not match the saved vocabulary): give text the "
            "tokenizer knows"
        )
    causal = adapter.causal
    job = Job(
        loaded,
        text,
        inputs,
        tokens,
        causal,
        _separator_positions(loaded, ids, causal),
        "full" if n <= max_full_tokens else "streaming",
        max_full_tokens,
        out,
        backend=backend,
        chosen=chosen,
        thresholds=thresholds,
        annotations=annotations,
        write_flow=flow,
        say=say,
    )
    return job, [s for s in registered() if s.active(job)], notes


def mode_line(job: Job) -> str:
    """What the recording is about to hold, as the progress step says it."""
    if job.mode == "full":
        return (
            f"capturing attention maps: {job.n} tokens, {job.adapter.n_layers} layers x "
            f"{heads_text(job.adapter.layer_heads)} heads"
        )
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

    It runs the ``analyze`` instrument (:mod:`headlab.interpret.report.instrument`, ``headlab analyze``) through
    the study runner (:func:`headlab.interpret.study.runner.call`): the same checks, load, one recording, unit and
    folder as the command. Under torchrun rank 0 writes the folder and every rank returns its result. The phases
    are public: :func:`check_request`, :func:`prepare_out_dir`, the load, :func:`plan`, :func:`record_once` (or
    any recording of the sites the sections declare), :func:`compute` and :func:`write_report`.

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
    from headlab.distributed.comm import world
    from headlab.interpret.study import runner

    options = {
        "text": text,
        "model": Path(model) if isinstance(model, os.PathLike) else model,
        "out": out_dir,
        "backend": backend,
        "force": force,
        "max_full_tokens": max_full_tokens,
        "heads": heads,
        "truncate": truncate,
        "thresholds": thresholds,
        "annotations": annotations,
        "flow": flow,
    }
    with reporter(progress, legacy=messages) as report:  # the one display (the older progress(message) too)
        result = runner.call("analyze", options, progress=report)
    if world()[1] > 1:  # under torchrun rank 0 wrote the folder: every rank returns what it wrote
        from headlab.distributed.data import gather_objects

        result = gather_objects(result)[0]
    return result


__all__ = [
    "DRAWN_HEADS",
    "MAX_FULL_TOKENS",
    "ReportResult",
    "analyze",
    "backend_provenance",
    "check_head",
    "check_heads_in_config",
    "check_out_dir",
    "check_request",
    "compute",
    "default_drawn_heads",
    "heads_text",
    "interesting_heads",
    "mode_line",
    "parse_heads",
    "plan",
    "prepare_out_dir",
    "record_once",
    "write_csv",
    "write_json",
    "write_report",
]
