"""Key material and configuration the devcluster generates.

Covers: the apiserver certificate names every address clients and pods use,
client certificates carry the user and groups RBAC expects, material is
created once and reused, kubeconfigs point at the CA and client pair, and the
S3 identity file grants exactly one identity.
"""

import ipaddress
import pathlib

import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from cairn.devcluster import controlplane, pki, s3


def _cert(path: pathlib.Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_apiserver_certificate_names_every_address(tmp_path: pathlib.Path) -> None:
    pki.ensure(tmp_path)
    san = _cert(tmp_path / "apiserver.crt").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    ips = {str(ip) for ip in san.value.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "10.244.0.1", "10.96.0.1"} <= ips
    assert "kubernetes.default.svc.cluster.local" in san.value.get_values_for_type(x509.DNSName)
    assert all(isinstance(ipaddress.ip_address(ip), ipaddress.IPv4Address) for ip in ips)


def test_admin_certificate_is_in_system_masters(tmp_path: pathlib.Path) -> None:
    pki.ensure(tmp_path)
    subject = _cert(tmp_path / "admin.crt").subject
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "kubernetes-admin"
    orgs = [a.value for a in subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert orgs == ["system:masters"]


def test_material_is_created_once(tmp_path: pathlib.Path) -> None:
    pki.ensure(tmp_path)
    first = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "sa.key").read_bytes()
    pki.ensure(tmp_path)
    assert ((tmp_path / "ca.crt").read_bytes(), (tmp_path / "sa.key").read_bytes()) == first
    assert (tmp_path / "ca.key").stat().st_mode & 0o077 == 0


def test_kubeconfig_points_at_ca_and_client_pair(tmp_path: pathlib.Path) -> None:
    doc = yaml.safe_load(
        controlplane.kubeconfig(
            server="https://127.0.0.1:6443", pki=tmp_path, client_stem="admin", user="admin"
        )
    )
    assert doc["clusters"][0]["cluster"]["certificate-authority"] == str(tmp_path / "ca.crt")
    assert doc["users"][0]["user"]["client-key"] == str(tmp_path / "admin.key")
    assert doc["current-context"] == "devcluster"


def test_s3_identities_grant_one_identity() -> None:
    creds = s3.S3Credentials(access_key="AK", secret_key="SK")
    config = s3.identities_config(creds)
    assert config == {
        "identities": [
            {
                "name": "cairn",
                "credentials": [{"accessKey": "AK", "secretKey": "SK"}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
