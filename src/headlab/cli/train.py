"""``headlab train-classifier``: the SST-2 sentence classifier the saliency study explains."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import app, check_at_least, check_output_dir, console, err_console, print_json, read_text_file
from headlab.errors import ConfigError, InputError
from headlab.reading import read_tsv


@app.command("train-classifier")
def train_classifier_cmd(
    data: Path = typer.Option(
        None, "--data", "-d", help="a folder holding train.tsv and validation.tsv (SST-2's GLUE files: sentence, label)"
    ),
    train: Path = typer.Option(None, "--train", help="the training TSV (instead of --data)"),
    validation: Path = typer.Option(None, "--validation", help="the validation TSV (instead of --data)"),
    out: Path = typer.Option(
        None,
        "--out",
        "-o",
        help="the model folder (default: ~/.cache/headlab/minilm-sst2, where explain and probe look)",
    ),
    subset: int = typer.Option(40000, "--subset", help="train on a seeded sample of N training rows (0: all)"),
    limit: int = typer.Option(None, "--limit", help="only the first N training rows (a smoke run)"),
    epochs: float = typer.Option(1.0, "--epochs"),
    seed: int = typer.Option(0, "--seed"),
    threads: int = typer.Option(1, "--threads", help="torch threads (1: fastest on a shared 2-core machine)"),
    force: bool = typer.Option(False, "--force", help="replace an existing model folder"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Fine-tune the bundled all-MiniLM-L6-v2 into a 2-class sentence classifier (about 23 min on 2 cores
    with the defaults on SST-2: validation accuracy 0.885).

    Example: headlab train-classifier --data path/to/sst2 --subset 2000    (a 1-minute classifier)
    """
    from headlab.models.finetune import TrainingConfig, default_folder, train_classifier
    from headlab.progress import reporter

    if data is not None:
        if train is not None or validation is not None:
            raise InputError("give --data FOLDER, or --train FILE and --validation FILE, not both")
        train, validation = Path(data) / "train.tsv", Path(data) / "validation.tsv"
    if train is None or validation is None:
        raise InputError("no data: give --data FOLDER (with train.tsv and validation.tsv) or --train and --validation")
    for p, option in ((train, "--train"), (validation, "--validation")):
        read_text_file(
            Path(p),
            "--data" if data is not None else option,  # missing, a folder, not UTF-8, empty
            what="SST-2's train.tsv and validation.tsv (columns sentence, label)",
        )
        # the header (a sentence and a label column) and the first row, before the start line and the model
        read_tsv(Path(p), "--data" if data is not None else option, labelled=True, limit=1)
    if not 0 < epochs < float("inf"):
        raise ConfigError(f"--epochs must be a number > 0, got {epochs}")
    check_at_least("--threads", threads, 1)
    check_at_least("--subset", subset, 0, what=" (0: all rows)")
    check_at_least("--limit", limit, 1, what=" row")
    check_at_least("--seed", seed, 0)
    cfg = TrainingConfig(epochs=epochs, seed=seed, threads=threads, subset=subset, limit=limit)
    cfg.check()  # the settings' bounds (threads, epochs), before the output check and the minutes of training
    target = out or default_folder()
    check_output_dir(Path(target), "--out", force=force)  # before the minutes of training
    err_console.print(f"fine-tuning all-MiniLM-L6-v2 on {train} -> {target}", highlight=False, soft_wrap=True)
    with reporter(True) as say:  # train_classifier's progress(step, steps, loss), as the one protocol
        r = train_classifier(
            train,
            validation,
            out=out,
            config=cfg,
            force=force,
            progress=lambda step, steps, loss: say("train", step, steps),
        )
    if as_json:
        print_json(r.to_json())
        return
    console.print(
        f"validation accuracy {r.validation_accuracy:.4f} on {r.validation_sentences} sentences; "
        f"{r.steps} steps on {r.train_sentences} sentences in {r.train_seconds / 60:.1f} min; saved {r.out}",
        highlight=False,
        soft_wrap=True,
    )
