"""``headlab kv error``'s view: each way of quantizing the cache, by the relative error of attention's output."""

from __future__ import annotations

from headlab.cli.views import view


def table(figures: dict, settings: dict) -> list[str]:
    """The markdown table, one row per variant, and the share of the five worst kv heads.

    >>> f = {"tasks": 2, "rows": [{"variant": "kivi", "rel_error": 0.06, "vs_kivi": 1.0, "worst_layer": 0.1,
    ...      "worst_layer_index": 3}], "top5_share": 0.13, "worst_heads": [[3, 1, 0.2]], "head_error": [[0.1]]}
    >>> table(f, {"bits": 4, "group": 64})[-2]
    '| kivi | 0.0600 | 1.00x | 0.1000 (layer 3) |'
    """
    at = "that decode the answer" if settings.get("at") == "answer" else "of the question"
    lines = [
        f"{figures['tasks']} tasks, {settings['bits']}-bit, groups of {settings['group']}: relative error of each "
        f"layer's attention output at the queries {at}, against a 16-bit cache (mean over tasks and layers)",
        "| variant | relative error | vs KIVI | worst layer |",
        "|---|---|---|---|",
    ]
    for r in figures["rows"]:
        lines.append(
            f"| {r['variant']} | {r['rel_error']:.4f} | {r['vs_kivi']:.2f}x | {r['worst_layer']:.4f} "
            f"(layer {r['worst_layer_index']}) |"
        )
    n = sum(len(x) for x in figures["head_error"])
    worst = ", ".join(f"layer {a} head {b} ({e:.3f})" for a, b, e in figures["worst_heads"])
    lines.append(f"KIVI's five worst of the {n} kv heads carry {figures['top5_share']:.1%} of its error: {worst}")
    return lines


@view("kv-error")
def show_error(ctx, outcome, console, err) -> None:
    from headlab.results import print_json

    if ctx.options["as_json"]:
        print_json(outcome.result.to_json())
        return
    for line in table(outcome.result.figures, outcome.result.settings):
        console.print(line, highlight=False, soft_wrap=True)
    if not outcome.result.figures["pre_rope"]:
        console.print("keys before RoPE: left out (the model's keys are not input @ W_K turned by a rotary_emb)")
    if outcome.files:
        err.print(f"wrote {outcome.files[0]}", highlight=False, soft_wrap=True)
