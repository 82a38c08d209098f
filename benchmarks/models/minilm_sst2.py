"""Fine-tune the bundled all-MiniLM-L6-v2 on SST-2: a real classifier for headlab's saliency study.

    python benchmarks/models/minilm_sst2.py                 # trains once, then skips
    python benchmarks/models/minilm_sst2.py --force         # trains again
    python benchmarks/models/minilm_sst2.py --limit 200 --out /tmp/smoke   # a smoke run

What it makes: an ordinary Hugging Face folder (``config.json``, ``model.safetensors``, the tokenizer
files, and ``headlab-training.json`` with the validation accuracy, the time, the seed and the steps)
at ``headlab.models.cache_dir("minilm-sst2")`` (``$HEADLAB_CACHE/minilm-sst2``, by default
``~/.cache/headlab/minilm-sst2``); ``headlab.load(that_path)`` loads it as a
``BertForSequenceClassification`` (2 labels: 0 negative, 1 positive).

How: a ``BertForSequenceClassification`` (num_labels=2) whose encoder is all-MiniLM-L6-v2's (the
pooler and the classifier start fresh, from a fixed seed), trained for one epoch on a seeded sample
of 40,000 of ``train.tsv``'s 67,349 rows (word embeddings fixed) with AdamW at 1e-4, linear warm-up
(6%) then linear decay, batches of 32 drawn from length buckets (sentences of similar length
together, so dynamic padding pads little), and evaluated on ``validation.tsv``
(GLUE's 872-sentence dev set, the split papers report). It writes into a temporary folder beside
the target and renames it at the end, so nobody ever sees a half-written model.

The data (``/work/shared/data/sst2`` or ``--data``) is read by path; it is not part of the package.

Measured (the defaults, seed 0, one torch thread on a shared 2-core machine at load average ~12-24):
validation accuracy 0.8853 (772/872), 1,250 steps, 23.3 min wall, 7.9 min of CPU time. Two torch
threads on that loaded machine were ten times slower per step (threads spin-waiting), hence the
default of one.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
DEFAULT_DATA = next((p for p in (HERE.parents[3] / "shared" / "data" / "sst2", Path("/work/shared/data/sst2"))
                     if (p / "train.tsv").is_file()), Path("/work/shared/data/sst2"))
MAX_TOKENS = 128  # SST-2's longest sentence is ~70 WordPiece tokens; a cap, not a truncation in practice


def read_tsv(path: Path, limit: int | None = None) -> tuple[list[str], list[int]]:
    """The ``sentence`` and ``label`` columns of a GLUE SST-2 file."""
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = {"sentence", "label"} - set(reader.fieldnames or ())
        if missing:
            sys.exit(f"{path}: no column(s) {sorted(missing)}; columns seen: {reader.fieldnames}")
        for i, row in enumerate(reader, start=2):
            text = (row["sentence"] or "").strip()
            if not text:
                continue
            texts.append(text)
            labels.append(int(row["label"]))
            if limit and len(texts) >= limit:
                break
    return texts, labels


def bucketed_batches(lengths: list[int], batch_size: int, rng: random.Random, chunk: int = 50) -> list[list[int]]:
    """Indices in batches of similar length: shuffle, sort within chunks of ``chunk`` batches, shuffle batches."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    span = batch_size * chunk
    batches = []
    for s in range(0, len(order), span):
        part = sorted(order[s:s + span], key=lambda i: lengths[i])
        batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def pad(ids: list[list[int]], pad_id: int):
    import torch

    n = max(map(len, ids))
    x = torch.full((len(ids), n), pad_id, dtype=torch.long)
    m = torch.zeros((len(ids), n), dtype=torch.long)
    for r, seq in enumerate(ids):
        x[r, :len(seq)] = torch.tensor(seq)
        m[r, :len(seq)] = 1
    return x, m


