"""Hugging Face Transformers' `Trainer`, checkpointed by Cairn.

`CairnTrainer` is a `transformers.Trainer` whose checkpointer is Cairn's
`CheckpointManager` (public API only): the Trainer keeps its loop, its data
order and its resume logic; Cairn decides when to save, writes, commits,
uploads, rotates, fences and reports status (docs/frameworks.md).

    cfg = runtime_config.from_env()
    args = TrainingArguments(output_dir=..., ddp_backend="gloo", use_cpu=True)
    with transformers_integration.checkpoint_manager(cfg, args) as ckpt:
        trainer = CairnTrainer(model=model, args=args, train_dataset=data,
                               checkpoints=ckpt, runtime=cfg)
        trainer.train()
    if trainer.preempted:
        raise SystemExit(143)

The Trainer's checkpoint hooks, mapped:

    Trainer                          Cairn
    on_pre_optimizer_step            ckpt.wait_until_staged()
    on_step_end (every step)         ckpt.should_save(step) → control.should_save
    _save_checkpoint                 ckpt.save(step, objects, force=True)
    on_save                          ckpt.reached_final(step) → stop (preemption)
    on_train_end                     ckpt.wait_until_finished()
    train(resume_from_checkpoint)    ckpt.restore(objects) before the loop, then
                                     the Trainer's own resume from a folder
                                     holding only the restored trainer_state.json
    _load_from_checkpoint,           nothing left to load (restored already)
    _load_optimizer_and_scheduler
    _load_rng_state                  the restored RNG states, applied where the
                                     Trainer applies its own (after skipping
                                     the consumed batches)

A checkpoint holds the model with its optimizer (DCP `get_state_dict`), the
lr scheduler, each rank's RNG states, and the `TrainerState` (global step,
epoch, log history, callback states) as JSON: the data position is the
Trainer's own (`global_step` → epochs and batches to skip, the sampler seeded
by `args.seed` and the epoch). Supported: one process or DDP (the Trainer's
multi-process mode, gloo on CPU). Not supported, refused at construction:
FSDP or DeepSpeed through Accelerate (their state lives in Accelerate's
wrappers) and fp16 loss scaling (the scaler is not checkpointed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import tempfile
import typing

import torch
import transformers
from transformers import trainer_callback

from cairn.checkpoint import errors, manager, runtime_config, state

log = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
"""The file the Trainer reads its state from on resume (transformers' name)."""


def checkpoint_manager(
    cfg: runtime_config.RuntimeConfig, args: transformers.TrainingArguments
) -> manager.CheckpointManager:
    """The run's `CheckpointManager`, opened after Accelerate started the process group.

    The manager's ranks coordinate through the default group's store, which
    Accelerate creates on the first use of `args.device` (under torchrun);
    with one process there is no group and the manager coordinates locally.
    """
    _ = args.device  # starts the process group (Accelerate's PartialState)
    return manager.CheckpointManager(cfg.checkpoint)


class _TrainerStateful:
    """The Trainer's `TrainerState` as JSON text: what the Trainer itself would
    write to trainer_state.json (step, epoch, log history, callback states)."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self._trainer = trainer
        self.loaded: str | None = None
        """The restored JSON, written for the Trainer's own resume."""

    def state_dict(self) -> dict[str, typing.Any]:
        return {"json": _state_json(self._trainer.state)}

    def load_state_dict(self, state_dict: dict[str, typing.Any]) -> None:
        self.loaded = state_dict["json"]


class _DeferredRNG:
    """Each rank's RNG states, saved now but applied only when the Trainer asks
    (`_load_rng_state`, after it skipped the consumed batches), as its own
    rng_state_<rank>.pth would be."""

    cairn_per_rank = True
    cairn_optional_keys = state.RNGState.cairn_optional_keys

    def __init__(self) -> None:
        self._rng = state.RNGState()
        self._pending: dict[str, typing.Any] | None = None

    def state_dict(self) -> dict[str, typing.Any]:
        return self._rng.state_dict()

    def load_state_dict(self, state_dict: dict[str, typing.Any]) -> None:
        self._pending = state_dict

    def apply(self) -> None:
        if self._pending is not None:
            self._rng.load_state_dict(self._pending)
            self._pending = None


class _CairnCallback(transformers.TrainerCallback):
    """The loop's side of the mapping: ordering, the save schedule, preemption."""

    def __init__(self, trainer: CairnTrainer) -> None:
        self._trainer = trainer

    def on_pre_optimizer_step(
        self,
        args: transformers.TrainingArguments,
        state: trainer_callback.TrainerState,
        control: trainer_callback.TrainerControl,
        **kwargs: typing.Any,
    ) -> None:
        # The in-flight save's snapshot must be copied before the weights change.
        self._trainer.checkpoints.wait_until_staged()

    def on_step_end(
        self,
        args: transformers.TrainingArguments,
        state: trainer_callback.TrainerState,
        control: trainer_callback.TrainerControl,
        **kwargs: typing.Any,
    ) -> None:
        # Cairn's schedule (interval, time, preemption; agreed by all ranks)
        # adds to the Trainer's own save_strategy; both save through Cairn.
        if self._trainer.checkpoints.should_save(state.global_step):
            control.should_save = True

    def on_train_end(
        self,
        args: transformers.TrainingArguments,
        state: trainer_callback.TrainerState,
        control: trainer_callback.TrainerControl,
        **kwargs: typing.Any,
    ) -> None:
        # As with the Trainer's own checkpoints: once train() returns, the
        # last save is committed (its upload goes on until the manager closes).
        self._trainer.checkpoints.wait_until_finished()

    def on_save(
        self,
        args: transformers.TrainingArguments,
        state: trainer_callback.TrainerState,
        control: trainer_callback.TrainerControl,
        **kwargs: typing.Any,
    ) -> None:
        if self._trainer.checkpoints.reached_final(state.global_step):
            self._trainer.preempted = True
            control.should_training_stop = True


class CairnTrainer(transformers.Trainer):
    """A `Trainer` that saves, uploads and resumes through Cairn (see the module doc)."""

    def __init__(
        self,
        *args: typing.Any,
        checkpoints: manager.CheckpointManager,
        runtime: runtime_config.RuntimeConfig,
        **kwargs: typing.Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        self.checkpoints = checkpoints
        self.runtime = runtime
        self.preempted = False
        """True once a preemption (SIGTERM) checkpoint was committed and the loop stopped."""
        self._rng = _DeferredRNG()
        self._trainer_state = _TrainerStateful(self)
        self._resume_dir: str | None = None
        self._restored_scheduler: typing.Any = None
        self.add_callback(_CairnCallback(self))

    def checkpoint_objects(self) -> dict[str, state.Stateful]:
        """What one Cairn checkpoint of this Trainer holds."""
        if self.optimizer is None or self.lr_scheduler is None:
            raise errors.CheckpointError("the Trainer has no optimizer or scheduler yet")
        if not isinstance(self.model, torch.nn.Module):
            raise errors.CheckpointError("the Trainer has no model")
        return {
            "model": state.ModelOptimizerState(self.model, _unwrapped(self.optimizer, "optimizer")),
            "lr_scheduler": _unwrapped(self.lr_scheduler, "scheduler"),
            "rng": self._rng,
            "trainer": self._trainer_state,
        }

    # -- training: Cairn decides what to resume from -------------------------------

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: typing.Any
    ) -> transformers.trainer_utils.TrainOutput:
        if resume_from_checkpoint not in (None, False):
            raise ValueError(
                "resume_from_checkpoint: Cairn decides what to resume from "
                "(spec.checkpoint.resume, CAIRN_RESUME_*); leave it unset"
            )
        self._resume_dir = self._restore_from_cairn()
        try:
            return super().train(resume_from_checkpoint=self._resume_dir, **kwargs)
        finally:
            if self._resume_dir is not None:
                shutil.rmtree(self._resume_dir, ignore_errors=True)
                self._resume_dir = None

    def _restore_from_cairn(self) -> str | None:
        """Restore the newest verified step (or the requested one) into the live
        objects; the folder for the Trainer's own resume, or None for a fresh start."""
        resume = self.runtime.resume
        if resume.kind == "none":
            self.checkpoints.report_step(0)
            return None
        # The optimizer and scheduler exist only inside train(): make them now
        # (the Trainer keeps an existing optimizer; `create_scheduler` below
        # keeps the restored scheduler).
        max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        result = self.checkpoints.restore(
            self.checkpoint_objects(),
            step=resume.step,
            uri=resume.uri,
            key_map=self.runtime.import_keys,
            sha256=resume.sha256,
        )
        if result is None:  # nothing committed yet: the Trainer starts as usual
            self.optimizer = None
            self.lr_scheduler = None
            self.checkpoints.report_step(0)
            return None
        self._restored_scheduler = self.lr_scheduler
        folder = tempfile.mkdtemp(prefix="cairn-hf-resume-")
        text = _checked_trainer_state(self._trainer_state.loaded, step=result.step)
        (pathlib.Path(folder) / TRAINER_STATE_NAME).write_text(text, encoding="utf-8")
        log.info("resuming the Trainer from Cairn step %d", result.step)
        return folder

    def create_scheduler(self, num_training_steps: int, optimizer: typing.Any = None) -> typing.Any:
        # The Trainer drops a scheduler it created itself before making its
        # own in train(); a restored one must survive that.
        if self._restored_scheduler is not None:
            self.lr_scheduler = self._restored_scheduler
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)

    # -- the Trainer's checkpoint hooks ---------------------------------------------

    def _save_checkpoint(self, model: typing.Any, trial: typing.Any) -> None:
        # HF's own folder (weights, optimizer.pt, rng_state_*.pth) is replaced
        # by one Cairn step; the decision to save was already agreed on. The
        # trainer state is brought up to date as the Trainer does before it
        # writes trainer_state.json (FLOs, callback and control states).
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        states: dict[str, typing.Any] = typing.cast(
            dict[str, typing.Any], self.state.stateful_callbacks
        )
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, trainer_callback.ExportableState):
                name = type(callback).__name__
                if isinstance(states.get(name), list):
                    states[name].append(callback.state())
                else:
                    states[name] = callback.state()
        self.checkpoints.save(self.state.global_step, self.checkpoint_objects(), force=True)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: typing.Any = None) -> None:
        self._expect_own(resume_from_checkpoint)  # the model was restored by Cairn

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._expect_own(checkpoint)  # restored by Cairn

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._expect_own(checkpoint)  # fp16 scaling is refused: no scaler

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._expect_own(checkpoint)
            self._rng.apply()

    def _expect_own(self, folder: str) -> None:
        if folder != self._resume_dir:
            raise ValueError(f"{folder}: not a Cairn resume folder; Cairn decides what to resume")


