"""One rank of tests/test_tensor_parallel_more.py: ``python tp_more_worker.py RANK WORLD PORT OUT_DIR MODEL_DIR``.

Set up as torchrun sets a rank up (as tests/workers/tp_worker.py is). With 2 ranks it loads the model with
``tensor_parallel=True`` under a memory cap (``TP_MORE_CAP`` bytes, when set, as ``HEADLAB_MEMORY_LIMIT`` during
the load only) and saves ``OUT_DIR/rank{R}.pt`` with: the bytes of every parameter this rank holds (its DTensor's
local shard), the bytes headlab's gathers received in a capture (``gather="all"``, ``"rank0"``, ``"none"``) and in
an exact patch (counted on ``torch.distributed.all_gather`` / ``gather`` themselves), pruned models' logits and
the refusals of unbalanced prunings, and greedy decoding under three KV policies. With 4 ranks
(``TP_MORE_MESH=2``) it loads with ``tensor_parallel=2`` (a 2 x 2 data x tensor mesh) and saves head importance,
confidence, a capture and a dependency probe.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker  # noqa: E402

PRUNE = {0: [1, 3], 1: [0, 2]}  # one head of each rank in every layer (4 heads over 2 ranks): balanced
UNBALANCED = {"one_rank": {0: [0, 1]}, "one_layer": {0: [1, 3]}}
PRUNE_GQA = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}  # 8 heads / 4 kv: each rank loses one whole kv group per layer


TREEBANK_WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "saw", "bird", "ran"]


def treebank(path: Path) -> Path:
    """Five tiny CoNLL-U sentences over :data:`TREEBANK_WORDS` (a 2 x 2 mesh splits them 3 + 2 across its groups)."""
    sents = [("the cat sat on the mat", [2, 3, 0, 6, 6, 3], ["det", "nsubj", "root", "case", "det", "obl"]),
             ("a dog saw the bird", [2, 3, 0, 5, 3], ["det", "nsubj", "root", "det", "obj"]),
             ("the bird ran on a mat", [2, 3, 0, 6, 6, 3], ["det", "nsubj", "root", "case", "det", "obl"]),
             ("a cat saw the dog", [2, 3, 0, 5, 3], ["det", "nsubj", "root", "det", "obj"]),
             ("the dog sat", [2, 3, 0], ["det", "nsubj", "root"])]
    lines = []
    for i, (text, heads, rels) in enumerate(sents, 1):
        lines += [f"# sent_id = {i}", f"# text = {text}"]
        lines += [f"{j}\t{w}\t{w}\tX\tX\t_\t{h}\t{r}\t_\t_"
                  for j, (w, h, r) in enumerate(zip(text.split(), heads, rels), 1)]
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def probe_figures(loaded, path: Path) -> dict:
    """``headlab.probe`` on :func:`treebank`: its counts and per-head figures (every rank writes its own copy)."""
    import headlab

    r = headlab.probe(loaded, treebank(path), grad_sentences=5)
    out = {k: torch.as_tensor(getattr(r, k)) for k in ("accuracy", "count", "visible", "baseline_accuracy")}
    out.update({f"per_head {k}": torch.as_tensor(v) for k, v in r.per_head.items()})
    out["sentences"], out["tokens"] = r.sentences, r.tokens
    return out


def policies():
    from headlab import kv

    return {"none": None, "window": kv.Policy.uniform(kv.window(sink=1, recent=4)),
            "split": kv.Policy.from_spec({(0, 0): kv.window(1, 3), (1, 0): kv.window(2, 2)}, name="split")}


def prompt() -> torch.Tensor:
    return torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(11))


class Counter:
    """Bytes this rank receives through ``dist.all_gather`` and ``dist.gather`` (the other ranks' parts)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.received = dist, 0
        self._ag, self._g = dist.all_gather, dist.gather

    def __enter__(self):
        def all_gather(parts, t, group=None, **kw):
            self.received += sum(p.nbytes for p in parts) - t.nbytes
            return self._ag(parts, t, group=group, **kw)

        def gather(t, parts=None, group=None, **kw):
            if parts is not None:
                self.received += sum(p.nbytes for p in parts) - t.nbytes
            return self._g(t, parts, group=group, **kw)

        self.dist.all_gather, self.dist.gather = all_gather, gather
        return self

    def __exit__(self, *exc):
        self.dist.all_gather, self.dist.gather = self._ag, self._g


def local_bytes(model) -> dict[str, int]:
    out = {}
    for n, p in model.named_parameters():
        t = p.to_local() if type(p).__name__ == "DTensor" else p
        out[n] = t.numel() * t.element_size()
    return out


def moved(loaded) -> dict:
    """Bytes received by this rank for a capture of every head site (three ways) and for an exact patch."""
    import headlab
    from headlab.interpret.patching import logit_diff

    x = tp_worker.inputs()
    out = {}
    for to in ("all", "rank0", "none"):
        with Counter() as c:
            headlab.capture(loaded, x, tp_worker.SITES, gather=to)
        out[to] = c.received
    clean = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    corrupt = clean.clone()
    corrupt[:, 3] = (corrupt[:, 3] + 7) % 64
    with Counter() as c:
        headlab.patch(loaded, clean, corrupt, logit_diff(4, 9), sites=["z", "v"], max_rows=16)
    out["patch"] = c.received
    return out


def pruning(loaded) -> dict:
    import headlab
    from headlab.errors import PruneError

    x = tp_worker.inputs()
    before = loaded.adapter.forward(x).logits
    p = headlab.prune_heads(loaded, PRUNE)
    out = {"logits": p.adapter.forward(x).logits, "heads": p.adapter.tp.local_heads, "kept": p.kept,
           "q_local": tuple(p.model.model.layers[0].self_attn.q_proj.weight.to_local().shape),
           "untouched": torch.equal(before, loaded.adapter.forward(x).logits)}
    for name, heads in UNBALANCED.items():
        try:
            headlab.prune_heads(loaded, heads)
            out[name] = None
        except PruneError as e:
            out[name] = str(e)
    return out


def decoding(loaded) -> dict:
    import headlab

    out = {}
    for name, policy in policies().items():
        g = headlab.generate(loaded, prompt(), policy=policy, max_new_tokens=6)
        out[name] = {"ids": g.ids, "kv_bytes": g.kv_bytes, "per_rank": g.kv_bytes_per_rank,
                     "json_per_rank": g.to_json()["kv_bytes_per_rank"],
                     "held": g.prompt_tokens + g.ids.shape[1] - 1}
    return out


def main() -> None:
    out, model_dir, rank, world = tp_worker.as_rank(sys.argv)
    import torch.distributed as dist

    import headlab

    mesh = int(os.environ.get("TP_MORE_MESH", "0"))
    if mesh:  # data x tensor: groups of `mesh` ranks
        from headlab.interpret.heads.importance import head_confidence
        from headlab.models import tensor_parallel as tp

        loaded = headlab.load(model_dir, tensor_parallel=mesh)
        g = torch.Generator().manual_seed(5)
        texts = [torch.randint(0, 64, (n,), generator=g) for n in (7, 11, 11, 9, 6)]
        t = loaded.adapter.tp
        res = {"rank": rank, "tp_rank": t.rank, "tp_world": t.world, "heads": list(t.heads()),
               "examples": tp.study_examples(loaded.adapter, len(texts)), "data_rank": tp.data_rank(loaded.adapter),
               "importance": headlab.head_importance(loaded, texts, loss="lm", batch_size=2),
               "confidence": head_confidence(loaded, texts, batch_size=2),
               "capture": dict(headlab.capture(loaded, tp_worker.inputs(), ["blocks.*.attn.z", "blocks.*.attn.k"])),
               "probe": probe_figures(loaded, Path(out) / f"tb{rank}.conllu")}
    else:
        cap = os.environ.get("TP_MORE_CAP")
        if cap:
            os.environ["HEADLAB_MEMORY_LIMIT"] = cap
        loaded = headlab.load(model_dir, tensor_parallel=True)
        os.environ.pop("HEADLAB_MEMORY_LIMIT", None)
        res = {"rank": rank, "params": local_bytes(loaded.model), "moved": moved(loaded), "prune": pruning(loaded),
               "decode": decoding(loaded)}
        gqa = Path(out) / "gqa"  # a model with 2 kv heads per rank: pruning whole kv groups
        if rank == 0:
            sys.path.insert(0, str(Path(__file__).parents[1]))
            from test_tensor_parallel import tiny_llama

            tiny_llama(gqa, 8, 4)
        dist.barrier()
        other = headlab.load(gqa, tensor_parallel=True)
        p = headlab.prune_heads(other, PRUNE_GQA)
        res["prune_gqa"] = {"logits": p.adapter.forward(tp_worker.inputs()).logits,
                            "kv_local": tuple(p.model.model.layers[0].self_attn.k_proj.weight.to_local().shape)}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
