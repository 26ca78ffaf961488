"""A throw-away certificate authority made with openssl: a CA, a server and a client certificate,
and a second CA that signed neither (the "wrong CA")."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

# The server certificate names this address only: "localhost" is a host it does not name.
SERVER_HOST = "127.0.0.1"
DAYS = "2"


@dataclass(frozen=True, slots=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    wrong_ca: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def _authority(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl(
        "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", key, "-out", cert, "-days", DAYS, "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-addext", "subjectKeyIdentifier=hash",
    )  # fmt: skip
    return cert, key


def _issue(
    folder: Path, name: str, ca: tuple[Path, Path], extensions: list[str]
) -> tuple[Path, Path]:
    cert, key, request = folder / f"{name}.pem", folder / f"{name}.key", folder / f"{name}.csr"
    config = folder / f"{name}.ext"
    config.write_text(
        "\n".join(
            [
                "basicConstraints=critical,CA:FALSE",
                "keyUsage=critical,digitalSignature",
                "subjectKeyIdentifier=hash",
                "authorityKeyIdentifier=keyid,issuer",
                *extensions,
            ]
        )
        + "\n"
    )
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", request, "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", request, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", cert, "-days", DAYS, "-extfile", config,
    )  # fmt: skip
    return cert, key


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca = _authority(folder, "test-ca")
    server = _issue(
        folder,
        "server",
        ca,
        [f"subjectAltName=IP:{SERVER_HOST}", "extendedKeyUsage=serverAuth"],
    )
    client = _issue(folder, "client", ca, ["extendedKeyUsage=clientAuth"])
    wrong_ca, _ = _authority(folder, "wrong-ca")
    return Pki(ca[0], server[0], server[1], client[0], client[1], wrong_ca)
