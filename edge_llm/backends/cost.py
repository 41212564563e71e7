"""What a forward of T rows costs relative to one row: the declared profile every backend states
(`Backend.forward_cost`, docs/speculative.md). Speculative decoding drafts only where the profile
says a verify forward pays, so its choices never depend on how fast this moment happens to be."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    """A forward of T >= 2 rows costs `multi + slope * (T - 2)` one-row forwards: a BLAS or a
    graph runner switches kernels at two rows (`multi`), then each row adds a little (`slope`)."""

    multi: float
    slope: float

    def __call__(self, rows: int) -> float:
        return 1.0 if rows <= 1 else self.multi + self.slope * (rows - 2)


NEVER_PAYS = ForwardCost(2.0, 1.0)  # T rows cost T steps (or more): a draft never pays
