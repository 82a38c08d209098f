"""``headlab kv suite``: the RULER-style suite under KV policies, as an instrument of the study runner.

The tasks are :mod:`headlab.decode.suite`'s (single, multi-key and multi-value needles, variable tracking, common
words, question answering over a passage), deterministic from ``--seed``, about ``--tokens`` tokens each. A unit is
one task under every policy: the answer's correctness and RULER's score (the share of answers found), the bytes the
cache held against the full cache's (``kv_bytes / kv_bytes_full``), the seconds, and, for the first ``--ppl`` tasks,
the mean negative log-likelihood of a held-out continuation decoded after the compressed prefill
(:func:`~headlab.decode.suite_stats.decoded_nll`). The first policy is the baseline; :meth:`KVSuite.finish` pairs
every other one with it: McNemar's interval of the difference of accuracies with its exact p-value, and paired
bootstrap intervals of the difference of RULER scores and of the relative change of decoded perplexity
(:mod:`headlab.decode.suite_stats`).

Being the runner's units, a long evaluation (the issue's 500 tasks take hours on a CPU) keeps its finished tasks on
Ctrl-C and goes on with ``--resume``, and under torchrun the tasks are split over the ranks.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from headlab.decode.instrument import MODEL
from headlab.errors import ConfigError
from headlab.interpret.study.base import Context, Instrument, InstrumentResult, Option, Output, Unit, at_least, register

DEFAULT_POLICIES = "full;full:bits=4;adakv:256,bits=4"
KIND = "kv_suite"


def policy_texts(value: str) -> list[str]:
    """The policies of ``--policies`` (``;`` between them: a policy's own items are separated by commas).

    >>> policy_texts("full; full:bits=4 ;adakv:256,bits=4")
    ['full', 'full:bits=4', 'adakv:256,bits=4']
    """
    return [p.strip() for p in value.split(";") if p.strip()]


MAX_TASKS = 100_000  # the evaluation is 500; more is a typo, refused before anything is generated


def check_tasks(value, option, options) -> None:
    at_least(1)(value, option, options)
    if value > MAX_TASKS:
        raise ConfigError(f"{option.label} {value:,}: at most {MAX_TASKS:,} tasks (the suite builds them all first)")


def _kv_dtype(value, option, options) -> None:
    """A floating storage dtype, which every rule of the policies' stores can take (a user's store may not)."""
    from headlab.decode import kv
    from headlab.decode.cache import check_storage

    texts = policy_texts(options["policies"]) if isinstance(options.get("policies"), str) else []
    check_storage(value, [kv.Policy.parse(t) for t in texts], name=option.label)


def check_policies(value, option, options) -> None:
    from headlab.decode import kv

    texts = policy_texts(value)
    if not texts:
        raise ConfigError(f"{option.label} {value!r}: give at least one policy, e.g. {DEFAULT_POLICIES!r}")
    if len(set(texts)) != len(texts):
        raise ConfigError(f"{option.label} {value!r}: a policy is named twice; each is compared once")
    for t in texts:
        kv.Policy.parse(t)  # an unknown rule or a bad item: the rule's own message


def check_fits(ctx: Context, limit: int | None, need: int, what: str, fit: str = "a task and its question") -> None:
    """``need`` positions (``fit``: a task and what follows it) must fit the model's ``limit`` (None: peeked from
    the model's config before the load); refused in ``what``'s words."""
    if limit is None and isinstance(ctx.options["model"], str | Path):
        from headlab.models.peek import peek_max_positions

        limit = peek_max_positions(str(ctx.options["model"]))
    if limit is not None and need >= limit:
        raise ConfigError(
            f"{what}: {fit} must fit in the {limit:,} positions of {ctx.options['model']}; give fewer --tokens"
        )


@register
class KVSuite(Instrument):
    """The RULER-style suite under KV policies, paired against the first."""

    name = "kv-suite"
    command = "kv suite"
    kind = KIND
    reads_text = True
    resumable = True  # hours of tasks: Ctrl-C keeps the finished ones, --resume runs the rest
    stage = "tasks"
    sharded = "decoding with a per-head cache runs the model on one process; split the tasks with torchrun instead"
    summary = """Run a RULER-style suite (needles, variable tracking, common words, QA) under KV policies, paired against the first.

