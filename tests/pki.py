"""A throwaway PKI made at test time with `cryptography`: a CA, a server certificate for
127.0.0.1/localhost, client certificates, and the same from a second CA nobody trusts."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path  # the CA that signs everything below
    server_cert: Path
    server_key: Path
    client_cert: Path  # SAN DNS scraper.example
    client_key: Path
    other_client_cert: Path  # from the same CA, SAN DNS intruder.example
    other_client_key: Path
    rogue_ca: Path  # a CA the server does not trust, and a client certificate it signed
    rogue_client_cert: Path
    rogue_client_key: Path
    encrypted_key: Path  # server_key, encrypted with a passphrase


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key, encryption=serialization.NoEncryption()) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    path.chmod(0o600)
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, cn: str, sans: list, usage):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def make_pki(d: Path) -> Pki:
    import ipaddress

    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("gpuwatch test CA")
    rogue_key, rogue_cert = _ca("rogue CA")
    server_key, server_cert = _leaf(ca_key, ca_cert, "gpuwatch test server",
                                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.IPAddress(ipaddress.ip_address("::1"))], ExtendedKeyUsageOID.SERVER_AUTH)
    client_key, client_cert = _leaf(ca_key, ca_cert, "scraper", [x509.DNSName("scraper.example")],
                                    ExtendedKeyUsageOID.CLIENT_AUTH)
    other_key, other_cert = _leaf(ca_key, ca_cert, "intruder", [x509.DNSName("intruder.example")],
                                  ExtendedKeyUsageOID.CLIENT_AUTH)
    rclient_key, rclient_cert = _leaf(rogue_key, rogue_cert, "scraper", [x509.DNSName("scraper.example")],
                                      ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(
        dir=d,
        ca=_write_cert(d / "ca.pem", ca_cert),
        server_cert=_write_cert(d / "server.pem", server_cert),
        server_key=_write_key(d / "server.key", server_key),
        client_cert=_write_cert(d / "client.pem", client_cert),
        client_key=_write_key(d / "client.key", client_key),
        other_client_cert=_write_cert(d / "other-client.pem", other_cert),
        other_client_key=_write_key(d / "other-client.key", other_key),
        rogue_ca=_write_cert(d / "rogue-ca.pem", rogue_cert),
        rogue_client_cert=_write_cert(d / "rogue-client.pem", rclient_cert),
        rogue_client_key=_write_key(d / "rogue-client.key", rclient_key),
        encrypted_key=_write_key(d / "encrypted.key", server_key,
                                 serialization.BestAvailableEncryption(b"passphrase")),
    )
