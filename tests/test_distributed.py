"""DPTrainer on 2 processes: DDP through accelerate launch / torchrun, and DeepSpeed ZeRO-1/2/3.

Every run is a real 2-process job (tests/distributed_worker.py) and asserts the world size and the
distributed type it meant to test. With σ = 0 and the same logical batches each must end at the same
parameters as one process; with σ > 0 the noise must be added exactly once: std σC/B̄ per coordinate
of the update, identical on DDP replicas, independent between the partitions of different ZeRO ranks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_dp import calibrate_noise_multiplier, compute_epsilon
from hf_dp.checkpoint_files import COMPLETE_FILE, noise_state_file
from hf_dp.distributed import check_deepspeed, check_deepspeed_config, check_fsdp, check_launched_world
from hf_dp.optim.registry import dp_optimizer_names, scaled_geometry, shifted_evaluations
from tests import models
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "distributed_worker.py")
BIN = Path(sys.executable).parent
CONFIGS = REPO / "recipes" / "configs"
LR, CLIP = 0.5, 0.5  # the worker's learning rate (SGD) and clip norm


RESUME = ("--sigma", "1.0", "--steps", "4", "--optimizer", "adamw", "--lr", "0.01")
BANDMF = (*RESUME, "--noise_mechanism", "bandmf", "--num_bands", "2")  # ε: ⌈4/2⌉ DP-SGD steps at p = 2B̄/N
# Update rules whose state is per parameter (and, under FSDP2, per shard), on every sharded backend. DP-AdamBC
# needs σC/B̄ > 0: σ = 1e-9 (noise ~3e-11 per coordinate, far below the 1e-4 parity bar; RDP, since PRV's grid
# cannot hold that ε).
STATEFUL = {
    "adam": ("--optimizer", "adam", "--lr", "0.01"),
    "adamw": ("--optimizer", "adamw", "--lr", "0.01"),
    "adam_bc": ("--optimizer", "adam_bc", "--lr", "0.01", "--sigma", "1e-9", "--accountant", "rdp"),
    "doppler": ("--optimizer", "doppler", "--lr", "0.01"),
}
SHARDED = {"fsdp2": ("--fsdp",), "zero2": ("--zero", "2"), "zero3": ("--zero", "3")}
NODE_BACKENDS = {"ddp": (), "zero2": ("--zero", "2"), "fsdp2": ("--fsdp",)}


def node_jobs(backend: str) -> dict[str, tuple[str, ...]]:
    """The 2-node runs of one backend, by name suffix: σ = 0; σ = 1 saved and resumed from one shared
    output_dir; the same with one output_dir per node, checkpoint-4 torn on node 1 only."""
    return {
        "": ("--per_device", "2"),
        "_whole": (*RESUME, "--per_device", "2", "--save_steps", "2"),
        "_resumed": (
            *RESUME,
            "--per_device",
            "2",
            "--resume_from",
            f"{{nodes_{backend}_whole}}/checkpoint-2",
        ),
        "_each_whole": (*RESUME, "--per_device", "2", "--save_steps", "2", "--per_node_dir"),
        "_each_resumed": (
            *(*RESUME, "--per_device", "2", "--per_node_dir", "--resume_from", "true"),
            *("--output_dir", f"{{nodes_{backend}_each_whole}}", "--tear", "node1/checkpoint-4"),
        ),
    }


# Update rules that clip in a geometry ‖s ⊙ g_i‖ built from their per-parameter state, on FSDP2 (DeepSpeed refuses
# them): STP with the dense and the factored (rank-1) scale, DP² through its SGD step into two adaptive steps.
SCALED = {
    "stp": ("--optimizer", "stp", "--lr", "0.01"),
    "stp_factored": ("--optimizer", "stp", "--lr", "0.01", "--optimizer_kwargs", '{"factored": true}'),
    "dp2": (
        "--optimizer",
        "dp2",
        "--lr",
        "0.01",
        "--optimizer_kwargs",
        '{"sgd_steps": 1, "adaptive_steps": 2, "adaptive_clip_norm": 1.0}',
    ),
}

# Every run, by name: its launcher (one process, torchrun, or an accelerate config from recipes/configs) and
# the worker's arguments. "{name}" in an argument is that run's output folder.
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    # one process: the references (same logical batches: 2 × the per-device batch, same accumulation)
    "reference": ("single", ("--per_device", "8")),
    "reference_unclipped": ("single", ("--per_device", "8", "--clip", "1e6")),
    "reference_groups": ("single", ("--per_device", "8", "--clipping_groups", "layer")),
    "reference_users": ("single", ("--users", "--per_device", "8")),
    "reference_llama": ("single", ("--per_device", "8", "--model", "llama")),
    "reference_lora": ("single", ("--per_device", "8", "--model", "llama", "--lora")),
    "reference_mixtral": ("single", ("--per_device", "8", "--model", "mixtral")),
    "reference_disk": ("single", ("--per_device", "8", "--optimizer", "disk", "--lr", "0.05")),
    **{
        f"reference_{rule}": ("single", ("--per_device", "8", *rule_args))
        for rule, rule_args in {**STATEFUL, **SCALED}.items()
    },
    "dropout_plain": ("single", ("--per_device", "8", "--dropout", "0.2")),
    "dropout_zero2": ("single", ("--per_device", "8", "--dropout", "0.2", "--zero", "2")),
    # accelerate launch --config_file recipes/configs/ddp.yaml
    "ddp_accelerate": ("ddp.yaml", ("--snapshot_step", "1")),
    "ddp_disk": ("ddp.yaml", ("--optimizer", "disk", "--lr", "0.05")),
    "ddp_noisy": ("ddp.yaml", ("--sigma", "1.0", "--snapshot_step", "1", "--record_noise")),
    "ddp_secret": ("ddp.yaml", ("--sigma", "1.0", "--record_noise", "--secret")),
    "ddp_secret_again": ("ddp.yaml", ("--sigma", "1.0", "--record_noise", "--secret")),
    "ddp_whole": ("ddp.yaml", (*RESUME, "--save_steps", "2")),
    "ddp_resumed": ("ddp.yaml", (*RESUME, "--resume_from", "{ddp_whole}/checkpoint-2")),
    # accelerate launch --config_file recipes/configs/deepspeed_zero2.yaml
    "zero2_accelerate": ("deepspeed_zero2.yaml", ("--snapshot_step", "1")),
    "zero2_noisy": (
        "deepspeed_zero2.yaml",
        ("--target_epsilon", "4", "--snapshot_step", "1", "--record_noise"),
    ),
    # accelerate launch --config_file recipes/configs/fsdp2.yaml
    "fsdp2_accelerate": ("fsdp2.yaml", ()),
    # torchrun: DDP and DeepSpeed
    "ddp_torchrun": ("torchrun", ()),
    "ddp_users": ("torchrun", ("--users",)),
    "ddp_checkpointing": ("torchrun", ("--checkpointing", "non_reentrant")),
    "ddp_groups": ("torchrun", ("--clipping_groups", "layer", "--checkpointing", "non_reentrant")),
    "ddp_checkpointing_deep_tail": ("torchrun", ("--checkpointing", "non_reentrant", "--tail_share", "1e9")),
    # LoRA whose kept gradients do not fit and whose tail reaches over no layer: the tail starts at the last layer
    "ddp_checkpointing_lora": (
        "torchrun",
        (
            *("--model", "llama", "--lora", "--checkpointing", "non_reentrant"),
            *("--kept_share", "0", "--tail_share", "0"),
        ),
    ),
    # LoRA whose kept gradients fit (this tiny model's adapters are 23% of it, B 4: the budget raised to fit them):
    # after the checked first step the norm pass's per-example gradients give the sum
    "zero2_checkpointing_lora": (
        "torchrun",
        (
            *("--zero", "2", "--model", "llama", "--lora"),
            *("--checkpointing", "non_reentrant", "--kept_share", "1"),
        ),
    ),
    "zero1": ("torchrun", ("--zero", "1")),
    # group-wise clipping: each group's sum formed in the norm pass's backward, handed to ZeRO-2 as linear terms
    "zero2_groups": ("torchrun", ("--zero", "2", "--clipping_groups", "layer")),
    # ... into the unsharded weights' .grad, reduce-scattered by FSDP2's end-of-backward callback
    "fsdp2_groups": ("torchrun_fsdp", ("--fsdp", "--clipping_groups", "layer")),
    "fsdp2_groups_checkpointing": (
        "torchrun_fsdp",
        ("--fsdp", "--clipping_groups", "layer", "--checkpointing", "non_reentrant"),
    ),
    "zero2_bf16": ("torchrun", ("--zero", "2", "--bf16")),
    "zero2_disk": ("torchrun", ("--zero", "2", "--optimizer", "disk")),
    "zero3": ("torchrun", ("--zero", "3")),
    "zero3_per_sample": ("torchrun", ("--zero", "3", "--clipping_mode", "per_sample")),
    "zero1_checkpointing": ("torchrun", ("--zero", "1", "--checkpointing", "non_reentrant")),
    "zero2_checkpointing_deep_tail": (
        "torchrun",
        ("--zero", "2", "--checkpointing", "non_reentrant", "--tail_share", "1e9"),
    ),
    "zero2_checkpointing": ("torchrun", ("--zero", "2", "--checkpointing", "reentrant")),
    "zero2_checkpointing_llama": (
        "torchrun",
        ("--zero", "2", "--checkpointing", "non_reentrant", "--model", "llama"),
    ),
    "zero2_bf16_checkpointing": ("torchrun", ("--zero", "2", "--bf16", "--checkpointing", "non_reentrant")),
    "zero3_checkpointing": ("torchrun", ("--zero", "3", "--checkpointing", "reentrant")),
    "zero3_llama": ("torchrun", ("--zero", "3", "--model", "llama")),
    # MoE: flattened rows, routers and fused experts by their call rules (refused under ZeRO-3)
    "zero3_mixtral_refused": ("torchrun", ("--zero", "3", "--model", "mixtral")),
    "zero2_checkpointing_mixtral": (
        "torchrun",
        ("--zero", "2", "--checkpointing", "non_reentrant", "--model", "mixtral"),
    ),
    # GPT-2 left-padded without position_ids: every process refuses on the first step, before any release
    "zero3_left_padded_refused": ("torchrun", ("--zero", "3", "--left_pad")),
    "zero3_whole": ("torchrun", (*RESUME, "--zero", "3", "--save_steps", "2")),
    "zero3_resumed": ("torchrun", (*RESUME, "--zero", "3", "--resume_from", "{zero3_whole}/checkpoint-2")),
    # torchrun: FSDP2 (a launch of its own: its shared state is switched to FSDP on CPU)
    "fsdp2_gpt2": ("torchrun_fsdp", ("--fsdp",)),
    "fsdp2_llama": ("torchrun_fsdp", ("--fsdp", "--model", "llama")),
    "fsdp2_mixtral": ("torchrun_fsdp", ("--fsdp", "--model", "mixtral")),
    "fsdp2_checkpointing_mixtral": (
        "torchrun_fsdp",
        ("--fsdp", "--checkpointing", "non_reentrant", "--model", "mixtral"),
    ),
    "fsdp2_checkpointing": ("torchrun_fsdp", ("--fsdp", "--checkpointing", "non_reentrant")),
    # the tail over both blocks of the tied GPT-2: the stopped forward reaches no unit's output (the embeddings
    # belong to the root), so none of FSDP2's pre-backward hooks queues its end-of-backward reduce-scatter
    "fsdp2_checkpointing_deep_tail": (
        "torchrun_fsdp",
        ("--fsdp", "--checkpointing", "non_reentrant", "--tail_share", "1e9"),
    ),
    "fsdp2_fsdp_checkpointing": ("torchrun_fsdp", ("--fsdp", "--fsdp_checkpointing")),
    "fsdp2_checkpointing_llama": (
        "torchrun_fsdp",
        ("--fsdp", "--checkpointing", "non_reentrant", "--model", "llama"),
    ),
    # the LM head a unit of its own, sharded again after its forward
    "fsdp2_checkpointing_head_unit": (
        "torchrun_fsdp",
        ("--fsdp", "--checkpointing", "non_reentrant", "--model", "llama", "--fsdp_unit", "Linear"),
    ),
    # the final norm a unit of its own that keeps its weights unsharded after its forward
    "fsdp2_checkpointing_norm_unit": (
        "torchrun_fsdp",
        (
            *("--fsdp", "--checkpointing", "non_reentrant", "--model", "llama"),
            *("--fsdp_unit", "LlamaRMSNorm", "--fsdp_keep_unsharded"),
        ),
    ),
    "fsdp2_bf16_checkpointing": ("torchrun_fsdp", ("--fsdp", "--bf16", "--checkpointing", "non_reentrant")),
    "fsdp2_bf16": ("torchrun_fsdp", ("--fsdp", "--bf16")),
    "fsdp2_lora": ("torchrun_fsdp", ("--fsdp", "--model", "llama", "--lora")),
    "fsdp2_clean": ("torchrun_fsdp", ("--fsdp", "--snapshot_step", "1")),
    "fsdp2_noisy": (
        "torchrun_fsdp",
        ("--fsdp", "--target_epsilon", "4", "--snapshot_step", "1", "--record_noise"),
    ),
    "fsdp2_whole": ("torchrun_fsdp", (*RESUME, "--fsdp", "--save_steps", "2")),
    "fsdp2_resumed": ("torchrun_fsdp", (*RESUME, "--fsdp", "--resume_from", "{fsdp2_whole}/checkpoint-2")),
    # correlated noise (BandMF) resumed mid-run on every backend: its buffers come back with the checkpoint
    "ddp_bandmf_whole": ("ddp.yaml", (*BANDMF, "--save_steps", "3")),
    "ddp_bandmf_resumed": ("ddp.yaml", (*BANDMF, "--resume_from", "{ddp_bandmf_whole}/checkpoint-3")),
    "zero1_bandmf_whole": ("torchrun", (*BANDMF, "--zero", "1", "--save_steps", "3")),
    "zero1_bandmf_resumed": (
        "torchrun",
        (*BANDMF, "--zero", "1", "--resume_from", "{zero1_bandmf_whole}/checkpoint-3"),
    ),
    "zero2_bandmf_whole": ("torchrun", (*BANDMF, "--zero", "2", "--save_steps", "3")),
    "zero2_bandmf_resumed": (
        "torchrun",
        (*BANDMF, "--zero", "2", "--resume_from", "{zero2_bandmf_whole}/checkpoint-3"),
    ),
    "zero3_bandmf_whole": ("torchrun", (*BANDMF, "--zero", "3", "--save_steps", "3")),
    "zero3_bandmf_resumed": (
        "torchrun",
        (*BANDMF, "--zero", "3", "--resume_from", "{zero3_bandmf_whole}/checkpoint-3"),
    ),
    "fsdp2_bandmf_whole": ("torchrun_fsdp", (*BANDMF, "--fsdp", "--save_steps", "3")),
    "fsdp2_bandmf_resumed": (
        "torchrun_fsdp",
        (*BANDMF, "--fsdp", "--resume_from", "{fsdp2_bandmf_whole}/checkpoint-3"),
    ),
    # 2 nodes × 2 processes (a launcher per node, static rendezvous on one host: accelerate launch with
    # recipes/configs/multi_node.yaml, torchrun for FSDP2): σ = 0 against one process;
    # checkpoint and resume with one shared output_dir, and with one per node (save_on_each_node), where the
    # newest checkpoint is torn on node 1 only and every process must resume from the one before it
    **{
        f"nodes_{backend}{suffix}": ("two_nodes_fsdp" if backend == "fsdp2" else "two_nodes", (*flags, *job))
        for backend, flags in NODE_BACKENDS.items()
        for suffix, job in node_jobs(backend).items()
        if backend != "fsdp2" or "each" not in suffix
    },
    # FSDP2's shards cannot be split over one folder per machine: refused before training
    "nodes_fsdp2_each_refused": (
        "two_nodes_fsdp",
        ("--fsdp", *RESUME, "--per_device", "2", "--save_steps", "2", "--per_node_dir"),
    ),
    # every stateful update rule on every sharded backend
    **{
        f"{backend}_{rule}": ("torchrun_fsdp" if backend == "fsdp2" else "torchrun", (*flags, *rule_args))
        for backend, flags in SHARDED.items()
        for rule, rule_args in STATEFUL.items()
    },
    **{f"fsdp2_{rule}": ("torchrun_fsdp", ("--fsdp", *rule_args)) for rule, rule_args in SCALED.items()},
    **{
        f"fsdp2_{rule}_noisy": (
            "torchrun_fsdp",
            ("--fsdp", *SCALED[rule], "--sigma", "100", "--record_release"),
        )
        for rule in ("stp", "stp_factored")
    },
}


class Runs:
    """Runs the jobs of one launcher together, in one launch (the worker's --jobs), the first time any of them
    is asked for: a launch spends ~10 s starting, a run ~1 s. Launches go one at a time (2 cores), each on a
    free port."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, name: str) -> Path:
        return self.root / name

    def __call__(self, name: str, fails: bool = False) -> Path | str:
        """The run's output folder, or with ``fails=True`` the error it raised (the run must fail)."""
        out = self.folder(name)
        if not out.exists():
            self.launch(JOBS[name][0])
        errors = sorted(out.glob("error_process*.txt"))
        if fails:
            assert errors, f"{name} was expected to fail"
            return errors[0].read_text()
        if errors or not (out / "info.json").exists():
            raise AssertionError(f"{name} failed:\n" + "\n".join(e.read_text()[-6000:] for e in errors))
        return out

    def launch(self, launcher: str) -> None:
        folders = {name: str(self.folder(name)) for name in JOBS}
        jobs = [
            ["--out", folders[name], *(re.sub(r"\{(\w+)\}", lambda m: folders[m[1]], a) for a in args)]
            for name, (job_launcher, args) in JOBS.items()
            if job_launcher == launcher
        ]
        port = str(free_port())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
        if launcher == "single":
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            command = [sys.executable]
        elif launcher.startswith("torchrun"):
            command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port]
        elif launcher == "two_nodes":  # one launcher per node, as on two machines
            command = [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / "multi_node.yaml")]
            command += ["--main_process_ip", "127.0.0.1", "--main_process_port", port]
        elif launcher == "two_nodes_fsdp":
            command = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "2"]
            command += ["--master_addr", "127.0.0.1", "--master_port", port]
        else:  # an accelerate config file from recipes/configs
            command = [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / launcher)]
            command += ["--main_process_port", port]
        rank = "--machine_rank" if launcher == "two_nodes" else "--node_rank"
        nodes = [[rank, "0"], [rank, "1"]] if launcher.startswith("two_nodes") else [[]]
        logs = [(self.root / f"{launcher}{i}.log").open("w") for i in range(len(nodes))]
        processes = [
            subprocess.Popen(
                [*command, *node, WORKER, "--jobs", json.dumps(jobs)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node, log in zip(nodes, logs, strict=True)
        ]
        try:
            codes = [process.wait(timeout=900) for process in processes]
        finally:
            for process, log in zip(processes, logs, strict=True):
                if process.poll() is None:
                    process.kill()
                log.close()
        missing = [job[1] for job in jobs if not Path(job[1]).exists()]
        if missing:  # the launch itself died: every test of its runs says why
            tail = (self.root / f"{launcher}0.log").read_text()[-6000:]
            for folder in missing:
                Path(folder).mkdir(parents=True)
                (Path(folder) / "error_process0.txt").write_text(
                    f"the {launcher} launch exited with {codes}:\n{tail}"
                )


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


@pytest.mark.slow
def test_user_level_dp_with_two_processes_matches_one_process(runs):
    """Users sampled once for all processes, split between them by user (never a user's rows on two), each
    user's rows clipped as one: DDP equals the one-process run without noise."""
    reference, out = runs("reference_users"), runs("ddp_users")
    run = assert_world(out, "MULTI_CPU")
    assert run["privacy_unit"] == info(reference)["privacy_unit"] == "user"
    assert run["sample_rate"] == info(reference)["sample_rate"] == pytest.approx(16 / 22)
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4
    assert relative_difference(out / "final.pt", runs("reference") / "final.pt") > 1e-3


@pytest.mark.slow
def test_reference_clips(runs):
    """The parity tests below mean something only if clipping is active: a huge C gives another result."""
    reference, unclipped = runs("reference"), runs("reference_unclipped")
    assert relative_difference(unclipped / "final.pt", reference / "final.pt") > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "distributed_type", "stage"),
    [
        ("ddp_accelerate", "MULTI_CPU", None),
        ("ddp_torchrun", "MULTI_CPU", None),
        ("zero1", "DEEPSPEED", 1),
        ("zero2_accelerate", "DEEPSPEED", 2),
        ("zero3", "DEEPSPEED", 3),
        ("zero3_per_sample", "DEEPSPEED", 3),
        ("ddp_checkpointing", "MULTI_CPU", None),
        ("ddp_checkpointing_deep_tail", "MULTI_CPU", None),
        ("zero1_checkpointing", "DEEPSPEED", 1),
        ("zero2_checkpointing_deep_tail", "DEEPSPEED", 2),
        ("zero2_checkpointing", "DEEPSPEED", 2),
        ("zero3_checkpointing", "DEEPSPEED", 3),
        ("fsdp2_checkpointing", "FSDP", None),
        ("fsdp2_checkpointing_deep_tail", "FSDP", None),
        ("fsdp2_fsdp_checkpointing", "FSDP", None),  # fsdp_config["activation_checkpointing"]
    ],
)
def test_two_processes_match_one_process_without_noise(runs, name, distributed_type, stage):
    """The reference runs without activation checkpointing: with it, the norms come from inside a backward."""
    reference, out = runs("reference"), runs(name)
    run = assert_world(out, distributed_type, stage)
    assert run["checkpointing"] == ("--checkpointing" in JOBS[name][1])
    assert run["checkpoint_wrapped"] == ("--fsdp_checkpointing" in JOBS[name][1])
    assert run["norms_in_backward"] == (run["checkpointing"] or distributed_type == "FSDP")
    checkpointed = run["checkpointing"] or run["checkpoint_wrapped"]
    if checkpointed and (distributed_type == "FSDP" or (stage or 0) <= 2):
        assert run["skips_tail"] is True  # after the checked first step the weighted pass skips the tied head
    else:
        assert not run["skips_tail"]
    if run["checkpointing"] and (distributed_type == "FSDP" or stage in (1, 2)):
        assert run["replays"] is True  # through a framework, once the first step compared the layers' outputs
    else:
        assert not run["replays"]
    if "--tail_share" in JOBS[name][1]:  # the tail reaches down over both GPT-2 blocks
        assert run["tail_layers"] == 2
    # DDP and ZeRO-1/2 run the layers below the tail one by one (layerwise.py), FSDP2 and ZeRO-3 as one chain
    assert run["layerwise"] is (run["checkpointing"] and (distributed_type == "MULTI_CPU" or stage in (1, 2)))
    assert run["expected_batch_size"] == info(reference)["expected_batch_size"] == 16
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4
    # the logged loss is the mean over the whole logical batch, not one process's share
    assert run["losses"] == pytest.approx(info(reference)["losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "distributed_type", "stage"),
    [
        ("ddp_groups", "MULTI_CPU", None),
        ("zero2_groups", "DEEPSPEED", 2),
        ("fsdp2_groups", "FSDP", None),
        ("fsdp2_groups_checkpointing", "FSDP", None),
    ],
)
def test_groupwise_clipping_on_two_processes_matches_one_process(runs, name, distributed_type, stage):
    """clipping_groups="layer": the sums the norm pass's backward forms (with checkpointing under DDP and FSDP2),
    reduced by DDP, handed to ZeRO-2 as terms linear in each parameter or written into FSDP2's unsharded
    gradients, take the one-process group-wise steps; and they are not flat clipping's."""
    reference, out = runs("reference_groups"), runs(name)
    run = assert_world(out, distributed_type, stage)
    assert run["norms_in_backward"] is True
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4
    assert relative_difference(reference / "final.pt", runs("reference") / "final.pt") > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2_bf16", "zero2_bf16_checkpointing"])
def test_zero2_bf16_matches_one_process_within_bf16_rounding(runs, name):
    """DeepSpeed with bf16 (bf16 weights and activations, float32 master weights and gradient partitions, noise
    in the float32 client optimizer): the update is the float32 one-process update up to bf16 rounding. Measured:
    2.0% after 3 steps, as a one-process bf16 run (2.0%); the two bf16 runs agree to 0.4%."""
    out = runs(name)
    run = assert_world(out, "DEEPSPEED", 2)
    assert run["expected_batch_size"] == 16
    assert run["skips_tail"] is ("checkpointing" in name)
    assert run["layerwise"] is ("checkpointing" in name)  # the first step's check allows bf16 rounding
    torch.manual_seed(0)  # the worker's model
    start = dict(models.gpt2().named_parameters())
    initial = torch.cat([start[name].detach().flatten() for name in sorted(start)])
    ours = flat(out / "final.pt") - initial
    reference = flat(runs("reference") / "final.pt") - initial
    assert ((ours - reference).norm() / reference.norm()).item() < 0.04


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage"), [("zero3_llama", 3), ("zero2_checkpointing_llama", 2)])
def test_llama_under_zero_matches_one_process_without_noise(runs, name, stage):
    """RMSNorm's rule runs the module itself: under ZeRO-3 it must not trip the parameter gathering; under ZeRO-2
    with checkpointing the weighted pass skips the untied head and final norm."""
    reference, out = runs("reference_llama"), runs(name)
    run = assert_world(out, "DEEPSPEED", stage)
    assert run["skips_tail"] is ("checkpointing" in name)
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "kind", "stage"),
    [
        ("zero2_checkpointing_mixtral", "DEEPSPEED", 2),
        ("fsdp2_mixtral", "FSDP", None),
        ("fsdp2_checkpointing_mixtral", "FSDP", None),
    ],
)
def test_mixtral_under_zero_and_fsdp2_matches_one_process_without_noise(runs, name, kind, stage):
    """Mixtral's routers and fused experts (their call rules on rows of both examples' tokens) through ZeRO-2 with
    checkpointing and with their weights sharded by FSDP2: equal one process. Under ZeRO-3 every process refuses
    them in one line before training."""
    reference, out = runs("reference_mixtral"), runs(name)
    assert_world(out, kind, stage)
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4
    error = runs("zero3_mixtral_refused", fails=True).strip().splitlines()[-1]
    assert "MixtralTopKRouter) has no layer rule" in error and "use ZeRO-2 or FSDP2" in error


