"""Sums of ``floor((a k + b) / m)`` over ``k = 0 .. n - 1`` in ``O(log)`` steps.

A pattern that repeats every ``s`` offsets (a stride, a dilation) marks a tile visible when its
offsets hold a multiple of ``s``: ``floor(hi / s) - floor((lo - 1) / s)``. Along a diagonal of tiles
the offsets move by a fixed step, so the number of visible tiles is a difference of two such floor
sums, weighted by how many tiles share the diagonal (an affine function of its index). This is the
classic "Euclid-like" recursion (the one behind AtCoder's ``floor_sum``), extended to the weighted
sum ``sum k floor(...)``; ``tests/test_costs_all_patterns.py`` checks it against brute force.

    >>> floor_sums(10, 3, -4, 7) == (sum((3 * k - 4) // 7 for k in range(10)),
    ...                              sum(k * ((3 * k - 4) // 7) for k in range(10)))
    True
"""

from __future__ import annotations

__all__ = ["floor_sums"]


def _fgh(a: int, b: int, c: int, n: int) -> tuple[int, int, int]:
    """``sum floor((a i + b) / c)``, ``sum i floor(...)``, ``sum floor(...)^2`` over ``i = 0 .. n``,
    for ``a, b >= 0``, ``c > 0``, ``n >= 0``."""
    s1 = n * (n + 1) // 2
    if a == 0:
        q = b // c
        return (n + 1) * q, q * s1, q * q * (n + 1)
    if a >= c or b >= c:
        qa, qb = a // c, b // c
        f, g, h = _fgh(a % c, b % c, c, n)
        s2 = n * (n + 1) * (2 * n + 1) // 6
        return (
            f + qa * s1 + qb * (n + 1),
            g + qa * s2 + qb * s1,
            h + qa * qa * s2 + qb * qb * (n + 1) + 2 * qa * qb * s1 + 2 * qb * f + 2 * qa * g,
        )
    m = (a * n + b) // c
    if m == 0:
        return 0, 0, 0
    f2, g2, h2 = _fgh(c, c - b - 1, a, m - 1)
    f = n * m - f2
    g = (m * n * (n + 1) - h2 - f2) // 2
    h = n * m * (m + 1) - 2 * g2 - 2 * f2 - f
    return f, g, h


def floor_sums(n: int, a: int, b: int, m: int) -> tuple[int, int]:
    """``(sum_k floor((a k + b) / m), sum_k k * floor((a k + b) / m))`` over ``k = 0 .. n - 1``,
    for ``n >= 0``, ``a >= 0``, ``m > 0`` and any integer ``b``."""
    if n <= 0:
        return 0, 0
    q, b = divmod(b, m)  # floor((a k + b) / m) = q + floor((a k + b mod m) / m)
    f, g, _ = _fgh(a, b, m, n - 1)
    return f + q * n, g + q * (n * (n - 1) // 2)
