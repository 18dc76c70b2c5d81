"""python -m cluster certs DIR [--worker-host NAME ...] [--attention-host NAME ...]

Makes what mutual TLS between the pools needs, with the `cryptography` library:

    ca.crt          the cluster's CA certificate                       every host
    ca.key          the CA's private key (signs new certificates)      no host: keep it offline
    worker.crt/.key the expert workers' certificate (server, and client   pool B
                    for the worker host's own health probe)
    attention.crt/.key  the attention node's client certificate      pool A
    token           a random shared token, checked per call           every host

File names are fixed (protos/security.py reads them), so `--tls-dir DIR` is the one flag both
services need; a host gets a copy of DIR without the keys it has no use for. The workers'
certificate names expert-0 .. expert-7, localhost and 127.0.0.1, plus every --worker-host.
Keys and the token are written 0600, the rest 0644. An existing file is never overwritten.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protos import security

VALID_DAYS = 825  # the longest server-certificate life common TLS clients accept
DEFAULT_WORKER_NAMES = (*(f"expert-{i}" for i in range(8)), "localhost", "127.0.0.1")
DEFAULT_ATTENTION_NAMES = ("attention", "localhost", "127.0.0.1")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hetero-moe"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])  # fmt: skip


def _alt_names(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # hosts' clocks drift
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))  # fmt: skip


def _leaf(ca_key, ca_cert: x509.Certificate, common_name: str, names: list[str],
          usages: list[x509.ObjectIdentifier]) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:  # fmt: skip
    key = _key()
    cert = (_builder(_name(common_name), ca_cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(_alt_names(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    return key, cert


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)  # never widen, never overwrite
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # O_CREAT's mode is masked by the umask


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def make_certs(directory: Path, worker_hosts: list[str] = (), attention_hosts: list[str] = ()) -> Path:
    """A new CA, the workers' and the attention node's certificates and a token in `directory`
    (created; it must not hold any of these files yet). Returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    if existing := [n for n in (*security.FILES, security.CA_KEY) if (directory / n).exists()]:
        raise FileExistsError(f"{directory} already holds {existing}; use another directory")
    ca_key = _key()
    ca_name = _name("hetero-moe cluster CA")
    ca_cert = (_builder(ca_name, ca_name, ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, key_encipherment=False, content_commitment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))  # fmt: skip
    # The workers' certificate is a client one too: a worker host's health probe presents it.
    worker_key, worker_cert = _leaf(ca_key, ca_cert, "hetero-moe expert worker",
                                    [*DEFAULT_WORKER_NAMES, *worker_hosts],
                                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])  # fmt: skip
    attention_key, attention_cert = _leaf(ca_key, ca_cert, "hetero-moe attention node",
                                          [*DEFAULT_ATTENTION_NAMES, *attention_hosts],
                                          [ExtendedKeyUsageOID.CLIENT_AUTH])  # fmt: skip
    pem = serialization.Encoding.PEM
    _write(directory / security.CA_KEY, _key_pem(ca_key), 0o600)
    _write(directory / security.CA_CERT, ca_cert.public_bytes(pem), 0o644)
    _write(directory / security.WORKER_KEY, _key_pem(worker_key), 0o600)
    _write(directory / security.WORKER_CERT, worker_cert.public_bytes(pem), 0o644)
    _write(directory / security.ATTENTION_KEY, _key_pem(attention_key), 0o600)
    _write(directory / security.ATTENTION_CERT, attention_cert.public_bytes(pem), 0o644)
    _write(directory / security.TOKEN, secrets.token_urlsafe(32).encode() + b"\n", 0o600)
    return directory


def has_certs(directory: Path) -> bool:
    """True when `directory` holds every file nodes read (made earlier)."""
    return all((directory / name).is_file() for name in security.FILES)


def reuse_or_make(directory: Path) -> Path:
    """`directory` when it holds every file nodes read (made earlier), else a new set made there."""
    if not has_certs(directory):
        make_certs(directory)
    return directory
