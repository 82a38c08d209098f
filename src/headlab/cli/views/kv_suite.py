"""``headlab kv suite``'s view: the paired table against the first policy (``--json``: the result envelope)."""

from __future__ import annotations

from headlab.cli.views import view


def table(figures: dict) -> list[str]:
    """The suite's markdown table, one row per policy.

    >>> row = {"policy": "full", "right": 3, "n": 4, "kv_bytes_vs_full": 1.0, "seconds_per_task": 2.0,
    ...        "by_kind": {}}
    >>> table({"rows": [row], "tasks": 4, "lengths": [900, 1100]})[-1]
    '| full | 3/4 | baseline |  | 100.0% | - | 2.0 |'
    """
    lines = [
        f"{figures['tasks']} tasks, {figures['lengths'][0]}-{figures['lengths'][1]} tokens",
        "| policy | right | accuracy diff vs first (95% paired CI, McNemar p) | RULER score diff (bootstrap 95%) "
        "| KV bytes vs full | decoded ppl (change, 95%) | s/task |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in figures["rows"]:
        v = r.get("vs_first")
        acc = (
            "baseline"
            if v is None
            else f"{v['acc_diff']:+.1%} [{v['acc_ci95'][0]:+.1%}, {v['acc_ci95'][1]:+.1%}], "
            f"p={v['mcnemar_p']:.3f} ({v['n10']}:{v['n01']})"
        )
        score = "" if v is None else f"{v['score_diff']:+.3f} [{v['score_ci95'][0]:+.3f}, {v['score_ci95'][1]:+.3f}]"
        ppl = f"{r['decoded_ppl']:.3f}" if "decoded_ppl" in r else "-"
        if v is not None and "decoded_ppl_change" in v:
            c = v["decoded_ppl_change"]
            ppl += f" ({c[0]:+.2%} [{c[1]:+.2%}, {c[2]:+.2%}])"
        lines.append(
            f"| {r['policy']} | {r['right']}/{r['n']} | {acc} | {score} | {r['kv_bytes_vs_full']:.1%} | {ppl} | "
            f"{r['seconds_per_task']:.1f} |"
        )
    return lines


@view("kv-suite")
def show_suite(ctx, outcome, console, err) -> None:
    from headlab.results import print_json

    if ctx.options["as_json"]:
        print_json(outcome.result.to_json())
        return
    for line in table(outcome.result.figures):
        console.print(line, highlight=False, soft_wrap=True)
    kinds = {r["policy"]: r["by_kind"] for r in outcome.result.figures["rows"]}
    console.print(f"right by kind: {kinds}", highlight=False, soft_wrap=True)
    if outcome.files:
        err.print(f"wrote {outcome.files[0]}", highlight=False, soft_wrap=True)
