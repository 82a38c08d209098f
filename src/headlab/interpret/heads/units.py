"""The heads studies cut into the study runner's units: one batch of examples each, and the sums that add them up.

:class:`ImportanceUnits` is :func:`~headlab.interpret.heads.importance.importance_study` batch by batch: a unit's
value is its batch's sums (each head's ``sum |dL/dxi|``, the confidence's sums and the rows counted), which
:meth:`~ImportanceUnits.finish` adds in the order of the batches and turns into the same
:class:`~headlab.interpret.heads.importance.ImportanceResult` (on one process, the same numbers bit for bit: the
same batches, the same chunk functions, the same order of the sums). The units are independent: under torchrun
the runner splits them across the data ranks; on a model sharded by heads, a tensor-parallel group runs its units
together and each unit adds its heads' sums over the group, so every rank of the group holds the whole value.
The label-free losses (``kl``, ``cosine``) draw from one generator that runs on from batch to batch, as the library
does; a unit keeps the generator's state after it, so a resumed run draws on from where it stopped.

:class:`AblationUnits` is :func:`~headlab.interpret.heads.ablation.ablate` batch by batch: first the single and
keep-one configurations on each batch (a unit's value: each configuration's effect on each example of the batch),
then the pairs among the ``k`` lowest single effects on each batch, then the CKA of the pair heads. The pairs are
chosen from every single effect, so the units build on the ones before (``chained``: the runner runs them in
order on the first data rank, a tensor-parallel group together); the bootstrap draws once, from ``seed``, over
the per-example effects, so the intervals and verdicts are :func:`ablate`'s.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from headlab.interpret.heads import examples as C
from headlab.interpret.heads.ablation import AblationResult
from headlab.interpret.heads.ablation_plan import AblationPlan
from headlab.interpret.heads.ablation_stats import config_masks
from headlab.interpret.heads.importance import (
    ImportanceResult,
    confidence_grid,
    confidence_sums,
    gated,
    importance_grid,
    importance_sums,
    study_result,
)
from headlab.models.loader import resolve

LABEL_FREE = ("kl", "cosine")  # the losses whose surrogate draws from a generator


class ImportanceUnits:
    """Head importance (and confidence) over ``texts``, one unit per batch of ``batch_size`` examples."""

    def __init__(
        self,
        loaded,
        texts,
        labels=None,
        *,
        loss: C.Loss = "auto",
        batch_size: int = 16,
        backend: str = "auto",
        seed: int = 0,
        confidence: bool = True,
        max_length: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.adapter, self.ld = resolve(loaded)
        self.loss = C.choose_loss(self.adapter, loss, labels)
        C.check_data(texts, labels, self.loss)
        self.texts, self.labels, self.batch_size, self.backend = texts, labels, batch_size, backend
        self.seed, self.confidence, self.max_length = seed, confidence, max_length
        n = len(texts)
        self.spans = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]  # C.batches' own spans
        self._gen: torch.Generator | None = None

    def keys(self) -> list[str]:
        return [f"batch {i}" for i in range(len(self.spans))]

    def _generator(self, before: dict | None) -> torch.Generator:
        """The label-free draws' generator: this process's, running on from its last unit; else the state the unit
        before kept (a resumed run); else a fresh one from ``seed`` (plus the data rank, as the library's split)."""
        if self._gen is None:
            self._gen = torch.Generator()
            state = None if before is None else before.get("rng")
            if state:
                self._gen.set_state(torch.frombuffer(bytearray.fromhex(state), dtype=torch.uint8).clone())
            else:
                self._gen.manual_seed(self.seed + self.adapter.placement.data_rank)
        return self._gen

    def run(self, i: int, before: dict | None = None) -> dict:
        """Batch ``i``'s sums (``before``: the value of batch ``i - 1`` when kept, for the generator's state)."""
        s, e = self.spans[i]
        adapter, place = self.adapter, self.adapter.placement
        b = C.batches(
            self.ld,
            adapter,
            self.texts[s:e],
            None if self.labels is None else self.labels[s:e],
            self.batch_size,
            max_length=self.max_length,
        )[0]
        gen = self._generator(before)
        t0 = time.perf_counter()
        with gated(adapter, self.backend) as holder:
            sums = importance_sums(adapter, b, holder, self.loss, gen)
        value: dict = {
            "importance": place.sum_group(sums),
            "seconds": time.perf_counter() - t0,
            "rng": gen.get_state().numpy().tobytes().hex() if self.loss in LABEL_FREE else None,
            "confidence": None,
            "rows": 0.0,
        }
        if self.confidence:
            conf, rows = confidence_sums(adapter, b)
            value["confidence"], value["rows"] = place.sum_group(conf), rows
        return value

    def grid(self, values: list[dict], normalize: bool = False) -> torch.Tensor:
        """The importance ``(n_layers, H)`` from every batch's value, in the order of the batches."""
        total = torch.zeros(self.adapter.n_layers, self.adapter.n_heads, dtype=torch.float64)
        for v in values:
            total += v["importance"]
        return importance_grid(self.adapter, total, len(self.texts), normalize)

    def finish(self, values: list[dict], single_effects: torch.Tensor | None = None) -> ImportanceResult:
        """:func:`~headlab.interpret.heads.importance.importance_study`'s result from every batch's value (and the
        rank correlations with ``single_effects``, an ablation's single effects, when given)."""
        conf = None
        if self.confidence:
            total = torch.zeros(self.adapter.n_layers, self.adapter.n_heads, dtype=torch.float64)
            rows = 0.0
            for v in values:
                total += v["confidence"]
                rows += v["rows"]
            conf = confidence_grid(self.adapter, total, rows)
        seconds = sum(v["seconds"] for v in values)
        return study_result(self.loaded, self.grid(values), self.loss, len(self.texts), seconds, conf, single_effects)

    @staticmethod
    def unit_to_json(value: dict) -> dict:
        """A batch's value as JSON (float64 sums as lists: they read back exactly)."""
        return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in value.items()}

    @staticmethod
    def unit_from_json(data: dict) -> dict:
        out = dict(data)
        for k in ("importance", "confidence"):
            if out.get(k) is not None:
                out[k] = torch.tensor(out[k], dtype=torch.float64)
        return out


