"""``generate``: decoding with a KV cache shaped per head, as an instrument; and what ``train-gates``
(:mod:`headlab.decode.gates_instrument`) shares with it.

Both live in the decode layer because their library is here (:func:`headlab.decode.generate.generate`,
:func:`headlab.decode.train.train_gates`); the registry they join is interpret's
(:mod:`headlab.interpret.study.base`), which decode may import. The command table (``headlab.cli.table``) makes them
rows; their views (the terminal) are :mod:`headlab.cli.views.decode`.

:class:`Generate` continues one prompt: one unit (a generation cannot be kept half done). Its options are checked
before anything is read or loaded, the ``--kv-from`` file is read (:func:`read_policy_file`) before the load, and the
policy is built against the loaded model (:func:`build_policy`) before the first token.
:func:`~headlab.decode.generate.generate` draws its own bar over the steps (none with ``--json``).

Both read a model's positions from its config files before the load
(:func:`headlab.models.peek.peek_max_positions`); when the config does not say, the same check runs on the loaded
model, still before any work.
"""

from __future__ import annotations

from pathlib import Path

from headlab.decode import policy as _policy  # noqa: F401  (registers every shipped rule: --policy's help lists them)
from headlab.decode.rules import usages
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

POLICY_FILE = "a policy JSON, an atlas JSON (headlab atlas) or trained gates (GateTraining.save)"


def read_policy_file(path: Path) -> dict:
    """A policy file (``{"heads": ...}``, from ``Policy.to_json``), an atlas JSON (``{"scores": ...}``) or trained
    gates (``{"gates": ...}``, from ``GateTraining.save``), read by :func:`headlab.reading.read_json_file` and
    checked. Messages keep this option's words: "is not a file", "is not readable JSON: <the reader's reason>"."""
    from headlab.reading import read_json_file

    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"--kv-from {str(p)!r} is not a file; give {POLICY_FILE}")
    try:
        data = read_json_file(p, what=POLICY_FILE)
    except InputError as e:  # the reader's line is "'FILE' is not JSON: WHY": keep WHY
        why = str(e).removeprefix(repr(str(p)) + " ").removeprefix("is ").removeprefix("not JSON: ")
        raise InputError(f"--kv-from {str(p)!r} is not readable JSON: {why}") from None
    if not isinstance(data, dict) or not ({"heads", "scores", "gates"} & set(data)):
        raise InputError(
            f"--kv-from {str(p)!r}: expected a policy ({{\"heads\": ...}}), an atlas ({{\"scores\": ...}}) "
            "or trained gates ({\"gates\": ...})"
        )
    if "heads" in data:  # a policy; or heads.json of headlab analyze, whose "heads" is its per-head table
        from headlab.decode.rule_checks import check_policy_data

        check_policy_data(data, f"--kv-from {str(p)!r}")
    return data


def build_policy(loaded, policy: str, kv_from: Path | None, keep: float | None, data: dict | None):
    """The policy the options describe: ``--policy`` alone is uniform; with an atlas (or trained gates), the
    split keeps ``--keep`` of the kv heads full and gives the rest ``--policy``'s window."""
    from headlab.decode import kv

    rule = kv.as_rule(policy)
    keep = 0.5 if keep is None else keep
    if data is None:
        return kv.Policy.uniform(rule)
    assert kv_from is not None  # data is read from it
    if "heads" in data:
        if policy.strip().lower() != "full":
            raise ConfigError(f"--kv-from {kv_from} is a whole policy; drop --policy {policy} (it would be ignored)")
        return kv.Policy.load(kv_from)
    if "gates" in data:
        gates = kv.GateTraining.load(kv_from)

        def split(rest, kept=None):
            return kv.Policy.from_gates(loaded, gates, keep=keep, rest=rest, kept=kept)
    else:

        def split(rest, kept=None):
            return kv.Policy.from_atlas(loaded, data, keep=keep, rest=rest, kept=kept)

    if rule.kind == "window":  # the split's windowed heads take --policy's window, the kept ones stay full
        return split(rule)
    if rule.kind == "full" and rule.bits != 16:  # a split on quantized KV: --policy's precision everywhere
        return split(kv.window(4, 256, bits=rule.bits), rule)
    return split(kv.window(4, 256) if "gates" not in data else None)