@pytest.mark.slow
def test_ddp_disk_matches_one_process_without_noise(runs):
    """DiSK's two evaluations per step (shifted parameters, the combination clipped once) under DDP."""
    reference, out = runs("reference_disk"), runs("ddp_disk")
    assert_world(out, "MULTI_CPU")
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


@pytest.mark.slow
def test_optimizers_that_need_bookkeeping_are_refused_under_deepspeed(runs):
    error = runs("zero2_disk", fails=True)
    assert "dp_optimizer='disk'" in error and "not supported under DeepSpeed" in error


@pytest.mark.slow
def test_an_example_that_depends_on_its_batch_is_refused_on_every_process(runs):
    """The first step's check of examples alone under ZeRO-3 (a sharded forward: losses compared, every process
    runs the same forwards): both processes refuse, one naming the cause, none hangs."""
    runs("zero3_left_padded_refused", fails=True)
    errors = sorted(runs.folder("zero3_left_padded_refused").glob("error_process*.txt"))
    assert len(errors) == 2
    texts = [e.read_text() for e in errors]
    assert any("padded on the left and no position_ids" in t for t in texts)
    assert all("padded on the left" in t or "on another process" in t for t in texts)


def noise_of_first_step(noisy: Path, clean: Path) -> torch.Tensor:
    return (flat(noisy / "params_step1.pt") - flat(clean / "params_step1.pt")) / LR


