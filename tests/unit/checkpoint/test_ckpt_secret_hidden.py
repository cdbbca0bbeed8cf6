"""Objects that carry S3 credentials never print the secret key.

Covers, for ``S3Options`` (trainer), the ``CheckpointOptions`` holding it, the
trainer's and the operator's boto3 clients built from a key pair and the
operator's client cache: ``repr``, ``str``, ``format`` (f-strings), ``%s``/``%r``
log lines and a validation error's message never contain the secret key; the
secret is still what the client signs with (hiding it broke nothing).
"""

import dataclasses
import logging
import pathlib
import typing

import pytest

from cairn.api import checkpointspec
from cairn.checkpoint import options, s3transport
from cairn.operator import s3observe

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
ACCESS = "AKIAEXAMPLEACCESS"


def _s3() -> options.S3Options:
    return options.S3Options(
        uri="s3://bucket/runs/a",
        endpoint_url="http://127.0.0.1:1",
        access_key=ACCESS,
        secret_key=SECRET,
    )


def _printed(thing: object) -> list[str]:
    return [repr(thing), str(thing), f"{thing}", f"{thing!r}", format(thing)]


def test_s3options_repr_str_format_hide_the_secret() -> None:
    opts = _s3()
    for text in _printed(opts):
        assert SECRET not in text
        assert "s3://bucket/runs/a" in text  # the rest is still there to debug with


def test_checkpoint_options_holding_s3_hide_the_secret(tmp_path: pathlib.Path) -> None:
    holder = options.CheckpointOptions(directory=tmp_path, s3=_s3())
    for text in _printed(holder):
        assert SECRET not in text
        assert "S3Options(" in text


def test_log_lines_of_s3options_hide_the_secret(caplog: pytest.LogCaptureFixture) -> None:
    opts = _s3()
    logger = logging.getLogger("cairn.test.secret")
    with caplog.at_level(logging.DEBUG, logger="cairn.test.secret"):
        logger.info("options %s", opts)
        logger.info("options %r", opts)
        logger.info("nested %s", {"s3": opts})
    assert len(caplog.records) == 3
    assert SECRET not in caplog.text


def test_validation_error_of_s3options_hides_the_secret() -> None:
    with pytest.raises(ValueError) as raised:
        options.S3Options(uri="not-s3", access_key=ACCESS, secret_key=SECRET)
    assert SECRET not in str(raised.value) and SECRET not in repr(raised.value)
    with pytest.raises(ValueError) as unpaired:
        options.S3Options(uri="s3://bucket/a", secret_key=SECRET)
    assert SECRET not in str(unpaired.value)


def test_replaced_s3options_keep_the_secret_for_the_client() -> None:
    opts = dataclasses.replace(_s3(), concurrency=2)
    assert opts.secret_key == SECRET
    client: typing.Any = s3transport.make_client(opts)
    assert client._request_signer._credentials.secret_key == SECRET


def test_trainer_s3_client_repr_hides_the_secret() -> None:
    client = s3transport.make_client(_s3())
    for text in _printed(client):
        assert SECRET not in text


def test_operator_client_and_cache_hide_the_secret() -> None:
    upload = checkpointspec.UploadSpec(uri="s3://bucket/runs/a", endpoint="http://127.0.0.1:1")
    cache = s3observe.ClientCache(limit=4)
    client = cache.get(upload, access_key=ACCESS, secret_key=SECRET)
    key = s3observe.client_key(upload, access_key=ACCESS, secret_key=SECRET)
    for text in [*_printed(client), *_printed(cache), *_printed(key)]:
        assert SECRET not in text
