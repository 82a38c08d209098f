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
    # hybrid stacks: blocks without attention between the attention blocks (headlab.models.hf.hybrid)
    "jamba",
    "bamba",
    "lfm2",
    "olmo_hybrid",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    # attention computed in the model's own modules, read through its own math (headlab.models.hf.own_bridge)
    "gpt_neo",
    "big_bird",
    "roformer",
    "mpt",
    "mpnet",
    "rembert",
    "luke",
    "tapas",
    "imagegpt",
    "visual_bert",
    "megatron-bert",
    "mvp",
    "xglm",
    "deberta-v2",
    # further decoders, encoders, vision and audio encoders and encoder-decoders
    "ctrl",
    "persimmon",
    "phimoe",
    "roc_bert",
    "roberta-prelayernorm",
    "bert-generation",
    "layoutlm",
    "markuplm",
    "data2vec-vision",
    "ijepa",
    "dpt",
    "aimv2_vision_model",
    "dinov2_with_registers",
    "dinov3_vit",
    "chinese_clip_vision_model",
    "data2vec-audio",
    "wav2vec2-conformer",
    "unispeech-sat",
    "sew-d",
    "switch_transformers",
    # variants: a scaled residual branch (residual multiplier, LayerScale); bucketed relative encoder-decoders
    "granitemoeshared",
    "internvl_vision",
    "umt5",
    "pop2piano",
)
# caveats the suite shows for some of them (physical removal, residual-mode norms)
STRUCTURE_LIMITS = {
    "olmoe": "pruning refused: its q/k norms span all heads",
    "olmo3": "pruning refused: its q/k norms span all heads",
    "jamba": "Mamba blocks between its attention blocks; rollout and flow refused: they mix tokens without a map",
    "bamba": "Mamba-2 blocks between its attention blocks; rollout and flow refused: they mix tokens without a map",
    "lfm2": "convolution blocks between its attention blocks; rollout and flow refused: they mix tokens without a map",
    "olmo_hybrid": "pruning refused: its q/k norms span all heads; gated delta-rule blocks between its attention "
    "blocks: rollout and flow refused, they mix tokens without a map",
    "granitemoehybrid": "Mamba-2 blocks between its attention blocks; rollout and flow refused: they mix tokens "
    "without a map",
    "nemotron_h": "MLP-only blocks between its attention blocks, which have no heads",
    "falcon_h1": "a Mamba-2 mixer beside the attention in every block; rollout and flow refused: it mixes tokens "
    "without a map",
    "mpt": "pruning refused: its own math reads the head count (ALiBi slopes); torch's SDPA refused: ALiBi is a bias",
    "mpnet": "pruning refused: its own math reads the head count (its relative position bias)",
    "deberta-v2": "pruning refused: its own math reads the head count (its relative position projections)",
    "wav2vec2-conformer": "pruning refused: its relative-position terms hold per-head parameters; residual-mode norms "
    "refused: its conformer block's residual is not one a norm layout reads",
    "markuplm": "torch's SDPA refused on padded batches: its padding mask is a finite -10000 bias",
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