def assert_noise_std(noise: torch.Tensor, sigma: float, expected_batch: int) -> None:
    """Per coordinate the update noise must be σC/B̄ (once, after the sum): 3% is > 4 standard errors here."""
    expected = sigma * CLIP / expected_batch
    assert noise.numel() > 5000
    assert noise.std().item() == pytest.approx(expected, rel=0.03)


@pytest.mark.slow
def test_ddp_noise_is_added_once_and_identical_on_replicas(runs):
    noisy = runs("ddp_noisy")
    run = assert_world(noisy, "MULTI_CPU")
    assert_noise_std(noise_of_first_step(noisy, runs("ddp_accelerate")), 1.0, run["expected_batch_size"])
    # replicated gradients: both processes drew the same noise, so their parameters stay identical
    assert torch.equal(torch.load(noisy / "noise_process0.pt"), torch.load(noisy / "noise_process1.pt"))


@pytest.mark.slow
def test_a_secret_key_drawn_by_the_main_process_is_shared_by_both(runs):
    """The default run (no insecure_dp_seed): one OS-entropy key, broadcast, so both DDP replicas draw the same
    global batches and the same noise; a second such run draws other noise."""
    first, second = runs("ddp_secret"), runs("ddp_secret_again")
    assert_world(first, "MULTI_CPU")
    noise = [torch.load(first / f"noise_process{r}.pt") for r in (0, 1)]
    assert noise[0].numel() > 5000 and torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], torch.load(second / "noise_process0.pt"))
    assert relative_difference(first / "final.pt", second / "final.pt") > 1e-6


