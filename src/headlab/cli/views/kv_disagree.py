"""``headlab kv disagree``'s view: each policy's answers on the tasks two policies of the runs disagreed on."""

from __future__ import annotations

from headlab.cli.views import view


def table(figures: dict) -> list[str]:
    """The markdown table, one row per policy decoded.

    >>> f = {"baseline": "full", "compared": "full:bits=4", "tasks": 3, "baseline_right": 2, "compared_right": 1,
    ...      "rotated_values": False, "rows": [{"policy": "full:bits=8", "right": 2, "as_baseline": 3,
    ...                                         "as_compared": 0, "as_recorded": None}]}
    >>> table(f)[0]
    "3 tasks on which 'full' and 'full:bits=4' disagree ('full' right on 2, 'full:bits=4' on 1)"
    >>> table(f)[-1]
    '| full:bits=8 | 2 | 3 | 0 |  |'
    """
    lines = [
        f"{figures['tasks']} tasks on which {figures['baseline']!r} and {figures['compared']!r} disagree "
        f"({figures['baseline']!r} right on {figures['baseline_right']}, {figures['compared']!r} on "
        f"{figures['compared_right']})" + (", values rotated" if figures["rotated_values"] else ""),
        "| policy | right | answers as the baseline | as the compared | as recorded |",
        "|---|---|---|---|---|",
    ]
    for r in figures["rows"]:
        rec = "" if r["as_recorded"] is None else r["as_recorded"]
        lines.append(f"| {r['policy']} | {r['right']} | {r['as_baseline']} | {r['as_compared']} | {rec} |")
    return lines


@view("kv-disagree")
def show_disagree(ctx, outcome, console, err) -> None:
    from headlab.results import print_json

    if ctx.options["as_json"]:
        print_json(outcome.result.to_json())
        return
    for line in table(outcome.result.figures):
        console.print(line, highlight=False, soft_wrap=True)
    if outcome.files:
        err.print(f"wrote {outcome.files[0]}", highlight=False, soft_wrap=True)
