"""Stop before the privacy budget would be exceeded.

σ and q are fixed within a run, so the number of steps the budget allows is found once, at train start, by
bisection over the accountant (``PrivacyAccountant.steps_within``), not by asking it after every step. With b
bands (cyclic Poisson sampling) only every b-th step spends ε (``PrivacyPlan.ledger_steps``); the steps between
are free.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class PrivacyBudgetCallback(TrainerCallback):
    """Stops training before the step that would spend more than ``target_epsilon``."""

    def __init__(self, run) -> None:
        self.run, self.allowed_steps = run, None  # run: hf_dp.run.PrivateRun

    def on_train_begin(self, args, state, control, **kwargs):
        plan, accountant = self.run.plan, self.run.accountant
        self.allowed_steps = None
        if not plan.private or args.target_epsilon is None or state.max_steps <= state.global_step:
            return control
        remaining = plan.ledger_steps(state.max_steps) - accountant.steps
        fit = accountant.steps_within(args.target_epsilon, plan.noise_multiplier, plan.sample_rate, remaining)
        if fit == 0 and remaining > 0 and _spends(plan, state.global_step):
            spent = accountant.epsilon_after(plan.noise_multiplier, plan.sample_rate)
            raise ValueError(
                f"hf_dp: the privacy budget is spent: after {accountant.steps} steps one more would reach "
                f"epsilon {spent:.4g} > target_epsilon {args.target_epsilon:g}; raise target_epsilon or train fewer steps"
            )
        self.allowed_steps = accountant.steps + fit
        return control

    def on_step_end(self, args, state, control, **kwargs):
        plan, accountant = self.run.plan, self.run.accountant
        if (
            self.allowed_steps is not None
            and accountant.steps >= self.allowed_steps
            and _spends(plan, state.global_step)
            and state.global_step < state.max_steps  # the planned end is no stop
        ):
            logger.warning(
                f"hf_dp: stopping at step {state.global_step}: one more step would spend epsilon "
                f"{accountant.epsilon_after(plan.noise_multiplier, plan.sample_rate):.4g} > target_epsilon "
                f"{args.target_epsilon:g} (spent so far {self.run.epsilon():.4g})"
            )
            control.should_training_stop = True
        return control


def _spends(plan, step: int) -> bool:
    """Whether the step with index ``step`` (0-based) takes a ledger step."""
    return step % plan.bands == 0
