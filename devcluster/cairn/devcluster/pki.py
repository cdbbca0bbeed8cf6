"""Certificates and keys for the devcluster, made with `cryptography`.

One CA signs every serving and client certificate, exactly as kubeadm lays a
cluster out: the apiserver's serving certificate, the kubelet (node agent)
serving certificate, client certificates for the admin, the controller
manager, the scheduler and the apiserver's kubelet client, plus the
ServiceAccount token signing key pair. Files are created once and reused, so
`up` after `down` keeps kubeconfigs that users already copied valid.
"""

import dataclasses
import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=3650)
APISERVER_IPS = ("127.0.0.1", "10.244.0.1", "10.96.0.1")
APISERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
KUBELET_IPS = ("127.0.0.1", "10.244.0.1")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClientIdentity:
    """A client certificate's user (CN) and groups (O)."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = ClientIdentity(file_stem="admin", user="kubernetes-admin", groups=("system:masters",))
CONTROLLER_MANAGER = ClientIdentity(
    file_stem="controller-manager", user="system:kube-controller-manager"
)
SCHEDULER = ClientIdentity(file_stem="scheduler", user="system:kube-scheduler")
APISERVER_KUBELET_CLIENT = ClientIdentity(
    file_stem="apiserver-kubelet-client",
    user="kube-apiserver-kubelet-client",
)
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, APISERVER_KUBELET_CLIENT)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: pathlib.Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, groups: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _load_ca(pki: pathlib.Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError("ca.key is not an EC key")
    return cert, key


def _ensure_ca(pki: pathlib.Path) -> None:
    if (pki / "ca.crt").exists() and (pki / "ca.key").exists():
        return
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    name = _name("cairn-devcluster-ca")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(pki / "ca.key", key)
    (pki / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    *,
    pki: pathlib.Path,
    stem: str,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
) -> None:
    if (pki / f"{stem}.crt").exists() and (pki / f"{stem}.key").exists():
        return
    ca_cert, ca_key = _load_ca(pki)
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if dns or ips:
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(pki / f"{stem}.key", key)
    (pki / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _ensure_service_account_keys(pki: pathlib.Path) -> None:
    if (pki / "sa.key").exists() and (pki / "sa.pub").exists():
        return
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki / "sa.key", key)
    (pki / "sa.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def ensure(pki: pathlib.Path) -> None:
    """Create whatever of the cluster's key material is missing under `pki`."""
    pki.mkdir(parents=True, exist_ok=True)
    pki.chmod(0o700)
    _ensure_ca(pki)
    _issue(
        pki=pki,
        stem="apiserver",
        subject=_name("kube-apiserver"),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        dns=APISERVER_DNS,
        ips=APISERVER_IPS,
    )
    _issue(
        pki=pki,
        stem="kubelet",
        subject=_name("cairn-node-agent"),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        dns=("localhost",),
        ips=KUBELET_IPS,
    )
    for client in CLIENTS:
        _issue(
            pki=pki,
            stem=client.file_stem,
            subject=_name(client.user, client.groups),
            usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        )
    _ensure_service_account_keys(pki)


def ensure_serving(
    pki: pathlib.Path, *, stem: str, common_name: str, ips: tuple[str, ...], dns: tuple[str, ...]
) -> None:
    """A serving certificate `<stem>.crt`/`.key` signed by the cluster's CA, once.

    For servers the API server calls (Kueue's webhook on loopback): the CA is
    the caBundle the webhook configurations name, so nothing else is trusted.
    """
    ensure(pki)
    _issue(
        pki=pki,
        stem=stem,
        subject=_name(common_name),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        dns=dns,
        ips=ips,
    )
