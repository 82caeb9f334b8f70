"""A pairwise covering array under constraints: rows that cover every pair of factor values some valid row can hold.

``covering_rows(factors, violations)`` returns rows (one value per factor) such that every pair (factor i = a,
factor j = b) that occurs in some valid row occurs in one of them, with far fewer rows than the full product (the
product of 14 factors of 2-9 values each is ~1e9; a covering array needs about max_i |F_i| * max_j |F_j| rows).
``violations(row)`` counts the constraints a row breaks (0: valid).

Greedy, in the manner of AETG (Cohen et al., IEEE TSE 1997): take the first uncovered pair, fix it in a starting row
(the neutral row, every factor at its first value, and a few valid rows seen so far that hold one of the pair's
values) and make that valid by min-conflicts (change the one other factor that removes the most violations, or a
random one of those that keep their number, up to ``repairs`` times); then change each other factor, in a random
order, to the value that covers the most uncovered pairs while the row stays valid. Keep the best of a few such
completions and repeat. A pair that no repair makes valid is reported as ``infeasible``: the constraint forbids it
(the test that uses the array lists those pairs). Seeded: the same factors give the same rows.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

Row = dict[str, str]
Pair = tuple[str, str, str, str]  # (factor i, value a, factor j, value b), i before j in the factor order


@dataclass
class Covering:
    """The rows, and what building them cost."""

    rows: list[Row]
    pairs: int  # pairs of values the rows cover (every feasible pair)
    checked: int  # distinct rows the constraint was asked about while building
    refused: int  # of those, the rows it refused
    infeasible: list[Pair] = field(default_factory=list)


def row_pairs(row: Mapping[str, str], names: Sequence[str]) -> set[Pair]:
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}


def covering_rows(
    factors: Mapping[str, Sequence[str]],
    violations: Callable[[Row], int],
    *,
    seed: int = 0,
    completions: int = 2,
    repairs: int = 4,
) -> Covering:
    """Rows covering every feasible pair of ``factors`` (name -> values; the first value is the neutral one)."""
    names = list(factors)
    rng = random.Random(seed)
    memo: dict[tuple[str, ...], int] = {}
    valid_with: dict[tuple[str, str], list[Row]] = {}  # (factor, value) -> valid rows seen that hold it

    def broken(row: Row) -> int:
        key = tuple(row[n] for n in names)
        if key not in memo:
            memo[key] = violations(row)
            if memo[key] == 0:
                for n in names:
                    valid_with.setdefault((n, row[n]), []).append(row)
        return memo[key]

    uncovered: set[Pair] = set()
    for a, b in itertools.combinations(names, 2):
        uncovered.update((a, va, b, vb) for va in factors[a] for vb in factors[b])

    def gain(row: Row) -> int:
        return len(row_pairs(row, names) & uncovered)

    def repair(row: Row, free: list[str]) -> Row | None:
        for _ in range(repairs + 1):
            now = broken(row)
            if now == 0:
                return row
            moves = [(broken({**row, n: v}), rng.random(), n, v) for n in free for v in factors[n] if v != row[n]]
            best = min(moves, default=None)
            if best is None or best[0] > now:  # sideways moves allowed: a plateau needs two changes at once
                return None
            row = {**row, best[2]: best[3]}
        return row if broken(row) == 0 else None

    def complete(start: Row, fixed: Row) -> Row | None:
        free = [n for n in names if n not in fixed]
        row = repair({**start, **fixed}, free)
        if row is None:
            return None
        rng.shuffle(free)
        for n in free:
            now = gain(row)
            for g, _, v in sorted(((gain({**row, n: v}), rng.random(), v) for v in factors[n]), reverse=True):
                if g <= now:
                    break
                if broken({**row, n: v}) == 0:
                    row = {**row, n: v}
                    break
        return row

    neutral = {n: factors[n][0] for n in names}
    rows: list[Row] = []
    infeasible: list[Pair] = []
    covered = 0
    while uncovered:
        a, va, b, vb = target = min(uncovered)
        best: Row | None = None
        near = valid_with.get((a, va), []) + valid_with.get((b, vb), [])
        for start in [neutral, *rng.sample(near, min(completions, len(near)))]:
            row = complete(start, {a: va, b: vb})
            if row is not None and (best is None or gain(row) > gain(best)):
                best = row
        if best is None:
            infeasible.append(target)
            uncovered.discard(target)
            continue
        new = row_pairs(best, names) & uncovered
        covered += len(new)
        uncovered -= new
        rows.append(best)
    refused = sum(count > 0 for count in memo.values())
    return Covering(rows, covered, len(memo), refused, sorted(infeasible))
