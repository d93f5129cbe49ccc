"""DPTrainer on 2 processes: DDP through accelerate launch / torchrun, and DeepSpeed ZeRO-1/2/3.

Every run is a real 2-process job (tests/distributed_worker.py) and asserts the world size and the
distributed type it meant to test. With σ = 0 and the same logical batches each must end at the same
parameters as one process; with σ > 0 the noise must be added exactly once: std σC/B̄ per coordinate
of the update, identical on DDP replicas, independent between the partitions of different ZeRO ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_dp import calibrate_noise_multiplier, compute_epsilon
from hf_dp.distributed import check_deepspeed_config, check_fsdp, check_launched_world
from tests import models

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "distributed_worker.py")
BIN = Path(sys.executable).parent
CONFIGS = REPO / "recipes" / "configs"
LR, CLIP = 0.5, 0.5  # the worker's learning rate (SGD) and clip norm


class Runs:
    """Launches each distinct job once, one at a time (2 cores), each on its own port."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.done = root, 29700 + os.getpid() % 200, {}

    def __call__(self, name: str, launcher: str, *worker_args: str, fails: bool = False) -> Path | str:
        """The run's output folder, or with ``fails=True`` its stderr (the run must fail)."""
        if name in self.done:
            return self.done[name]
        out = self.root / name
        self.port += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
        if launcher == "single":
            env.update(
                RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port)
            )
            command = [sys.executable]
        elif launcher == "torchrun":
            command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(self.port)]
        else:  # an accelerate config file from recipes/configs
            command = [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / launcher)]
            command += ["--main_process_port", str(self.port)]
        result = subprocess.run(
            [*command, WORKER, "--out", str(out), *worker_args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if fails:
            assert result.returncode != 0, f"{name} was expected to fail"
            return result.stderr
        if result.returncode != 0:
            raise AssertionError(f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
        self.done[name] = out
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("distributed"))


def info(out: Path) -> dict:
    return json.loads((out / "info.json").read_text())


def flat(path: Path) -> torch.Tensor:
    params = torch.load(path)
    return torch.cat([params[name].flatten() for name in sorted(params)])


def relative_difference(a: Path, b: Path) -> float:
    x, y = flat(a), flat(b)
    return ((x - y).norm() / y.norm()).item()


def assert_world(out: Path, distributed_type: str, zero_stage: int | None = None) -> dict:
    run = info(out)
    assert run["world_size"] == 2, run
    assert run["distributed_type"] == f"DistributedType.{distributed_type}", run
    assert run["zero_stage"] == zero_stage, run
    assert "grad_norm" not in run["log_keys"]  # the unnoised norm must never be logged
    return run


def one_process_reference(runs: Runs) -> Path:
    """The same logical batches in one process: 2 × the per-device batch, same accumulation."""
    return runs("reference", "single", "--per_device", "8")


def test_user_level_dp_with_two_processes_matches_one_process(runs):
    """Users sampled once for all processes, split between them by user (never a user's rows on two), each
    user's rows clipped as one: DDP equals the one-process run without noise."""
    reference = runs("reference_users", "single", "--users", "--per_device", "8")
    out = runs("ddp_users", "torchrun", "--users")
    run = assert_world(out, "MULTI_CPU")
    assert run["privacy_unit"] == info(reference)["privacy_unit"] == "user"
    assert run["sample_rate"] == info(reference)["sample_rate"] == pytest.approx(16 / 22)
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4
    assert relative_difference(out / "final.pt", one_process_reference(runs) / "final.pt") > 1e-3


def test_reference_clips(runs):
    """The parity tests below mean something only if clipping is active: a huge C gives another result."""
    reference = one_process_reference(runs)
    unclipped = runs("reference_unclipped", "single", "--per_device", "8", "--clip", "1e6")
    assert relative_difference(unclipped / "final.pt", reference / "final.pt") > 1e-3


@pytest.mark.parametrize(
    ("name", "launcher", "extra", "distributed_type", "stage"),
    [
        ("ddp_accelerate", "ddp.yaml", ("--snapshot_step", "1"), "MULTI_CPU", None),
        ("ddp_torchrun", "torchrun", (), "MULTI_CPU", None),
        ("zero1", "torchrun", ("--zero", "1"), "DEEPSPEED", 1),
        ("zero2_accelerate", "deepspeed_zero2.yaml", ("--snapshot_step", "1"), "DEEPSPEED", 2),
        ("zero3", "torchrun", ("--zero", "3"), "DEEPSPEED", 3),
        ("zero3_per_sample", "torchrun", ("--zero", "3", "--clipping_mode", "per_sample"), "DEEPSPEED", 3),
        ("ddp_checkpointing", "torchrun", ("--checkpointing", "non_reentrant"), "MULTI_CPU", None),
        ("zero3_checkpointing", "torchrun", ("--zero", "3", "--checkpointing", "reentrant"), "DEEPSPEED", 3),
        ("fsdp2_checkpointing", "torchrun", ("--fsdp", "--checkpointing", "non_reentrant"), "FSDP", None),
    ],
)
def test_two_processes_match_one_process_without_noise(runs, name, launcher, extra, distributed_type, stage):
    """The reference runs without activation checkpointing: with it, the norms come from inside a backward."""
    reference = one_process_reference(runs)
    out = runs(name, launcher, *extra)
    run = assert_world(out, distributed_type, stage)
    assert run["checkpointing"] == run["norms_in_backward"] == ("--checkpointing" in extra)
    assert run["expected_batch_size"] == info(reference)["expected_batch_size"] == 16
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4
    # the logged loss is the mean over the whole logical batch, not one process's share
    assert run["losses"] == pytest.approx(info(reference)["losses"], rel=1e-5)


def test_zero2_bf16_matches_one_process_within_bf16_rounding(runs):
    """DeepSpeed with bf16 (bf16 weights and activations, float32 master weights and gradient partitions, noise
    in the float32 client optimizer): the update is the float32 one-process update up to bf16 rounding. Measured:
    2.0% after 3 steps, as a one-process bf16 run (2.0%); the two bf16 runs agree to 0.4%."""
    out = runs("zero2_bf16", "torchrun", "--zero", "2", "--bf16")
    run = assert_world(out, "DEEPSPEED", 2)
    assert run["expected_batch_size"] == 16
    torch.manual_seed(0)  # the worker's model
    start = dict(models.gpt2().named_parameters())
    initial = torch.cat([start[name].detach().flatten() for name in sorted(start)])
    ours = flat(out / "final.pt") - initial
    reference = flat(one_process_reference(runs) / "final.pt") - initial
    assert ((ours - reference).norm() / reference.norm()).item() < 0.04


def test_zero3_llama_matches_one_process_without_noise(runs):
    """RMSNorm's rule runs the module itself: under ZeRO-3 it must not trip the parameter gathering."""
    reference = runs("reference_llama", "single", "--per_device", "8", "--model", "llama")
    out = runs("zero3_llama", "torchrun", "--zero", "3", "--model", "llama")
    assert_world(out, "DEEPSPEED", 3)
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


def test_ddp_disk_matches_one_process_without_noise(runs):
    """DiSK's two evaluations per step (shifted parameters, the combination clipped once) under DDP."""
    common = ("--optimizer", "disk", "--lr", "0.05")
    reference = runs("reference_disk", "single", "--per_device", "8", *common)
    out = runs("ddp_disk", "ddp.yaml", *common)
    assert_world(out, "MULTI_CPU")
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


def test_optimizers_that_need_bookkeeping_are_refused_under_deepspeed(runs):
    stderr = runs("zero2_disk", "torchrun", "--zero", "2", "--optimizer", "disk", fails=True)
    assert "dp_optimizer='disk'" in stderr and "not supported under DeepSpeed" in stderr


def noise_of_first_step(runs: Runs, noisy: Path, clean_name: str, launcher: str, *extra: str) -> torch.Tensor:
    clean = runs(clean_name, launcher, "--snapshot_step", "1", *extra)
    return (flat(noisy / "params_step1.pt") - flat(clean / "params_step1.pt")) / LR


def assert_noise_std(noise: torch.Tensor, sigma: float, expected_batch: int) -> None:
    """Per coordinate the update noise must be σC/B̄ (once, after the sum): 3% is > 4 standard errors here."""
    expected = sigma * CLIP / expected_batch
    assert noise.numel() > 5000
    assert noise.std().item() == pytest.approx(expected, rel=0.03)


def test_ddp_noise_is_added_once_and_identical_on_replicas(runs):
    noisy = runs("ddp_noisy", "ddp.yaml", "--sigma", "1.0", "--snapshot_step", "1", "--record_noise")
    run = assert_world(noisy, "MULTI_CPU")
    assert_noise_std(
        noise_of_first_step(runs, noisy, "ddp_accelerate", "ddp.yaml"), 1.0, run["expected_batch_size"]
    )
    # replicated gradients: both processes drew the same noise, so their parameters stay identical
    assert torch.equal(torch.load(noisy / "noise_process0.pt"), torch.load(noisy / "noise_process1.pt"))


def test_a_secret_key_drawn_by_the_main_process_is_shared_by_both(runs):
    """The default run (no insecure_dp_seed): one OS-entropy key, broadcast, so both DDP replicas draw the same
    global batches and the same noise; a second such run draws other noise."""
    first = runs("ddp_secret", "ddp.yaml", "--sigma", "1.0", "--record_noise", "--secret")
    second = runs("ddp_secret_again", "ddp.yaml", "--sigma", "1.0", "--record_noise", "--secret")
    assert_world(first, "MULTI_CPU")
    noise = [torch.load(first / f"noise_process{r}.pt") for r in (0, 1)]
    assert noise[0].numel() > 5000 and torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], torch.load(second / "noise_process0.pt"))
    assert relative_difference(first / "final.pt", second / "final.pt") > 1e-6


