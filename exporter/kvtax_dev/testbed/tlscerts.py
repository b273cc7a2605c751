"""Throwaway certificates for tests of ``--web.config.file``: a CA, a server and a client.

Made with the ``openssl`` command line (Debian's ``openssl`` package), EC P-256 keys, valid for
one day, the server's for ``127.0.0.1`` and ``localhost``. Nothing here is a secret: the folder
is a test's temporary directory.

Example::

    certs = make_certs(tmp_path)
    requests.get(url, verify=str(certs.ca), cert=(str(certs.client_cert), str(certs.client_key)))
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certs", "make_certs"]


@dataclass(frozen=True, slots=True)
class Certs:
    """Paths of the files :func:`make_certs` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl") or "/usr/bin/openssl"
    subprocess.run([binary, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(name: str, subject: str, extensions: str, folder: Path) -> None:
    """``name.key`` and ``name.crt``, signed by ``ca.crt`` with the given v3 extensions."""
    _openssl(
        "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=folder
    )
    _openssl(
        "req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=folder
    )
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-sha256", "-extfile", f"{name}.ext",
        "-out", f"{name}.crt",
        cwd=folder,
    )  # fmt: skip


def make_certs(folder: Path) -> Certs:
    """Write a CA, a server certificate for 127.0.0.1 and a client certificate into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=folder)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kvtax test CA", "-days", "1",
        "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", "ca.crt",
        cwd=folder,
    )  # fmt: skip
    _signed(
        "server",
        "/CN=127.0.0.1",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        folder,
    )
    _signed("client", "/CN=prometheus", "extendedKeyUsage=clientAuth\n", folder)
    return Certs(
        ca=folder / "ca.crt",
        server_cert=folder / "server.crt",
        server_key=folder / "server.key",
        client_cert=folder / "client.crt",
        client_key=folder / "client.key",
    )
