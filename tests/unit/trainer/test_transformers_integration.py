"""The Transformers `Trainer` integration's own rules (no cluster, one process).

Covers: the restored trainer state is the Trainer's own JSON, written exactly
as `TrainerState.save_to_json` writes it; an absent, malformed, foreign
(unknown fields) or mismatched (another global step) trainer state is a
ConfigurationError naming the step, never a fresh start; restored RNG states
wait until the Trainer asks for them (after it skipped the consumed batches).
With Accelerate present (the Trainer needs it): `train(resume_from_checkpoint=...)`
is refused (Cairn decides), fp16 loss scaling is refused at construction, and
a folder that is not Cairn's resume folder is refused by every load hook; a
fresh run checkpoints model, optimizer, scheduler, RNG and trainer state in
one Cairn step; a preemption request (SIGTERM) stops the loop once its final
checkpoint is committed (`trainer.preempted`). The kill-and-resume path: tests/e2e/test_transformers_trainer.py.
"""

from __future__ import annotations

import json
import pathlib
import typing

import pytest
import torch
import transformers

from cairn.checkpoint import errors, runtime_config, state
from cairn.trainer.integrations import transformers as cairn_hf


def state_at(step: int) -> transformers.TrainerState:
    trainer_state = transformers.TrainerState(global_step=step, max_steps=30)
    trainer_state.log_history = [{"loss": 4.25, "step": step}]
    return trainer_state


def test_the_state_json_is_what_the_trainer_itself_writes(tmp_path: pathlib.Path) -> None:
    trainer_state = state_at(10)
    trainer_state.save_to_json(str(tmp_path / "trainer_state.json"))
    written = (tmp_path / "trainer_state.json").read_text(encoding="utf-8")
    assert cairn_hf._state_json(trainer_state) == written
    assert cairn_hf._checked_trainer_state(written, step=10) == written


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "holds no trainer state"),
        ("[1, 2]", "holds no trainer state"),
        ("{not json", "unreadable"),
        ('{"global_step": 10, "evil": 1}', "unreadable"),
        (cairn_hf._state_json(state_at(5)), "at global step 5"),
    ],
    ids=["absent", "not-an-object", "malformed", "unknown-field", "other-step"],
)
def test_a_bad_trainer_state_is_a_configuration_error(text: str | None, reason: str) -> None:
    with pytest.raises(errors.ConfigurationError, match=f"step 10: .*{reason}"):
        cairn_hf._checked_trainer_state(text, step=10)


def test_restored_rng_waits_until_the_trainer_asks() -> None:
    rng = cairn_hf._DeferredRNG()
    torch.manual_seed(1)
    saved = rng.state_dict()
    expected = torch.rand(3)
    torch.manual_seed(2)
    rng.load_state_dict(saved)
    after_load = torch.rand(3)
    assert not torch.equal(after_load, expected), "applied on load, not when asked"
    rng.apply()
    assert torch.equal(torch.rand(3), expected)
    rng.apply()  # applied once; a second call changes nothing
    assert not torch.equal(torch.rand(3), expected)


class _Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(8) + index) % 31
        return {"input_ids": ids, "labels": ids}


def make_trainer(
    tmp_path: pathlib.Path,
    ckpt: typing.Any,
    cfg: runtime_config.RuntimeConfig,
    **overrides: typing.Any,
) -> cairn_hf.CairnTrainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **overrides,
    )
    config = transformers.GPT2Config(vocab_size=31, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    return cairn_hf.CairnTrainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=_Rows(),
        checkpoints=ckpt,
        runtime=cfg,
    )


def local_config(tmp_path: pathlib.Path) -> runtime_config.RuntimeConfig:
    return runtime_config.from_env(
        {"CAIRN_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "CAIRN_CHECKPOINT_INTERVAL_STEPS": "2"}
    )


def test_the_trainer_refuses_what_cairn_would_not_hold(tmp_path: pathlib.Path) -> None:
    cfg = local_config(tmp_path)
    with cairn_hf.checkpoint_manager(cfg, transformers.TrainingArguments(use_cpu=True)) as ckpt:
        trainer = make_trainer(tmp_path, ckpt, cfg)
        with pytest.raises(ValueError, match="resume_from_checkpoint: Cairn decides"):
            trainer.train(resume_from_checkpoint=str(tmp_path))
        with pytest.raises(ValueError, match="resume_from_checkpoint: Cairn decides"):
            trainer.train(resume_from_checkpoint=True)
        for hook in (trainer._load_optimizer_and_scheduler, trainer._load_rng_state):
            with pytest.raises(ValueError, match="not a Cairn resume folder"):
                hook(str(tmp_path))
        with pytest.raises(ValueError, match="fp16: the loss scaler"):
            make_trainer(tmp_path, ckpt, cfg, fp16=True, fp16_full_eval=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_fresh_run_checkpoints_every_part_in_one_step(tmp_path: pathlib.Path) -> None:
    cfg = local_config(tmp_path)
    with cairn_hf.checkpoint_manager(cfg, transformers.TrainingArguments(use_cpu=True)) as ckpt:
        trainer = make_trainer(tmp_path, ckpt, cfg)
        trainer.train()
        assert ckpt.all_steps()[-1] == 4
        assert not trainer.preempted
    folder = tmp_path / "ckpt" / "step-000000004"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 4
    keys = state.checkpoint_keys(folder)
    for prefix in ("model.model.", "model.optim.", "lr_scheduler.", "rng", "trainer.json"):
        assert any(key.startswith(prefix) for key in keys), (prefix, sorted(keys)[:20])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_preemption_request_stops_the_loop_after_a_committed_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    cfg = local_config(tmp_path)
    with cairn_hf.checkpoint_manager(cfg, transformers.TrainingArguments(use_cpu=True)) as ckpt:
        trainer = make_trainer(tmp_path, ckpt, cfg)
        ckpt.request_final_checkpoint()  # what the SIGTERM handler does
        trainer.train()
        assert trainer.preempted
        assert trainer.state.global_step < 4, "the loop went on after the final checkpoint"
        assert ckpt.all_steps()[-1] == trainer.state.global_step
