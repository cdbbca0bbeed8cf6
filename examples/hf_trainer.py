"""A Hugging Face Transformers `Trainer` run, checkpointed by Cairn.

A tiny GPT-2 built from a config (no download), a deterministic synthetic
token corpus, the Trainer's own loop, data order and AdamW + linear
schedule; `CairnTrainer` saves, uploads, resumes and reports status through
Cairn's `CheckpointManager` (docs/frameworks.md):

    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 20

`tests/e2e/test_transformers_trainer.py` runs it as a TrainingJob, SIGKILLs
rank 1 and compares the final loss with an undisturbed run.
"""

import argparse
import json
import pathlib
import tempfile
import time
from typing import Any

import torch
import transformers

from cairn.checkpoint import process_exit, runtime_config
from cairn.trainer.integrations import transformers as cairn_hf

PREEMPTED = 143
VOCAB = 97
SEQUENCE = 16


class Corpus(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Deterministic token rows (a noisy arithmetic sequence per row)."""

    def __init__(self, rows: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, VOCAB, (rows, 1), generator=generator)
        strides = torch.randint(1, 7, (rows, 1), generator=generator)
        self._ids = (starts + strides * torch.arange(SEQUENCE)) % VOCAB

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self._ids[index], "labels": self._ids[index]}


class Pace(transformers.TrainerCallback):
    """Slows each step down (so a test can kill a rank mid-run)."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self._seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--losses-out", help="rank 0 writes {step: loss} here as JSON")
    parser.add_argument("--output-dir", help="the Trainer's output_dir (default: a temp dir)")
    args = parser.parse_args()

    cfg = runtime_config.from_env()
    output = args.output_dir or tempfile.mkdtemp(prefix="hf-trainer-")
    training = transformers.TrainingArguments(
        output_dir=output,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",  # Cairn's schedule (spec.checkpoint) decides
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=7,
        disable_tqdm=True,
    )
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2
    )
    with cairn_hf.checkpoint_manager(cfg, training) as ckpt:
        ckpt.install_sigterm_handler()  # preemption → final checkpoint
        transformers.set_seed(training.seed)
        trainer = cairn_hf.CairnTrainer(
            model=transformers.GPT2LMHeadModel(config),
            args=training,
            train_dataset=Corpus(rows=256),
            callbacks=[Pace(args.step_delay)],
            checkpoints=ckpt,
            runtime=cfg,
        )
        trainer.train()
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    if training.process_index == 0:
        print(f"final step {trainer.state.global_step} loss {losses.get(args.steps)!r}", flush=True)
        if args.losses_out:
            pathlib.Path(args.losses_out).write_text(json.dumps(losses, sort_keys=True))
    return PREEMPTED if trainer.preempted else 0


if __name__ == "__main__":
    # Not SystemExit: interpreter finalization can race torch's gloo threads
    # into an abort after the last step (docs/trainer.md, exit_process).
    process_exit.exit_process(main())