Example (48 tasks of about 1k tokens; the full cache, 4-bit, Ada-KV at 256 keys on 4 bits):
headlab kv suite --policies "full;full:bits=4;adakv:256,bits=4" --n 48 --tokens 1024 --out suite.json"""
    options = (
        MODEL,
        Option(
            "policies",
            "--policies",
            str,
            DEFAULT_POLICIES,
            "the policies, separated by ';' (the first is the baseline)",
            check=check_policies,
        ),
        Option("n", "--n", int, 48, "tasks (the six kinds in turn)", check=check_tasks),
        Option("tokens", "--tokens", int, 1024, "tokens per task's context", check=at_least(128)),
        Option("seed", "--seed", int, 0, "the tasks' seed", check=at_least(0)),
        Option("ppl", "--ppl", int, 12, "tasks whose held-out continuation is scored", check=at_least(0)),
        Option(
            "kv_dtype",
            "--kv-dtype",
            str,
            None,
            "the caches' storage dtype, e.g. float16 (a 16-bit cache held under a float32 model; default: the model's)",
            check=_kv_dtype,
        ),
        Option(
            "query_aware",
            "--query-aware",
            bool,
            False,
            "ask the question at the end of the context, inside SnapKV's observation window (the papers' setting); "
            "default: compress the context, then ask (kvpress's)",
        ),
        Option("continuation", "--continuation", int, 64, "tokens of held-out continuation", check=at_least(2)),
        Option("out", "--out", Path, None, "write the result (JSON) here", short="-o", setting=False),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
    )
    output = Output("out", folder=False, force="force")

    def check(self, ctx: Context) -> None:
        """The context and its continuation must fit the model's positions (peeked before the load)."""
        self.check_positions(ctx, None)

    def check_positions(self, ctx: Context, limit: int | None) -> None:
        o = ctx.options
        check_fits(
            ctx,
            limit,
            o["tokens"] + o["continuation"],
            f"--tokens {o['tokens']} with --continuation {o['continuation']}",
        )

    def check_loaded(self, ctx: Context) -> None:
        from headlab.decode import kv, suite
        from headlab.decode.heads import check_decoder

        self.check_positions(ctx, getattr(ctx.loaded, "max_positions", None))
        adapter = getattr(ctx.loaded, "adapter", ctx.loaded)
        check_decoder(adapter, getattr(ctx.loaded, "name", None) or type(adapter.model).__name__)
        o = ctx.options
        tok = getattr(ctx.loaded, "tokenizer", None)
        ctx.state["policies"] = {t: (None if t == "full" else kv.Policy.parse(t)) for t in policy_texts(o["policies"])}
        ctx.state["tasks"] = suite.make_suite(
            tok, o["n"], tokens=o["tokens"], seed=o["seed"], continuation_tokens=o["continuation"]
        )

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(f"task {i}", i) for i in range(len(ctx.state["tasks"]))]

    def run_unit(self, ctx: Context, unit: Unit, recording=None) -> dict:
        """One task under every policy: ``{"kind", "length", "policies": {text: {right, score, bytes, seconds,
        nll?}}}``."""
        import torch

        from headlab.decode.generate import generate
        from headlab.decode.suite_stats import decoded_nll

        loaded, tok = ctx.loaded, ctx.loaded.tokenizer
        t = ctx.state["tasks"][unit.payload]

        def ids(text: str) -> torch.Tensor:
            return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])

        context, asked = ids(t.context), ids(t.question)
        out: dict = {"kind": t.kind, "length": context.shape[1] + asked.shape[1], "policies": {}}
        question: torch.Tensor | None = asked
        if ctx.options["query_aware"]:  # one prompt: the selection sees the question
            context, question = torch.cat([context, asked], 1), None
        dtype = ctx.options["kv_dtype"]
        for text, policy in ctx.state["policies"].items():
            t0 = time.perf_counter()
            g = generate(
                loaded, context, question=question, policy=policy, max_new_tokens=t.max_new_tokens, kv_dtype=dtype
            )
            row = {
                "right": int(t.correct(g.text)),
                "score": t.score(g.text),
                "bytes": g.kv_bytes / g.kv_bytes_full,
                "seconds": time.perf_counter() - t0,
            }
            if unit.payload < ctx.options["ppl"]:
                nll = decoded_nll(
                    loaded, context, ids(t.continuation), policy=policy, question=question, kv_dtype=dtype
                )
                row["nll"] = float(nll.mean())
            out["policies"][text] = row
        return out

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        rows = suite_rows(
            policy_texts(ctx.options["policies"]),
            [values[k] for k in sorted(values, key=_index)],
            seed=ctx.options["seed"],
        )
        lengths = [v["length"] for v in values.values()]
        figures = {"rows": rows, "tasks": len(values), "lengths": [min(lengths), max(lengths)]}
        return InstrumentResult(KIND, model=getattr(ctx.loaded, "name", None), settings=ctx.settings, figures=figures)


