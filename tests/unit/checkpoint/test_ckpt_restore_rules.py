"""The pure rules of restore and import, table-tested.

Covers: all ranks' reports fold into the strongest verdict (transport beats
corruption beats unreadable...); only a size/CRC mismatch counts as proven
corruption; which S3 failures are transient (5xx, SlowDown, resets,
timeouts) and which are not (404, 403); bounded retry rounds turn a lasting
transient failure into TransportError and let other errors through at once;
the import key rule (TorchTitan, `{"model": sd}`, bare names, a user map)
and its refusals; the action of a verdict and the outcome when nothing
loads; what a node-local rank loads itself and which files that reads, and
that merging rank 0's entries keeps containers without leaves (LambdaLR); the data prefix of a step; the termination message is
clipped to 4096 bytes on a character boundary and its path can be overridden.
"""

from __future__ import annotations

import functools
import pathlib
import typing

import botocore.exceptions
import pytest
import s3transfer.exceptions
import torch
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from cairn.api import exitcodes
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, foreign, layout, load, remote, s3transport
from cairn.checkpoint import verdict as verdict_mod
from cairn.trainer import termination


def report(status: verdict_mod.Status, rank: int = 0) -> verdict_mod.Report:
    return verdict_mod.Report(status=status, detail=f"{status} here", rank=rank)


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        (["ok", "ok"], "ok"),
        (["ok", "unreadable"], "unreadable"),
        (["corrupt", "unreadable"], "corrupt"),
        (["incomplete", "ok"], "incomplete"),
        (["corrupt", "transport"], "transport"),
        (["refused", "corrupt"], "refused"),
        (["foreign", "foreign"], "foreign"),
    ],
)
def test_the_strongest_report_decides(
    statuses: list[verdict_mod.Status], expected: verdict_mod.Status
) -> None:
    found = verdict_mod.judge([report(s, rank=r) for r, s in enumerate(statuses)])
    assert found.status == expected
    for rank, status in enumerate(statuses):
        assert (f"rank {rank}: {status} here" in found.reason) == (status != "ok")


def test_no_reports_is_not_ok() -> None:
    assert verdict_mod.judge([]).status != "ok"


@pytest.mark.parametrize(
    ("reasons", "expected"),
    [
        ([], "ok"),
        (["size 3 != manifest 4"], "corrupt"),
        (["crc32c 00000000 != manifest 11111111"], "corrupt"),
        (["missing", "crc32c 0 != manifest 1"], "corrupt"),
        (["missing", "missing"], "incomplete"),
        (["'../x' resolves outside /ckpt"], "unreadable"),
    ],
)
def test_only_a_size_or_crc_mismatch_is_proven_corruption(
    reasons: list[str], expected: verdict_mod.Status
) -> None:
    problems = [layout.Problem(path=f"f{i}", reason=r) for i, r in enumerate(reasons)]
    assert verdict_mod.status_of_problems(problems) == expected


def client_error(status: int, code: str) -> botocore.exceptions.ClientError:
    response: typing.Any = {
        "Error": {"Code": code, "Message": "x"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, "GetObject")


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (client_error(503, "SlowDown"), True),
        (client_error(500, "InternalError"), True),
        (client_error(400, "RequestTimeout"), True),
        (client_error(404, "NoSuchKey"), False),
        (client_error(403, "AccessDenied"), False),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), True),
        (botocore.exceptions.ConnectionClosedError(endpoint_url="http://x"), True),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), True),
        (botocore.exceptions.ResponseStreamingError(error="reset"), True),
        (s3transfer.exceptions.RetriesExceededError(last_exception=OSError("reset")), True),
        (TimeoutError(), True),
        (ValueError("bad manifest"), False),
        (errors.CheckpointError("corrupt"), False),
    ],
)
def test_which_failures_are_transient(exc: BaseException, transient: bool) -> None:
    assert s3transport.is_transient(exc) is transient


def test_a_wrapped_transient_failure_is_transient() -> None:
    outer = errors.RemoteError("download failed")
    outer.__cause__ = client_error(502, "BadGateway")
    assert s3transport.is_transient(outer)


class Flaky:
    """Fails with `exc` for the first `failures` calls, then returns 'done'."""

    def __init__(self, failures: int, exc: BaseException) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "done"


def test_transient_failures_are_retried_in_bounded_rounds() -> None:
    slept: list[float] = []
    fetch = Flaky(2, client_error(503, "SlowDown"))
    backoff = s3transport.Backoff(rounds=3, first_seconds=1.0, max_seconds=8.0)
    assert s3transport.retrying(fetch, what="t", backoff=backoff, sleep=slept.append) == "done"
    assert fetch.calls == 3
    assert slept == [1.0, 2.0]


