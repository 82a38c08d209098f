"""``headlab generate``'s and ``headlab train-gates``' views: the continued text on stdout and the cache's bytes and
speed on stderr (``--json``: the generation's document instead); the gates' training in one line on stderr."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("generate")
def show_generation(ctx, outcome, console, err) -> None:
    from headlab.decode.instrument import kv_heads_text
    from headlab.units import human_bytes

    g = outcome.result.native
    if ctx.options["as_json"]:
        print_json(ctx.instrument.document(ctx, g))
        return
    console.print(f"{ctx.options['prompt']}[bold]{g.text}[/]", highlight=False, soft_wrap=True)
    err.print(
        f"{ctx.loaded.name}, policy {g.policy.name} ({kv_heads_text(g.counts)}): "
        f"KV cache {human_bytes(g.kv_bytes)} vs {human_bytes(g.kv_bytes_full)} full "
        f"({g.kv_bytes / g.kv_bytes_full:.1%})"
        + (f", per rank {' + '.join(human_bytes(b) for b in g.kv_bytes_per_rank)}" if g.kv_bytes_per_rank else "")
        + f" at {g.prompt_tokens + g.ids.shape[1] - 1} tokens; prefill "
        f"{g.prefill_seconds:.2f} s, {g.tokens_per_second:.1f} tokens/s",
        highlight=False,
        soft_wrap=True,
    )


@view("train-gates")
def show_gates(ctx, outcome, console, err) -> None:
    t = outcome.result.native
    g = t.gates.clamp(0, 1)
    first, last = (f"{t.losses[0]:.4f}", f"{t.losses[-1]:.4f}") if t.losses else ("-", "-")
    err.print(
        f"{ctx.loaded.name}: {t.steps} steps in {t.seconds:.0f} s ({t.stopped}); loss {first} -> "
        f"{last}; {int((g > 0.5).sum())} of {g.numel()} kv heads above 0.5. Wrote {ctx.options['out']}",
        highlight=False,
        soft_wrap=True,
    )
