"""``headlab generate "PROMPT"``: decode with a KV cache shaped per head, and what the cache holds."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from headlab.cli.app import (app, check_at_least, check_output_file, check_text, console, err_console, heads_text,
                             human_bytes, peek_max_positions, print_json)
from headlab.errors import ConfigError, InputError


def read_policy_file(path: Path) -> dict:
    """A policy file (``{"heads": ...}``, from ``Policy.to_json``), an atlas JSON (``{"scores": ...}``) or trained
    gates (``{"gates": ...}``, from ``GateTraining.save``), read by :func:`headlab.reading.read_json_file` and
    checked. Messages keep this option's words: "is not a file", "is not readable JSON: <the reader's reason>"."""
    from headlab.reading import read_json_file

    what = "a policy JSON, an atlas JSON (headlab atlas) or trained gates (GateTraining.save)"
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"--kv-from {str(p)!r} is not a file; give {what}")
    try:
        data = read_json_file(p, what=what)
    except InputError as e:  # the reader's line is "'FILE' is not JSON: WHY": keep WHY
        why = str(e).removeprefix(repr(str(p)) + " ").removeprefix("is ").removeprefix("not JSON: ")
        raise InputError(f"--kv-from {str(p)!r} is not readable JSON: {why}") from None
    if not isinstance(data, dict) or not ({"heads", "scores", "gates"} & set(data)):
        raise InputError(f"--kv-from {str(p)!r}: expected a policy ({{\"heads\": ...}}), an atlas ({{\"scores\": ...}}) "
                         "or trained gates ({\"gates\": ...})")
    return data


