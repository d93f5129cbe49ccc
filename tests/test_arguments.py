"""DPTrainingArguments: every misuse refused in one clear line before any training, and the warnings it gives."""

from __future__ import annotations

import math
import warnings

import pytest

from tests.trainer_utils import make_args

REFUSED = [
    # what to train against, and how much noise
    ({"target_epsilon": 1.0, "noise_multiplier": 1.0}, "give exactly one of target_epsilon"),
    ({"target_epsilon": -1.0}, "target_epsilon must be > 0"),
    ({"target_epsilon": math.inf}, "target_epsilon must be > 0 and finite"),
    ({"noise_multiplier": -0.5}, "noise_multiplier must be >= 0"),
    ({"noise_multiplier": math.inf}, "noise_multiplier must be >= 0 and finite"),
    ({"noise_multiplier": math.nan}, "noise_multiplier must be >= 0 and finite"),
    ({"noise_multiplier": 1.0, "target_delta": 1.5}, r"target_delta must be in \(0, 1\)"),
    ({"disable_dp": True, "noise_multiplier": 1.0}, "disable_dp=True trains without privacy"),
    # clipping
    ({"noise_multiplier": 1.0, "per_sample_max_grad_norm": 0.0}, "per_sample_max_grad_norm must be > 0"),
    (
        {"noise_multiplier": 1.0, "per_sample_max_grad_norm": math.inf},
        "per_sample_max_grad_norm must be > 0 and finite",
    ),
    (
        {"noise_multiplier": 1.0, "per_sample_max_grad_norm": math.nan},
        "per_sample_max_grad_norm must be > 0 and finite",
    ),
    ({"noise_multiplier": 1.0, "clipping_mode": "fast"}, "clipping_mode='fast' is unknown"),
    ({"noise_multiplier": 1.0, "clipping_fn": "soft"}, "clipping_fn='soft' is unknown"),
    ({"noise_multiplier": 1.0, "max_grad_norm": 1.0}, "would clip the noisy aggregate"),
    # the update rule's targets (each trained silently: the token loss took any smoothing, the DP rules any decay)
    (
        {"noise_multiplier": 1.0, "label_smoothing_factor": 1.5},
        r"label_smoothing_factor=1.5 .* set it in \[0, 1\)",
    ),
    ({"noise_multiplier": 1.0, "label_smoothing_factor": -0.1}, r"label_smoothing_factor=-0.1"),
    ({"noise_multiplier": 1.0, "weight_decay": -1.0}, r"weight_decay=-1.0 would grow the weights"),
    # accounting, the update rule
    ({"noise_multiplier": 1.0, "accountant": "gdp"}, "accountant='gdp' is unknown"),
    ({"noise_multiplier": 1.0, "dp_optimizer": "lion"}, "dp_optimizer='lion' is unknown"),
    ({"noise_multiplier": 1.0, "dp_optimizer_kwargs": "{kappa: 1"}, "dp_optimizer_kwargs is not valid JSON"),
    (
        {"noise_multiplier": 1.0, "dp_optimizer": "adamw", "dp_optimizer_kwargs": {"betaz": 0.9}},
        "betaz",  # a wrong optimizer kwarg is named with the arguments
    ),
    # the noise mechanism
    ({"noise_multiplier": 1.0, "num_bands": "0"}, "num_bands='0' must be an integer >= 1 or 'auto'"),
    ({"noise_multiplier": 1.0, "num_bands": "four"}, "must be an integer >= 1 or 'auto'"),
    ({"noise_multiplier": 1.0, "num_bands": 4}, "num_bands=4 sets the bands of noise_mechanism='bandmf'"),
    ({"noise_multiplier": 1.0, "bandmf_buffers_on_cpu": True}, "bandmf_buffers_on_cpu places"),
    (
        {"noise_multiplier": 1.0, "noise_mechanism": "bandmf", "num_bands": 2, "poisson_sampling": False},
        "accounted for cyclic Poisson sampling, not fixed-size batches",
    ),
    (
        {"noise_multiplier": 1.0, "noise_mechanism": "bandmf"},
        "num_bands='auto' compares bands at equal epsilon",
    ),
    ({"disable_dp": True, "noise_mechanism": "bandmf"}, "disable_dp=True adds no noise"),
    # the data order and the seed
    ({"noise_multiplier": 1.0, "ignore_data_skip": True}, "ignore_data_skip=True would replay"),
    ({"noise_multiplier": 1.0, "insecure_dp_seed": 1, "secure_mode": True}, "contradict"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED)
def test_invalid_arguments_raise_one_clear_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_args(tmp_path, **overrides)
    assert "\n" not in str(info.value)


def test_noise_multiplier_zero_warns_not_private(tmp_path):
    with pytest.warns(UserWarning, match="NOT differentially private"):
        make_args(tmp_path, noise_multiplier=0.0)


def test_fixed_size_batches_warn_that_accounting_assumes_poisson(tmp_path):
    with pytest.warns(UserWarning, match="accounted as if batches were Poisson"):
        make_args(tmp_path, noise_multiplier=1.0, poisson_sampling=False)