@pytest.mark.slow
def test_zero2_noise_is_independent_per_partition_and_epsilon_matches_one_process(runs):
    noisy = runs("zero2_noisy")
    run = assert_world(noisy, "DEEPSPEED", 2)
    noise = noise_of_first_step(noisy, runs("zero2_accelerate"))
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


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_fsdp2_matches_one_process_without_noise(runs, model):
    """FSDP2 through the Trainer's own fsdp arguments really shards on CPU (every parameter a DTensor, gloo, two
    processes; accelerate alone would silently run DDP), and the norm pass never reaches its reduce-scatter:
    tied GPT-2 and Llama equal one process."""
    reference = runs("reference" if model == "gpt2" else "reference_llama")
    out = runs(f"fsdp2_{model}")
    run = assert_world(out, "FSDP")
    assert run["sharded"] and run["backend"] == "gloo" and run["norms_in_backward"]
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["fsdp2_checkpointing_llama", "fsdp2_checkpointing_head_unit", "fsdp2_checkpointing_norm_unit"]
)
def test_fsdp2_skips_the_tail_wherever_its_weights_are_sharded(runs, name):
    """With checkpointing, FSDP2's weighted pass skips Llama's untied head and final norm, writing their clipped
    sums into the unsharded weights' gradients, which FSDP2 reduce-scatters at the end of the backward. Also where
    the head is an FSDP unit of its own, which a forward stopped at h never gathers (its weight's storage is freed
    there, and nothing reads it), and where the final norm is a unit of its own that keeps its weights after its
    forward. All equal one process."""
    out = runs(name)
    run = assert_world(out, "FSDP")
    assert run["sharded"] and run["checkpointing"]
    assert run["skips_tail"] is True and run["replays"] is True and run["tail_layers"] == 0
    assert relative_difference(out / "final.pt", runs("reference_llama") / "final.pt") < 1e-4


