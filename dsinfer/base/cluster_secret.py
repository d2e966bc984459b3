"""The cluster secret and the control plane's CURVE keys derived from it.

Every process of a deployment (gateway, pool launchers, ranks) holds the same secret, from
``--cluster-secret-file`` or ``$DSINFER_CLUSTER_SECRET``; the all-in-one server makes one per run.
The secret itself never travels: each process derives the same CURVE key pairs from it with HKDF
(SHA-256, one label per key), so a peer proves it holds the secret by completing a CURVE
handshake with a key only the secret yields. dsinfer/base/control_auth.py puts them on sockets.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from zmq.utils import z85

SECRET_ENV = "DSINFER_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16
_KDF_LABEL = "dsinfer control plane v1: "


class SecretError(ValueError):
    """No usable cluster secret; the message says where one comes from."""


def generate_secret() -> str:
    return secrets.token_urlsafe(32)


def load_secret(file: str | Path | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The secret of ``file`` (surrounding whitespace dropped), else ``$DSINFER_CLUSTER_SECRET``,
    else None; SecretError for an unreadable file or a secret too short to be one."""
    if file is not None:
        try:
            secret = Path(file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SecretError(f"cannot read --cluster-secret-file {file}: {e.__class__.__name__}") from None
        origin = f"--cluster-secret-file {file}"
    else:
        secret = environ.get(SECRET_ENV, "").strip()
        if not secret:
            return None
        origin = f"${SECRET_ENV}"
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(
            f"the cluster secret from {origin} has {len(secret)} characters; use at least "
            f"{MIN_SECRET_CHARS} random ones (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return secret


def missing_secret_error(what: str) -> SecretError:
    return SecretError(
        f"{what} needs the cluster secret that the gateway and every pool share: "
        f"--cluster-secret-file FILE or ${SECRET_ENV} (e.g. from python3 -c 'import secrets; "
        f"print(secrets.token_urlsafe(32))'); the all-in-one `dsinfer serve` makes its own"
    )


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes = field(repr=False)


@dataclass(frozen=True, repr=False)
class ControlKeys:
    """The control plane's key pairs: one per kind of listening socket, one for every client."""

    gateway: KeyPair  # the gateway's ROUTER (the pools' --gateway-addr)
    inbox: KeyPair  # every rank's inbox (PULL) for messages from peer ranks
    client: KeyPair  # every connecting socket: ranks, heartbeats, launchers, peer ranks

    @classmethod
    def from_secret(cls, secret: str) -> ControlKeys:
        if not zmq.has("curve"):
            raise SecretError(
                f"this pyzmq/libzmq ({zmq.zmq_version()}) has no CURVE security; install a pyzmq "
                "wheel (they bundle libzmq with libsodium)"
            )
        raw = secret.encode()
        return cls(_derive(raw, "gateway"), _derive(raw, "inbox"), _derive(raw, "client"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, what: str = "a rank") -> ControlKeys:
        secret = load_secret(None, environ)
        if secret is None:
            raise missing_secret_error(what)
        return cls.from_secret(secret)

    def __repr__(self) -> str:
        return "ControlKeys(<derived from the cluster secret>)"


def _derive(secret: bytes, label: str) -> KeyPair:
    kdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=(_KDF_LABEL + label).encode())
    secret_key = z85.encode(kdf.derive(secret))
    return KeyPair(zmq.curve_public(secret_key), secret_key)
