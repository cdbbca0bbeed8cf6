"""A deterministic synthetic corpus and a stateful, resumable sampler.

The corpus is a fixed pseudo-random "language" (each sequence follows an
affine recurrence over the vocabulary with seeded noise), so a small model's
loss falls and every run sees identical data. The sampler walks a seeded
permutation per epoch; its state is the *global* number of samples consumed,
so a checkpoint written by 2 ranks resumes at the same data position on 1.
"""

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Corpus:
    vocab: int
    seq_len: int
    size: int
    seed: int

    def sample(self, index: int) -> torch.Tensor:
        """Sequence `index` (seq_len + 1 tokens: inputs and shifted targets). Pure."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        a = int(torch.randint(1, 7, (1,), generator=gen))
        b = int(torch.randint(0, self.vocab, (1,), generator=gen))
        steps = torch.arange(self.seq_len + 1)
        tokens = (a * steps + b) % self.vocab
        noise = torch.rand(self.seq_len + 1, generator=gen) < 0.05
        random_tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=gen)
        return torch.where(noise, random_tokens, tokens)


class ShardedSampler:
    """Yields this rank's batch each step; `Stateful` by global position."""

    def __init__(self, *, corpus: Corpus, batch_per_rank: int, rank: int, world: int) -> None:
        self.corpus = corpus
        self.batch_per_rank = batch_per_rank
        self.rank = rank
        self.world = world
        self.consumed = 0  # samples consumed by all ranks together

    def _order(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.corpus.seed + 7919 * epoch)
        return torch.randperm(self.corpus.size, generator=gen)

    def next_batch(self) -> torch.Tensor:
        global_batch = self.batch_per_rank * self.world
        start = self.consumed + self.rank * self.batch_per_rank
        rows = []
        for offset in range(self.batch_per_rank):
            position = start + offset
            epoch, within = divmod(position, self.corpus.size)
            rows.append(self.corpus.sample(int(self._order(epoch)[within])))
        self.consumed += global_batch
        return torch.stack(rows)

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = int(state_dict["consumed"])