class AblationUnits:
    """:func:`~headlab.interpret.heads.ablation.ablate`'s measurements, one unit per batch and phase (see the
    module docstring); keyword arguments as :class:`~headlab.interpret.heads.ablation_plan.AblationPlan`."""

    def __init__(self, loaded, texts, labels=None, **options) -> None:
        self.plan = AblationPlan(loaded, texts, labels, **options)
        self._pairs: tuple[list, list, torch.Tensor] | None = None

    def keys(self) -> list[str]:
        n, plan = len(self.plan.data), self.plan
        keys = [f"single {i}" for i in range(n)]
        if plan.n_pairs:
            keys += [f"pairs {i}" for i in range(n)] + (["cka"] if plan.cka else [])
        return keys

    def _effects(self, values: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(d_all (configurations, examples), unablated loss, accuracy or None)`` from the single units."""
        plan = self.plan
        d, base, acc = np.zeros((plan.masks.shape[0], plan.N)), np.zeros(plan.N), None
        for i in range(len(plan.data)):
            v = values[f"single {i}"]
            idx = np.asarray(v["index"], dtype=np.int64)
            d[:, idx], base[idx] = v["d"], v["base"]
            if v["acc"] is not None:
                acc = np.zeros(plan.N) if acc is None else acc
                acc[idx] = v["acc"]
        return d, base, acc

    def pairs(self, values: dict) -> tuple[list, list, torch.Tensor]:
        """``(pair heads, pairs, their masks)``, chosen from every single unit's effects (``values``: by key)."""
        if self._pairs is None:
            heads, pairs = self.plan.pairs_of(self._effects(values)[0])
            self._pairs = heads, pairs, config_masks(self.plan.adapter, [list(p) for p in pairs])
        return self._pairs

    def run(self, key: str, kept: dict) -> dict:
        """The value of unit ``key`` (``kept``: the values of the units before it, by key)."""
        plan = self.plan
        t0 = time.perf_counter()
        if key == "cka":
            heads, pairs, _ = self.pairs(kept)
            grid = plan.cka_grid(heads, pairs, plan.cka_batches(heads))
            return {"cka": grid.double().numpy(), "seconds": time.perf_counter() - t0}
        phase, i = key.split()
        b = plan.data[int(i)]
        masks = plan.masks if phase == "single" else self.pairs(kept)[2]
        d, base, acc = plan.measure(b, masks)
        return {"d": d, "base": base, "acc": acc, "index": b.index.tolist(), "seconds": time.perf_counter() - t0}

    def finish(self, values: dict) -> AblationResult:
        """:func:`ablate`'s result from every unit's value (by key)."""
        plan = self.plan
        d_all, base, acc = self._effects(values)
        heads, pairs, _ = self.pairs(values)
        d_pair = None
        if pairs:
            d_pair = np.zeros((len(pairs), plan.N))
            for i in range(len(plan.data)):
                v = values[f"pairs {i}"]
                d_pair[:, np.asarray(v["index"], dtype=np.int64)] = v["d"]
        cka = values.get("cka")
        cka_t = torch.from_numpy(np.asarray(cka["cka"], dtype=np.float64)).float() if cka is not None else None
        seconds = {
            "single_and_keep_one": sum(v["seconds"] for k, v in values.items() if k.startswith("single")),
            "pairs": sum(v["seconds"] for k, v in values.items() if not k.startswith("single")),
        }
        return plan.result(d_all, base, acc, heads, pairs, d_pair, cka_t, seconds)

    @staticmethod
    def unit_to_json(value: dict) -> dict:
        """A unit's value as JSON (arrays as lists; a CKA not measurable, NaN, as null)."""
        out = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in value.items()}
        if "cka" in out:
            out["cka"] = [[None if math.isnan(x) else x for x in row] for row in out["cka"]]
        return out

    @staticmethod
    def unit_from_json(data: dict) -> dict:
        out = dict(data)
        for k in ("d", "base", "acc", "cka"):
            if out.get(k) is not None:
                out[k] = np.array(out[k], dtype=np.float64)  # null (a NaN CKA) reads back as NaN
        return out


__all__ = ["AblationUnits", "ImportanceUnits"]
