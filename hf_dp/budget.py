"""Stop before the privacy budget would be exceeded, and close each logical batch's step plan.

σ and q are fixed within a run, so the number of steps the budget allows is found once, at train start, by
bisection over the accountant (``PrivacyAccountant.steps_within``), not by asking it after every step.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class PrivacyBudgetCallback(TrainerCallback):
    """Ends each logical batch's plan and stops training before the budget would be exceeded."""

    def __init__(self, trainer) -> None:
        self.trainer, self.allowed_steps = trainer, None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, plan = self.trainer, self.trainer.privacy_plan
        self.allowed_steps = None
        if not plan.private or args.target_epsilon is None or state.max_steps <= state.global_step:
            return control
        fit = trainer.accountant.steps_within(
            args.target_epsilon, plan.noise_multiplier, plan.sample_rate, state.max_steps - state.global_step
        )
        if fit == 0:
            spent = trainer.accountant.epsilon_after(plan.noise_multiplier, plan.sample_rate)
            raise ValueError(
                f"hf_dp: the privacy budget is spent: after {trainer.accountant.steps} steps one more would reach "
                f"epsilon {spent:.4g} > target_epsilon {args.target_epsilon:g}; raise target_epsilon or train fewer steps"
            )
        self.allowed_steps = trainer.accountant.steps + fit
        return control

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        trainer._planner.end()
        if self.allowed_steps is not None and trainer.accountant.steps >= self.allowed_steps:
            plan = trainer.privacy_plan
            logger.warning(
                f"hf_dp: stopping at step {state.global_step}: one more step would spend epsilon "
                f"{trainer.accountant.epsilon_after(plan.noise_multiplier, plan.sample_rate):.4g} > target_epsilon "
                f"{args.target_epsilon:g} (spent so far {trainer.get_epsilon():.4g})"
            )
            control.should_training_stop = True
        return control
