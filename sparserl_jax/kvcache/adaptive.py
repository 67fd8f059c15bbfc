"""The adaptive KV budget: a ladder of budgets and a hysteresis controller that walks it.

Sparse rollouts trade KV memory for mismatch between the sparse sampler mu and the dense policy
pi_old. Sparrow (arXiv 2606.08446) watches the tail of the token ratio `rho = pi_old / mu`
rather than its mean: a run stays stable while the 5th percentile `p5` stays at or above about
0.86. `BudgetController` holds `p5` there with the least budget it can:

    after step s (its rollout used budget B_s, its correction measured p5_s):
      p5_s < target                              -> B_{s+1} = the next rung up   (at once)
      p5_s > target + margin for `patience` steps -> B_{s+1} = the next rung down
      otherwise                                  -> B_{s+1} = B_s

With `max_rejected` set, a step whose correction rejected more than that fraction of its
sequences (veto, sequence-level rejection, or every token masked) also counts as below target:
p5 is a token percentile, and a rung can hold it in the band while the veto drops half of each
batch (the L/4 study in docs/reproductions.md: p5 0.88 at 128 tokens, 48% of sequences vetoed).

Raising is immediate and lowering waits, because a tail collapse costs more than a few steps of
extra memory; the band `[target, target + margin]` keeps the budget from oscillating between
two rungs. A non-finite `p5` counts as below target. The budget moves only between steps: a
rollout always runs at one budget.

Backoff: a lowering is a probe of the rung below. If that rung falls below the target within its
first `patience` steps, the probe failed: the budget goes back up and the wait before the next
lowering is multiplied by `backoff` (up to `max_patience`); `patience` steps at or above the
target pass the probe and reset the wait to `patience`. Without it a rung that fails every time
is probed every `patience + 1` steps for the whole run (on the CPU demo: 40, 40, 24, repeated,
with a third of the steps below the target); with it the share of steps spent failing probes
falls geometrically, while a rung that becomes viable later is still found.

Why a ladder: the budget is static in the rollout engine (it sizes the page pool and the page
table, and the compression's top-k), so each distinct budget is a separate engine with its own
compiled programs. `budget_ladder` allows at most `levels` budgets, `min_budget` to
`max_budget` in equal whole-page steps from the start budget; engines are built once per rung
and kept (their page pools are allocated per rollout and freed after it, so an idle rung holds
only its compiled code), so a run compiles at most `levels` rollout engines whatever the
controller does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sparserl_jax.kvcache.config import CompressionConfig

__all__ = ["BudgetController", "BudgetState", "budget_ladder"]


def budget_ladder(kv: CompressionConfig, *, page_size: int, max_len: int) -> tuple[int, ...]:
    """The budgets (tokens, ascending) the controller may pick: the start budget `kv.budget`,
    rungs above and below it in equal steps of the smallest whole number of pages that needs
    at most `kv.adaptive.levels` rungs, and the two ends: `min_budget` (default: half the start
    budget, above the window, so the budget can go down from where it starts) and `max_budget`
    (default `max_len`: nothing is evicted; the steps next to either end may be shorter)."""
    ad = kv.adaptive
    start = kv.budget
    lo = max(kv.window + 1, start // 2) if ad.min_budget is None else ad.min_budget
    hi = max_len if ad.max_budget is None else ad.max_budget
    if not lo < hi:
        raise ValueError(
            f"the adaptive budget needs min_budget < max_budget, got [{lo}, {hi}] (max_budget "
            f"defaults to the rollout length max_prompt_len + max_new_tokens = {max_len})"
        )
    if not lo <= start <= hi:
        raise ValueError(
            f"budget ({start}) is where the adaptive budget starts: it must lie in "
            f"[min_budget, max_budget] = [{lo}, {hi}]"
        )
    if ad.levels < len({lo, start, hi}):
        raise ValueError(
            f"adaptive.levels={ad.levels} cannot hold min_budget {lo}, the start budget {start} "
            f"and max_budget {hi}: use at least {len({lo, start, hi})}"
        )

    def rungs(stride: int) -> list[int]:
        return sorted({lo, hi, *range(start, lo, -stride), *range(start, hi, stride)})

    pages = 1
    while len(rungs(pages * page_size)) > ad.levels:
        pages += 1
    return tuple(rungs(pages * page_size))


class BudgetState(NamedTuple):
    """The controller's state: the budget of the next rollout; how many steps in a row `p5` has
    been above the band (reset by any step that is not); `wait`, the steps above the band the next
    lowering needs (0: `patience`); `trial`, the steps left in the probe of the rung just lowered
    to (0: no probe running)."""

    budget: int
    above: int = 0
    wait: int = 0
    trial: int = 0


class BudgetController:
    """The control law of the module docstring over a fixed `ladder` (optax-like: `init` and
    `update` are pure; the state is a `BudgetState`, stored in checkpoints as a dict)."""

    def __init__(
        self,
        ladder: Sequence[int],
        *,
        target: float,
        margin: float,
        patience: int,
        backoff: int = 2,
        max_patience: int = 32,
        max_rejected: float | None = None,
    ) -> None:
        ladder = tuple(int(b) for b in ladder)
        if not ladder or list(ladder) != sorted(set(ladder)):
            raise ValueError(f"the budget ladder must be ascending and distinct, got {ladder}")
        if max_rejected is not None and not 0 <= max_rejected < 1:
            raise ValueError(f"max_rejected must be in [0, 1), got {max_rejected}")
        self.ladder, self.target, self.margin, self.patience = ladder, target, margin, patience
        self.backoff, self.max_patience = backoff, max(max_patience, patience)
        self.max_rejected = max_rejected

    @classmethod
    def from_config(cls, kv: CompressionConfig, *, page_size: int, max_len: int):
        """The controller `kv.adaptive` describes (see `budget_ladder`)."""
        ad = kv.adaptive
        ladder = budget_ladder(kv, page_size=page_size, max_len=max_len)
        return cls(
            ladder,
            target=ad.target,
            margin=ad.margin,
            patience=ad.patience,
            backoff=ad.backoff,
            max_patience=ad.max_patience,
            max_rejected=ad.max_rejected,
        )

    def init(self, budget: int) -> BudgetState:
        """Start at the lowest rung at or above `budget` (the top rung if none is)."""
        at_or_above = [b for b in self.ladder if b >= budget]
        return BudgetState(budget=at_or_above[0] if at_or_above else self.ladder[-1])

    def update(self, state: BudgetState, rho_p5: float, rejected: float = 0.0) -> BudgetState:
        """The budget after a step whose correction measured `rho_p5` and rejected the fraction
        `rejected` of its sequences (read only when `max_rejected` is set)."""
        i = self._index(state.budget)
        wait, trial = state.wait or self.patience, state.trial
        too_many = self.max_rejected is not None and not rejected <= self.max_rejected  # NaN too
        if too_many or not (math.isfinite(rho_p5) and rho_p5 >= self.target):
            if trial:  # the probe of this rung failed: wait longer before the next one
                wait = min(wait * self.backoff, self.max_patience)
            return self._state(self.ladder[min(i + 1, len(self.ladder) - 1)], 0, wait, 0)
        if trial:
            trial -= 1
            if not trial:  # the rung held for `patience` steps: the probe passed
                wait = self.patience
        if rho_p5 <= self.target + self.margin or i == 0:  # hold (at the bottom: nowhere to go)
            return self._state(state.budget, 0, wait, trial)
        above = state.above + 1
        if above >= wait:
            return self._state(self.ladder[i - 1], 0, wait, self.patience)
        return self._state(state.budget, above, wait, trial)

    def _state(self, budget: int, above: int, wait: int, trial: int) -> BudgetState:
        return BudgetState(budget, above, 0 if wait == self.patience else wait, trial)

    def restore(self, saved: Mapping[str, Any]) -> BudgetState:
        """A state saved as `state._asdict()` (checkpoint meta), checked against the ladder."""
        state = BudgetState(
            budget=int(saved["budget"]),
            above=int(saved.get("above", 0)),
            wait=int(saved.get("wait", 0)),
            trial=int(saved.get("trial", 0)),
        )
        self._index(state.budget)
        return state

    def _index(self, budget: int) -> int:
        if budget not in self.ladder:
            raise ValueError(
                f"KV budget {budget} is not on the adaptive ladder {self.ladder} (a checkpoint "
                "from a run with other rollout.kv.adaptive settings?)"
            )
        return self.ladder.index(budget)
