"""``headlab patch``: activation patching of every head for one clean/corrupted prompt pair."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import app, check_at_least, check_output_file, check_text, console, print_json
from headlab.errors import ConfigError, InputError
from headlab.results import envelope, write_json, write_text

METHODS = ("exact", "attribution", "both")


@app.command("patch")
def patch_cmd(
    clean: str = typer.Option(..., "--clean", help="the clean prompt, e.g. \"When Mary and John went to the store, "
                                                   "John gave a drink to\""),
    corrupted: str = typer.Option(..., "--corrupted", help="the same prompt with other names (as many tokens)"),
    answer: str = typer.Option(..., "--answer", help="the right next token, with its leading space: \" Mary\""),
    wrong: str = typer.Option(..., "--wrong", help="the wrong next token: \" John\""),
    model: str = typer.Option("smollm2", "--model", "-m", help="a known model name or a model folder"),
    sites: str = typer.Option("z", "--sites", help="comma-separated: z, q, k, v, pattern (per head); resid_pre, "
                                                   "resid_post, mlp_out (per layer, exact only)"),
    positions: str = typer.Option(None, "--positions", help="'each' (every position separately) or 3,5,-1"),
    method: str = typer.Option("exact", "--method", help="exact | attribution | both (with their rank correlation)"),
    top: int = typer.Option(10, "--top", help="how many heads to list"),
    out: Path = typer.Option(None, "--out", "-o", help="write the result: FILE.json (data) or FILE.html (page)"),
    force: bool = typer.Option(False, "--force", help="replace an existing --out file"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Patch each head's activation from the corrupted prompt into the clean one and rank the heads.

    The metric is the logit difference answer - wrong at the last token; an effect is
    (m_patched - m_clean) / (m_corrupted - m_clean): 0 = no change, 1 = the whole gap.
    """
    from headlab.interpret.patching import attribution_patch, compare, patch
    from headlab.interpret.patching.runs import HEAD_KINDS, RESID_KINDS, check_positions
    from headlab.models import load

    if method not in METHODS:  # options first: a load takes time
        raise ConfigError(f"--method {method!r}: choose one of {', '.join(METHODS)}")
    kinds = [s.strip() for s in sites.split(",") if s.strip()]
    allowed = HEAD_KINDS + RESID_KINDS if method == "exact" else HEAD_KINDS
    if not kinds or any(k not in allowed for k in kinds):  # in the option's name (the library's says sites=)
        why = ("k and v per kv head; resid_pre, resid_post and mlp_out per layer" if method == "exact" else
               f"--method {method}: attribution patching reads gradients at the head sites only")
        raise ConfigError(f"--sites {sites!r}: choose from the kinds {', '.join(allowed)} ({why})")
    pos = _positions(positions)
    check_at_least("--top", top, 1)
    if out is not None:
        if Path(out).suffix not in (".json", ".html"):
            raise InputError(f"--out {out}: give a file ending in .json (the data) or .html (the page)")
        check_output_file(out, "--out", force=force)
    for text, opt in ((clean, "--clean"), (corrupted, "--corrupted"), (answer, "--answer"), (wrong, "--wrong")):
        check_text(text, opt)
    if answer == wrong:
        raise InputError(f"--answer and --wrong are both {answer!r}: their logit difference is 0 on every run, so every "
                         "effect would be 0/0; give the right and a wrong next token")
    if clean == corrupted:
        raise InputError("--clean and --corrupted are the same text: patching one into the other changes nothing "
                         "(every effect would be 0/0); give a corrupted prompt with other names")
    from headlab.interpret.patching.prompts import prompt_pair

    loaded = load(model)
    a, b, metric = prompt_pair(loaded, clean, corrupted, answer, wrong)
    try:
        check_positions(pos, a["input_ids"].shape[1])
    except ConfigError as e:
        raise ConfigError(f"--positions {positions}: {e}") from None
    results = {}
    if method in ("exact", "both"):
        results["exact"] = patch(loaded, a, b, metric, sites=kinds, positions=pos, progress=True)
    if method in ("attribution", "both"):
        results["attribution"] = attribution_patch(loaded, a, b, metric, sites=kinds, positions=pos)
    main = results.get("exact") or results["attribution"]
    doc = {name: r.to_json() for name, r in results.items()}
    if len(results) == 2:
        doc["agreement"] = {k: compare(results["exact"], results["attribution"], k) for k in kinds}
    if out is not None:
        if Path(out).suffix == ".html":
            write_text(out, main.page())
        else:
            write_json(out, envelope("patch", doc, model=main.model, settings={"method": method, "sites": kinds,
                                                                               "positions": positions}))
    if as_json:
        print_json(doc)
        return
    console.print(f"{main.model}: logit diff {answer!r} - {wrong!r}: clean {main.clean:.3f}, corrupted "
                  f"{main.corrupted:.3f}", highlight=False, soft_wrap=True)
    for name, r in results.items():
        for kind in kinds:
            per_layer = kind in RESID_KINDS  # one value per layer
            console.print(f"{name} patching, {kind}: top {'layers (layer' if per_layer else 'heads (layer.head'} "
                          "effect)", highlight=False)
            console.print("  " + ", ".join(f"{l}{'' if per_layer else f'.{h}'} {e:+.3f}" for l, h, e in r.top(top, kind)),
                          highlight=False, soft_wrap=True)
    for kind, c in doc.get("agreement", {}).items():
        sp = "n/a" if c["spearman"] is None else f"{c['spearman']:.3f}"
        console.print(f"attribution vs exact ({kind}): Spearman {sp}, top-10 overlap "
                      f"{c['top10_overlap']}/{min(10, c['n'])}, {c.get('time_ratio', float('nan')):.1f}x faster",
                      highlight=False)
    if out is not None:
        console.print(f"wrote {out}", highlight=False)


def _positions(spec: str | None):
    if spec is None or spec.strip() == "each":
        return None if spec is None else "each"
    try:
        got = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        got = []
    if not got:
        raise ConfigError(f"--positions takes 'each' or comma-separated positions (3,5,-1); got {spec!r}")
    return got
