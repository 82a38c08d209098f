"""The report folder: what :func:`~headlab.interpret.report.analyze_job.analyze` wrote and found
(:class:`ReportResult`), where a report may go (:func:`check_out_dir`, :func:`prepare_out_dir`), and writing it
from the sections' results (:func:`write_report`: the sections' files, ``heads.csv``, ``heads.json`` and
``report.html``; :func:`write_csv`, :func:`write_json`; :func:`backend_provenance`, what computed what).

The job that computes those results (the text planned on the model, one recording, the sections) is
:mod:`headlab.interpret.report.analyze_job`'s.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from headlab._version import __version__
from headlab.errors import InputError
from headlab.interpret import shell
from headlab.interpret.heads.labels import HeadRecord
from headlab.interpret.report.html import render_html
from headlab.interpret.report.sections import Job, Section
from headlab.interpret.report.sections.heads import HeadsTable, initial_head
from headlab.interpret.report.selection import heads_text, interesting_heads
from headlab.outputs import Unwritable, check_output_dir
from headlab.results import envelope
from headlab.results import write_json as _write_json

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


def check_out_dir(out_dir: str | os.PathLike, *, force: bool) -> Path:
    """Refuse, before any work and without touching the disk, a folder that cannot take a report
    (:func:`headlab.outputs.check_output_dir`, in the report's words): a kernel filesystem, a file in its
    place or above it, a place where nothing can be written, or files already there (unless ``force``)."""
    path = Path(out_dir).expanduser()
    resolved = path.resolve()
    if resolved.parts[1:2] in (("proc",), ("sys",)):
        raise InputError(
            f"the output folder {str(path)!r} is under /{resolved.parts[1]}, a kernel filesystem that "
            "takes no files; choose a folder on disk with --out"
        )
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
    stats = (
        "attention maps captured on the reference computation (exact softmax)"
        if mode == "full"
        else f"exact softmax statistics (streaming) of the q and k computed while the model ran on {name!r}"
    )
    warning = (
        None
        if exact
        else (
            f"backend {name!r} is approximate, but capturing every map runs each layer on the reference computation: "
            f"the maps and the table are those of the exact model, and {name!r} was not used"
            if mode == "full"
            else f"backend {name!r} is approximate (not softmax attention): the model ran on it, so the q and k of "
            f"every layer after the first, and the model's outputs, differ from the exact model; this report shows "
            f"{stats}"
        )
    )
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
    doc = envelope(
        "analyze", {**meta, "heads": [r.as_dict() for r in records]}, model=meta.get("model"), settings=settings
    )
    return _write_json(path, doc, ensure_ascii=False)


def write_report(
    job: Job, sections: Sequence[Section], results: Mapping[str, object], notes: Sequence[str] = ()
) -> ReportResult:
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
        records,
        out / "heads.json",
        headlab_version=__version__,
        model=loaded.name,
        family=loaded.family,
        text=job.text,
        tokens=tokens,
        causal=causal,
        separator_positions=job.separators,
        mode=job.mode,
        max_full_tokens=job.max_full_tokens,
        backend=job.backend,
        **provenance,
        drawn_heads=[f"{a}.{b}" for a, b in drawn],
        notes=notes,
        thresholds={"positional": thresholds.positional, "sink": thresholds.sink, "broad": thresholds.broad},
        n_layers=n_layers,
        n_heads=n_heads,
        layer_heads=counts,
    )

    job.say("writing the page")
    first_label = "mass first token" if causal else "mass [CLS]"
    text = job.text
    summary = [
        f"model: {loaded.name} ({loaded.family}, {n_layers} layers x {heads_text(counts)} heads"
        f"{', causal' if causal else ''})",
        f"backend: {provenance['model_backend']}"
        f"{'' if provenance['model_backend_exact'] else ' (approximate)'}; shown: {provenance['statistics']}",
        f"{n} tokens: {text if len(text) <= 300 else text[:297] + '...'}",
    ]
    embedded = table.embedded
    page = render_html(
        title=f"headlab analyze: {loaded.name}",
        tokens=tokens,
        records=records,
        maps={d: table.maps[d] for d in embedded},
        n_layers=n_layers,
        n_heads=counts,
        summary_lines=summary,
        banner=" ".join(notes) or None,
        first_label=first_label,
        initial=initial_head(table, job.chosen),
        sections=[p.html for p in parts.values() if p.html],
        extra_data={k: v for p in parts.values() for k, v in p.data.items()},
        undrawn_note=(
            f"Long input ({n} tokens): this head's map is not in the page"
            + (
                " (too large to embed; see the layer PNGs)."
                if embedded != drawn
                else "; only its statistics were computed. Draw it with --heads LAYER.HEAD."
            )
            if job.mode == "streaming"
            else ""
        ),
    )
    html_path = out / "report.html"
    html_path.write_text(page, encoding="utf-8")
    return ReportResult(
        out_dir=out,
        html=html_path,
        csv=csv_path,
        json=json_path,
        pngs=table.pngs,
        records=records,
        tokens=tokens,
        mode=job.mode,
        drawn=drawn,
        model=loaded.name,
        family=loaded.family,
        n_layers=n_layers,
        n_heads=n_heads,
        notes=notes,
    )


__all__ = [
    "REPORT_FILES",
    "ReportResult",
    "backend_provenance",
    "check_out_dir",
    "prepare_out_dir",
    "write_csv",
    "write_json",
    "write_report",
]