def test_a_lasting_transient_failure_becomes_transport_error() -> None:
    slept: list[float] = []
    fetch = Flaky(10, botocore.exceptions.ConnectionClosedError(endpoint_url="http://x"))
    backoff = s3transport.Backoff(rounds=3, first_seconds=1.0, max_seconds=1.5)
    with pytest.raises(errors.TransportError, match="after 3 rounds"):
        s3transport.retrying(fetch, what="restoring step 4", backoff=backoff, sleep=slept.append)
    assert fetch.calls == 3
    assert slept == [1.0, 1.5]


def test_other_failures_pass_through_at_once() -> None:
    fetch = Flaky(1, client_error(403, "AccessDenied"))
    with pytest.raises(botocore.exceptions.ClientError):
        s3transport.retrying(fetch, what="t", sleep=lambda _: None)
    assert fetch.calls == 1


MODEL = ["embed.weight", "head.weight"]


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (
            [
                "model.embed.weight",
                "model.head.weight",
                "optimizer.state.embed.weight.exp_avg",
                "train_state.step",
            ],
            foreign.KeyMap(
                model="model.", optimizer="optimizer.", step="train_state.step", rule="torchtitan"
            ),
        ),
        (
            ["model.embed.weight", "model.head.weight"],
            foreign.KeyMap(model="model.", rule="model-state-dict"),
        ),
        (
            ["embed.weight", "head.weight", "extra"],
            foreign.KeyMap(model="", rule="bare-state-dict"),
        ),
    ],
)
def test_the_key_rule_recognises_common_layouts(keys: list[str], expected: foreign.KeyMap) -> None:
    assert foreign.choose_key_map(keys, model_fqns=MODEL, user=None) == expected


def test_a_user_map_wins_and_a_mismatch_names_the_keys() -> None:
    user = foreign.KeyMap(model="net.", optimizer=None)
    assert foreign.choose_key_map(["x"], model_fqns=MODEL, user=user) is user
    with pytest.raises(errors.ConfigurationError, match=r"head\.weight.*CAIRN_IMPORT_KEYS"):
        foreign.choose_key_map(["model.embed.weight"], model_fqns=MODEL, user=None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"model": "module."}', foreign.KeyMap(model="module.")),
        (
            '{"model": "", "optimizer": "optim.", "step": "meta.step"}',
            foreign.KeyMap(model="", optimizer="optim.", step="meta.step"),
        ),
        ('{"model": "m.", "optimizer": null}', foreign.KeyMap(model="m.")),
    ],
)
def test_user_key_maps_parse(text: str, expected: foreign.KeyMap) -> None:
    assert foreign.parse_key_map(text) == expected


@pytest.mark.parametrize(
    "text", ["not json", "[]", '{"optimizer": "o."}', '{"model": 1}', '{"model": "", "lr": "x"}']
)
def test_bad_user_key_maps_are_configuration_errors(text: str) -> None:
    with pytest.raises(errors.ConfigurationError, match="CAIRN_IMPORT_KEYS"):
        foreign.parse_key_map(text)


def test_data_objects_live_under_the_manifest_data_prefix() -> None:
    doc = {"step": 4, "world_size": 1, "attempt": 1, "created_at": 0, "files": []}
    old = manifest_mod.Manifest.model_validate(doc)
    new = manifest_mod.Manifest.model_validate({**doc, "data_prefix": "a1-abcd1234"})
    assert remote.data_prefix("p/step-000000004", old) == "p/step-000000004"
    assert remote.data_prefix("p/step-000000004", new) == "p/step-000000004/a1-abcd1234"


