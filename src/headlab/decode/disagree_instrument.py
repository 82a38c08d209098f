"""``headlab kv disagree``: the tasks on which two policies of finished ``headlab kv suite`` runs disagreed, decoded
again under other policies, as an instrument of the study runner.

Does a change to the cache give the baseline's answers back where the compared policy lost them? The tasks are
rebuilt from each result file's settings (model, seed, tokens, continuation: the suite is deterministic from them)
and decoded exactly as the suite decodes them (the question asked after the compressed context, or inside it with
``--query-aware``; caches held in the run's ``--kv-dtype``), so a policy the files ran gives back their answers (the
``as recorded`` column checks it). For each policy: how many of the disagreeing tasks it gets right, on how many it
answers as the baseline did and on how many as the compared policy did.

``--rotate-values`` folds a normalised Hadamard matrix ``R`` into every layer (:func:`rotate_values`): the values
are stored turned and turned back by W^O, the same model in exact arithmetic, whose cache quantizes rotated values
(QuaRot, Ashkboos et al. 2024).

A unit is one disagreeing task under every policy; the runner keeps finished tasks on Ctrl-C (``--resume`` goes
on) and splits them over torchrun's ranks.
"""

from __future__ import annotations

from pathlib import Path

from headlab.decode.quant import hadamard
from headlab.decode.suite_instrument import KIND as SUITE_KIND
from headlab.decode.suite_instrument import check_policies, policy_texts
from headlab.errors import ConfigError, InputError
from headlab.interpret.study.base import REQUIRED, Context, Instrument, InstrumentResult, Option, Output, Unit, register

KIND = "kv_disagree"
SUITE_DEFAULTS = {"kv_dtype": None, "query_aware": False}  # settings a run written before them did not record


def rotate_values(adapter) -> None:
    """Fold ``R = hadamard(d)`` into every layer, in place: each kv head's value ``v R`` (W_V and b_V), each query
    head's output block ``R^T W^O`` (``R`` is orthogonal), so the model computes what it did in exact arithmetic."""
    import torch

    with torch.no_grad():
        for layer in range(adapter.n_layers):
            w_v, w_o, b_v = adapter.W_V(layer), adapter.W_O(layer), adapter.b_V(layer)
            r = hadamard(w_v.shape[-1]).to(w_v.dtype)
            w_v.copy_(w_v @ r)  # (Hkv, E, d) @ (d, d): views of the model's weights
            w_o.copy_(r.T @ w_o)  # (H, d, E)
            if b_v is not None:
                b_v.copy_(b_v @ r)


def _runs(value, option, options) -> None:
    if not [p for p in value.split(",") if p.strip()]:
        raise ConfigError(
            f"{option.label} {value!r}: give one or more `headlab kv suite` result files, separated by ','"
        )


