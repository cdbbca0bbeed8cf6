"""Importing checkpoints Cairn did not write: plain DCP folders (TorchTitan, `dcp.save`).

A plain DCP checkpoint is a folder with DCP's `.metadata` (a pickled
`Metadata`) and the data files it references (`__<rank>_<n>.distcp`), and no
Cairn manifest: no CRC to check, no job identity. What can be verified is:
`.metadata` is DCP metadata and nothing else (read as data by
`cairn.checkpoint.safedcp`, optionally pinned by `resume.sha256`), every file
it references is a plain name inside the folder that exists and is at least
as long as the byte ranges it reads from it (`verify_folder`,
`verify_listing`), and its bytes entries are weights-only data
(`cairn.checkpoint.vet`).

Its state keys follow the writer's layout, not the trainer's `Stateful`
names, so they are mapped by one documented rule (`choose_key_map`, pure;
docs/checkpointing.md "Importing a foreign checkpoint"):

1. a user-supplied `KeyMap` (`CAIRN_IMPORT_KEYS`, JSON) wins;
2. TorchTitan's layout (`model.<fqn>`, a flattened optimizer state dict under
   `optimizer.`, the step at `train_state.step`) or a plain `{"model": sd}`
   save: every parameter of the model is found under `model.`;
3. a bare model state dict: every parameter is found under its own name.

Imported are the model weights, the optimizer state (when the checkpoint
has one under the mapped prefix: every `state.*` entry, and the
`param_groups.*` hyperparameters it has) and the step counter (when mapped); every
other piece of the trainer's state (lr scheduler, data position, RNG)
starts fresh, and `ImportResult.not_imported` names those pieces. Anything
that does not fit (missing keys, a shape mismatch, an unreadable
`.metadata`) is a ConfigurationError: an import never half-succeeds and
never turns into a fresh start.

Side effects: reads the folder, loads into the given objects (collectively
with DCP over the process group: every rank calls `load`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import typing

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import metadata
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from cairn.checkpoint import errors, safedcp, state

log = logging.getLogger(__name__)

DCP_METADATA = ".metadata"
KEY_MAP_ENV = "CAIRN_IMPORT_KEYS"
"""JSON object with any of "model", "optimizer", "step" (see `KeyMap`)."""
_SHOW_KEYS = 5


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KeyMap:
    """Where the imported pieces live in the checkpoint's flattened keys."""

    model: str
    """Prefix of the model weights: `<model><fqn>` ("model." for TorchTitan, "" for bare)."""
    optimizer: str | None = None
    """Prefix of a flattened optimizer state dict (`state.<fqn>.<k>`,
    `param_groups.<fqn>.<k>`, as `flatten_optimizer_state_dict=True` writes);
    None: the optimizer starts fresh."""
    step: str | None = None
    """Key of the step counter (a tensor or an int); None: the step is not imported."""
    rule: str = "user"
    """Which rule chose this map (reported with the import)."""


TORCHTITAN_OPTIMIZER = "optimizer."
TORCHTITAN_STEP = "train_state.step"


def parse_key_map(text: str) -> KeyMap:
    """A user's KeyMap from JSON, e.g. `{"model": "module.", "optimizer": null}`. Pure.

    Raises ConfigurationError naming the variable on anything else.
    """
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise errors.ConfigurationError(f"{KEY_MAP_ENV} is not JSON: {exc}") from None
    allowed = {"model", "optimizer", "step"}
    if not isinstance(doc, dict) or not set(doc) <= allowed or "model" not in doc:
        raise errors.ConfigurationError(
            f"{KEY_MAP_ENV} must be a JSON object with a string 'model' and optionally"
            f" 'optimizer' and 'step' (strings or null), got {text!r}"
        )
    if not isinstance(doc["model"], str) or not all(
        doc.get(name) is None or isinstance(doc.get(name), str) for name in ("optimizer", "step")
    ):
        raise errors.ConfigurationError(f"{KEY_MAP_ENV}: values must be strings or null")
    return KeyMap(model=doc["model"], optimizer=doc.get("optimizer"), step=doc.get("step"))


