"""DPTrainer runs for the multi-process tests, launched by torchrun / accelerate launch (or alone).

Each run trains a tiny model (tied GPT-2 or Llama) on random token rows and writes, from the main process,
the final full parameters, what the run was (world size, distributed type, ZeRO stage) and its privacy
numbers to ``--out``; every process also writes the noise it drew (``--record_noise``).

    torchrun --nproc_per_node 2 tests/distributed_worker.py --out DIR [--zero 2] [--sigma 1.0] ...
    torchrun --nproc_per_node 2 tests/distributed_worker.py --jobs '[["--out", "A"], ["--out", "B", "--zero", "3"]]'

``--jobs`` runs several in one launch, one after the other in the same process group (a launch costs ~10 s
of start-up; a run ~1 s). A run that raises writes its traceback to ``DIR/error.txt`` and the next one starts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # noqa: E402

import hf_dp.clipping.pipeline  # noqa: E402
from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.checkpoint_files import COMPLETE_FILE, resume_point  # noqa: E402
from hf_dp.clipping.geometry import dense_scale, unsharded  # noqa: E402
from hf_dp.noise import GaussianNoise  # noqa: E402
from tests import models  # noqa: E402
from tests.trainer_utils import TokenRows, left_pad_collate, pad_collate  # noqa: E402


class UserRows(TokenRows):
    """Token rows whose user_id column gives every 3 consecutive rows one user."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "user_id": i // 3}


def deepspeed_config(stage: int) -> dict:
    return {
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }


LAYERS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "mixtral": "MixtralDecoderLayer"}


def full_parameters(trainer: DPTrainer) -> dict[str, torch.Tensor]:
    params = dict(trainer.model.named_parameters())
    if any(isinstance(p, DTensor) for p in params.values()):  # FSDP2: every process takes part in the gather
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()
        }
    if trainer.is_deepspeed_enabled and trainer.args.bf16:  # the float32 master weights, not their bf16 copy
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params.items()}
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def dense_whole(scale) -> torch.Tensor:
    """A clip scale as one whole tensor (gathering DTensor parts)."""
    return dense_scale(unsharded(scale)).detach().clone()