@pytest.mark.slow
def test_fsdp2_through_accelerate_launch_matches_one_process(runs):
    """`accelerate launch` with recipes/configs/fsdp2.yaml (the script sets no fsdp argument) shards as well."""
    out = runs("fsdp2_accelerate")
    run = assert_world(out, "FSDP")
    assert run["sharded"] and run["backend"] == "gloo"
    assert relative_difference(out / "final.pt", runs("reference") / "final.pt") < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2_bf16", "fsdp2_bf16_checkpointing"])
def test_fsdp2_bf16_mixed_precision_is_applied_and_close_to_float32(runs, name):
    """bf16=True under FSDP2 becomes FSDP's MixedPrecisionPolicy (bf16 compute over float32 sharded weights and
    gradients, noise in float32): the update is the float32 one-process update up to bf16 rounding (measured
    0.45%), and not equal to it (the policy is applied, not silently dropped as accelerate does on CPU). With
    checkpointing the weighted pass skips the tail in bf16 too."""
    out = runs(name)
    run = assert_world(out, "FSDP")
    assert run["sharded"]
    assert run["skips_tail"] is ("checkpointing" in name)
    torch.manual_seed(0)  # the worker's model
    start = dict(models.gpt2().named_parameters())
    initial = torch.cat([start[name].detach().flatten() for name in sorted(start)])
    ours = flat(out / "final.pt") - initial
    reference = flat(runs("reference") / "final.pt") - initial
    assert 1e-4 < ((ours - reference).norm() / reference.norm()).item() < 2e-2


