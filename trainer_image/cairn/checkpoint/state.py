"""The Stateful pieces that make up a training checkpoint.

A checkpoint is a mapping of names to `Stateful` objects (anything with
`state_dict()` / `load_state_dict()`): the FSDP2 model with its optimizer,
the lr scheduler, RNG states, the data position and the train state. Objects
whose state differs between ranks (RNG, a per-rank data cursor) set
`cairn_per_rank = True`; the manager stores them under a per-rank key, and a
restore into a different world size skips them (and reports it).

RNG states are stored as tensors, not pickles, so that DCP loads them in
place and `torch.load(weights_only=True)` semantics hold.

Device moves: a checkpoint saved on CPU has no CUDA generator state and one
saved on GPU has it. An object lists such keys in `cairn_optional_keys`;
restore drops them from the load template when the checkpoint lacks them
(`drop_absent_optional`), so a CPU checkpoint loads on a GPU (the CUDA
generator keeps its seed, reported in the log) and a GPU checkpoint loads on
CPU (its CUDA state is not requested, so it is ignored).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import random
import typing

import numpy as np
import torch
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from cairn.checkpoint import optimstate, safedcp

log = logging.getLogger(__name__)


@typing.runtime_checkable
class Stateful(typing.Protocol):
    def state_dict(self) -> dict[str, typing.Any]: ...

    def load_state_dict(self, state_dict: dict[str, typing.Any]) -> None: ...


def is_per_rank(obj: object) -> bool:
    return bool(getattr(obj, "cairn_per_rank", False))


def optional_keys(obj: object) -> tuple[str, ...]:
    """Top-level state keys the object can do without (device-specific state)."""
    return tuple(getattr(obj, "cairn_optional_keys", ()))


def checkpoint_keys(folder: str | os.PathLike[str]) -> set[str]:
    """The flattened state keys a DCP checkpoint folder holds (`name.key...`);
    `.metadata` is read as data (`cairn.checkpoint.safedcp`), never run."""
    meta = safedcp.read_metadata(pathlib.Path(folder))
    return set(meta.state_dict_metadata)


def drop_absent_optional(
    template: dict[str, typing.Any], *, key: str, obj: object, present: set[str]
) -> list[str]:
    """Remove the object's optional keys the checkpoint lacks from its load
    template (DCP refuses a requested key that is absent); returns them."""
    inner = template.get(key)
    if not isinstance(inner, dict):
        return []
    dropped = [
        name for name in optional_keys(obj) if name in inner and f"{key}.{name}" not in present
    ]
    for name in dropped:
        del inner[name]
    if dropped:
        log.info("%s: the checkpoint has no %s (saved on another device); kept as is", key, dropped)
    return dropped


class ModelOptimizerState:
    """Model + optimizer through DCP's `get_state_dict`/`set_state_dict` (FSDP2 aware)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | typing.Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        self.model = model
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = (optimizers,)
        self.optimizers = tuple(optimizers)

    def state_dict(self) -> dict[str, typing.Any]:
        if not self.optimizers:
            return {"model": dcp_state_dict.get_model_state_dict(self.model)}
        for optimizer in self.optimizers:
            # DCP's template step over DTensors, made on the shards where that is exact.
            optimstate.init_on_shards(optimizer)
        model_sd, optim_sd = dcp_state_dict.get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, typing.Any]) -> None:
        if not self.optimizers:
            dcp_state_dict.set_model_state_dict(self.model, state_dict["model"])
            return
        dcp_state_dict.set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


class RNGState:
    """torch, CUDA (when present), numpy and Python `random` generator states."""

    cairn_per_rank = True
    cairn_optional_keys = ("cuda",)
    """Saved on a GPU only: a CPU checkpoint loads on a GPU and vice versa."""

    def state_dict(self) -> dict[str, typing.Any]:
        np_state = np.random.get_state(legacy=True)
        assert isinstance(np_state, tuple)  # legacy=True always returns the tuple form
        py_version, py_internal, py_gauss = random.getstate()
        state: dict[str, typing.Any] = {
            "torch": torch.get_rng_state(),
            "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "numpy_meta": torch.tensor([int(np_state[2]), int(np_state[3])], dtype=torch.int64),
            "numpy_gauss": torch.tensor([float(np_state[4])], dtype=torch.float64),
            "python": torch.tensor(list(py_internal), dtype=torch.int64),
            "python_meta": torch.tensor(
                [py_version, 0 if py_gauss is None else 1], dtype=torch.int64
            ),
            "python_gauss": torch.tensor(
                [0.0 if py_gauss is None else py_gauss], dtype=torch.float64
            ),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, typing.Any]) -> None:
        torch.set_rng_state(_cpu_bytes(state_dict["torch"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(_cpu_bytes(state_dict["cuda"]))
        meta = state_dict["numpy_meta"].tolist()
        np.random.set_state(
            (
                "MT19937",
                state_dict["numpy_keys"].numpy().astype(np.uint32),
                int(meta[0]),
                int(meta[1]),
                float(state_dict["numpy_gauss"].item()),
            )
        )
        py_meta = state_dict["python_meta"].tolist()
        gauss = float(state_dict["python_gauss"].item()) if py_meta[1] else None
        random.setstate((int(py_meta[0]), tuple(state_dict["python"].tolist()), gauss))


def _cpu_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Generator states are CPU uint8 tensors; a load may hand them elsewhere."""
    return tensor.detach().to(device="cpu", dtype=torch.uint8).contiguous()


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainState:
    """The trainer's own counters; lands in the same checkpoint."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, typing.Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, typing.Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