def _refuse_unsupported(trainer: transformers.Trainer) -> None:
    """Configurations whose state Cairn's checkpoint would not hold: refused."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        raise ValueError(
            "fsdp/deepspeed: CairnTrainer supports one process or DDP; shard with "
            "FSDP2 yourself and use CheckpointManager directly (docs/frameworks.md)"
        )
    if trainer.args.fp16:
        raise ValueError("fp16: the loss scaler is not checkpointed; use bf16 or fp32")


def _unwrapped(obj: typing.Any, attribute: str) -> typing.Any:
    """The torch optimizer or scheduler inside Accelerate's wrapper."""
    return getattr(obj, attribute, obj)


def _checked_trainer_state(text: str | None, *, step: int) -> str:
    """The restored trainer state, checked to be the Trainer's own and at `step`."""
    try:
        parsed = json.loads(text) if isinstance(text, str) else None
        restored = transformers.TrainerState(**parsed) if isinstance(parsed, dict) else None
    except (ValueError, TypeError) as exc:
        raise errors.ConfigurationError(f"step {step}: trainer state unreadable: {exc}") from None
    if restored is None:
        raise errors.ConfigurationError(f"step {step}: the checkpoint holds no trainer state")
    if restored.global_step != step:
        raise errors.ConfigurationError(
            f"step {step}: trainer state is at global step {restored.global_step}"
        )
    return _state_json(restored)


def _state_json(trainer_state: trainer_callback.TrainerState) -> str:
    """trainer_state.json's text, exactly as `TrainerState.save_to_json` writes it."""
    return json.dumps(dataclasses.asdict(trainer_state), indent=2, sort_keys=True) + "\n"