@pytest.mark.slow
def test_ddp_lora_with_checkpointing_skips_the_frozen_head_and_matches_one_process(runs):
    """No clipped parameter after the last checkpointed layer (LoRA's frozen final norm and head): after the checked
    first step the weighted pass stops at that layer's output and replays the layers, and the adapters still take
    the one-process steps."""
    reference, out = runs("reference_lora"), runs("ddp_checkpointing_lora")
    run = assert_world(out, "MULTI_CPU")
    assert run["checkpointing"] and run["skips_tail"] is True and run["tail_layers"] == 0 and run["layerwise"]
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


@pytest.mark.slow
def test_zero2_lora_with_checkpointing_takes_one_pass_and_matches_one_process(runs):
    """LoRA's B per-example gradients within the budget: from the second step on the norm pass keeps them and ZeRO-2
    gets the clipped sum as terms linear in each adapter, with no weighted pass."""
    reference, out = runs("reference_lora"), runs("zero2_checkpointing_lora")
    run = assert_world(out, "DEEPSPEED", 2)
    assert run["checkpointing"] and run["last_need"] == "one pass"
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


@pytest.mark.slow
def test_fsdp2_lora_matches_one_process(runs):
    """peft LoRA on every linear layer of Llama, the base sharded and frozen: the adapters take the one-process
    steps."""
    reference, out = runs("reference_lora"), runs("fsdp2_lora")
    assert assert_world(out, "FSDP")["sharded"]
    ours, theirs = torch.load(out / "final.pt"), torch.load(reference / "final.pt")
    adapters = [n for n in theirs if "lora_B" in n]
    assert len(adapters) == 14 and all(theirs[n].norm() > 0 for n in adapters)  # B starts at zero
    x = torch.cat([ours[n].flatten() for n in adapters])
    y = torch.cat([theirs[n].flatten() for n in adapters])
    assert ((x - y).norm() / y.norm()).item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("backend", SHARDED)
