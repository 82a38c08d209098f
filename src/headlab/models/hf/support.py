"""The support table, read from the registered families: what each step does for each family.

``headlab models`` prints it and ``docs/models.md`` holds it (a test checks the page against
:func:`support_markdown`, so the page cannot drift from the code).

    >>> rows = support_rows()
    >>> next(r for r in rows if r["family"] == "llama")["model_types"][:3]
    ['llama', 'mistral', 'mixtral']
"""

from __future__ import annotations

from headlab.models.hf.registry import FAMILIES, REFUSED

STEPS = ("capture", "backends", "gates", "statistics", "importance", "pruning", "norms", "rollout")

# model types no family declares that the test suite runs through every step (tests/test_architectures.py), each
# adapted by structure and checked at load; a test keeps this list equal to the suite's
VERIFIED_BY_STRUCTURE = (
    "qwen2_moe",
    "qwen3_moe",
    "smollm3",
    "granite",
    "granitemoe",
    "olmoe",
    "glm4",
    "nemotron",
    "gpt_bigcode",
    "cohere2",
    "olmo3",
    "arcee",
    "helium",
    "ernie4_5",
    "seed_oss",
    "hunyuan_v1_dense",
    "apertus",
    "ministral",
    "exaone4",
    "biogpt",
    "camembert",
    "esm",
    "ernie",
    "data2vec-text",
    "xlm-roberta-xl",
    "deit",
    "beit",
    "dinov2",
    "siglip_vision_model",
    "clip_vision_model",
    "vit_msn",
    "wav2vec2",
    "hubert",
    "unispeech",
    "sew",
    "mbart",
    "pegasus",
    "marian",
    "m2m_100",
    "blenderbot",
    "blenderbot-small",
    "plbart",
    "mt5",
)
# caveats the suite shows for some of them (physical removal, residual-mode norms)
STRUCTURE_LIMITS = {
    "olmoe": "pruning refused: its q/k norms span all heads",
    "olmo3": "pruning refused: its q/k norms span all heads",
    "beit": "residual-mode norms refused: LayerScale scales the attention branch",
}


def _declared(fam, name):
    """A class attribute, or None when the family computes it from the config (a property)."""
    for klass in fam.__mro__:
        if name in klass.__dict__:
            v = klass.__dict__[name]
            return None if isinstance(v, property) else v
    return None


def norm_layout_of(fam) -> str:
    n = _declared(fam, "norms")
    if n is None:
        return "by config"
    if n.post is not None:
        return "sandwich" if n.post_reads == "branch" else "post"
    return "parallel" if n.parallel else "pre"


def support_rows() -> list[dict]:
    """One dict per registered family: ``family``, ``model_types``, ``positions``, ``score_mods``, ``norm_layout``
    and one entry per step of :data:`STEPS` (``"yes"`` or ``"yes: <caveat>"``); then the refused types."""
    rows = []
    for fam in FAMILIES:
        limits = dict(getattr(fam, "limits", {}))
        row = {
            "family": fam.family,
            "model_types": list(fam.model_types),
            "description": fam.description,
            "positions": _declared(fam, "positions") or "by config",
            "score_mods": fam.score_mods or "-",
            "norm_layout": norm_layout_of(fam),
        }
        for step in STEPS:
            row[step] = "yes" + (f": {limits[step]}" if step in limits else "")
        rows.append(row)
    for t, why in REFUSED.items():
        rows.append({"family": None, "model_types": [t], "refused": why})
    return rows


def support_markdown() -> str:
    """The table of :func:`support_rows` as Markdown (what ``docs/models.md`` holds)."""
    head = ["family", "model types", "positions", "norm layout", "score modifications", *STEPS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    refused = []
    for r in support_rows():
        if r["family"] is None:
            refused.append(f"- `{r['model_types'][0]}`: refused ({r['refused']}).")
            continue
        cells = [
            f"`{r['family']}`",
            ", ".join(r["model_types"]),
            r["positions"],
            r["norm_layout"],
            r["score_mods"],
            *(r[s] for s in STEPS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    served = ", ".join(f"{t} ({STRUCTURE_LIMITS[t]})" if t in STRUCTURE_LIMITS else t for t in VERIFIED_BY_STRUCTURE)
    return (
        "\n".join(lines) + "\n\nAdapted by structure (no declaration), checked at load, and run through every step "
        f"by the test suite ({len(VERIFIED_BY_STRUCTURE)} types): {served}.\n\nAny other model type is adapted by "
        "its structure and served only if the load-time check passes on its weights (`headlab models --check "
        "PATH` prints each check).\n\nRefused with `UnsupportedArchitectureError`, before anything runs:\n\n"
        + "\n".join(refused)
        + "\n"
    )


__all__ = ["STEPS", "STRUCTURE_LIMITS", "VERIFIED_BY_STRUCTURE", "support_markdown", "support_rows"]
