"""The env the operator builds for a pod is exactly what the trainer parses.

Covers: for each example TrainingJob, the operator's pod builder's env is
resolved the way the node agent (a kubelet) resolves it, and
`runtime_config.from_env` turns it into the checkpoint options, resume
target and reporting settings the spec asked for — so the two sides of the
contract cannot drift apart unnoticed. The manifest keyring file the env
names is the pod's Secret volume (here: a file standing in for the mounted
Secret, at the path the mount maps to); the trainer reads that keyring.
"""

import pathlib

import pytest
import yaml

from cairn.api import manifest, podenv, trainingjob
from cairn.checkpoint import runtime_config
from cairn.devcluster.agent import podspec
from cairn.operator.core import builders

EXAMPLES = sorted(
    p
    for p in (pathlib.Path(__file__).resolve().parents[3] / "examples").glob("*.yaml")
    if yaml.safe_load(p.read_text()).get("kind") == "TrainingJob"
)


def _job(path: pathlib.Path) -> trainingjob.TrainingJob:
    raw = yaml.safe_load(path.read_text())
    raw["metadata"].setdefault("namespace", "team-a")
    raw["metadata"]["uid"] = "0000-uid"
    return trainingjob.TrainingJob.model_validate(raw)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("rank", [0, 1])
def test_operator_env_parses_into_the_spec(
    path: pathlib.Path, rank: int, tmp_path: pathlib.Path
) -> None:
    job = _job(path)
    if rank >= job.spec.nodes:
        pytest.skip("single-node job")
    resume = podenv.ResumeTarget(kind="step", step=40)
    pod = builders.pod(job, attempt=3, rank=rank, resume=resume)
    container = pod["spec"]["containers"][0]
    upload = job.spec.checkpoint.upload
    secrets = {}
    if upload is not None and upload.credentials_secret_ref is not None:
        ref = upload.credentials_secret_ref
        secrets[("team-a", ref.name)] = {
            ref.access_key_id_key: "AKIA-test",
            ref.secret_access_key_key: "secret-test",
        }
    env = podspec.container_env(
        pod=dict(pod),
        container=dict(container),
        pod_ip="10.244.1.9",
        host_ip="127.0.0.1",
        secrets=secrets,
        config_maps={},
        base={},
    )
    # The Secret volume mounted at MANIFEST_KEY_DIR: its file, as the agent writes it.
    ring = manifest.Keyring(current="k1", keys={"k1": bytes(range(32))})
    keyring_path = pathlib.PurePosixPath(env[podenv.MANIFEST_KEYRING])
    assert keyring_path.parent == pathlib.PurePosixPath(podenv.MANIFEST_KEY_DIR)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == podenv.MANIFEST_KEY_DIR]
    assert mount.get("readOnly") is True
    mounted = tmp_path / keyring_path.name  # tmp_path stands for the mounted volume
    mounted.write_bytes(manifest.dump_keyring(ring))
    env[podenv.MANIFEST_KEYRING] = str(mounted)
    if container["command"][0] == "torchrun":
        env[podenv.LOCAL_RANK] = "0"  # torchrun sets it in each process it starts
    cfg = runtime_config.from_env(env)
    assert cfg.checkpoint.manifest_keyring == ring
    spec = job.spec.checkpoint
    assert cfg.job_name == job.metadata.name
    assert cfg.namespace == "team-a"
    assert cfg.attempt == 3
    assert cfg.node_rank == rank
    assert cfg.resume == resume
    assert cfg.report_status is (rank == 0)
    assert cfg.checkpoint.directory == pathlib.Path(spec.mount_path)
    assert cfg.checkpoint.interval_steps == spec.interval_steps
    assert cfg.checkpoint.interval_seconds == spec.interval_seconds
    assert cfg.checkpoint.keep_last == spec.retention.local.keep_last
    assert cfg.checkpoint.max_bytes == spec.retention.local.max_bytes
    assert cfg.checkpoint.attempt == 3
    assert cfg.checkpoint.async_mode == spec.async_mode
    assert cfg.checkpoint.final_grace_seconds == spec.final_checkpoint_grace_seconds
    assert cfg.status_interval_seconds == spec.status_interval_seconds
    if upload is None:
        assert cfg.checkpoint.s3 is None
    else:
        assert cfg.checkpoint.s3 is not None
        assert cfg.checkpoint.s3.uri == upload.uri
        assert cfg.checkpoint.s3.endpoint_url == upload.endpoint
        assert cfg.checkpoint.s3.concurrency == upload.concurrency
        assert cfg.checkpoint.s3.stall_seconds == upload.stall_seconds
        assert cfg.checkpoint.upload_on_failure == upload.on_failure
        if upload.credentials_secret_ref is not None:
            assert env[podenv.AWS_ACCESS_KEY_ID] == "AKIA-test"
    assert env[podenv.WORLD_SIZE] == str(job.spec.nodes * job.spec.procs_per_node)


def test_malformed_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="CAIRN_CHECKPOINT_INTERVAL_STEPS"):
        runtime_config.from_env({podenv.CHECKPOINT_INTERVAL_STEPS: "five"})
    with pytest.raises(ValueError, match="CAIRN_RESUME_FROM"):
        runtime_config.from_env({podenv.RESUME_FROM: "yesterday"})
    with pytest.raises(ValueError, match="CAIRN_ASYNC_MODE"):
        runtime_config.from_env({podenv.ASYNC_MODE: "sometimes"})
    with pytest.raises(ValueError, match="CAIRN_UPLOAD_ON_FAILURE"):
        runtime_config.from_env({podenv.UPLOAD_ON_FAILURE: "Ignore"})


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        ({podenv.NPROC_PER_NODE: "2"}, True),
        ({podenv.NPROC_PER_NODE: "2", podenv.RUNTIME: "torchrun"}, True),
        ({podenv.NPROC_PER_NODE: "2", podenv.LOCAL_RANK: "1"}, False),
        ({podenv.NPROC_PER_NODE: "1"}, False),
        ({}, False),
        ({podenv.NPROC_PER_NODE: "4", podenv.RUNTIME: "ray"}, False),
    ],
    ids=["no-launcher", "no-launcher-torchrun", "under-torchrun", "one-proc", "local-run", "ray"],
)
def test_several_procs_per_pod_without_a_launcher_are_refused(
    env: dict[str, str], refused: bool
) -> None:
    """procsPerNode > 1 with `python train.py` would wait forever for ranks nobody
    starts; from_env refuses it with the fix in the message instead."""
    if refused:
        with pytest.raises(ValueError, match=r"torchrun -m your\.module") as info:
            runtime_config.from_env(env)
        assert "procsPerNode is" in str(info.value)
    else:
        runtime_config.from_env(env)