def choose_key_map(
    keys: typing.Collection[str], *, model_fqns: typing.Collection[str], user: KeyMap | None
) -> KeyMap:
    """The key map for a checkpoint with these flattened keys (the rule above). Pure."""
    if user is not None:
        return user
    available = set(keys)
    if all(f"model.{fqn}" in available for fqn in model_fqns):
        has_optim = any(key.startswith(f"{TORCHTITAN_OPTIMIZER}state.") for key in available)
        return KeyMap(
            model="model.",
            optimizer=TORCHTITAN_OPTIMIZER if has_optim else None,
            step=TORCHTITAN_STEP if TORCHTITAN_STEP in available else None,
            rule="torchtitan" if has_optim else "model-state-dict",
        )
    if all(fqn in available for fqn in model_fqns):
        return KeyMap(model="", rule="bare-state-dict")
    missing = sorted(fqn for fqn in model_fqns if f"model.{fqn}" not in available)
    raise errors.ConfigurationError(
        "cannot map the checkpoint's keys onto the model: neither 'model.<name>' nor bare"
        f" parameter names cover it (missing e.g. {missing[:_SHOW_KEYS]}; the checkpoint has"
        f" e.g. {sorted(available)[:_SHOW_KEYS]}); set {KEY_MAP_ENV} (docs/checkpointing.md)"
    )


# -- what can be verified ------------------------------------------------------------


def read_metadata(
    folder: pathlib.Path,
    *,
    allowed: typing.Collection[str] | None = None,
    sha256: str | None = None,
) -> metadata.Metadata:
    """DCP's `.metadata` of folder, read as data (`safedcp`: allow-listed
    classes, file references inside the folder and, given, in `allowed`;
    pinned by `sha256`). ConfigurationError when absent, unreadable or refused."""
    try:
        return safedcp.read_metadata(folder, allowed=allowed, sha256=sha256)
    except errors.ConfigurationError:
        raise
    except errors.CheckpointError as exc:
        raise errors.ConfigurationError(f"{folder}: {exc}") from None


def present_files(folder: pathlib.Path) -> frozenset[str]:
    """The regular files of a plain DCP folder (symlinks are not its files)."""
    return frozenset(
        path.name for path in folder.iterdir() if path.is_file() and not path.is_symlink()
    )


def required_sizes(meta: metadata.Metadata) -> dict[str, int]:
    """Each referenced data file with the least size it must have. Pure."""
    needed: dict[str, int] = {}
    storage = meta.storage_data or {}
    for info in storage.values():
        path = str(info.relative_path)
        needed[path] = max(needed.get(path, 0), int(info.offset) + int(info.length))
    return needed


def verify_listing(sizes: typing.Mapping[str, int], meta: metadata.Metadata) -> list[str]:
    """Problems of a set of files (relative path -> size) against the metadata. Pure."""
    problems: list[str] = []
    for path, least in sorted(required_sizes(meta).items()):
        if path not in sizes:
            problems.append(f"{path}: missing")
        elif sizes[path] < least:
            problems.append(f"{path}: {sizes[path]} bytes, metadata reads up to {least}")
    return problems


def verify_folder(folder: pathlib.Path, meta: metadata.Metadata) -> list[str]:
    """`verify_listing` against the files in folder."""
    sizes = {
        path: (folder / path).stat().st_size
        for path in required_sizes(meta)
        if (folder / path).is_file() and not (folder / path).is_symlink()
    }
    return verify_listing(sizes, meta)


# -- loading -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ImportResult:
    step: int | None
    """The imported step counter (None when the map has no step key)."""
    key_map: KeyMap
    not_imported: tuple[str, ...]
    """Names of the trainer's state objects that start fresh."""


def _find(
    objects: typing.Mapping[str, state.Stateful], kind: type[typing.Any]
) -> tuple[str, typing.Any] | None:
    for name, obj in objects.items():
        if isinstance(obj, kind):
            return name, obj
    return None


def _placeholder(meta: metadata.Metadata, key: str) -> object:
    """A template value DCP can load `key` into (tensors by shape, anything for bytes)."""
    item = meta.state_dict_metadata[key]
    if isinstance(item, metadata.TensorStorageMetadata):
        return torch.empty(item.size, dtype=item.properties.dtype)
    return None


