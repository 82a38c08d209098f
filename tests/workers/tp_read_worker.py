"""One rank of the tensor-parallel reading tests: ``python tp_read_worker.py RANK WORLD PORT OUT_DIR MODEL_DIR``, or
under ``torchrun --nproc_per_node N tp_read_worker.py - - - OUT_DIR MODEL_DIR``.

Set up as torchrun sets a rank up (as tests/workers/tp_worker.py is): ``headlab.load(..., tensor_parallel=True)``
lets transformers start the gloo group and shard the model with its family's plan. Each rank runs every reading
instrument (:func:`reads`: value-aware norms in every form, rollout, attention flow, the logit lens, direct logit
attribution, ``headlab.capture(..., grads=True)`` and ``headlab analyze``'s per-head table) on every model saved in MODEL_DIR (or in its subfolders: one
launch reads several families) and saves ``OUT_DIR/rank{R}.pt``, ``{model name: results}``; the test runs the same
:func:`reads` in one process on each unsharded model and compares.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_worker  # noqa: E402

TEXT = "the cat sat on the mat and the dog saw the cat"  # words of the test's tokenizer


def _ids(n: int, seed: int, vocab: int = 64, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, n), generator=g)


def _norms(r) -> dict:
    """The tensors of a :class:`~headlab.interpret.flow.norms.NormsResult`, keyed by what they are."""
    out = {}
    for name in ("per_head", "layer", "row_per_head", "row_layer", "weights"):
        for l, t in getattr(r, name).items():
            out[f"{name}.{l}"] = t
    for l, s in r.summaries.items():
        out.update({f"summary.{l}.{k}": v for k, v in vars(s).items() if isinstance(v, torch.Tensor)})
    return out


def reads(target, out_dir: str) -> dict:
    """Every reading instrument on ``target`` (the same calls, in the same order, on every rank)."""
    import headlab
    from headlab.interpret.flow.norms import value_norms
    from headlab.errors import InputError, UnsupportedArchitectureError
    from headlab.interpret.patching.readout import direct_logit_attribution, logit_lens

    ids = _ids(10, 7)
    out: dict = {}
    for mode in ("attention", "residual"):
        out[f"norms_{mode}"] = _norms(headlab.attention_norms(target, ids, mode=mode))
        out[f"norms_{mode}_rows"] = _norms(headlab.attention_norms(target, ids, mode=mode, rows=[9, 4]))
    out["norms_stream"] = _norms(headlab.attention_norms(target, ids, stream=True, key_positions=[0, 5]))
    out["value_norms"] = {str(l): t for l, t in value_norms(target, ids).items()}
    for method in ("mean", "norm"):
        out[f"rollout_{method}"] = headlab.rollout(target, ids, method=method).maps
        out[f"rollout_{method}_rows"] = headlab.rollout(target, ids, method=method, rows=[9, 2], layer=1).rows
    fl = headlab.attention_flow(target, ids, source=9)
    out["flow"] = {"flow": fl.flow, "values": fl.values}
    batch = _ids(8, 11, batch=3)
    lens = logit_lens(target, batch, position=[7, 5, 6])
    out["logit_lens"] = {"logits": lens.logits, "diff": lens.logit_diff(3, 4)}
    try:
        dla = direct_logit_attribution(target, batch, correct=[3, 5, 7], wrong=4, position=[7, 5, 6])
        out["dla"] = {"per_example": dla.per_example, "heads": dla.heads, "rest": dla.rest,
                      "logit_diff": dla.logit_diff}
    except UnsupportedArchitectureError as e:  # sandwich blocks (Gemma 3): refused alike, sharded or not
        out["dla"] = {"refused": str(e)}
    out["capture_grads"] = capture_grads(target)
    try:
        rep = headlab.analyze(TEXT, model=target, out_dir=out_dir, force=True)
        out["analyze"] = {"records": [r.as_dict() for r in rep.records], "tokens": rep.tokens, "mode": rep.mode,
                          "drawn": rep.drawn, "n_heads": rep.n_heads}
    except InputError as e:  # a tokenizer that reads the test's text as no tokens: refused alike, sharded or not
        out["analyze"] = {"refused": str(e)}
    return out


def capture_grads(target) -> dict:
    """``headlab.capture(..., grads=True)``: the head sites' values and gradients and the gates' (head importance's
    d m / d gate), in global head order on every rank (and on rank 0 alone)."""
    import headlab
    from headlab.models.loader import resolve

    adapter = resolve(target)[0]
    sites = ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.attn.pattern", "blocks.*.attn.z",
             "blocks.*.attn.head_out"]
    ids = _ids(9, 5)
    adapter.gates.requires_grad_(True)
    try:
        c = headlab.capture(target, ids, sites, grads=True, scalar=lambda o: o.logits[0, -1, 3] - o.logits[0, 4, 5])
    finally:
        adapter.gates.requires_grad_(False)
    out = {f"grad {k}": v for k, v in c.grads.items()}
    out.update({f"value {k}": c[k] for k in c})
    out["scalar"] = float(c.scalar)
    rank0 = headlab.capture(target, ids, ["blocks.1.attn.z"], grads=True, scalar=lambda o: o.logits[0, -1, 3],
                            gather="rank0")
    out["rank0 grads"] = sorted(rank0.grads) if adapter.tp is None or adapter.tp.rank == 0 else ["blocks.1.attn.z"]
    return out


def models(folder: str) -> dict[str, str]:
    """``{name: path}``: the one model saved in ``folder``, or each model saved in a subfolder of it (one launch
    reads several families)."""
    from pathlib import Path

    root = Path(folder)
    if (root / "config.json").is_file():
        return {root.name: str(root)}
    return {p.name: str(p) for p in sorted(root.iterdir()) if (p / "config.json").is_file()}


def main() -> None:
    out, model_dir, rank, _ = tp_worker.as_rank(sys.argv)
    import torch.distributed as dist

    import headlab

    res = {}
    for name, path in models(model_dir).items():
        loaded = headlab.load(path, tensor_parallel=True)  # transformers starts the group, as under torchrun
        tp = loaded.adapter.tp
        with tempfile.TemporaryDirectory() as tmp:
            res[name] = {"rank": tp.rank, "world": tp.world, "heads": list(tp.heads()), "reads": reads(loaded, tmp),
                         "lm_head_restored": loaded.model.get_output_embeddings() is loaded.model.lm_head}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