def test_the_termination_message_is_clipped_on_a_character_boundary() -> None:
    message = "é" * 3000  # 6000 bytes
    clipped = termination.clip(message)
    assert len(clipped) <= exitcodes.TERMINATION_MESSAGE_MAX_BYTES
    assert clipped.decode() == "é" * (exitcodes.TERMINATION_MESSAGE_MAX_BYTES // 2)
    assert termination.clip("short") == b"short"


def test_a_configuration_error_writes_the_reason_and_returns_78(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "termination-log"
    env = {termination.PATH_ENV: str(path)}
    code = termination.config_error(errors.ConfigurationError("no step 9"), env=env)
    assert code == exitcodes.CONFIG_ERROR == 78
    assert path.read_text() == "ConfigurationError: no step 9"
    assert termination.message_path({}) == pathlib.Path(exitcodes.TERMINATION_MESSAGE_PATH)
    assert not termination.write_reason("x", env={termination.PATH_ENV: str(tmp_path / "no/dir")})


@pytest.mark.parametrize(
    ("status", "ours", "expected"),
    [
        ("ok", True, "load"),
        ("ok", False, "load"),
        ("transport", True, "fail"),
        ("refused", False, "fail"),
        ("corrupt", True, "quarantine"),
        ("corrupt", False, "skip"),  # another job's bytes: never moved
        ("unreadable", True, "skip"),
        ("incomplete", True, "skip"),
        ("foreign", True, "skip"),
    ],
)
def test_restore_action_of_a_verdict(
    status: verdict_mod.Status, ours: bool, expected: verdict_mod.Action
) -> None:
    assert verdict_mod.action(status, ours=ours) == expected


def test_what_happens_when_no_copy_loads() -> None:
    skipped = [(8, "local corrupt"), (6, "s3 incomplete")]
    explicit = verdict_mod.give_up(skipped, explicit=True, target=8)
    assert isinstance(explicit, errors.ConfigurationError) and "step 8" in str(explicit)
    by_uri = verdict_mod.give_up([], explicit=True, target="s3://b/p")
    assert isinstance(by_uri, errors.ConfigurationError) and "s3://b/p" in str(by_uri)
    failed = verdict_mod.give_up(skipped, explicit=False, target=None)
    assert type(failed) is errors.CheckpointError and "step 6: s3 incomplete" in str(failed)
    assert verdict_mod.give_up([], explicit=False, target=None) is None  # fresh start


class _PerRank:
    cairn_per_rank = True

    def __init__(self) -> None:
        self.value = {"seed": torch.tensor([7])}

    def state_dict(self) -> dict[str, typing.Any]:
        return dict(self.value)

    def load_state_dict(self, sd: dict[str, typing.Any]) -> None:
        self.value = dict(sd)


class _Plain:
    def __init__(self) -> None:
        self.value = {"w": torch.arange(4.0), "lr": 0.5}

    def state_dict(self) -> dict[str, typing.Any]:
        return dict(self.value)

    def load_state_dict(self, sd: dict[str, typing.Any]) -> None:
        self.value = dict(sd)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_node_local_rank_reads_only_its_own_part(tmp_path: pathlib.Path) -> None:
    """Rank 1 of a node-local pair loads its per-rank object and no replicated
    entry (those come from rank 0); the files a load reads come from .metadata."""
    objects: dict[str, typing.Any] = {"plain": _Plain(), "rng": _PerRank()}
    tmpl = load.template(objects, rank=1, same_world=True)
    assert load.own_part(tmpl, rank=0, node_local=True) == tmpl.dicts
    assert set(load.own_part(tmpl, rank=1, node_local=True)) == {"rng/rank-1.seed"}
    assert load.own_part(tmpl, rank=1, node_local=False) == tmpl.dicts

    state_dict_saver.save(
        {"plain": _Plain().state_dict(), "rng/rank-1": _PerRank().state_dict()},
        checkpoint_id=tmp_path,
        no_dist=True,
    )
    meta = load.read_metadata(tmp_path)
    assert load.needed_files(meta, tmpl.dicts) == {"__0_0.distcp"}
    with pytest.raises(errors.CheckpointError, match="does not fit"):
        load.needed_files(meta, {"other": {"x": torch.zeros(1)}})


def test_a_node_local_merge_keeps_containers_without_leaves() -> None:
    """A LambdaLR of `functools.partial`s (every Transformers scheduler) has
    `lr_lambdas: [{}, {}]`: flattening drops it, and its `load_state_dict`
    needs it; the merge into the template keeps it and takes every loaded leaf."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, [functools.partial(_halved, 1), functools.partial(_halved, 2)]
    )
    dicts: dict[str, typing.Any] = {"lr_scheduler": scheduler.state_dict()}
    assert dicts["lr_scheduler"]["lr_lambdas"] == [{}, {}]
    flat, mapping = flatten_state_dict(dicts)
    assert "lr_scheduler.lr_lambdas" not in flat
    loaded = {**flat, "lr_scheduler.last_epoch": 10, "lr_scheduler._step_count": 11}

    merged = load.into_template(dicts, loaded, mapping)

    assert merged["lr_scheduler"]["lr_lambdas"] == [{}, {}]
    assert merged["lr_scheduler"]["last_epoch"] == 10
    scheduler.load_state_dict(merged["lr_scheduler"])
    assert scheduler.last_epoch == 10


def _halved(scale: int, step: int) -> float:
    return 0.5**step / scale
