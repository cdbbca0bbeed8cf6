"""Every operator API call has a deadline, even against a server that never answers.

Covers `kubeapi.BoundedApiClient` (what `handlers.configure` builds the
operator's `KubeApi` over) against a real TCP listener on loopback that
accepts connections and never sends a byte (a frozen API server, or a
half-open connection): a call without its own `_request_timeout` fails with
a read timeout instead of holding its thread, and a call's own timeout
still wins. The plain `ApiClient` would wait until the connection dies.
"""

import socket
import threading
from collections.abc import Iterator

import pytest
import urllib3
from kubernetes import client

from cairn.operator import kubeapi


@pytest.fixture
def silent_server() -> Iterator[str]:
    """http://127.0.0.1:<port> that accepts and then says nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    listener.close()


def _api(host: str, *, read_seconds: float) -> kubeapi.KubeApi:
    configuration = client.Configuration()
    configuration.host = host
    configuration.retries = urllib3.Retry(total=0)
    return kubeapi.KubeApi.of(
        kubeapi.BoundedApiClient(configuration, connect_seconds=2.0, read_seconds=read_seconds)
    )


def test_a_call_without_its_own_timeout_gets_the_default(silent_server: str) -> None:
    api = _api(silent_server, read_seconds=0.5)
    with pytest.raises(urllib3.exceptions.MaxRetryError) as failed:
        api.core.read_namespaced_secret("x", "default")
    assert isinstance(failed.value.reason, urllib3.exceptions.ReadTimeoutError)


def test_a_call_s_own_timeout_wins(silent_server: str) -> None:
    api = _api(silent_server, read_seconds=3600.0)  # would hang the test: the call's own wins
    with pytest.raises(urllib3.exceptions.MaxRetryError) as failed:
        api.admission.read_validating_admission_policy("x", _request_timeout=0.5)
    assert isinstance(failed.value.reason, urllib3.exceptions.ReadTimeoutError)
