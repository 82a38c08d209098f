"""Clark et al.'s other measurements (2019, sections 3 and 6), token-level, every head at once.

- :class:`SurfaceStats`: mean attention to the first token ([CLS]), to [SEP], to punctuation, to
  the next / previous token and to itself, and the attention entropy, per head; a mean over every
  real query token of every sentence.
- :func:`js_sums`: Jensen-Shannon divergences between every pair of heads' attention
  distributions, summed over query tokens: ``JS(P, Q) = H(M) - (H(P) + H(Q)) / 2`` with
  ``M = (P + Q) / 2`` (nats). :func:`classical_mds` embeds the distances ``sqrt(JS)`` in 2-D
  (Torgerson's classical scaling), which is how figure 6 of the paper is drawn.
- :func:`grad_sums`: mean ``|d loss / d attention|`` on the attention to [SEP] against all other
  attention (their figure 3, the "no-op" test), per head.

All take ``att (B, K, T, T)`` with K = layers x heads and masks ``(B, T)``.
"""

from __future__ import annotations

import numpy as np
import torch


class SurfaceStats:
    """Running sums of the surface measurements for K heads."""

    def __init__(self, K: int) -> None:
        self.sums = {
            k: torch.zeros(K, dtype=torch.float64)
            for k in ("to_first", "to_sep", "to_punct", "to_next", "to_prev", "to_self", "entropy")
        }
        self.n_query = 0.0
        self.n_pairs = 0.0
        self.any_sep = False

    def add(self, att: torch.Tensor, valid: torch.Tensor, sep: torch.Tensor, punct: torch.Tensor) -> None:
        """``att (B, K, T, T)``; ``valid``, ``sep``, ``punct`` ``(B, T)`` bool (real token, separator, punctuation)."""
        q = valid[:, None, :].to(att.dtype)  # (B, 1, T) weight of each query row
        s = self.sums
        s["to_first"] += (att[..., 0] * q).sum((0, 2)).double()
        s["to_sep"] += ((att * sep[:, None, None, :]).sum(-1) * q).sum((0, 2)).double()
        s["to_punct"] += ((att * punct[:, None, None, :]).sum(-1) * q).sum((0, 2)).double()
        s["to_self"] += (att.diagonal(0, -2, -1) * q).sum((0, 2)).double()
        pair = (valid[:, :-1] & valid[:, 1:])[:, None, :].to(att.dtype)  # (B, 1, T-1)
        s["to_next"] += (att.diagonal(1, -2, -1) * pair).sum((0, 2)).double()
        s["to_prev"] += (att.diagonal(-1, -2, -1) * pair).sum((0, 2)).double()
        s["entropy"] += (-torch.special.xlogy(att, att).sum(-1) * q).sum((0, 2)).double()
        self.n_query += float(valid.sum())
        self.n_pairs += float(pair.sum())
        self.any_sep = self.any_sep or bool(sep.any())

    def means(self) -> dict[str, np.ndarray]:
        """``{name: (K,)}``; ``to_sep`` is NaN when no sentence had a separator token."""
        out = {}
        for k, v in self.sums.items():
            n = self.n_pairs if k in ("to_next", "to_prev") else self.n_query
            out[k] = (v / max(n, 1.0)).numpy()
        if not self.any_sep:
            out["to_sep"] = np.full_like(out["to_sep"], np.nan)
        return out


def js_sums(att: torch.Tensor, *, chunk: int = 16) -> torch.Tensor:
    """``(K, K)``: the sum over query rows of ``JS(att[i, row], att[j, row])`` for one sentence.

    Args:
        att: ``(K, r, t)`` r query rows of one sentence's attention over its t real tokens (no padding).
    """
    K = att.shape[0]
    P = att.float().reshape(K, -1)  # rows concatenated: JS is a sum over rows of per-row terms
    h = -torch.special.xlogy(P, P).sum(-1)  # (K,) sum over rows of each row's entropy
    out = torch.empty(K, K, dtype=torch.float64)
    for i in range(0, K, chunk):
        M = (P[i : i + chunk, None, :] + P[None, :, :]) * 0.5  # (c, K, t*t)
        hm = -torch.special.xlogy(M, M).sum(-1)
        out[i : i + chunk] = (hm - (h[i : i + chunk, None] + h[None, :]) * 0.5).double()
    return out.clamp_(min=0.0)


def classical_mds(dist: np.ndarray, dims: int = 2) -> np.ndarray:
    """Classical (Torgerson) multidimensional scaling of a distance matrix: ``(n, n) -> (n, dims)``.

    ``B = -J D^2 J / 2`` with ``J = I - 11^T / n``; the coordinates are the top eigenvectors of B
    scaled by the square roots of their eigenvalues (negative ones clipped to 0).

    >>> pts = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    >>> D = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    >>> Y = classical_mds(D)
    >>> bool(np.allclose(np.linalg.norm(Y[:, None] - Y[None], axis=-1), D))
    True
    """
    n = dist.shape[0]
    J = np.eye(n) - np.full((n, n), 1.0 / n)
    B = -0.5 * J @ (dist**2) @ J
    vals, vecs = np.linalg.eigh((B + B.T) / 2)
    order = np.argsort(vals)[::-1][:dims]
    return vecs[:, order] * np.sqrt(np.clip(vals[order], 0.0, None))


def grad_sums(grad: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, *, causal: bool):
    """Sums of ``|grad|`` on attention to sink keys and to the other keys, and their counts.

    Args:
        grad: ``(B, K, T, T)`` d loss / d attention weights.
        valid: ``(B, T)`` real tokens; sink: ``(B, T)`` the keys counted as [SEP] (or the first token).
        causal: count only keys at or before the query (later keys get no attention, so their
            gradient says nothing about how the model uses attention).

    Returns:
        ``(sum_sink (K,), n_sink, sum_other (K,), n_other)``.
    """
    T = grad.shape[-1]
    allowed = valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, T, T)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    to_sink = allowed & sink[:, None, None, :]
    to_other = allowed & ~sink[:, None, None, :]
    g = grad.abs().double()
    return ((g * to_sink).sum((0, 2, 3)), float(to_sink.sum()), (g * to_other).sum((0, 2, 3)), float(to_other.sum()))


__all__ = ["SurfaceStats", "classical_mds", "grad_sums", "js_sums"]