def kv_heads_text(counts: dict) -> str:
    """``"12 kv heads full, 78 windowed, 0 dropped"`` (and ``", 6 by token budget"`` for SnapKV / Ada-KV heads).

    >>> kv_heads_text({"full": 1, "window": 3, "drop": 0})
    '1 kv heads full, 3 windowed, 0 dropped'
    """
    text = f"{counts.get('full', 0)} kv heads full, {counts.get('window', 0)} windowed, {counts.get('drop', 0)} dropped"
    return text + (f", {counts['snap']} by token budget" if counts.get("snap") else "")


def _rule(value, option, options) -> None:
    from headlab.decode import kv

    kv.as_rule(value)


def _kv_dtype(value, option, options) -> None:
    """A floating storage dtype; with ``--policy`` alone, a rule whose store keeps the model's dtype (a user's store) is
    refused here, before the load (a ``--kv-from`` policy is checked once it is built)."""
    from headlab.decode.cache import check_storage
    from headlab.decode.policy import Policy

    text = options.get("policy")
    policies = [Policy.parse(text)] if isinstance(text, str) and options.get("kv_from") is None else []
    check_storage(value, policies, name=option.label)


def _keep(value, option, options) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"--keep {value}: give the fraction of kv heads kept full, in [0, 1]")
    if options.get("kv_from") is None:
        raise ConfigError(
            f"--keep {value} acts only with --kv-from (an atlas or trained gates); add --kv-from FILE or drop --keep"
        )


def _temperature(value, option, options) -> None:
    if not 0 < value < float("inf"):
        raise ConfigError(f"--temperature must be a number > 0 for sampling, got {value}")


def _prompt(value, option, options) -> None:
    from headlab.reading import read_text

    if not value.strip():
        raise InputError("the prompt is empty; give a text to continue")
    read_text(value, "PROMPT")  # not UTF-8: the byte and where


class DecodingInstrument(Instrument):
    """What both share: the model's positions, peeked before the load (the runner's display shows their progress)."""

    # stderr holds the decoding (or training) progress and the runner's one line on Ctrl-C, without a "loading
    # model" line: a log of many prompts reads as one line per prompt (tests/test_row_generate.py)
    announce = False

    def positions(self, ctx: Context) -> int | None:
        """The model's positions: peeked before the load, or the loaded model's."""
        if ctx.loaded is not None:
            return getattr(ctx.loaded, "max_positions", None)
        from headlab.models.peek import peek_max_positions

        return peek_max_positions(ctx.options["model"])


MODEL = Option("model", "--model", str, "smollm2", "a known causal LM name (smollm2) or a model folder", short="-m")


