"""How a refusal words its fix: the values near a wrong one that would work."""

from __future__ import annotations

from collections.abc import Sequence


def divisor_list(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def multiple_list(n: int, step: int) -> list[int]:
    """The positive multiples of ``step`` nearest ``n``: two below or at it, two above."""
    below = n // step * step
    return [x for x in (below - step, below, below + step, below + 2 * step) if x > 0]


def either(values: Sequence[int]) -> str:
    """``[1, 2, 4]`` -> '1, 2 or 4'."""
    shown = [str(v) for v in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def divisors(n: int) -> str:
    """The divisors of ``n``, as 'a, b or c'."""
    return either(divisor_list(n))


def multiples(n: int, step: int) -> str:
    """The multiples of ``step`` either side of ``n``, as 'a or b'."""
    return " or ".join(str(x) for x in (n // step * step, (n // step + 1) * step) if x)
