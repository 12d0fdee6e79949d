"""How a refusal words its fix: the values near a wrong one that would work."""

from __future__ import annotations


def divisors(n: int) -> str:
    """The divisors of ``n``, as 'a, b or c'."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else ", ".join(ds[:-1]) + " or " + ds[-1]


def multiples(n: int, step: int) -> str:
    """The multiples of ``step`` either side of ``n``, as 'a or b'."""
    return " or ".join(str(x) for x in (n // step * step, (n // step + 1) * step) if x)