@register
class Generate(DecodingInstrument):
    """Continue a prompt with a per-head KV cache."""

    name = "generate"
    reads_text = True  # a model folder without a tokenizer is refused before the load
    kind = "generation"
    summary = """Continue PROMPT with a per-head KV cache; print the text, the cache's bytes against the full cache's, and speed.

Example (StreamingLLM: 4 sink tokens and the last 256 on every head):
headlab generate "The capital of France is" --policy streaming:4,256 --max-new-tokens 16"""
    options = (
        Option("prompt", None, str, REQUIRED, "the text to continue", check=_prompt),
        MODEL,
        Option(
            "policy",
            "--policy",
            str,
            "full",
            f"{usages()}; each with optional ,bits=N (every kv head)",
            short="-p",
            check=_rule,
            aliases=("--kv-policy",),
        ),
        Option(
            "kv_from",
            "--kv-from",
            Path,
            None,
            "a policy JSON (Policy.to_json), an atlas JSON (its retrieval and "
            "non-local heads stay full, the rest get --policy's window) or trained gates (kv.Policy.train / "
            "GateTraining.save: the highest gates stay full)",
        ),
        Option(
            "keep",
            "--keep",
            float,
            None,
            "with --kv-from (an atlas or gates): the fraction of kv heads kept full (default 0.5)",
            check=_keep,
        ),
        Option("max_new_tokens", "--max-new-tokens", int, 32, "tokens to generate", short="-n", check=at_least(1)),
        Option(
            "kv_dtype",
            "--kv-dtype",
            str,
            None,
            "hold the cache in this dtype, e.g. float16 (16 bits under a float32 model; default: the model's)",
            check=_kv_dtype,
        ),
        Option("sample", "--sample", bool, False, "sample instead of greedy decoding"),
        Option(
            "temperature",
            "--temperature",
            float,
            None,
            "with --sample: divides the logits (default 1.0)",
            check=_temperature,
        ),
        Option(
            "top_k", "--top-k", int, None, "with --sample: sample among the k most likely tokens", check=at_least(1)
        ),
        Option("seed", "--seed", int, None, "with --sample: the sampling seed (default 0)"),
        Option("out", "--out", Path, None, "also write the result as JSON here", short="-o", setting=False),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
        Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
    )
    output = Output("out", folder=False, force="force")

    def check(self, ctx: Context) -> None:
        o = ctx.options
        given = [
            flag
            for name, flag in (("temperature", "--temperature"), ("top_k", "--top-k"), ("seed", "--seed"))
            if o[name] is not None
        ]
        if given and not o["sample"]:
            it = "it acts" if len(given) == 1 else "they act"
            raise ConfigError(
                f"{', '.join(given)}: {it} only on sampling; add --sample (greedy decoding, the default, "
                f"would ignore {'it' if len(given) == 1 else 'them'})"
            )
        self.check_positions(ctx)

    def check_positions(self, ctx: Context) -> None:
        n, limit = ctx.options["max_new_tokens"], self.positions(ctx)
        if limit is not None and n >= limit:
            raise ConfigError(
                f"--max-new-tokens {n}: with the prompt it must fit in the {limit:,} positions "
                f"of {ctx.options['model']}; give at most {limit - 1}"
            )

    def prepare(self, ctx: Context) -> None:
        kv_from = ctx.options["kv_from"]
        ctx.state["policy_file"] = read_policy_file(kv_from) if kv_from is not None else None

    def check_loaded(self, ctx: Context) -> None:
        """The positions against the loaded model, and the policy built on it (a head it lacks, an encoder)."""
        from headlab.decode.heads import check_decoder

        self.check_positions(ctx)
        o, loaded = ctx.options, ctx.loaded
        ctx.state["policy"] = build_policy(loaded, o["policy"], o["kv_from"], o["keep"], ctx.state["policy_file"])
        from headlab.decode.cache import check_storage

        check_storage(o["kv_dtype"], [ctx.state["policy"]], name="--kv-dtype")
        adapter = getattr(loaded, "adapter", None)
        if adapter is not None:
            check_decoder(adapter, getattr(loaded, "name", None) or type(adapter.model).__name__)

    def run_unit(self, ctx: Context, unit, recording=None):
        from headlab.decode.generate import generate

        o = ctx.options
        return generate(
            ctx.loaded,
            o["prompt"],
            policy=ctx.state["policy"],
            max_new_tokens=o["max_new_tokens"],
            kv_dtype=o["kv_dtype"],
            sample=o["sample"],
            temperature=1.0 if o["temperature"] is None else o["temperature"],
            top_k=o["top_k"],
            seed=(o["seed"] or 0) if o["sample"] else None,
            progress=None if o["as_json"] else ctx.progress,
        )

    def unit_to_json(self, value):
        return value.to_json()

    def document(self, ctx: Context, g) -> dict:
        """What ``--out`` holds and ``--json`` prints: the model, the prompt and the generation's envelope."""
        return {"model": getattr(ctx.loaded, "name", None), "prompt": ctx.options["prompt"], **g.to_json()}

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        g = values[self.name]
        return InstrumentResult.of(g, self.document(ctx, g))

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.results import write_json

        return [write_json(path, self.document(ctx, result.native))]


__all__ = ["MODEL", "DecodingInstrument", "Generate", "build_policy", "kv_heads_text", "read_policy_file"]