def build_policy(loaded, policy: str, kv_from: Path | None, keep: float, data: dict | None):
    """The policy the options describe: ``--policy`` alone is uniform; with an atlas (or trained gates), the
    split keeps ``--keep`` of the kv heads full and gives the rest ``--policy``'s window."""
    from headlab.decode import kv

    rule = kv.as_rule(policy)
    if data is None:
        return kv.Policy.uniform(rule)
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


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Argument(..., help="the text to continue"),
    model: str = typer.Option("smollm2", "--model", "-m", help="a known causal LM name (smollm2) or a model folder"),
    policy: str = typer.Option("full", "--policy", "--kv-policy", "-p", help="full, drop, streaming:SINK,RECENT, snapkv:BUDGET or adakv:BUDGET, each with optional ,bits=N (every kv head)"),
    kv_from: Path = typer.Option(None, "--kv-from", help="a policy JSON (Policy.to_json), an atlas JSON (its "
                                 "retrieval and non-local heads stay full, the rest get --policy's window) or trained "
                                 "gates (kv.Policy.train / GateTraining.save: the highest gates stay full)"),
    keep: float = typer.Option(0.5, "--keep", help="with an atlas or gates: the fraction of kv heads kept full"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", help="tokens to generate"),
    sample: bool = typer.Option(False, "--sample", help="sample instead of greedy decoding"),
    temperature: float = typer.Option(None, "--temperature", help="with --sample: divides the logits (default 1.0)"),
    top_k: int = typer.Option(None, "--top-k", help="with --sample: sample among the k most likely tokens"),
    seed: int = typer.Option(None, "--seed", help="with --sample: the sampling seed (default 0)"),
    out: Path = typer.Option(None, "--out", "-o", help="also write the result as JSON here"),
    force: bool = typer.Option(False, "--force", help="replace an existing --out file"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Continue PROMPT with a per-head KV cache; print the text, the cache's bytes against the full cache's, and speed.

    Example (StreamingLLM: 4 sink tokens and the last 256 on every head):
    headlab generate "The capital of France is" --policy streaming:4,256 --max-new-tokens 16
    """
    from headlab.decode import kv

    kv.as_rule(policy)  # every option checked before the model loads
    if not prompt.strip():
        raise InputError("the prompt is empty; give a text to continue")
    check_text(prompt, "PROMPT")
    check_at_least("--max-new-tokens", max_new_tokens, 1)
    if not 0.0 <= keep <= 1.0:
        raise ConfigError(f"--keep {keep}: give the fraction of kv heads kept full, in [0, 1]")
    check_at_least("--top-k", top_k, 1)
    if temperature is not None and not 0 < temperature < float("inf"):
        raise ConfigError(f"--temperature must be a number > 0 for sampling, got {temperature}")
    given = [name for name, v in (("--temperature", temperature), ("--top-k", top_k), ("--seed", seed)) if v is not None]
    if given and not sample:
        it = "it acts" if len(given) == 1 else "they act"
        raise ConfigError(f"{', '.join(given)}: {it} only on sampling; add --sample (greedy decoding, the default, "
                          f"would ignore {'it' if len(given) == 1 else 'them'})")
    temperature = 1.0 if temperature is None else temperature
    limit = peek_max_positions(model)
    if limit is not None and max_new_tokens >= limit:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: with the prompt it must fit in the {limit:,} positions "
                          f"of {model}; give at most {limit - 1}")
    data = read_policy_file(kv_from) if kv_from is not None else None
    if out is not None:
        check_output_file(out, "--out", force=force)
    from headlab.decode import generate
    from headlab.models import load

    loaded = load(model)
    pol = build_policy(loaded, policy, kv_from, keep, data)
    g = generate(loaded, prompt, policy=pol, max_new_tokens=max_new_tokens, sample=sample, temperature=temperature,
                 top_k=top_k, seed=(seed or 0) if sample else None, progress=not as_json)
    doc = {"model": loaded.name, "prompt": prompt, **g.to_json()}
    if out is not None:
        Path(out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if as_json:
        print_json(doc)
        return
    console.print(f"{prompt}[bold]{g.text}[/]", highlight=False, soft_wrap=True)
    c = g.counts
    err_console.print(
        f"{loaded.name}, policy {pol.name} ({heads_text(c)}): "
        f"KV cache {human_bytes(g.kv_bytes)} vs {human_bytes(g.kv_bytes_full)} full "
        f"({g.kv_bytes / g.kv_bytes_full:.1%}) at {g.prompt_tokens + g.ids.shape[1] - 1} tokens; prefill "
        f"{g.prefill_seconds:.2f} s, {g.tokens_per_second:.1f} tokens/s", highlight=False, soft_wrap=True)


@app.command("train-gates")
def train_gates_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="where to write the gates (JSON; --kv-from reads it)"),
    model: str = typer.Option("smollm2", "--model", "-m", help="a known causal LM name (smollm2) or a model folder"),
    window: str = typer.Option("4,256", "--window", help="SINK,RECENT: the window the gates choose against"),
    steps: int = typer.Option(100, "--steps", help="optimiser steps, one training context each"),
    seconds: float = typer.Option(None, "--seconds", help="a time budget: stop (and save) after this long"),
    tokens: int = typer.Option(512, "--tokens", help="tokens per training context"),
    contexts: int = typer.Option(16, "--contexts", help="training contexts (cycled through)"),
    keys: int = typer.Option(4, "--keys", help="passkeys hidden in each context"),
    lr: float = typer.Option(0.05, "--lr", help="Adam's learning rate"),
    l1: float = typer.Option(0.05, "--l1", help="the weight of the L1 pull towards the window"),
    seed: int = typer.Option(0, "--seed", help="draws the contexts"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="resume from / save to this file (default: OUT.ckpt)"),
    force: bool = typer.Option(False, "--force", help="replace an existing --out file"),
) -> None:
    """Train DuoAttention's gates (one per kv head) on synthetic passkey contexts; write them for --kv-from.

    Example (then decode with the half of kv heads whose gates are highest kept full):
    headlab train-gates --out gates.json --steps 50 --seconds 1800
    headlab generate "..." --kv-from gates.json --keep 0.5
    """
    from headlab.decode import kv

    parts = window.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--window {window!r}: write SINK,RECENT, e.g. 4,256")
    rule = kv.as_rule(f"streaming:{window}")
    for name, v, low in (("--steps", steps, 1), ("--contexts", contexts, 1), ("--keys", keys, 1), ("--tokens", tokens,
                         rule.sink + rule.recent + 64)):
        check_at_least(name, v, low, what=" (the window's sink + recent + 64)" if name == "--tokens" else "")
    check_at_least("--lr", lr, 1e-9)
    check_at_least("--l1", l1, 0)
    check_at_least("--seconds", seconds, 1)
    limit = peek_max_positions(model)
    if limit is not None and tokens > limit:
        raise ConfigError(f"--tokens {tokens}: {model} reads at most {limit:,} positions")
    check_output_file(out, "--out", force=force)
    ck = checkpoint if checkpoint is not None else Path(str(out) + ".ckpt")
    if ck.exists() and not ck.is_file():
        raise InputError(f"--checkpoint {str(ck)!r} is not a file")
    from headlab.decode import train_gates
    from headlab.models import load

    loaded = load(model)
    t = train_gates(loaded, rest=rule, steps=steps, seconds=seconds, tokens=tokens, contexts=contexts, keys=keys, lr=lr,
                    l1=l1, seed=seed, checkpoint=ck)
    t.save(out)
    g = t.gates.clamp(0, 1)
    err_console.print(f"{loaded.name}: {t.steps} steps in {t.seconds:.0f} s ({t.stopped}); loss {t.losses[0]:.4f} -> "
                      f"{t.losses[-1]:.4f}; {int((g > 0.5).sum())} of {g.numel()} kv heads above 0.5. Wrote {out} "
                      f"(resume: the same command; checkpoint {ck})")