@pytest.mark.parametrize("rule", STATEFUL)
def test_every_stateful_update_rule_on_every_sharded_backend_matches_one_process(runs, backend, rule):
    """Adam's moments, DP-AdamBC's corrected v̂ (fed σC/B̄) and DOPPLER's histories of ĝ live per parameter, on
    DTensor shards (FSDP2) or flattened float32 partitions (ZeRO-2/3): each takes the one-process steps (sgd
    is every other test here; stp, dp2 and disk are refused, test_sharded_refusals)."""
    reference, out = runs(f"reference_{rule}"), runs(f"{backend}_{rule}")
    if backend == "fsdp2":
        assert assert_world(out, "FSDP")["sharded"]
    else:
        assert_world(out, "DEEPSPEED", int(backend[-1]))
    assert relative_difference(reference / "final.pt", runs("reference") / "final.pt") > 1e-3  # rule acted
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


@pytest.mark.slow
def test_fsdp2_noise_is_independent_per_shard_and_epsilon_matches_one_process(runs):
    noisy = runs("fsdp2_noisy")
    run = assert_world(noisy, "FSDP")
    assert_noise_std(
        noise_of_first_step(noisy, runs("fsdp2_clean")), run["noise_multiplier"], run["expected_batch_size"]
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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "distributed_type", "stage"),
    [("ddp", "MULTI_CPU", None), ("zero3", "DEEPSPEED", 3), ("fsdp2", "FSDP", None)],
)
def test_resume_continues_the_uninterrupted_run(runs, name, distributed_type, stage):
    """σ > 0: the noise generators, sampler and accountant resume exactly with the weights and optimizer."""
    whole, resumed = runs(f"{name}_whole"), runs(f"{name}_resumed")
    run = assert_world(resumed, distributed_type, stage)
    assert run["steps"] == 4 and run["epsilon"] == pytest.approx(info(whole)["epsilon"], rel=1e-12)
    assert relative_difference(resumed / "final.pt", whole / "final.pt") < 1e-6


@pytest.mark.parametrize(
    ("name", "distributed_type", "stage"),
    [
        ("ddp", "MULTI_CPU", None),
        ("zero1", "DEEPSPEED", 1),
        ("zero2", "DEEPSPEED", 2),
        ("zero3", "DEEPSPEED", 3),
        ("fsdp2", "FSDP", None),
    ],
)
def test_bandmf_resumes_mid_run_exactly_on_every_backend(runs, name, distributed_type, stage):
    """noise_mechanism='bandmf', 2 bands, resumed after step 3 of 4 (the buffers then hold x_2): the same weights as
    the uninterrupted run; the ledger has ⌈4/2⌉ = 2 DP-SGD steps at p = 2B̄/N; each process keeps b − 1 = 1 float32
    buffer of what it owns (all of the model under DDP, its share under ZeRO and FSDP2)."""
    whole, resumed = runs(f"{name}_bandmf_whole"), runs(f"{name}_bandmf_resumed")
    run = assert_world(resumed, distributed_type, stage)
    assert run["steps"] == 2 and run["released_steps"] == 4
    assert run["sample_rate"] == 2 * run["expected_batch_size"] / 64
    assert run["epsilon"] == pytest.approx(
        compute_epsilon(1.0, run["sample_rate"], 2, 64**-1.1, "prv"), rel=1e-9
    )
    assert run["epsilon"] == pytest.approx(info(whole)["epsilon"], rel=1e-12)
    assert relative_difference(resumed / "final.pt", whole / "final.pt") < 1e-6
    if f"{name}_whole" in JOBS:  # the same run with independent noise ends elsewhere
        assert relative_difference(whole / "final.pt", runs(f"{name}_whole") / "final.pt") > 1e-3
    parameters = sum(t.numel() for t in torch.load(whole / "final.pt").values())
    share = parameters if name == "ddp" else parameters / 2
    assert run["noise_buffer_bytes"] == pytest.approx(4 * share, rel=0.05)


@pytest.mark.slow
def test_deepspeed_norm_and_gradient_passes_see_the_same_dropout(runs):
    """DeepSpeed needs two passes; with different dropout masks the clipped object would not be the one
    whose norm was measured. One process, dropout on: DeepSpeed ZeRO-2 must equal the book-keeping path."""
    plain, zero2 = runs("dropout_plain"), runs("dropout_zero2")
    assert info(zero2)["zero_stage"] == 2 and info(zero2)["world_size"] == 1
    assert relative_difference(zero2 / "final.pt", plain / "final.pt") < 1e-5
    undropped = runs("reference")
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


def test_fsdp_settings_that_break_dp_are_refused():
    with pytest.raises(ValueError, match="FSDP1 flattens the parameters"):
        check_fsdp(1, "sgd")
    with pytest.raises(ValueError, match="use_reentrant': False"):
        check_fsdp(2, "sgd", reentrant_checkpointing=True)


