"""Feature maps of linear attention: ``phi(x)`` with ``sim(q, k) = phi(q) . phi(k)``.

Linear attention (Katharopoulos et al. 2020) replaces ``exp(q . k * scale)`` by a product of
non-negative features, so that ``sum_j phi(k_j) v_j^T`` can be summed once and reused by
every query::

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j))

Three maps, each ``(..., head_dim) -> (..., features)``:

* ``elu``: ``phi(x) = elu(x) + 1`` (Katharopoulos et al.); ``head_dim`` features, all > 0.
* ``relu``: ``phi(x) = max(x, 0)``; ``head_dim`` features, may all be 0 (that row outputs 0).
* ``favor``: Performer's FAVOR+ (Choromanski et al. 2020), ``m`` positive orthogonal random
  features ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)`` with rows of ``W`` drawn orthogonal in
  blocks of ``head_dim`` and with Gaussian norms, so ``E[phi(x) . phi(y)] = exp(x . y)``:
  an unbiased estimate of the softmax kernel. Applied to ``x * scale**0.5`` so that the
  product estimates ``exp(q . k * scale)``.

    >>> import torch
    >>> from headlab.spec import feature_maps as fm
    >>> w = fm.orthogonal_gaussian(8, 4, torch.Generator().manual_seed(0))
    >>> w.shape                                    # (features, head_dim)
    torch.Size([8, 4])
    >>> g = w[:4] @ w[:4].T                        # one block: orthogonal rows
    >>> bool((g - torch.diag(torch.diag(g))).abs().max() < 1e-10)
    True
    >>> x = torch.randn(3, 4, dtype=torch.float64)
    >>> fm.favor(x, w).shape, bool((fm.favor(x, w) > 0).all()), bool((fm.elu(x) > 0).all())
    (torch.Size([3, 8]), True, True)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["elu", "relu", "favor", "favor_logits", "orthogonal_gaussian"]


def elu(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1``: strictly positive, ``head_dim`` features. ``x``: ``(..., head_dim)``."""
    # = exp(min(x, 0)) + max(x, 0): twice as fast as F.elu(x) + 1 on CPUs (vectorised exp)
    if x.requires_grad:
        return torch.exp(torch.clamp(x, max=0.0)) + torch.relu(x)
    return torch.clamp(x, max=0.0).exp_().add_(torch.relu(x))


def relu(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0)``: non-negative, ``head_dim`` features. ``x``: ``(..., head_dim)``."""
    return F.relu(x)


def orthogonal_gaussian(
    num_features: int, head_dim: int, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """FAVOR+ projection ``W``: ``(num_features, head_dim)``, drawn on the CPU from ``generator``.

    Rows come in blocks of ``head_dim`` mutually orthogonal directions (QR of a Gaussian matrix,
    signs fixed so each block is Haar-distributed); each row is then scaled by the norm of an
    independent Gaussian vector, so that every row is marginally ``N(0, I)`` (the kernel estimate
    stays unbiased) while rows of a block are exactly orthogonal (lower variance).
    """
    n_blocks = -(-num_features // head_dim)
    g = torch.randn(n_blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)
    qm, r = torch.linalg.qr(g)  # (nb, d, d): one batched QR
    qm = qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar: fix QR's sign ambiguity
    w = qm.transpose(-1, -2).reshape(n_blocks * head_dim, head_dim)[:num_features]  # (m, d): rows orthonormal per block
    norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return (w * norms.view(-1, 1)).to(dtype)


def favor_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``W x - |x|^2 / 2``: ``(..., head_dim) -> (..., m)``, the exponent of FAVOR+ features."""
    return torch.matmul(x, w.T) - 0.5 * (x * x).sum(-1, keepdim=True)


def favor(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Positive random features ``exp(W x - |x|^2/2) / sqrt(m)``, unstabilised (the plain formula).

    ``x``: ``(..., head_dim)``; ``w``: ``(m, head_dim)``. The backend subtracts a per-row (queries)
    or per-head (keys) maximum from the exponent before ``exp``; both cancel in the ratio.
    """
    return torch.exp(favor_logits(x, w)) / math.sqrt(w.shape[0])
