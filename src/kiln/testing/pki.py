"""Throwaway certificates for TLS tests, made with the openssl command line."""

from __future__ import annotations

import subprocess
from pathlib import Path

_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
_LEAF = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
         "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")


def make_pki(folder: Path) -> Path:
    """In ``folder``: ca.pem/key; server.pem/key for 127.0.0.1 and localhost and client.pem/key from that CA;
    stranger.pem/key from another CA (other-ca). Returns ``folder``."""
    _authority(folder, "ca")
    _authority(folder, "other-ca")
    _leaf(folder, "server", "ca", "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(folder, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(folder, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    return folder


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def _authority(folder: Path, name: str) -> None:
    _openssl(folder, "req", "-x509", *_EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def _leaf(folder: Path, name: str, authority: str, usage: str) -> None:
    _openssl(folder, "req", *_EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (folder / f"{name}.ext").write_text(_LEAF + usage)
    _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{authority}.pem", "-CAkey", f"{authority}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