@pytest.mark.slow
@pytest.mark.parametrize("rule", SCALED)
def test_a_clip_geometry_from_sharded_optimizer_state_matches_one_process_on_fsdp2(runs, rule):
    """STP's and DP²'s scale s lives on the optimizer's DTensor shards: the norm pass gathers each layer's s as it
    computes that layer's ‖s ⊙ g_i‖, and each process noises its shard with the matching part of s."""
    reference, out = runs(f"reference_{rule}"), runs(f"fsdp2_{rule}")
    assert assert_world(out, "FSDP")["sharded"]
    assert relative_difference(reference / "final.pt", runs("reference") / "final.pt") > 1e-3  # rule acted
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["stp", "stp_factored"])
def test_fsdp2_noise_is_shaped_by_the_matching_shard_of_the_clip_scale(runs, rule):
    """Each process adds N(0, σ²C²) ⊘ s to its shard with ITS rows of s: at σ = 100 the released ĝ of step 2
    (s from ν̂ of step 1, far from uniform) times s·B̄/(σC) is N(0, 1) per coordinate. Measured 1.0001; the halves
    of s swapped (a shard noised with the other's scale) gives 1.78 (dense s) and 1.07 (factored)."""
    out = runs(f"fsdp2_{rule}_noisy")
    run = assert_world(out, "FSDP")
    released = torch.load(out / "release_step2.pt")
    assert all(scale is not None for _, scale in released.values())
    log_scale = torch.cat([scale.log().flatten() for _, scale in released.values()])
    assert log_scale.std() > 0.2  # a uniform s could not tell the shards' rows apart
    z = torch.cat([(g * scale).flatten() for g, scale in released.values()])
    z *= run["expected_batch_size"] / (run["noise_multiplier"] * CLIP)
    assert z.numel() > 5000 and z.std().item() == pytest.approx(1.0, abs=0.03)  # 4 standard errors


@pytest.mark.parametrize("rule", dp_optimizer_names())
def test_every_update_rule_runs_or_is_refused_in_one_line_on_every_sharded_backend(rule):
    """Every registered name runs on FSDP2 and ZeRO-2/3 (the parity tests above), or on FSDP2 only (a scale
    from optimizer state), or is refused before training, with the reason (docs/distributed.md argues each)."""
    on_fsdp2 = rule == "sgd" or rule in STATEFUL or rule in SCALED
    on_deepspeed = rule == "sgd" or rule in STATEFUL
    assert on_fsdp2 == (not shifted_evaluations(rule))
    assert on_deepspeed == (not shifted_evaluations(rule) and not scaled_geometry(rule))
    if on_fsdp2:
        check_fsdp(2, rule)
    else:
        with pytest.raises(ValueError, match=rf"dp_optimizer='{rule}' .* not supported under FSDP"):
            check_fsdp(2, rule)
    if on_deepspeed:
        check_deepspeed({}, SimpleNamespace(dp_optimizer=rule))
    else:
        with pytest.raises(ValueError, match=rf"dp_optimizer='{rule}' .* not supported under DeepSpeed"):
            check_deepspeed({}, SimpleNamespace(dp_optimizer=rule))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "distributed_type", "stage"),
    [("ddp", "MULTI_CPU", None), ("zero2", "DEEPSPEED", 2), ("fsdp2", "FSDP", None)],
)
def test_two_nodes_of_two_processes_match_one_process_and_resume_from_shared_or_per_node_checkpoints(
    runs, backend, distributed_type, stage
):
    """2 nodes × 2 processes (a launcher per node): σ = 0 equals one process; σ = 1 saved after step 2 of 4 and
    resumed equals the uninterrupted run, from one shared output_dir (an explicit checkpoint) and, for DDP and
    ZeRO-2, from one output_dir per node (save_on_each_node; resume_from_checkpoint=True with checkpoint-4 torn
    on node 1 only: every process resumes from checkpoint-2), each node's checkpoint holding the model and its
    own processes' noise. FSDP2 refuses one folder per node."""
    reference, out = runs("reference"), runs(f"nodes_{backend}")
    run = info(out)
    assert (run["world_size"], run["nodes"], run["backend"]) == (4, 2, "gloo"), run
    assert run["distributed_type"] == f"DistributedType.{distributed_type}" and run["zero_stage"] == stage
    assert run["expected_batch_size"] == info(reference)["expected_batch_size"] == 16
    assert relative_difference(out / "final.pt", reference / "final.pt") < 1e-6
    assert run["losses"] == pytest.approx(info(reference)["losses"], rel=1e-5)

    whole = runs(f"nodes_{backend}_whole")
    shared = set(os.listdir(whole / "checkpoint-2"))
    assert {noise_state_file(i) for i in range(4)} <= shared
    resumed = ["resumed"] if backend == "fsdp2" else ["resumed", "each_whole", "each_resumed"]
    for name in resumed:
        other = runs(f"nodes_{backend}_{name}")
        result = info(other)
        assert (result["world_size"], result["nodes"], result["steps"]) == (4, 2, 4), (name, result)
        assert result["epsilon"] == pytest.approx(info(whole)["epsilon"], rel=1e-12), name
        assert relative_difference(other / "final.pt", whole / "final.pt") < 1e-6, name
    assert info(runs(f"nodes_{backend}_resumed"))["resumed_from"] == f"../nodes_{backend}_whole/checkpoint-2"
    if backend == "fsdp2":
        refusal = runs("nodes_fsdp2_each_refused", fails=True)
        assert "save_on_each_node with FSDP2 on several machines" in refusal, refusal[-2000:]
        return
    assert info(runs(f"nodes_{backend}_each_resumed"))["resumed_from"] == "node0/checkpoint-2"
    each = runs(f"nodes_{backend}_each_whole")
    for node, own in ((0, {0, 1}), (1, {2, 3})):
        files = set(os.listdir(each / f"node{node}" / "checkpoint-2"))
        assert {noise_state_file(i) for i in range(4)} & files == {noise_state_file(i) for i in own}, files
        assert {COMPLETE_FILE, "model.safetensors", "trainer_state.json"} <= files, files
