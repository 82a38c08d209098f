"""``headlab models``: the model families headlab declares, what each step does for each (the support table), and
``--check PATH``: the load-time check of any model, one line per check."""

from __future__ import annotations

import typer
from rich.table import Table

from headlab.cli.app import app, console, print_json


@app.command("models")
def list_models(
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    check: str = typer.Option(
        None,
        "--check",
        metavar="PATH",
        help="load this model (a folder or known name) and print each load-time "
        "check of headlab's view against its own eager attention",
    ),
) -> None:
    """List the Hugging Face families headlab declares, their model types, and per step what is supported;
    any other type is adapted by structure and checked at load (--check PATH shows the checks)."""
    import headlab.models.hf  # noqa: F401  (registers the families)
    from headlab.models.hf.support import STEPS, support_rows

    if check is not None:
        _check(check, as_json)
        return
    rows = support_rows()
    if as_json:
        print_json(rows)
        return
    t = Table(title="model families (a step marked yes: works; a caveat follows the colon)")
    for col in ("family", "model types", "positions", "norms", *STEPS):
        t.add_column(col)
    for r in rows:
        if r["family"] is None:
            continue
        t.add_row(
            r["family"],
            ", ".join(r["model_types"]),
            r["positions"],
            r["norm_layout"],
            *(r[s].replace("yes: ", "yes*: ") for s in STEPS),
        )
    console.print(t)
    for r in rows:
        if r["family"] is None:
            console.print(f"[red]refused[/] {r['model_types'][0]}: {r['refused']}", highlight=False)
    from headlab.models.hf.support import STRUCTURE_LIMITS, VERIFIED_BY_STRUCTURE

    served = ", ".join(f"{t} ({STRUCTURE_LIMITS[t]})" if t in STRUCTURE_LIMITS else t for t in VERIFIED_BY_STRUCTURE)
    console.print(
        f"Adapted by structure and run through every step by the test suite ({len(VERIFIED_BY_STRUCTURE)} "
        f"types): {served}",
        highlight=False,
        markup=False,
    )
    console.print(
        "Any other Hugging Face type is adapted by its structure and checked on its weights at load "
        "(headlab models --check PATH prints the checks); to declare what structure cannot show: "
        "docs/adding-a-family.md",
        highlight=False,
    )


def _check(path: str, as_json: bool) -> None:
    """Load ``path`` without serving it, run every check, print one line each; exit 1 when one failed."""
    from headlab.models.hf.verify import verify
    from headlab.models.loader import load

    loaded = load(path, check=False)
    a = loaded.adapter
    verdict = verify(a, cache=False)
    found = getattr(a, "found", None)
    from headlab.models.hf.own_state import bridge_of

    own = bridge_of(a.model)
    own_text = None
    if own is not None:
        said = {"math": "softmax(q k^T) v written out", "sdpa": "scaled_dot_product_attention called directly"}
        kinds = sorted({said.get(k, k) for k in own.kinds.values()})
        own_text = (
            f"attention computed in {len(own.modules)} modules' own math ({'; '.join(kinds)}), read through "
            "headlab's bridge"
            + (
                f"; keys and values repeated {max(own.repeats.values())}x by the module, read unrepeated"
                if own.repeats
                else ""
            )
        )
    if as_json:
        print_json(
            {
                "verdict": verdict.to_json(),
                "structure": found.summary() if found else None,
                "own_math": None
                if own is None
                else {"modules": own.modules, "kinds": own.kinds, "repeats": own.repeats},
            }
        )
    else:
        how = "adapted by structure" if found is not None else f"declared family {a.family!r}"
        console.print(
            f"{loaded.name}: {verdict.model_type}, {how}; {a.n_layers} attention layers, {a.n_heads} heads "
            f"({a.n_kv_heads} kv), head size {a.head_dim}, width {a.d_model}",
            highlight=False,
        )
        if found is not None:
            for stack, desc in found.summary().items():
                if isinstance(desc, dict) and "projections" in desc:
                    console.print(
                        f"  {stack}: attention {desc['attention']!r}, {desc['projections']}, W^O "
                        f"{desc['out']!r}, norms {desc['norms']}",
                        highlight=False,
                        markup=False,
                    )
        if own_text:
            console.print(f"  {own_text}", highlight=False, markup=False)
        for c in verdict.checks:
            mark = "pass" if c.passed else "FAIL"
            console.print(
                f"  {mark}  {c.name:<9} worst {c.worst:.2e} (tolerance {c.tol:.0e})  {c.detail}",
                highlight=False,
                markup=False,
            )
        console.print(
            f"{'served' if verdict.passed else 'refused'}: checks took {verdict.seconds:.2f} s", highlight=False
        )
    if not verdict.passed:
        raise typer.Exit(1)
