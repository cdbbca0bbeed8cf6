"""A small decoder-only transformer, sized by a handful of numbers.

Tiny for tests (a few hundred thousand parameters), large for GPU benchmarks
(`layers=24, dim=2048` is about 1.3 B). Blocks are the unit FSDP2 shards.
"""

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    seq_len: int = 32

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError("ModelConfig.dim must be a multiple of ModelConfig.heads")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        mask = torch.triu(
            torch.full((length, length), float("-inf"), device=tokens.device), diagonal=1
        )
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
    )