def test_zero2_noise_is_independent_per_partition_and_epsilon_matches_one_process(runs):
    noisy = runs(
        "zero2_noisy",
        "deepspeed_zero2.yaml",
        "--target_epsilon",
        "4",
        "--snapshot_step",
        "1",
        "--record_noise",
    )
    run = assert_world(noisy, "DEEPSPEED", 2)
    noise = noise_of_first_step(runs, noisy, "zero2_accelerate", "deepspeed_zero2.yaml")
    assert_noise_std(noise, run["noise_multiplier"], run["expected_batch_size"])
    first, second = torch.load(noisy / "noise_process0.pt"), torch.load(noisy / "noise_process1.pt")
    total = sum(p.numel() for p in torch.load(noisy / "final.pt").values())
    # each process drew noise for its own partition only: about half of the coordinates per step
    assert first.numel() < 0.6 * total * run["steps"] and second.numel() < 0.6 * total * run["steps"]
    n = min(first.numel(), second.numel())
    correlation = torch.corrcoef(torch.stack([first[:n], second[:n]]))[0, 1].item()
    assert abs(correlation) < 0.05  # the same seed on both ranks would give 1.0
    # accounting sees the global q and the optimizer steps: the same σ and ε as one process
    sigma = calibrate_noise_multiplier(4.0, 64**-1.1, run["sample_rate"], run["steps"], "prv")
    assert run["sample_rate"] == 16 / 64
    assert run["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
    assert run["epsilon"] == pytest.approx(
        compute_epsilon(sigma, run["sample_rate"], 3, 64**-1.1, "prv"), rel=1e-6
    )
    assert run["epsilon"] <= 4.0


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_fsdp2_matches_one_process_without_noise(runs, model):
    """FSDP2 through the Trainer's own fsdp arguments really shards on CPU (every parameter a DTensor, gloo, two
    processes; accelerate alone would silently run DDP), and the norm pass never reaches its reduce-scatter:
    tied GPT-2 and Llama equal one process."""
    if model == "gpt2":
        reference = one_process_reference(runs)
    else:
        reference = runs("reference_llama", "single", "--per_device", "8", "--model", "llama")
    out = runs(f"fsdp2_{model}", "torchrun", "--fsdp", "--model", model)
    run = assert_world(out, "FSDP")
    assert run["sharded"] and run["backend"] == "gloo" and run["norms_in_backward"]
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


def test_fsdp2_through_accelerate_launch_matches_one_process(runs):
    """`accelerate launch` with recipes/configs/fsdp2.yaml (the script sets no fsdp argument) shards as well."""
    out = runs("fsdp2_accelerate", "fsdp2.yaml")
    run = assert_world(out, "FSDP")
    assert run["sharded"] and run["backend"] == "gloo"
    assert relative_difference(out / "final.pt", one_process_reference(runs) / "final.pt") < 1e-4


def test_fsdp2_bf16_mixed_precision_is_applied_and_close_to_float32(runs):
    """bf16=True under FSDP2 becomes FSDP's MixedPrecisionPolicy (bf16 compute over float32 sharded weights and
    gradients, noise in float32): the update is the float32 one-process update up to bf16 rounding (measured
    0.45%), and not equal to it (the policy is applied, not silently dropped as accelerate does on CPU)."""
    out = runs("fsdp2_bf16", "torchrun", "--fsdp", "--bf16")
    assert assert_world(out, "FSDP")["sharded"]
    torch.manual_seed(0)  # the worker's model
    start = dict(models.gpt2().named_parameters())
    initial = torch.cat([start[name].detach().flatten() for name in sorted(start)])
    ours = flat(out / "final.pt") - initial
    reference = flat(one_process_reference(runs) / "final.pt") - initial
    assert 1e-4 < ((ours - reference).norm() / reference.norm()).item() < 2e-2


def test_fsdp2_lora_matches_one_process(runs):
    """peft LoRA on every linear layer of Llama, the base sharded and frozen: the adapters take the one-process
    steps."""
    reference = runs("reference_lora", "single", "--per_device", "8", "--model", "llama", "--lora")
    out = runs("fsdp2_lora", "torchrun", "--fsdp", "--model", "llama", "--lora")
    assert assert_world(out, "FSDP")["sharded"]
    ours, theirs = torch.load(out / "final.pt"), torch.load(reference / "final.pt")
    adapters = [n for n in theirs if "lora_B" in n]
    assert len(adapters) == 14 and all(theirs[n].norm() > 0 for n in adapters)  # B starts at zero
    x = torch.cat([ours[n].flatten() for n in adapters])
    y = torch.cat([theirs[n].flatten() for n in adapters])
    assert ((x - y).norm() / y.norm()).item() < 1e-4


def test_fsdp2_stateful_update_rule_matches_one_process(runs):
    """DOPPLER keeps histories of ĝ per parameter: on DTensor shards it takes the one-process steps."""
    reference = runs(
        "reference_doppler", "single", "--per_device", "8", "--optimizer", "doppler", "--lr", "0.01"
    )
    out = runs("fsdp2_doppler", "torchrun", "--fsdp", "--optimizer", "doppler", "--lr", "0.01")
    assert assert_world(out, "FSDP")["sharded"]
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


def test_fsdp2_noise_is_independent_per_shard_and_epsilon_matches_one_process(runs):
    noisy = runs(
        "fsdp2_noisy", "torchrun", "--fsdp", "--target_epsilon", "4", "--snapshot_step", "1", "--record_noise"
    )
    run = assert_world(noisy, "FSDP")
    assert_noise_std(
        noise_of_first_step(runs, noisy, "fsdp2_clean", "torchrun", "--fsdp"),
        run["noise_multiplier"],
        run["expected_batch_size"],
    )
    first, second = torch.load(noisy / "noise_process0.pt"), torch.load(noisy / "noise_process1.pt")
    total = sum(p.numel() for p in torch.load(noisy / "final.pt").values())
    # each process drew noise for the shards it owns: half of the coordinates per step, none twice
    assert first.numel() + second.numel() == total * run["steps"]
    assert first.numel() < 0.6 * total * run["steps"] and second.numel() < 0.6 * total * run["steps"]
    n = min(first.numel(), second.numel())
    assert abs(torch.corrcoef(torch.stack([first[:n], second[:n]]))[0, 1].item()) < 0.05
    sigma = calibrate_noise_multiplier(4.0, 64**-1.1, run["sample_rate"], run["steps"], "prv")
    assert run["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
    assert run["epsilon"] == pytest.approx(
        compute_epsilon(sigma, run["sample_rate"], 3, 64**-1.1, "prv"), rel=1e-6
    )


@pytest.mark.parametrize(
    ("name", "launcher", "extra", "distributed_type", "stage"),
    [
        ("ddp", "ddp.yaml", (), "MULTI_CPU", None),
        ("zero3", "torchrun", ("--zero", "3"), "DEEPSPEED", 3),
        ("fsdp2", "torchrun", ("--fsdp",), "FSDP", None),
    ],
)
def test_resume_continues_the_uninterrupted_run(runs, name, launcher, extra, distributed_type, stage):
    """σ > 0: the noise generators, sampler and accountant resume exactly with the weights and optimizer."""
    common = ("--sigma", "1.0", "--steps", "4", "--optimizer", "adamw", "--lr", "0.01", *extra)
    whole = runs(f"{name}_whole", launcher, "--save_steps", "2", *common)
    resumed = runs(f"{name}_resumed", launcher, "--resume_from", str(whole / "checkpoint-2"), *common)
    run = assert_world(resumed, distributed_type, stage)
    assert run["steps"] == 4 and run["epsilon"] == pytest.approx(info(whole)["epsilon"], rel=1e-12)
    assert relative_difference(resumed / "final.pt", whole / "final.pt") < 1e-6


def test_deepspeed_norm_and_gradient_passes_see_the_same_dropout(runs):
    """DeepSpeed needs two passes; with different dropout masks the clipped object would not be the one
    whose norm was measured. One process, dropout on: DeepSpeed ZeRO-2 must equal the book-keeping path."""
    common = ("--per_device", "8", "--dropout", "0.2")
    plain = runs("dropout_plain", "single", *common)
    zero2 = runs("dropout_zero2", "single", "--zero", "2", *common)
    assert info(zero2)["zero_stage"] == 2 and info(zero2)["world_size"] == 1
    assert relative_difference(zero2 / "final.pt", plain / "final.pt") < 1e-5
    undropped = runs("reference", "single", "--per_device", "8")
    assert relative_difference(undropped / "final.pt", plain / "final.pt") > 1e-3  # dropout did act


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"optimizer": {"type": "Adam"}}, "'optimizer' section"),
        ({"gradient_clipping": 1.0}, "gradient_clipping=1.0"),
        ({"fp16": {"enabled": True}}, "dynamic loss scale overflows"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ],
)
def test_deepspeed_settings_that_break_dp_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        check_deepspeed_config(config)


def test_processes_that_would_each_train_alone_are_refused():
    """On CPU without use_cpu the Trainer ignores torchrun's process group (ENVIRONMENT: each process trains
    alone, with its own batches and noise); the launcher's WORLD_SIZE must match the Trainer's world size."""
    check_launched_world(SimpleNamespace(world_size=2), {"WORLD_SIZE": "2"})
    check_launched_world(SimpleNamespace(world_size=1), {})
    with pytest.raises(ValueError, match="started 2 processes .* sees 1; on CPU pass use_cpu=True"):
        check_launched_world(SimpleNamespace(world_size=1), {"WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("version", "dp_optimizer", "message"),
    [
        (1, "sgd", "FSDP1 flattens the parameters"),
        (2, "disk", "dp_optimizer='disk' .* not supported under FSDP"),
        (2, "stp", "dp_optimizer='stp' .* not supported under FSDP"),
    ],
)
def test_fsdp_settings_that_break_dp_are_refused(version, dp_optimizer, message):
    with pytest.raises(ValueError, match=message):
        check_fsdp(version, dp_optimizer)
    with pytest.raises(ValueError, match="use_reentrant': False"):
        check_fsdp(2, "sgd", reentrant_checkpointing=True)