def evaluate(model, ids: list[list[int]], labels: list[int], pad_id: int, batch_size: int = 64) -> float:
    import torch

    model.eval()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    correct = 0
    with torch.no_grad():
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            x, m = pad([ids[i] for i in idx], pad_id)
            pred = model(input_ids=x, attention_mask=m).logits.argmax(-1)
            correct += int((pred == torch.tensor([labels[i] for i in idx])).sum())
    model.train()
    return correct / max(len(ids), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with train.tsv and validation.tsv")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: cache_dir('minilm-sst2'))")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=0.06, help="share of steps spent warming up")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared, loaded machine 2 threads spin and ran 10x slower here)")
    ap.add_argument("--subset", type=int, default=40000,
                    help="train on a seeded random sample of N of the 67,349 training sentences (0: all)")
    ap.add_argument("--train-embeddings", dest="freeze_embeddings", action="store_false",
                    help="also train the word embeddings (by default they stay fixed: 30%% less time per step, "
                         "no dense 30522 x 384 update)")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N training rows (smoke runs)")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    ap.add_argument("--force", action="store_true", help="train even when the output folder exists")
    args = ap.parse_args(argv)

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from headlab.models import cache_dir
    from headlab.models.bundled import minilm_dir as _minilm_dir

    out = (args.out or cache_dir("minilm-sst2")).expanduser()
    if (out / "config.json").is_file() and not args.force:
        info = out / "headlab-training.json"
        acc = json.loads(info.read_text()).get("validation_accuracy") if info.is_file() else None
        print(f"{out} exists (validation accuracy {acc}); skipping. Pass --force to train again.")
        return 0
    for name in ("train.tsv", "validation.tsv"):
        if not (args.data / name).is_file():
            sys.exit(f"no {args.data / name}: pass --data FOLDER holding SST-2's train.tsv and validation.tsv")

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    src = _minilm_dir()
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    config = BertConfig.from_pretrained(src, num_labels=2, id2label={0: "negative", 1: "positive"},
                                        label2id={"negative": 0, "positive": 1})
    config.architectures = ["BertForSequenceClassification"]
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "classifier weights newly initialised" is the point
    model = BertForSequenceClassification.from_pretrained(src, config=config, local_files_only=True,
                                                          attn_implementation="sdpa")
    transformers.logging.set_verbosity(level)
    model.train()
    if args.freeze_embeddings:
        model.bert.embeddings.word_embeddings.weight.requires_grad_(False)

    tr_text, tr_y = read_tsv(args.data / "train.tsv", args.limit)
    if args.subset and 0 < args.subset < len(tr_text):
        pick = sorted(random.Random(args.seed).sample(range(len(tr_text)), args.subset))
        tr_text, tr_y = [tr_text[i] for i in pick], [tr_y[i] for i in pick]
    va_text, va_y = read_tsv(args.data / "validation.tsv")
    enc = lambda texts: tok(texts, truncation=True, max_length=MAX_TOKENS)["input_ids"]  # noqa: E731
    tr_ids, va_ids = enc(tr_text), enc(va_text)
    rng = random.Random(args.seed)
    epochs = max(1, math.ceil(args.epochs))
    plan = [bucketed_batches([len(s) for s in tr_ids], args.batch_size, rng) for _ in range(epochs)]
    steps = int(round(len(plan[0]) * args.epochs))
    warm = max(1, int(args.warmup * steps))

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not any(k in n for k in ("bias", "LayerNorm"))]
    rest = [p for n, p in named if any(k in n for k in ("bias", "LayerNorm"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm)))

    print(f"training {len(tr_ids):,} sentences, {steps:,} steps of {args.batch_size}, lr {args.lr}, "
          f"seed {args.seed}, {args.threads} threads -> {out}", flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    step, running, history = 0, None, []
    columns = (TextColumn("[bold]SST-2"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, refresh_per_second=1) as bar:
        task = bar.add_task("train", total=steps, loss="-")
        for batches in plan:
            for idx in batches:
                if step >= steps:
                    break
                x, m = pad([tr_ids[i] for i in idx], tok.pad_token_id)
                y = torch.tensor([tr_y[i] for i in idx])
                loss = model(input_ids=x, attention_mask=m, labels=y).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                lv = loss.item()
                running = lv if running is None else 0.98 * running + 0.02 * lv
                bar.update(task, advance=1, loss=f"{running:.3f}")
                if args.eval_every and step % args.eval_every == 0:
                    acc = evaluate(model, va_ids, va_y, tok.pad_token_id)
                    history.append({"step": step, "validation_accuracy": acc, "seconds": time.perf_counter() - t0})
                    print(f"step {step}: validation accuracy {acc:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    train_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    acc = evaluate(model, va_ids, va_y, tok.pad_token_id)
    total_s = time.perf_counter() - t0
    print(f"validation accuracy {acc:.4f} ({len(va_ids)} sentences); training {train_s / 60:.1f} min, "
          f"with evaluation {total_s / 60:.1f} min; CPU time {cpu_s / 60:.1f} min "
          f"(= {cpu_s / 60 / args.threads:.1f} min on {args.threads} dedicated cores)", flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.attn_implementation = None
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    record = {"validation_accuracy": acc, "validation_sentences": len(va_ids), "train_sentences": len(tr_ids),
              "train_seconds": round(train_s, 1), "train_cpu_seconds": round(cpu_s, 1),
              "load_avg_1min": os.getloadavg()[0], "total_seconds": round(total_s, 1), "seed": args.seed,
              "steps": steps, "epochs": args.epochs, "subset": args.subset,
              "freeze_embeddings": args.freeze_embeddings, "lr": args.lr, "batch_size": args.batch_size,
              "warmup": args.warmup, "weight_decay": args.weight_decay, "threads": args.threads,
              "torch": torch.__version__, "transformers": transformers.__version__, "base": str(src),
              "history": history, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    (tmp / "headlab-training.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
