"""``headlab probe --treebank FILE.conllu``: which heads track which dependency relations (Clark et al. 2019)."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import app, check_output_dir, console, print_json
from headlab.interpret.probing.render import prepare_out_dir, write_outputs
from headlab.interpret.probing.head_scores import probe as run_probe
from headlab.progress import reporter


@app.command("probe")
def probe_cmd(
    treebank: Path = typer.Option(..., "--treebank", "-t", help="a CoNLL-U file with gold trees (e.g. UD English-EWT dev)"),
    model: str = typer.Option("minilm", "--model", "-m", help="a known model name (minilm) or a local model folder"),
    limit: int = typer.Option(None, "--limit", "-n", help="read at most N sentences from the top of the file"),
    relations: str = typer.Option(None, "--relations", "-r", help="study only these, e.g. det,nsubj,obj"),
    fold_subtypes: bool = typer.Option(False, "--fold-subtypes", help="count nmod:poss as nmod, obl:tmod as obl, ..."),
    out: Path = typer.Option(None, "--out", "-o", help="write relations.csv/.json, two PNGs and probe.html here"),
    force: bool = typer.Option(False, "--force", help="write into a non-empty --out folder"),
    loss_model: str = typer.Option("auto", "--loss-model",
                                   help="model whose loss the [SEP] gradient test uses ('auto', 'none' or a folder)"),
    as_json: bool = typer.Option(False, "--json", help="print the best head per relation as JSON"),
) -> None:
    """Score every head on every dependency relation of a treebank against the best fixed-offset baseline.

    Example: headlab probe --treebank en_ewt-ud-dev.conllu --limit 200 --out probe-minilm

    Data-parallel with torchrun: `torchrun --nproc-per-node 2 -m headlab probe --treebank FILE ...` splits
    the sentences across the processes and adds their sums; rank 0 shows the progress and writes the output.
    """
    if not treebank.is_file():
        from headlab.errors import TreebankError

        what = ("is a folder" if treebank.is_dir() else "is not a regular file (a device or a pipe)"
                if treebank.exists() else "does not exist (no such treebank file)")
        raise TreebankError(f"--treebank {str(treebank)!r} {what}; give a CoNLL-U file (.conllu)")
    if out is not None:  # before the work: a file in the way, FILE/sub, an unwritable place, earlier files
        check_output_dir(out, "--out", force=force)
    from headlab.distributed.data import init_from_env, is_main

    init_from_env()  # under torchrun: the sentences are split across the processes, the sums added
    main = is_main()
    out_dir = prepare_out_dir(out, force=force) if out is not None and main else None
    with reporter(main, transient=True) as say:  # a bar per phase, on rank 0
        r = run_probe(model, treebank, limit=limit, relations=relations, fold_subtypes=fold_subtypes,
                      loss_model=None if loss_model.lower() == "none" else loss_model, progress=say)
    if not main:  # rank 0 writes and prints
        return
    files = write_outputs(r, out_dir) if out_dir is not None else []
    if as_json:
        print_json(r.summary())
        return
    console.print(f"{r.model} ({r.family}{', causal' if r.causal else ''}): {r.sentences} sentences, {r.tokens} tokens, "
                  f"{len(r.skipped)} skipped, {r.seconds:.1f} s", highlight=False, soft_wrap=True)
    console.print(f"{'relation':<14} {'direction':<10} {'head':>6} {'acc %':>6} {'offset':>6} {'base %':>6} {'count':>6}",
                  highlight=False)
    for b in r.best_heads:
        if b.count < r.min_count:
            continue
        mark = "*" if b.margin > 0 else " "
        console.print(f"{b.relation:<14} {b.direction:<10} {f'{b.layer}-{b.head}':>6} {100 * b.accuracy:6.1f} "
                      f"{b.baseline_offset:+6d} {100 * b.baseline_accuracy:6.1f} {b.count:6d} {mark}", highlight=False)
    for note in r.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if files:
        console.print(f"[bold]wrote:[/] {', '.join(str(f) for f in files)}", highlight=False, soft_wrap=True)
