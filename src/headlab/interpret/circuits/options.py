"""The options of ``headlab circuit`` (:class:`~headlab.interpret.instruments.circuit.CircuitStudy`), as the
command line shows them and the study runner checks them one by one: the task and its pairs, how edges are scored,
how the circuit is chosen and measured, and where the files go. The checks of several options together, and of
options against the model, are the instrument's."""

from __future__ import annotations

import math
from pathlib import Path

from headlab.errors import ConfigError
from headlab.interpret.circuits.discovery import METHODS as DISCOVER_METHODS
from headlab.interpret.circuits.eap import METHODS as SCORE_METHODS
from headlab.interpret.circuits.patching import ABLATIONS
from headlab.interpret.circuits.sizes import DEFAULT_EDGES
from headlab.interpret.circuits.tasks import TASKS
from headlab.interpret.study.base import Option, at_least

MAX_RANDOM = 1000  # --random: random circuits per size, one forward each


def check_pairs(value, option: Option, options: dict) -> None:
    from headlab.interpret.circuits.tasks.base import MAX_PAIRS

    at_least(1)(value, option, options)
    if value > MAX_PAIRS:
        raise ConfigError(
            f"{option.label} must be at most {MAX_PAIRS:,} (each pair is a row of every forward), got {value}"
        )


def check_steps(value, option: Option, options: dict) -> None:
    if not 1 <= value <= 1000:
        raise ConfigError(
            f"{option.label} must be from 1 to 1000 (EAP-IG's interpolation steps; Hanna et al. use 5 "
            f"to 100), got {value}"
        )


def check_random(value, option: Option, options: dict) -> None:
    at_least(0)(value, option, options)
    if value > MAX_RANDOM:  # 10**12 loaded the model, then ran a forward per random circuit without end
        raise ConfigError(
            f"{option.label} must be at most {MAX_RANDOM} (random circuits per size, a forward each; "
            f"the default 2 draws the baseline band), got {value:,}"
        )


def check_threshold(value, option: Option, options: dict) -> None:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"{option.label} must be a number of 0 or more (ACDC removes an edge when the criterion "
            f"grows by at most that; Conmy et al. sweep 1e-4 to 1e-1), got {value}"
        )


#: the options of ``headlab circuit``, in the order ``--help`` lists them
OPTIONS = (
    Option("task", "--task", str, "ioi", f"the task: {' | '.join(TASKS)}", choices=tuple(TASKS)),
    Option("pairs", "--pairs", int, 16, "clean/corrupted pairs of the task", check=check_pairs),
    Option("model", "--model", str, "smollm2", "a known model name or a model folder (a pre-norm decoder)", short="-m"),
    Option(
        "method",
        "--method",
        str,
        "eap-ig",
        f"edge scores: {' | '.join(SCORE_METHODS)} (exact: two forwards per edge, for small graphs)",
        choices=SCORE_METHODS,
    ),
    Option("steps", "--steps", int, 5, "EAP-IG's interpolation steps (Hanna et al. use 5 to 100)", check=check_steps),
    Option(
        "scores",
        "--scores",
        Path,
        None,
        "reuse the edge scores of an earlier run (its scores.json) instead of scoring again",
    ),
    Option(
        "discover",
        "--discover",
        str,
        "top-n",
        f"how the circuit is chosen: {' | '.join(DISCOVER_METHODS)}",
        choices=DISCOVER_METHODS,
    ),
    Option(
        "edges",
        "--edges",
        str,
        None,
        f"top-n and greedy: the circuit's size, N edges or P% of the graph's edges (default {DEFAULT_EDGES})",
    ),
    Option(
        "threshold",
        "--threshold",
        float,
        None,
        "acdc (required there): remove an edge when the criterion grows by at most this",
        check=check_threshold,
    ),
    Option(
        "criterion",
        "--criterion",
        str,
        None,
        "acdc: kl (KL divergence to the model, default) | metric (|change of the task's metric|)",
        choices=("kl", "metric"),
    ),
    Option(
        "rank",
        "--rank",
        str,
        "signed",
        "how top-n and the curve rank edges: signed (the edges whose patch "
        "moves the metric furthest towards the corrupted run first; MIB's CPR ranking) or abs (|score|, "
        "MIB's CMD ranking)",
        choices=("signed", "abs"),
    ),
    Option(
        "ablation",
        "--ablation",
        str,
        "patch",
        f"what an edge outside the circuit carries: {' | '.join(ABLATIONS)}",
        choices=ABLATIONS,
    ),
    Option(
        "faithfulness",
        "--faithfulness",
        bool,
        True,
        "measure the faithfulness curve over circuit sizes",
        off="--no-faithfulness",
    ),
    Option(
        "random",
        "--random",
        int,
        2,
        "random circuits per size (the curve's baseline band; a forward each)",
        check=check_random,
    ),
    Option("seed", "--seed", int, 0, "the pairs' draw, the random circuits and resample ablation", check=at_least(0)),
    Option(
        "atlas",
        "--atlas",
        Path,
        None,
        "an atlas.json (headlab atlas --out) whose head roles label the page",
        reads="json",
        setting=False,
    ),
    Option("top", "--top", int, 10, "how many edges to list", check=at_least(1), setting=False),
    Option(
        "out",
        "--out",
        Path,
        None,
        "a folder for scores.json, circuit.json, faithfulness.json, circuit.html",
        short="-o",
        setting=False,
    ),
    Option("force", "--force", bool, False, "write into a non-empty --out folder", setting=False),
    Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
)


__all__ = ["MAX_RANDOM", "OPTIONS", "check_pairs", "check_random", "check_steps", "check_threshold"]
