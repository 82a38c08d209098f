"""Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution"; kvpress's ``ExpectedAttentionPress``): a query-agnostic score of each prompt key, the
attention it is expected to receive from the queries still to come. :class:`Expected` is its rule (text
``expected:BUDGET``), held by SnapKV's store (``"snap"``), which calls :func:`expected_scores` after the prefill.

The future queries are modelled as a Gaussian. Over the prompt's queries past the first ``sink`` (which hold
outliers), before their rotary embedding, a query head's mean ``mu`` and covariance ``S``; a query at a future
position ``t`` is ``R_t q``, and over the next ``future`` positions the rotation is averaged, ``R = mean_t R_t``
(``R_t = diag(cos_t) + diag(sin_t) P``, ``P`` the rotation by half the channels), so the expected query is
``R mu`` with covariance ``R S R^T``. For ``q ~ N(m, C)``, ``E[exp(s q . k)] = exp(s m . k + s^2 k^T C k / 2)``
(``s``: the softmax scale), so key ``j``'s score is

    softmax_j( s (R mu) . k_j + s^2 / 2 k_j^T (R S R^T) k_j ) * ||v_j||

over the keys past the sinks, averaged over a kv head's query heads (then scaled by the value's norm, as kvpress's
``use_vnorm``). Each kv head keeps its ``sink`` first tokens (kvpress gives them the top score) and its ``budget -
sink`` best-scoring others. The queries are read from the cache's own (post-rotary) queries, un-rotated with the
model's rotary embedding (so QK-normed models are served too); a model without one has no rotation to average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headlab.decode.rule_checks import check_count, check_precision
from headlab.decode.rules import register_rule
from headlab.decode.snap_rule import Snap
from headlab.errors import ConfigError

__all__ = ["Expected", "expected", "expected_scores", "expected_select", "find_rotary"]


@register_rule
@dataclass(frozen=True)
class Expected(Snap):
    """Expected Attention's rule for a kv head: after the prefill, keep the ``sink`` first prompt tokens and the
    ``budget - sink`` others with the highest expected attention from future queries (module docstring), then
    every new token. Build it with :func:`expected`."""

    sink: int = 4
    future: int = 512  # future positions the rotation is averaged over
    covariance: bool = True
    vnorm: bool = True

    names = ("expected",)  # type: ignore[assignment]  # its own text, where Snap has three
    usage = "expected:BUDGET"

    def text(self) -> str:
        opts = [f"sink={self.sink}", f"future={self.future}"] + ([] if self.covariance else ["covariance=0"])
        opts += [] if self.vnorm else ["vnorm=0"]
        opts += [f"bits={self.bits}", f"group={self.group}", f"residual={self.residual}"] if self.bits != 16 else []
        return ",".join([f"expected:{self.budget}"] + opts)

    def label(self) -> str:
        return f"Expected Attention {self.budget}" + (f" {self.bits}-bit" if self.bits != 16 else "")

    @classmethod
    def from_text(cls, text: str, name: str, parts: list[str] | None) -> Expected:
        """``expected:BUDGET[,sink=4,future=512,covariance=0,vnorm=0,bits=4,group=32,residual=128]``."""
        parts = parts or []
        allowed = ("sink", "future", "covariance", "vnorm", "bits", "group", "residual")
        opts: dict = {}
        if not parts or "=" in parts[0]:
            raise ConfigError(
                f"kv rule {text!r}: write expected:BUDGET, the prompt tokens each kv head keeps "
                "(e.g. expected:256,sink=4)"
            )
        for i, item in enumerate(parts):
            key, eq, val = (p.strip() for p in item.partition("="))
            if i == 0:
                key, val = "budget", key
            elif key not in allowed or not eq:
                raise ConfigError(
                    f"kv rule {text!r}: unknown option {item!r}; expected takes "
                    f"{', '.join(a + '=' for a in allowed)} (e.g. expected:256,sink=4,bits=4)"
                )
            try:
                opts[key] = int(val)
            except ValueError:
                raise ConfigError(f"kv rule {text!r}: {key} takes an integer, got {val!r}") from None
        for flag in ("covariance", "vnorm"):
            if flag in opts:
                opts[flag] = bool(opts[flag])
        return expected(opts.pop("budget"), **opts)

    def __repr__(self) -> str:
        extra = "" if self.bits == 16 else f", bits={self.bits}, group={self.group}, residual={self.residual}"
        flags = ("" if self.covariance else ", covariance=False") + ("" if self.vnorm else ", vnorm=False")
        return f"expected({self.budget}, sink={self.sink}, future={self.future}{flags}{extra})"


def expected(
    budget: int,
    *,
    sink: int = 4,
    future: int = 512,
    covariance: bool = True,
    vnorm: bool = True,
    bits: int = 16,
    group: int | None = None,
    residual: int | None = None,
) -> Expected:
    """Expected Attention's rule (Devoto et al. 2025): each kv head keeps ``budget`` prompt tokens, its ``sink``
    first and the others future queries are expected to attend to most (:mod:`headlab.decode.expected`), then
    every new token; ``bits`` as :func:`~headlab.kv.snap`'s. kvpress's defaults: ``sink=4``, ``future=512``, with
    the covariance and the value norms. Raises :class:`~headlab.errors.ConfigError` for a budget below 1 or not
    above ``sink``, a negative sink, a future below 1."""
    check_count("budget", budget, low=1)
    check_count("future", future, low=1)
    check_count("sink", sink, low=0)
    if budget <= sink:
        raise ConfigError(
            f"expected(budget={budget}, sink={sink}): the budget counts the sinks it always keeps; "
            f"give budget > sink (e.g. expected({max(64, 4 * sink)}, sink={sink}))"
        )
    prec = check_precision(bits, group, residual)
    return Expected(budget, 1, 1, "max", False, None, None, *prec, sink, future, bool(covariance), bool(vnorm))


def find_rotary(model):
    """``rotary(positions) -> (cos, sin)`` ``(n, rotary dim)`` from the model's rotary embedding module (one named
    ``rotary_emb`` with an ``inv_freq``), or None when it has none."""
    for name, mod in model.named_modules():
        if name.split(".")[-1] == "rotary_emb" and hasattr(mod, "inv_freq"):

            def rotary(pos: torch.Tensor, mod=mod):
                x = torch.zeros(1, dtype=torch.float32, device=mod.inv_freq.device)
                cos, sin = mod(x, pos.reshape(1, -1).to(mod.inv_freq.device))
                return cos[0].float(), sin[0].float()

            return rotary
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def expected_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    rule: Expected,
    *,
    scale: float | None = None,
    rotary=None,
) -> torch.Tensor:
    """Expected Attention's scores of the prompt keys past the sinks (module docstring): ``q (B, H, n, d)`` the
    prompt's queries after their rotary embedding at positions ``q_pos``, ``k (B, Hkv, n, d)`` its keys, ``v`` its
    values; ``rotary``: :func:`find_rotary`'s function (None: no rotation). Returns ``(B, Hkv, n - sink)`` float32."""
    B, H, n, d = q.shape
    g, s0 = k.shape[1], rule.sink
    scale = d**-0.5 if scale is None else scale
    qs, ps = q[:, :, s0:].float(), q_pos[s0:]
    R = None
    if rotary is not None:
        cos, sin = rotary(ps)
        if cos.shape[-1] != d:
            raise ConfigError(
                f"Expected Attention: the rotary embedding covers {cos.shape[-1]} of the head's {d} "
                "channels (a partial rotary), which it does not model; use snapkv or adakv"
            )
        norm2 = cos**2 + sin**2  # the rotary's own attention scaling, squared (1 for plain RoPE)
        qs = (qs * cos - _rotate_half(qs) * sin) / norm2  # back to before the rotation
        fc, fs = rotary(torch.arange(n, n + rule.future))
        P = torch.zeros(d, d)
        P[d // 2 :, : d // 2], P[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
        R = torch.diag(fc.mean(0)) + fs.mean(0)[:, None] * P  # mean over t of diag(cos_t) + diag(sin_t) P
    mu = qs.mean(2)  # (B, H, d)
    if R is not None:
        mu = mu @ R.T
    keys = k[:, :, s0:].float().repeat_interleave(H // g, 1)  # (B, H, m, d)
    s = scale * (keys @ mu.unsqueeze(-1)).squeeze(-1)
    if rule.covariance:
        c = qs - qs.mean(2, keepdim=True)
        cov = c.transpose(-1, -2) @ c / c.shape[2]  # (B, H, d, d)
        if R is not None:
            cov = R @ cov @ R.T
        s = s + scale**2 / 2 * ((keys @ cov) * keys).sum(-1)
    a = torch.softmax(s, -1).reshape(B, g, H // g, -1).mean(2)
    if rule.vnorm:
        a = a * v[:, :, s0:].float().norm(dim=-1)
    return a


def expected_select(scores: torch.Tensor, rule: Expected, n: int) -> list[torch.Tensor]:
    """The prompt positions each kv head keeps, ascending: its sinks and the ``budget - sink`` best ``scores
    (heads, n - sink)`` (ties: the earlier position)."""
    heads, budget = scores.shape[0], rule.budget
    assert budget is not None  # every Expected rule has one
    if budget >= n:
        return [torch.arange(n)] * heads
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : budget - rule.sink]
    return [torch.cat([torch.arange(rule.sink), order[h].sort().values + rule.sink]) for h in range(heads)]