def _check_keys(template: typing.Mapping[str, object], meta: metadata.Metadata) -> None:
    missing = sorted(key for key in template if key not in meta.state_dict_metadata)
    if missing:
        raise errors.ConfigurationError(
            f"the checkpoint lacks {len(missing)} mapped keys, e.g. {missing[:_SHOW_KEYS]}"
            f" (set {KEY_MAP_ENV} to map or skip them; docs/checkpointing.md)"
        )
    for key, value in template.items():
        item = meta.state_dict_metadata[key]
        if (
            isinstance(value, torch.Tensor)
            and isinstance(item, metadata.TensorStorageMetadata)
            and tuple(value.shape) != tuple(item.size)
        ):
            raise errors.ConfigurationError(
                f"{key}: the checkpoint has shape {tuple(item.size)}, the model"
                f" {tuple(value.shape)}"
            )


def _optimizer_state(
    holder: state.ModelOptimizerState,
    *,
    key_map: KeyMap,
    options: dcp_state_dict.StateDictOptions,
) -> dict[str, typing.Any]:
    """The optimizer's flattened state to import into ({} when not mapped)."""
    if key_map.optimizer is None:
        return {}
    if len(holder.optimizers) != 1:
        raise errors.ConfigurationError(
            "importing optimizer state needs exactly one optimizer"
            f" (got {len(holder.optimizers)}); map 'optimizer' to null to skip it"
        )
    return dcp_state_dict.get_optimizer_state_dict(
        holder.model, holder.optimizers[0], options=options
    )


def load(
    folder: pathlib.Path,
    *,
    meta: metadata.Metadata,
    objects: typing.Mapping[str, state.Stateful],
    user_map: KeyMap | None,
    process_group: dist.ProcessGroup | None,
) -> ImportResult:
    """Load the mapped pieces of a verified plain DCP folder into objects (collective)."""
    found = _find(objects, state.ModelOptimizerState)
    if found is None:
        raise errors.ConfigurationError("nothing to import into: no ModelOptimizerState given")
    model_name, holder = found
    model_sd = dcp_state_dict.get_model_state_dict(holder.model)
    key_map = choose_key_map(meta.state_dict_metadata, model_fqns=model_sd, user=user_map)
    template: dict[str, typing.Any] = {f"{key_map.model}{k}": v for k, v in model_sd.items()}
    flat = dcp_state_dict.StateDictOptions(flatten_optimizer_state_dict=True)
    optim_sd = _optimizer_state(holder, key_map=key_map, options=flat)
    if key_map.optimizer is not None:
        template.update(_optimizer_template(optim_sd, prefix=key_map.optimizer, meta=meta))
    if key_map.step is not None:
        if key_map.step not in meta.state_dict_metadata:
            raise errors.ConfigurationError(f"the checkpoint has no step key {key_map.step!r}")
        template[key_map.step] = _placeholder(meta, key_map.step)
    _check_keys(template, meta)
    safedcp.load(
        template,
        folder=folder,
        meta=meta,
        allowed=present_files(folder),
        process_group=process_group,
    )
    dcp_state_dict.set_model_state_dict(
        holder.model, {k: template[f"{key_map.model}{k}"] for k in model_sd}
    )
    if key_map.optimizer is not None:
        prefix = key_map.optimizer
        loaded = {k: template.get(f"{prefix}{k}", value) for k, value in optim_sd.items()}
        dcp_state_dict.set_optimizer_state_dict(
            holder.model, holder.optimizers[0], loaded, options=flat
        )
    step = None if key_map.step is None else _as_int(template[key_map.step], key_map.step)
    train = _find(objects, state.TrainState)
    if step is not None and train is not None:
        train[1].step = step
    fresh = tuple(
        name
        for name in objects
        if name != model_name and not (step is not None and train and name == train[0])
    )
    log.info(
        "imported %s (rule %s): step %s; starting fresh: %s", folder, key_map.rule, step, fresh
    )
    return ImportResult(step=step, key_map=key_map, not_imported=fresh)


def _optimizer_template(
    optim_sd: typing.Mapping[str, typing.Any], *, prefix: str, meta: metadata.Metadata
) -> dict[str, typing.Any]:
    """Every `state.*` entry (must exist); `param_groups.*` entries only where the
    checkpoint has them: hyperparameters it lacks (say `initial_lr`, which an
    lr scheduler adds) keep the trainer's own values. Pure."""
    return {
        f"{prefix}{k}": v
        for k, v in optim_sd.items()
        if not k.startswith("param_groups.") or f"{prefix}{k}" in meta.state_dict_metadata
    }


def _as_int(value: object, key: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise errors.ConfigurationError(f"{key} holds {type(value).__name__}, not a step number")