def _index(key: str) -> int:
    return int(key.split()[-1])


def suite_rows(texts: list[str], tasks: list[dict], *, seed: int = 0) -> list[dict]:
    """Each policy's row over ``tasks`` (each a unit's value), paired against the first policy.

    >>> t = [{"kind": "qa", "policies": {"full": {"right": r, "score": r, "bytes": 1.0, "seconds": 1.0},
    ...                                  "full:bits=4": {"right": 1, "score": 1.0, "bytes": 0.3, "seconds": 2.0}}}
    ...      for r in (1, 0, 1, 1)]
    >>> rows = suite_rows(["full", "full:bits=4"], t)
    >>> rows[0]["right"], rows[1]["right"], rows[1]["vs_first"]["n10"], rows[1]["kv_bytes_vs_full"]
    (3, 4, 1, 0.3)
    """
    from headlab.decode.suite import KINDS
    from headlab.decode.suite_stats import mcnemar, paired_bootstrap

    base = texts[0]
    col = {p: {k: [t["policies"][p][k] for t in tasks] for k in ("right", "score", "bytes", "seconds")} for p in texts}
    nll = {p: [t["policies"][p]["nll"] for t in tasks if "nll" in t["policies"][p]] for p in texts}
    rows = []
    for p in texts:
        c = col[p]
        r: dict = {
            "policy": p,
            "right": sum(c["right"]),
            "n": len(tasks),
            "accuracy": sum(c["right"]) / len(tasks),
            "ruler_score": statistics.mean(c["score"]),
            "kv_bytes_vs_full": statistics.mean(c["bytes"]),
            "seconds_per_task": statistics.mean(c["seconds"]),
            "by_kind": {k: sum(x for x, t in zip(c["right"], tasks) if t["kind"] == k) for k in KINDS},
        }
        if nll[p]:
            r["decoded_ppl"] = math.exp(statistics.mean(nll[p]))
        if p != base:
            m = mcnemar(c["right"], col[base]["right"])
            b = paired_bootstrap(c["score"], col[base]["score"], seed=seed)
            r["vs_first"] = {
                "acc_diff": m.diff,
                "acc_ci95": [m.low, m.high],
                "n10": m.n10,
                "n01": m.n01,
                "mcnemar_p": m.p_value,
                "score_diff": b.diff,
                "score_ci95": [b.low, b.high],
            }
            if nll[p]:
                d = paired_bootstrap(nll[p], nll[base], seed=seed)  # the mean log-perplexity difference per task
                r["vs_first"]["decoded_ppl_change"] = [math.exp(d.diff) - 1, math.exp(d.low) - 1, math.exp(d.high) - 1]
        rows.append(r)
    return rows


__all__ = ["DEFAULT_POLICIES", "KVSuite", "check_fits", "policy_texts", "suite_rows"]