@register
class KVDisagree(Instrument):
    """The tasks two policies of finished suite runs disagreed on, decoded again under other policies."""

    name = "kv-disagree"
    command = "kv disagree"
    kind = KIND
    reads_text = True
    resumable = True
    stage = "tasks"
    sharded = "decoding with a per-head cache runs the model on one process; split the tasks with torchrun instead"
    summary = """Decode again, under other KV policies, the suite tasks on which two policies of finished runs disagreed.

Example (the tasks where the full cache and 4-bit disagreed, under 8 bits and 4 bits with 4 sinks in 16 bits):
headlab kv disagree --runs suite.json --policies "full:bits=8,group=64;window:4,100000,bits=4" --out disagree.json"""
    options = (
        Option("runs", "--runs", str, REQUIRED, "`headlab kv suite` result files, separated by ','", check=_runs),
        Option(
            "policies",
            "--policies",
            str,
            REQUIRED,
            "the policies to decode them with, separated by ';'",
            check=check_policies,
        ),
        Option("compared", "--compared", str, None, "the runs' policy compared with their first (default: the second)"),
        Option("model", "--model", str, None, "the model (default: the runs' own)", short="-m"),
        Option(
            "rotate_values",
            "--rotate-values",
            bool,
            False,
            "fold a Hadamard rotation into W_V and W^O (values quantized turned, QuaRot)",
        ),
        Option("out", "--out", Path, None, "write the result (JSON) here", short="-o", setting=False),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
    )
    output = Output("out", folder=False, force="force")

    def prepare(self, ctx: Context) -> None:
        """The runs read and checked, and the disagreeing tasks found, before the model loads."""
        from headlab.reading import read_json_file

        o, runs = ctx.options, []
        for p in (p.strip() for p in o["runs"].split(",") if p.strip()):
            r = read_json_file(p, "--runs", what="a `headlab kv suite` result file")
            if not isinstance(r, dict) or r.get("headlab", {}).get("kind") != SUITE_KIND or "units" not in r:
                raise InputError(
                    f"--runs {p!r}: not a `headlab kv suite` result (write one with `headlab kv suite -o FILE`)"
                )
            runs.append(r)
        settings = [{**SUITE_DEFAULTS, **r["headlab"]["settings"]} for r in runs]
        if any(st != {**settings[0], "seed": st["seed"]} for st in settings):
            raise InputError("--runs: the result files differ in a setting other than --seed; give runs of one suite")
        texts = policy_texts(settings[0]["policies"])
        base = texts[0]
        compared = o["compared"] or (texts[1] if len(texts) > 1 else None)
        if compared is None or compared == base or compared not in texts:
            raise InputError(
                f"--compared {compared!r}: give one of the runs' policies other than their first "
                f"({', '.join(texts[1:]) or 'they ran only ' + repr(base)})"
            )
        todo, recorded = [], []  # (run, task, baseline right, compared right); each task's answers by policy
        for ri, r in enumerate(runs):
            for key, unit in sorted(r["units"].items(), key=lambda kv: int(kv[0].split()[-1])):
                a, b = unit["policies"][base]["right"], unit["policies"][compared]["right"]
                if a != b:
                    todo.append((ri, int(key.split()[-1]), a, b))
                    recorded.append({p: v["right"] for p, v in unit["policies"].items()})
        if not todo:
            raise InputError(f"--runs: {base!r} and {compared!r} agree on every task; nothing to decode again")
        if o["model"] is None:
            o["model"] = settings[0]["model"]
        ctx.state.update(settings=settings, base=base, compared=compared, todo=todo, recorded=recorded)

    def check_loaded(self, ctx: Context) -> None:
        from headlab.decode import kv, suite
        from headlab.decode.heads import check_decoder
        from headlab.models.loaded_model import resolve

        adapter = resolve(ctx.loaded)[0]
        check_decoder(adapter, getattr(ctx.loaded, "name", None) or type(adapter.model).__name__)
        if ctx.options["rotate_values"]:
            try:
                rotate_values(adapter)
            except ConfigError as exc:
                raise ConfigError(f"--rotate-values: {exc}") from None
        tok = ctx.loaded.tokenizer
        st = ctx.state["settings"]
        ctx.state["tasks"] = {
            ri: suite.make_suite(tok, s["n"], tokens=s["tokens"], seed=s["seed"], continuation_tokens=s["continuation"])
            for ri, s in enumerate(st)
        }
        texts = policy_texts(ctx.options["policies"])
        ctx.state["policies"] = {t: (None if t == "full" else kv.Policy.parse(t)) for t in texts}

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(f"run {ri} task {i}", n) for n, (ri, i, _, _) in enumerate(ctx.state["todo"])]

    def run_unit(self, ctx: Context, unit: Unit, recording=None) -> dict:
        """One task under every policy: ``{"right": {policy: 0 or 1}}``."""
        import torch

        from headlab.decode.generate import generate

        ri, i, _, _ = ctx.state["todo"][unit.payload]
        st, t, tok = ctx.state["settings"][ri], ctx.state["tasks"][ri][i], ctx.loaded.tokenizer
        context, asked = (
            torch.tensor([tok(x, add_special_tokens=False)["input_ids"]]) for x in (t.context, t.question)
        )
        question: torch.Tensor | None = asked
        if st["query_aware"]:  # one prompt: the selection sees the question, as the runs' suite asked it
            context, question = torch.cat([context, asked], 1), None
        right = {}
        for text, policy in ctx.state["policies"].items():
            g = generate(
                ctx.loaded,
                context,
                question=question,
                policy=policy,
                max_new_tokens=t.max_new_tokens,
                kv_dtype=st["kv_dtype"],
            )
            right[text] = int(t.correct(g.text))
        return {"right": right}

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        todo, recorded = ctx.state["todo"], ctx.state["recorded"]
        got = [values[u.key]["right"] for u in self.units(ctx)]
        rows = []
        for p in policy_texts(ctx.options["policies"]):
            right = [g[p] for g in got]
            rows.append(
                {
                    "policy": p,
                    "right": sum(right),
                    "as_baseline": sum(x == a for x, (_, _, a, _) in zip(right, todo)),
                    "as_compared": sum(x == b for x, (_, _, _, b) in zip(right, todo)),
                    "as_recorded": sum(x == rec[p] for x, rec in zip(right, recorded)) if p in recorded[0] else None,
                }
            )
        figures = {
            "baseline": ctx.state["base"],
            "compared": ctx.state["compared"],
            "tasks": len(todo),
            "baseline_right": sum(a for _, _, a, _ in todo),
            "compared_right": sum(b for _, _, _, b in todo),
            "rotated_values": ctx.options["rotate_values"],
            "rows": rows,
            "tasks_run": [[ri, i] for ri, i, _, _ in todo],
        }
        return InstrumentResult(KIND, model=getattr(ctx.loaded, "name", None), settings=ctx.settings, figures=figures)


__all__ = ["KVDisagree", "rotate_values"]
