"""``headlab generate "PROMPT"``: decode with a KV cache shaped per head, and what the cache holds."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from headlab.cli.app import (app, check_at_least, check_output_file, check_text, console, err_console, heads_text,
                             human_bytes, peek_max_positions, print_json)
from headlab.errors import ConfigError, InputError


def read_policy_file(path: Path) -> dict:
    """A policy file (``{"heads": ...}``, from ``Policy.to_json``) or an atlas JSON (``{"scores": ...}``), checked."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"--kv-from {str(p)!r} is not a file; give a policy JSON or an atlas JSON (headlab atlas)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"--kv-from {str(p)!r} is not readable JSON: {e}") from None
    if not isinstance(data, dict) or not ({"heads", "scores"} & set(data)):
        raise InputError(f"--kv-from {str(p)!r}: expected a policy ({{\"heads\": ...}}) or an atlas ({{\"scores\": ...}})")
    return data


def build_policy(loaded, policy: str, kv_from: Path | None, keep: float, data: dict | None):
    """The policy the options describe: ``--policy`` alone is uniform; with an atlas, the atlas's split
    keeps ``--keep`` of the kv heads full and gives the rest ``--policy``'s window."""
    from headlab.decode import kv

    rule = kv.as_rule(policy)
    if data is None:
        return kv.Policy.uniform(rule)
    if "heads" in data:
        if policy.strip().lower() != "full":
            raise ConfigError(f"--kv-from {kv_from} is a whole policy; drop --policy {policy} (it would be ignored)")
        return kv.Policy.load(kv_from)
    if isinstance(rule, kv.Window):  # the split's windowed heads take --policy's window, the kept ones stay full
        return kv.Policy.from_atlas(loaded, data, keep=keep, rest=rule)
    if isinstance(rule, kv.Full) and rule.bits != 16:  # a split on quantized KV: --policy's precision everywhere
        return kv.Policy.from_atlas(loaded, data, keep=keep, rest=kv.window(4, 256, bits=rule.bits), kept=rule)
    return kv.Policy.from_atlas(loaded, data, keep=keep, rest=kv.window(4, 256))


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Argument(..., help="the text to continue"),
    model: str = typer.Option("smollm2", "--model", "-m", help="a known causal LM name (smollm2) or a model folder"),
    policy: str = typer.Option("full", "--policy", "-p", help="full, drop, streaming:SINK,RECENT, snapkv:BUDGET or adakv:BUDGET, each with optional ,bits=N (every kv head)"),
    kv_from: Path = typer.Option(None, "--kv-from", help="a policy JSON (Policy.to_json) or an atlas JSON: its "
                                 "retrieval and non-local heads stay full, the rest get --policy's window"),
    keep: float = typer.Option(0.5, "--keep", help="with an atlas: the fraction of kv heads kept full"),
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
