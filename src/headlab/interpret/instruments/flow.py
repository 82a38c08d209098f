"""``flow``: attention rollout, attention flow and value-aware norms of one text, as an instrument.

The computation is the flow room's (:func:`~headlab.interpret.flow.rollout.rollout`,
:func:`~headlab.interpret.flow.maxflow.attention_flow`, :func:`~headlab.interpret.flow.norms.attention_norms`);
this file declares the options of ``headlab flow``, checks them (alone, then against the model and the
text's tokens); its view (:mod:`headlab.cli.views.flow`) shows the result. One text is one unit; the result
file is ``<method>.json`` in ``--out``.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import ConfigError, InputError
from headlab.interpret.study.base import (
    REQUIRED,
    Context,
    Instrument,
    InstrumentResult,
    Option,
    Output,
    at_least,
    register,
)

METHODS = ("rollout", "norm-rollout", "flow", "norms")
MODES = ("attention", "residual")
SOLVERS = ("scipy", "networkx")
_NAMED_ROWS = {"cls": 0, "first": 0, "bos": 0, "last": -1, "sep": -1}


def parse_rows(spec: str | None) -> list[int] | None:
    """``"cls"`` -> [0], ``"last"`` -> [-1], ``"0,5,-1"`` -> [0, 5, -1].

    >>> parse_rows("cls,5,last")
    [0, 5, -1]
    """
    if spec is None:
        return None
    out = []
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        if part in _NAMED_ROWS:
            out.append(_NAMED_ROWS[part])
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise ConfigError(
                f"--rows takes token positions or names ({', '.join(_NAMED_ROWS)}), comma-separated; got {spec!r}"
            ) from None
    if not out:
        raise ConfigError("--rows is empty; give e.g. --rows cls or --rows 0,5")
    return out


def _check_rows(value, option, options) -> None:
    parse_rows(value)  # refuses a bad --rows before the load


def check_loaded(loaded, text: str, layer: int, rows: list[int] | None) -> None:
    """--layer against the model's layers and --rows against the text's tokens, before the work."""
    from headlab.models.loader import resolve

    n = resolve(loaded)[0].n_layers
    if not -n <= layer < n:
        raise ConfigError(
            f"--layer {layer} is out of range: {loaded.name} has {n} layers (0..{n - 1}, or -1 for the last)"
        )
    tok = getattr(loaded, "tokenizer", None)
    if tok is None:
        return
    t = len(tok(text, verbose=False)["input_ids"])
    limit = getattr(loaded, "max_positions", None)
    if limit is not None and t > limit:
        raise InputError(
            f"TEXT is {t} tokens long (special tokens included) but {loaded.name} reads at most {limit}; shorten it"
        )
    if rows is None:
        return
    bad = [r for r in rows if not -t <= r < t]
    if bad:
        raise ConfigError(
            f"--rows {','.join(map(str, bad))} is out of range: the text is {t} tokens (0..{t - 1}, "
            "negatives count from the end)"
        )


@register
class Flow(Instrument):
    """How much of each input token reaches an output token, for one text."""

    name = "flow"
    reads_text = True  # a model folder without a tokenizer is refused before the load
    summary = """How much of each input token reaches an output token: rollout, flow (Abnar and Zuidema 2020) or
value-aware norms (Kobayashi et al. 2020, 2021).

Example: headlab flow "The cat sat on the mat." --method flow --rows cls"""
    options = (
        Option("text", None, str, REQUIRED, "the text (quote it)", metavar="TEXT", reads="text"),
        Option("method", "--method", str, "rollout", "rollout | norm-rollout | flow | norms", choices=METHODS),
        Option(
            "rows",
            "--rows",
            str,
            None,
            "output tokens: cls, last, or positions 0,5 (flow: the source)",
            check=_check_rows,
        ),
        Option("layer", "--layer", int, -1, "the top layer (default the last)"),
        Option("model", "--model", str, "minilm", "a known model name (minilm) or a model folder", short="-m"),
        Option(
            "mode",
            "--mode",
            str,
            None,
            "norms: attention (Kobayashi 2020, the default) or residual (2021)",
            choices=MODES,
        ),
        Option(
            "solver",
            "--solver",
            str,
            None,
            "flow: scipy (fast, certified; the default) or networkx (the paper's)",
            choices=SOLVERS,
        ),
        Option("top", "--top", int, 10, "tokens shown per row", check=at_least(1), setting=False),
        Option("out", "--out", Path, None, "write <method>.json into this folder", short="-o", setting=False),
        Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
    )
    output = Output("out", folder=True, file="{method}.json", allow_existing=True, replace=True)

    def check(self, ctx: Context) -> None:
        o = ctx.options
        for option, value, used_by in (("--mode", o["mode"], "norms"), ("--solver", o["solver"], "flow")):
            if value is not None and o["method"] != used_by:
                raise ConfigError(
                    f"{option} acts only with --method {used_by}; drop it, or add --method {used_by} "
                    f"(--method {o['method']} would ignore it)"
                )
        ctx.state["rows"] = rows = parse_rows(o["rows"])
        from headlab.models.loader import peek_layer_heads

        heads = peek_layer_heads(o["model"])  # the config files alone: --layer 99 was refused only after the load
        if heads is not None and not -len(heads) <= o["layer"] < len(heads):
            n = len(heads)
            raise ConfigError(
                f"--layer {o['layer']} is out of range: {o['model']} has {n} layers (0..{n - 1}, or -1 for the last)"
            )
        if o["method"] == "flow" and rows is not None and len(rows) > 1:
            raise ConfigError(
                f"--rows {o['rows']}: --method flow follows one source token; give one position (e.g. --rows cls)"
            )

    def check_loaded(self, ctx: Context) -> None:
        check_loaded(ctx.loaded, ctx.data["text"], ctx.options["layer"], ctx.state["rows"])

    def run_unit(self, ctx: Context, unit, recording=None):
        o, rows, text = ctx.options, ctx.state["rows"], ctx.data["text"]
        from headlab.interpret.flow.stacks import several_stacks

        if o["method"] != "norms" and several_stacks(ctx.loaded.adapter):  # the page shows one chain of layers
            raise ConfigError(
                f"--method {o['method']} on an encoder-decoder answers per stack: call headlab.rollout / "
                "headlab.attention_flow from Python (a result per stack, or stack='encoder' / 'decoder')"
            )
        if o["method"] in ("rollout", "norm-rollout"):
            from headlab.interpret.flow.rollout import rollout

            return rollout(
                ctx.loaded,
                text,
                method="norm" if o["method"] == "norm-rollout" else "mean",
                rows=rows,
                layer=o["layer"],
            )
        if o["method"] == "flow":
            from headlab.interpret.flow.maxflow import attention_flow

            return attention_flow(
                ctx.loaded,
                text,
                source=rows[0] if rows else 0,
                layer=o["layer"],
                solver=o["solver"] or SOLVERS[0],
                progress=ctx.progress,
            )
        from headlab.interpret.flow.norms import attention_norms

        return attention_norms(
            ctx.loaded,
            text,
            mode=o["mode"] or MODES[0],  # type: ignore[arg-type]  # --mode: one of MODES (its choices)
            stream=True,
            rows=rows,
            key_positions=[0, -1],
        )

    def unit_to_json(self, value):
        return value.to_json()

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        return InstrumentResult.of(values[self.name])

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.results import write_json

        return [write_json(path, result.native.to_json(), indent=None)]


__all__ = ["Flow", "METHODS", "MODES", "SOLVERS", "check_loaded", "parse_rows"]
