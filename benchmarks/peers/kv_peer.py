"""headlab's KV caches beside transformers' ``QuantizedCache`` (optimum-quanto, HQQ) and kvpress's presses, on the
same prompts and model (issue 42, item 5). One script, four sides, each run in its own environment:

- ``--side export`` (headlab's venv): a fixed set of RULER-style tasks from ``headlab.decode.suite`` as token ids
  (context and question apart) with their answers, to JSON;
- ``--side headlab`` (headlab's venv): headlab's caches (``HeadCache``) on those ids;
- ``--side peer`` (``/work/peer-venv-kv``, no headlab): ``DynamicCache``, ``QuantizedCache`` and kvpress presses;
- ``--side table`` (headlab's venv): both result files scored by the suite's own ``Task.correct``, one table.

Both sides decode the same way: the context as one forward (the prefill a press or a SnapKV rule compresses),
the question as one more forward after it (query-agnostic, as kvpress's pipeline and ``headlab.generate(...,
question=)`` do; positions continue from the context's length), then greedy steps of one token until the task's
``max_new_tokens`` or the end-of-sequence token. Bytes are a walk of every tensor reachable from the cache object
after the question's forward (each storage counted once, at its size; tensor subclasses such as quanto's
``QBitsTensor`` through their inner tensors; modules and configs not entered). The decode step time is the median
of the one-token forwards, the methods interleaved per task (their order rotated task by task).

    P=benchmarks/peers
    .venv/bin/python $P/kv_peer.py --side export --n 24 --tokens 1024 --out /work/peer-data/kv_prompts.json
    .venv/bin/python $P/kv_peer.py --side headlab --prompts /work/peer-data/kv_prompts.json --out /work/peer-data/kv_headlab.json
    /work/peer-venv-kv/bin/python $P/kv_peer.py --side peer --prompts /work/peer-data/kv_prompts.json --out /work/peer-data/kv_peer.json
    .venv/bin/python $P/kv_peer.py --side table /work/peer-data/kv_headlab.json /work/peer-data/kv_peer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

MODEL_DIR = Path(os.path.expanduser("~/.cache/headlab/smollm2-135m-instruct"))

HEADLAB_METHODS = {  # name -> (policy text or None, storage dtype)
    "full 16-bit": (None, torch.float16),
    "full 32-bit": (None, None),
    "full:bits=4": ("full:bits=4", torch.float16),
    "full:bits=4,group=64": ("full:bits=4,group=64", torch.float16),
    "full:bits=4,residual=0": ("full:bits=4,residual=0", torch.float16),
    "full:bits=4,group=64,residual=0": ("full:bits=4,group=64,residual=0", torch.float16),
    "full:bits=2": ("full:bits=2", torch.float16),
    "full:bits=2,group=64": ("full:bits=2,group=64", torch.float16),
    "snapkv:512,bits=4": ("snapkv:512,bits=4", None),
    "expected:512,bits=4": ("expected:512,bits=4", None),
    "snapkv:512,window=64,pool=5,pooling=avg,bits=4": ("snapkv:512,window=64,pool=5,pooling=avg,bits=4", None),
    "expected:512,covariance=1,vnorm=1,bits=4": ("expected:512,covariance=1,vnorm=1,bits=4", None),
    "snapkv:256,bits=4": ("snapkv:256,bits=4", None),
    "expected:256,bits=4": ("expected:256,bits=4", None),
}
PEER_METHODS = (
    "DynamicCache",
    "quanto 4-bit",
    "quanto 2-bit",
    "HQQ 4-bit",
    "HQQ 2-bit",
    "SnapKVPress 0.75",
    "ExpectedAttentionPress 0.75",
    "KnormPress 0.75",
    "SnapKVPress 0.5 + quanto 4-bit",
    "ExpectedAttentionPress 0.5 + quanto 4-bit",
)


# ---------------------------------------------------------------- the walk (the same code on both sides)
def _inner(t: torch.Tensor):
    """A tensor subclass (quanto's QBitsTensor, ...) through its inner tensors; a plain tensor as itself."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _inner(getattr(t, n))
    else:
        yield t


def walk_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, dicts, lists, tuples and sets (modules, configs,
    classes and functions not entered)."""
    from transformers import PretrainedConfig

    seen: set[int] = set()
    out: list[torch.Tensor] = []
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool, type, torch.dtype, torch.device)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.extend(_inner(o))
            continue
        if isinstance(o, (torch.nn.Module, PretrainedConfig)) or callable(o) and not hasattr(o, "__dict__"):
            continue
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        else:
            d = getattr(o, "__dict__", None)
            if d is not None:
                stack.extend(d.values())
            for s in getattr(type(o), "__slots__", ()):
                stack.append(getattr(o, s, None))
    return out


def walk_bytes(root, as16: bool = False) -> int:
    """Bytes of the storages behind every tensor reachable from ``root``, each storage once. ``as16``: floating
    storages counted at 2 bytes an element (what the same cache holds under a 16-bit model)."""
    total, storages = 0, set()
    for t in walk_tensors(root):
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key in storages:
            continue
        storages.add(key)
        n = s.nbytes()
        if as16 and t.is_floating_point() and t.element_size() > 2:
            n = n * 2 // t.element_size()
        total += n
    return total


# ---------------------------------------------------------------- decoding (the same loop on both sides)
def decode(model, cache, ctx, q, max_new, eos, prefill_ctx=None):
    """Context, question, then greedy steps; returns (ids, bytes after the question, step seconds)."""
    n = ctx.shape[1]
    with torch.no_grad():
        with prefill_ctx if prefill_ctx is not None else _null():
            model(input_ids=ctx, cache=cache, use_cache=True, logits_to_keep=1)
        pos = torch.arange(n, n + q.shape[1]).unsqueeze(0)
        logits = model(input_ids=q, cache=cache, use_cache=True, position_ids=pos, logits_to_keep=1).logits
        held = cache
        own = held.nbytes() if callable(getattr(held, "nbytes", None)) else None  # headlab's own count
        after = (walk_bytes(held), walk_bytes(held, as16=True), own)
        ids, steps = [], []
        p = n + q.shape[1]
        for step in range(max_new):
            tok = int(logits[0, -1].argmax())
            ids.append(tok)
            if tok in eos or step == max_new - 1:
                break
            t0 = time.perf_counter()
            logits = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True,
                           position_ids=torch.tensor([[p]])).logits
            steps.append(time.perf_counter() - t0)
            p += 1
    return ids, after, steps


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def run(methods, make, prompts, model, eos, args, extra=None) -> dict:
    """Every task under every method, interleaved (order rotated per task)."""
    names = list(methods)
    per = {m: {"ids": [], "bytes": [], "bytes16": [], "steps": [], "step_median": []} for m in names}
    t_all = time.perf_counter()
    for i, p in enumerate(prompts):
        ctx, q = torch.tensor([p["context_ids"]]), torch.tensor([p["question_ids"]])
        order = names[i % len(names):] + names[: i % len(names)]
        for m in order:
            cache, pre = make(m)
            ids, (b, b16, own), steps = decode(model, cache, ctx, q, p["max_new_tokens"], eos, pre)
            r = per[m]
            r["ids"].append(ids)
            r["bytes"].append(b)
            r["bytes16"].append(b16)
            if own is not None:
                r.setdefault("nbytes", []).append(own)
            r["steps"].append(steps)
            r["step_median"].append(statistics.median(steps) if steps else None)
            if extra is not None:
                extra(m, cache, r)
            del cache
        print(f"[{i + 1}/{len(prompts)}] {p['kind']:18s} {len(p['context_ids']) + len(p['question_ids'])} tokens "
              f"{time.perf_counter() - t_all:.0f}s", flush=True)
        _dump(args, per, prompts[: i + 1])
    return per


def _dump(args, per, done) -> None:
    out = {"side": args.side, "threads": args.threads, "start": args.start, "tasks": len(done), "methods": per,
           "versions": versions(), "host": platform.node(), "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = Path(str(args.out) + ".tmp")  # written whole, then renamed: a run stopped with kill leaves the last file
    tmp.write_text(json.dumps(out))
    tmp.replace(args.out)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    v = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "optimum-quanto", "hqq", "kvpress", "headlab"):
        try:
            v[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return v


def load_prompts(path, limit, start=0):
    data = json.loads(Path(path).read_text())
    return data["tasks"][start:limit] if limit else data["tasks"][start:]


# ---------------------------------------------------------------- sides
def side_export(args) -> None:
    import headlab
    from headlab.decode import suite

    lm = headlab.load("smollm2")
    tok = lm.tokenizer
    tasks = suite.make_suite(tok, args.n, tokens=args.tokens, seed=args.seed)
    rows = []
    for t in tasks:
        rows.append({"kind": t.kind, "seed": t.seed, "answers": list(t.answers), "max_new_tokens": t.max_new_tokens,
                     "context": t.context, "question": t.question, "continuation": t.continuation,
                     "context_ids": tok(t.context, add_special_tokens=False)["input_ids"],
                     "question_ids": tok(t.question, add_special_tokens=False)["input_ids"]})
    meta = {"n": args.n, "tokens": args.tokens, "seed": args.seed, "model_dir": str(MODEL_DIR),
            "made_by": "headlab.decode.suite.make_suite(tok, n, tokens=, seed=)"}
    Path(args.out).write_text(json.dumps({"meta": meta, "tasks": rows}))
    print(f"{len(rows)} tasks, {[len(r['context_ids']) + len(r['question_ids']) for r in rows]} tokens -> {args.out}")


def side_headlab(args) -> None:
    import headlab
    from headlab import kv
    from headlab.decode import HeadCache
    from headlab.models.loaded_model import resolve

    lm = headlab.load("smollm2")
    adapter, _ = resolve(lm)
    model = adapter.model.eval()
    eos = {model.generation_config.eos_token_id}
    prompts = load_prompts(args.prompts, args.limit, args.start)
    methods = {m: HEADLAB_METHODS[m] for m in (args.methods or HEADLAB_METHODS)}

    def make(m):
        text, dtype = methods[m]
        policy = None if text is None else kv.Policy.parse(text)
        return HeadCache(adapter, policy, dtype=dtype), None

    with adapter.use_backend("auto"):  # the whole decode, as headlab.generate runs it
        per = run(methods, make, prompts, model, eos, args)
    if args.check_generate:  # the loop above against headlab.generate on the first task (32-bit full, 4-bit)
        p = prompts[0]
        for m in ("full 32-bit", "snapkv:512,bits=4"):
            if m in methods and methods[m][1] is None:
                pol = None if methods[m][0] is None else kv.Policy.parse(methods[m][0])
                g = headlab.generate(lm, torch.tensor([p["context_ids"]]), question=torch.tensor([p["question_ids"]]),
                                     policy=pol, max_new_tokens=p["max_new_tokens"])
                same = g.ids[0].tolist() == per[m]["ids"][0]
                print(f"check {m}: headlab.generate ids == this loop's: {same}")
    _dump(args, per, prompts)


def kvpress_shim() -> None:
    """kvpress 0.5.2's hook reads ``kwargs["past_key_values"]`` and ``kwargs["cache_position"]``; transformers 5.25
    passes the attention its cache as ``cache`` and no ``cache_position``. Hand the hook both: the cache, and the
    positions of the tokens this forward added to the layer (``0 .. q_len - 1`` on the prefill, so the press
    compresses then and only then, as it does on the transformers it was written for)."""
    from kvpress.presses.base_press import BasePress

    if getattr(BasePress.forward_hook, "_shim", False):
        return
    hook = BasePress.forward_hook

    def forward_hook(self, module, input, kwargs, output):
        if "past_key_values" not in kwargs:
            cache = kwargs["cache"]
            seen = cache.get_seq_length(module.layer_idx)
            q_len = kwargs["hidden_states"].shape[1]
            kwargs = {**kwargs, "past_key_values": cache, "cache_position": torch.arange(seen - q_len, seen)}
        return hook(self, module, input, kwargs, output)

    forward_hook._shim = True  # type: ignore[attr-defined]
    BasePress.forward_hook = forward_hook  # type: ignore[method-assign]


def peer_cache(m: str, model):
    """The cache and the press context (or None) a peer method names: ``DynamicCache``, ``quanto 4-bit``,
    ``HQQ 2-bit``, ``SnapKVPress 0.75`` (on a DynamicCache), ``SnapKVPress 0.5 + quanto 4-bit``."""
    import kvpress
    from transformers import DynamicCache, QuantizedCache

    parts = m.split(" + ")
    press = None
    if "Press" in parts[0]:
        cls, ratio = parts[0].split()
        press = getattr(kvpress, cls)(compression_ratio=float(ratio))
        parts = parts[1:]
    cache = DynamicCache(config=model.config)
    if parts and parts[0] != "DynamicCache":
        backend, bits = parts[0].split()
        cache = QuantizedCache(backend={"quanto": "quanto", "HQQ": "hqq"}[backend], config=model.config,
                               nbits=int(bits.split("-")[0]))
    return cache, (press(model) if press is not None else None)


def side_peer(args) -> None:
    from transformers import AutoModelForCausalLM

    kvpress_shim()
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    eos = {model.generation_config.eos_token_id}
    prompts = load_prompts(args.prompts, args.limit, args.start)
    names = args.methods or PEER_METHODS

    def extra(m, cache, r):
        lay = cache.layers[0]
        r.setdefault("settings", {k: getattr(lay, k) for k in ("nbits", "axis_key", "axis_value", "q_group_size",
                                                               "residual_length") if hasattr(lay, k)})

    per = run(names, lambda m: peer_cache(m, model), prompts, model, eos, args, extra)
    if args.check16:  # the 16-bit count against a cache really held by a bfloat16 model, first task
        m16 = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).eval()
        p = prompts[0]
        ctx, q = torch.tensor([p["context_ids"]]), torch.tensor([p["question_ids"]])
        check = {}
        for m in names:
            cache, pre = peer_cache(m, m16)
            _, (b, _, _), _ = decode(m16, cache, ctx, q, 1, eos, pre)
            check[m] = {"bf16_model_walk": b, "fp32_run_counted_at_16_bits": per[m]["bytes16"][0]}
            print(f"check16 {m}: bf16 model {b}, fp32 run counted at 16 bits {per[m]['bytes16'][0]}")
        per["_check16"] = check
    _dump(args, per, prompts)


def side_table(args) -> None:
    """Both sides' files on the tasks they have in common: the suite's own scoring, bytes against the 16-bit full
    cache (headlab's held in float16; the peers' fp32 DynamicCache at 2 bytes an element, which ``--check16`` finds
    equal to a bfloat16 model's DynamicCache), the step against each side's own full cache."""
    from transformers import AutoTokenizer

    from headlab.decode.suite import KINDS, Task

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = json.loads(Path(args.prompts).read_text())["tasks"]
    files = _merge([json.loads(Path(f).read_text()) for f in args.files])
    n = min(d["tasks"] for d in files)
    tasks = [Task(p["kind"], p["context"], p["question"], tuple(p["answers"]), p["continuation"], p["max_new_tokens"],
                  p["seed"]) for p in prompts[:n]]
    lengths = [len(p["context_ids"]) + len(p["question_ids"]) for p in prompts[:n]]
    print(f"{n} tasks ({', '.join(f'{sum(t.kind == k for t in tasks)} {k}' for k in KINDS)}), "
          f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}); threads "
          f"{', '.join(str(d['threads']) for d in files)}")
    lines = ["| side | method | right | RULER score | bytes held after the prompt, % of a 16-bit full cache | "
             "as held in this run | decode step vs its side's full cache | step ms |", "|---|---|---|---|---|---|---|---|"]
    ids_of = {}
    out = {"tasks": n, "lengths": lengths, "rows": []}
    for d in files:
        side, per = d["side"], d["methods"]
        if side == "headlab":
            full16 = per["full 16-bit"]["bytes"][:n]
            tbase, tother = "full 16-bit", "full 32-bit" if "full 32-bit" in per else None
        else:
            full16 = [b // 2 for b in per["DynamicCache"]["bytes"][:n]]
            tbase, tother = "DynamicCache", None
        for m, r in per.items():
            if m.startswith("_"):
                continue
            texts = [tok.decode(ids, skip_special_tokens=True) for ids in r["ids"][:n]]
            ids_of[(side, m)] = r["ids"][:n]
            right = [int(t.correct(x)) for t, x in zip(tasks, texts)]
            score = statistics.mean(t.score(x) for t, x in zip(tasks, texts))
            pct16 = statistics.mean(a / b for a, b in zip(r["bytes16"][:n], full16))
            pct = statistics.mean(a / b for a, b in zip(r["bytes"][:n], full16))

            def ratio(base):
                rs = [a / b for a, b in zip(r["step_median"][:n], per[base]["step_median"][:n]) if a and b]
                return statistics.median(rs) if rs else float("nan")

            ms = statistics.median([s for steps in r["steps"][:n] for s in steps]) * 1e3
            other = m in d.get("other_run", ())  # timed in another run than the side's full cache: no ratio
            step = f"{ratio(tbase):.2f}x" + (f" ({ratio(tother):.2f}x vs 32-bit)" if tother else "")
            step = "another run" if other else step
            held = f"{pct:.1%}" + (" (fp32 storage)" if r["bytes"][0] != r["bytes16"][0] else "")
            lines.append(f"| {side} | {m} | {sum(right)}/{n} | {score:.3f} | {pct16:.1%} | {held} | {step} | {ms:.0f} |")
            out["rows"].append({"side": side, "method": m, "right": right, "score": score, "pct16": pct16,
                                "pct_held": pct, "step_ratio": None if other else ratio(tbase), "step_ms": ms,
                                "by_kind": {k: sum(x for x, t in zip(right, tasks) if t.kind == k) for k in KINDS}})
    print("\n".join(lines))
    if args.suite:
        out["paired"], out["right_by_name"] = paired_with_suite(args.suite, out["rows"], tasks, lengths)
    if ("headlab", "full 32-bit") in ids_of and ("peer", "DynamicCache") in ids_of:
        same = sum(a == b for a, b in zip(ids_of[("headlab", "full 32-bit")], ids_of[("peer", "DynamicCache")]))
        print(f"headlab full 32-bit and the peer's DynamicCache decode the same ids on {same}/{n} tasks")
        out["same_ids_full32_vs_dynamic"] = same
    for r in out["rows"]:
        print(f"{r['side']:8s} {r['method']:44s} {r['by_kind']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def paired_with_suite(path, rows: list[dict], tasks, lengths: list[int]) -> tuple[list[dict], dict]:
    """The peer's methods paired, task by task, with a ``headlab kv suite`` result on the same tasks (the same
    ``--n``, ``--tokens`` and ``--seed``, checked by the kinds and lengths): each quantized method against its own
    side's full cache (McNemar's exact test and the paired Wald interval of ``headlab.decode.suite_stats``), and the
    peer's against headlab's at 4 bits. Returns the comparisons and each name's right (0/1) per task, which ``--side
    pool`` joins over tables."""
    try:
        units = json.loads(Path(path).read_text())["units"]
        units = [units[f"task {i}"] for i in range(len(tasks))]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--suite {path}: not a `headlab kv suite` result with {len(tasks)} tasks ({e!r})") from None
    if [(u["kind"], u["length"]) for u in units] != [(t.kind, m) for t, m in zip(tasks, lengths)]:
        raise SystemExit(f"{path}: not the prompts' tasks (kinds or lengths differ); run kv suite with the export's seed")
    right = {f"headlab {p}": [u["policies"][p]["right"] for u in units] for p in units[0]["policies"]}
    peer = [r["method"] for r in rows if r["side"] == "peer"]
    right.update({f"peer {r['method']}": r["right"] for r in rows if r["side"] == "peer"})
    pairs = [(h, "headlab full") for h in right if h.startswith("headlab ") and h != "headlab full"]
    pairs += [(f"peer {m}", "peer DynamicCache") for m in peer if m != "DynamicCache"]
    four = [h for h in right if h.startswith("headlab ") and "bits=4" in h]
    pairs += [(four[0], f"peer {m}") for m in peer if four and m.endswith(" 4-bit")]
    if "DynamicCache" in peer:
        pairs.append(("headlab full", "peer DynamicCache"))
    print(f"\npaired on {len(tasks)} tasks with {path} (McNemar; Wald interval, 95%)")
    return compare(pairs, right), right


def compare(pairs: list[tuple[str, str]], right: dict) -> list[dict]:
    """Each ``(a, b)`` of ``pairs``: McNemar's test and the paired interval of ``right[a]`` against ``right[b]``."""
    from headlab.decode.suite_stats import mcnemar

    out = []
    for a, b in pairs:
        x, y = right[a], right[b]
        m = mcnemar(x, y)
        print(f"{a:44s} vs {b:20s} {sum(x)} / {sum(y)}: {100 * m.diff:+.1f} points [{100 * m.low:+.1f}, "
              f"{100 * m.high:+.1f}], p={m.p_value:.2f}; {m.n01}:{m.n10} lost:won")
        out.append({"a": a, "b": b, "right": [sum(x), sum(y)], "diff": m.diff, "ci95": [m.low, m.high],
                    "p": m.p_value, "lost": m.n01, "won": m.n10})
    return out


