"""hf_dp: differentially private fine-tuning that drops into the Hugging Face Trainer."""

from hf_dp.accounting import PrivacyAccountant, calibrate_noise_multiplier, compute_epsilon
from hf_dp.arguments import DPTrainingArguments
from hf_dp.clipping.rules import UnsupportedModuleError, register_rule
from hf_dp.losses import per_example_loss
from hf_dp.mechanism import GaussianMechanism
from hf_dp.optim.registry import make_dp_optimizer, register_dp_optimizer
from hf_dp.trainer import DPTrainer, DPTrainerMixin

__all__ = [
    "DPTrainer",
    "DPTrainerMixin",
    "DPTrainingArguments",
    "GaussianMechanism",
    "PrivacyAccountant",
    "UnsupportedModuleError",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "make_dp_optimizer",
    "per_example_loss",
    "register_dp_optimizer",
    "register_rule",
]
