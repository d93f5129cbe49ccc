"""User mistakes end in one line that says what to change, before training (docs/trainer-arguments.md)."""

from __future__ import annotations

import datasets
import pytest
import torch
from trl import DPOTrainer, SFTTrainer

from hf_dp import DPTrainerMixin
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.loss_contract import require_per_example
from tests import models
from tests.trainer_utils import make_args, make_trainer


def test_a_model_with_no_trainable_parameters_is_refused(tmp_path):
    model = models.gpt2()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_trainer(tmp_path, model=model, noise_multiplier=1.0)


def test_a_streaming_dataset_is_refused_in_one_line(tmp_path):
    rows = [{"input_ids": [5, 6, 7]}] * 8
    streaming = datasets.IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match="map-style train_dataset .* not IterableDataset"):
        make_trainer(tmp_path, dataset=streaming, noise_multiplier=1.0)


@pytest.mark.parametrize("trl_trainer, ours", [(SFTTrainer, "DPSFTTrainer"), (DPOTrainer, "DPDPOTrainer")])
def test_the_mixin_mixed_straight_into_a_trl_trainer_points_at_hf_dp_trl(tmp_path, trl_trainer, ours):
    mixed = type("MyPrivateTrainer", (DPTrainerMixin, trl_trainer), {})
    with pytest.raises(TypeError, match=rf"into trl's {trl_trainer.__name__} directly.*hf_dp\.trl\.{ours}"):
        mixed(model=models.gpt2(), args=make_args(tmp_path, noise_multiplier=1.0))


def test_a_loss_of_the_wrong_length_says_how_many_units_and_rows():
    pairs = PrivacyUnits.of_rows(torch.tensor([0, 1, 2, 0, 1, 2]))
    with pytest.raises(ValueError, match=r"shape \(3,\) for this micro-batch's 3 units made of 6 rows"):
        require_per_example(torch.zeros(5), 3, "MyTrainer.compute_per_example_loss", pairs)
    with pytest.raises(ValueError, match=r"returned \(\); .* 4 units \(no mean over the batch\)"):
        require_per_example(torch.zeros(()), 4, "MyTrainer.compute_loss")