def side_pool(args) -> None:
    """Tables written with ``--suite`` on disjoint task sets (other seeds), joined: every comparison on all tasks."""
    if len({Path(f).resolve() for f in args.files}) != len(args.files):
        raise SystemExit("--side pool: a table is named twice; pool tables of other seeds")
    tables = [json.loads(Path(f).read_text()) for f in args.files]
    if not all("right_by_name" in t for t in tables):
        raise SystemExit("--side pool takes tables written by --side table --suite")
    if any(t["right_by_name"].keys() != tables[0]["right_by_name"].keys() for t in tables):
        raise SystemExit("--side pool: the tables compare different methods; pool tables made with the same ones")
    right = {k: [x for t in tables for x in t["right_by_name"][k]] for k in tables[0]["right_by_name"]}
    pairs = [(p["a"], p["b"]) for p in tables[0]["paired"]]
    print(f"pooled: {len(tables)} tables, {len(next(iter(right.values())))} tasks (McNemar; Wald interval, 95%)")
    out = {"tables": list(args.files), "paired": compare(pairs, right)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


BASE = {"peer": "DynamicCache", "headlab": "full 16-bit"}  # each side's full cache: the step ratios' baseline


def _merge(files: list[dict]) -> list[dict]:
    """One result per side: files of a side on the same tasks (the same ``--start`` and count, other ``--methods``)
    joined method by method, the one timed with the side's full cache first (the others' methods, timed in another
    run, get no step ratio), then its batches (``--start``) joined in task order, each list of a method extended;
    batches must hold the same methods."""

    def names(d: dict) -> set[str]:
        return {m for m in d["methods"] if not m.startswith("_")}

    same: dict[tuple[str, int], list[dict]] = {}
    for d in files:
        same.setdefault((d["side"], d.get("start", 0)), []).append(d)
    joined = []
    for (side, start), ds in same.items():
        ds = sorted(ds, key=lambda d: BASE.get(side) not in d["methods"])
        a = ds[0]
        for d in ds[1:]:
            if d["tasks"] != a["tasks"] or names(d) & names(a):
                raise SystemExit(f"{side}: two files from task {start} with other task counts or the same methods")
            a["methods"].update({m: d["methods"][m] for m in names(d)})
            a["other_run"] = a.get("other_run", []) + sorted(names(d))
        joined.append(a)
    by: dict[str, dict] = {}
    for d in sorted(joined, key=lambda d: (d["side"], d.get("start", 0))):
        if d["side"] not in by:
            by[d["side"]] = d
            continue
        a = by[d["side"]]
        if d.get("start", 0) != a["tasks"]:
            raise SystemExit(f"{d['side']}: a batch starts at task {d.get('start', 0)}, the ones before end at {a['tasks']}")
        if names(d) != names(a):
            raise SystemExit(f"{d['side']}: the batch from task {d.get('start', 0)} holds {sorted(names(d))}, the ones "
                             f"before {sorted(names(a))}; give every batch the same methods")
        for m in names(d):
            for k, v in d["methods"][m].items():
                if isinstance(v, list):
                    a["methods"][m].setdefault(k, []).extend(v)
        a["tasks"] += d["tasks"]
    return list(by.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", required=True, choices=("export", "headlab", "peer", "table", "pool"))
    ap.add_argument("files", nargs="*", help="--side table: the result files; --side pool: tables made with --suite")
    ap.add_argument("--prompts", default="/work/peer-data/kv_prompts.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="the tasks before LIMIT only (0: all)")
    ap.add_argument("--start", type=int, default=0, help="the tasks from START on (a second batch)")
    ap.add_argument("--methods", nargs="*", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-generate", action="store_true")
    ap.add_argument("--check16", action="store_true")
    ap.add_argument("--suite", default=None, help="--side table: a `headlab kv suite` result on the same tasks, paired")
    args = ap.parse_args()
    if args.suite and args.side != "table":
        ap.error("--suite goes with --side table")
    torch.set_num_threads(args.threads)
    {"export": side_export, "headlab": side_headlab, "peer": side_peer, "table": side_table, "pool": side_pool}[args.side](args)


if __name__ == "__main__":
    sys.exit(main())