class _RecordRelease(TrainerCallback):
    """After the mechanism's release (a later step pre-hook), save ĝ and the clip scales of that step, whole."""

    def __init__(self, trainer: DPTrainer, out: str) -> None:
        self.trainer, self.out, self.step = trainer, out, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.dp.optimizer.register_step_pre_hook(self.record)

    def record(self, optimizer, *_):
        self.step += 1
        names = {p: n for n, p in self.trainer.model.named_parameters()}
        scales = self.trainer.dp.planner.current.clip_scale or {}
        released = {
            names[p]: (
                (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone(),
                dense_whole(scales[p]) if p in scales else None,
            )
            for group in optimizer.param_groups
            for p in group["params"]
        }
        if self.trainer.args.process_index == 0:
            torch.save(released, os.path.join(self.out, f"release_step{self.step}.pt"))


class _Snapshot(TrainerCallback):
    """Saves the full parameters after one optimizer step (every process takes part in the ZeRO-3 gather)."""

    def __init__(self, trainer: DPTrainer, step: int, out: str) -> None:
        self.trainer, self.step, self.out = trainer, step, out

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            params = full_parameters(self.trainer)
            if args.process_index == 0:
                torch.save(params, os.path.join(self.out, f"params_step{self.step}.pt"))
        return control


def calibration_of(clipping) -> dict:
    """What the clipped step's first step found (None for each field where the run has no clipped step)."""
    calibration = getattr(clipping, "calibration", None)
    fields = ("skips_tail", "replays", "tail_layers", "layerwise")
    return {name: None if calibration is None else getattr(calibration, name) for name in fields}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero", type=int, default=None, help="DeepSpeed ZeRO stage (default: no DeepSpeed)")
    parser.add_argument("--sigma", type=float, default=0.0)
    parser.add_argument("--target_epsilon", type=float, default=None)
    parser.add_argument("--accountant", default="prv")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--per_device", type=int, default=4)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--left_pad", action="store_true", help="left padding without position_ids (refused)")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--optimizer_kwargs", default=None, help="dp_optimizer_kwargs, as JSON")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--model", choices=["gpt2", "llama", "mixtral"], default="gpt2")
    parser.add_argument("--clipping_mode", choices=["ghost", "per_sample"], default="ghost")
    parser.add_argument("--checkpointing", choices=["off", "reentrant", "non_reentrant"], default="off")
    parser.add_argument("--clipping_groups", default="all", help="DPTrainingArguments.clipping_groups")
    parser.add_argument(
        "--fsdp_checkpointing", action="store_true", help="FSDP's own fsdp_config['activation_checkpointing']"
    )
    parser.add_argument(
        "--users", action="store_true", help="user-level DP: 3 rows a user, at most 2 per step"
    )
    parser.add_argument(
        "--fsdp", action="store_true", help="FSDP2 (fully_shard) through the Trainer's fsdp args"
    )
    parser.add_argument(
        "--fsdp_unit",
        action="append",
        default=[],
        help="a module class FSDP2 also shards as a unit of its own (transformer_layer_cls_to_wrap)",
    )
    parser.add_argument(
        "--fsdp_keep_unsharded",
        action="store_true",
        help="FSDP2's reshard_after_forward=False: each unit keeps its weights unsharded from forward to backward",
    )
    parser.add_argument("--lora", action="store_true", help="peft LoRA (r 4) on every linear layer")
    parser.add_argument(
        "--tail_share",
        type=float,
        default=None,
        help="hf_dp.clipping.pipeline.DEEP_TAIL_SHARE: how far the checkpointed weighted pass's tail reaches down",
    )
    parser.add_argument(
        "--kept_share",
        type=float,
        default=None,
        help="hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE: when LoRA's kept gradients replace the weighted pass",
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 (DeepSpeed's bf16 section, or autocast)")
    parser.add_argument("--noise_mechanism", default="independent")
    parser.add_argument("--num_bands", default="auto")
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument(
        "--resume_from", default=None, help="a checkpoint folder, or 'true' (the newest complete)"
    )
    parser.add_argument("--output_dir", default=None, help="the Trainer's output_dir (default: --out)")
    parser.add_argument(
        "--per_node_dir",
        action="store_true",
        help="one output_dir per node (OUTPUT_DIR/node<GROUP_RANK>) with save_on_each_node, as on local disks",
    )
    parser.add_argument(
        "--tear",
        default=None,
        help="before training, remove this checkpoint's completion marker (one node's)",
    )
    parser.add_argument("--record_noise", action="store_true")
    parser.add_argument(
        "--record_release",
        action="store_true",
        help="save every step's released ĝ and its plan's clip scales, whole (release_step<k>.pt)",
    )
    parser.add_argument(
        "--secret",
        action="store_true",
        help="the default: a secret key from OS entropy, not insecure_dp_seed",
    )
    parser.add_argument(
        "--snapshot_step", type=int, default=0, help="also save the parameters after this step"
    )
    return parser


DEFAULT_SHARES = (hf_dp.clipping.pipeline.DEEP_TAIL_SHARE, hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE)


def run(cli: argparse.Namespace) -> None:
    torch.manual_seed(0)
    # each run of a launch from the defaults: the jobs share one process
    hf_dp.clipping.pipeline.DEEP_TAIL_SHARE = DEFAULT_SHARES[0] if cli.tail_share is None else cli.tail_share
    hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE = (
        DEFAULT_SHARES[1] if cli.kept_share is None else cli.kept_share
    )
    if cli.model == "llama":
        model = models.llama()
    elif cli.model == "mixtral":  # flattened rows, its routers and fused experts by their call rules
        model = models.mixtral()
    else:
        model = models.gpt2(resid_pdrop=cli.dropout, embd_pdrop=cli.dropout, attn_pdrop=cli.dropout)
    if cli.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        )
    privacy = (
        {"target_epsilon": cli.target_epsilon} if cli.target_epsilon else {"noise_multiplier": cli.sigma}
    )
    os.makedirs(cli.out, exist_ok=True)
    output_dir = cli.output_dir or cli.out
    if cli.per_node_dir:
        output_dir = os.path.join(output_dir, f"node{os.environ.get('GROUP_RANK', '0')}")
    args = DPTrainingArguments(
        output_dir=output_dir,
        save_on_each_node=cli.per_node_dir,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        per_device_train_batch_size=cli.per_device,
        gradient_accumulation_steps=cli.gas,
        learning_rate=cli.lr,
        lr_scheduler_type="constant",
        dp_optimizer=cli.optimizer,
        dp_optimizer_kwargs=cli.optimizer_kwargs,
        accountant=cli.accountant,
        noise_mechanism=cli.noise_mechanism,
        num_bands=cli.num_bands,
        per_sample_max_grad_norm=cli.clip,
        clipping_mode=cli.clipping_mode,
        clipping_groups=cli.clipping_groups,
        max_steps=cli.steps,
        seed=7,
        # every run draws the same batches, so one and two processes can be compared (unless --secret)
        insecure_dp_seed=None if cli.secret else 7,
        deepspeed=deepspeed_config(cli.zero) if cli.zero is not None else None,
        activation_checkpointing=cli.checkpointing != "off",
        activation_checkpointing_kwargs={"use_reentrant": cli.checkpointing == "reentrant"},
        privacy_unit_column="user_id" if cli.users else None,
        fsdp=cli.fsdp,
        bf16=cli.bf16,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": [LAYERS[cli.model], *cli.fsdp_unit],
            "activation_checkpointing": cli.fsdp_checkpointing,
            "reshard_after_forward": not cli.fsdp_keep_unsharded,
        }
        if cli.fsdp
        else None,
        max_examples_per_unit=2 if cli.users else 4,
        **privacy,
    )
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=UserRows(cli.examples) if cli.users else TokenRows(cli.examples),
        data_collator=left_pad_collate if cli.left_pad else pad_collate,
    )
    drawn: list[torch.Tensor] = []
    sample = GaussianNoise.sample
    if cli.record_noise:

        def recording_sample(*a, **k):
            noise = sample(*a, **k)
            drawn.append(noise.detach().flatten().clone())
            return noise

        GaussianNoise.sample = recording_sample
    if cli.snapshot_step:
        trainer.add_callback(_Snapshot(trainer, cli.snapshot_step, cli.out))
    if cli.record_release:
        trainer.add_callback(_RecordRelease(trainer, cli.out))
    if cli.tear and args.process_index == 0:
        os.remove(os.path.join(cli.output_dir or cli.out, cli.tear, COMPLETE_FILE))
    trainer.accelerator.wait_for_everyone()
    resume = True if cli.resume_from == "true" else cli.resume_from
    resumed_from = resume_point(resume, output_dir)  # what train() resumes from: the same on every process
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        GaussianNoise.sample = sample
    params = full_parameters(trainer)
    if drawn:
        torch.save(torch.cat(drawn), os.path.join(cli.out, f"noise_process{args.process_index}.pt"))
    if args.process_index == 0:
        torch.save(params, os.path.join(cli.out, "final.pt"))
        info = {
            "world_size": args.world_size,
            "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
            "resumed_from": resumed_from and os.path.relpath(resumed_from, cli.output_dir or cli.out),
            "distributed_type": str(trainer.accelerator.distributed_type),
            "deepspeed": trainer.is_deepspeed_enabled,
            "zero_stage": trainer.dp.backend.zero_stage,
            "norms_in_backward": getattr(trainer.dp.clipping, "norms_in_backward", None),
            "last_need": getattr(getattr(trainer.dp.clipping, "last_need", None), "value", None),
            **calibration_of(trainer.dp.clipping),
            "checkpointing": trainer.model.is_activation_checkpointing,
            "checkpoint_wrapped": any(
                type(m).__name__.endswith("CheckpointWrapper") for m in trainer.model.modules()
            ),
            "epsilon": trainer.get_epsilon(),
            "noise_multiplier": trainer.noise_multiplier,
            "sample_rate": trainer.sample_rate,
            "expected_batch_size": trainer.expected_batch_size,
            "sharded": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "privacy_unit": trainer.privacy_report()["unit"],
            "steps": trainer.accountant.steps,
            "released_steps": trainer.dp.mechanism.step,
            "noise_buffer_bytes": getattr(trainer.dp.mechanism, "buffer_bytes", lambda: 0)(),
            "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            "log_keys": sorted({k for log in trainer.state.log_history for k in log}),
        }
        with open(os.path.join(cli.out, "info.json"), "w") as f:
            json.dump(info, f)
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    argv = sys.argv[1:]
    jobs = json.loads(argv[1]) if argv[:1] == ["--jobs"] else [argv]
    failed = False
    gc.freeze()  # the imports live as long as the process: no collection walks them (conftest.py)
    for job in jobs:
        cli = parser().parse_args(job)
        try:
            run(cli)
        except Exception:  # e.g. a refusal the test expects: both processes raise it before training
            failed = True
            os.makedirs(cli.out, exist_ok=True)
            with open(os.path.join(cli.out, f"error_process{os.environ.get('RANK', '0')}.txt"), "w") as f:
                f.write(traceback.format_exc())
        # the next run starts from a clean slate: TrainingArguments resets accelerate's state itself
        unset_hf_deepspeed_config()
        gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    # Leave without interpreter teardown: DeepSpeed and DDP keep process groups that destroy_process_group
    # does not release, and freeing their gloo threads at interpreter exit sometimes aborts the process
    # ("terminate called without an active exception", pytorch/pytorch#179291) after the results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
