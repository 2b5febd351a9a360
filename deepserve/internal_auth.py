"""The internal plane's credential: one shared secret between gateway, routers and workers.

Every router and worker route except the bare liveness probe (``GET /health``) requires
``Authorization: Bearer <token>``; ``deepserve up`` generates a token for the processes it
starts, separate services are given one with ``--internal-token`` / ``--internal-token-file`` or
the environment (``DEEPSERVE_INTERNAL_TOKEN``, ``DEEPSERVE_INTERNAL_TOKEN_FILE``, read here and
nowhere else; a flag wins over the environment, a value over a file). A router or worker bound
beyond loopback refuses to start without one (``check_bind``); on loopback, no token means the
plane is open, which is logged. The optional mutual TLS of the plane (``deepserve.internal_tls``)
travels with the token: ``InternalAuth.tls``, set by the same flags' sub-command and environment.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deepserve import internal_tls
from deepserve.internal_tls import InternalTLS

log = logging.getLogger(__name__)

ENV_TOKEN = "DEEPSERVE_INTERNAL_TOKEN"
ENV_TOKEN_FILE = "DEEPSERVE_INTERNAL_TOKEN_FILE"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether a listen address only accepts connections from this host."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class InternalAuth:
    """The shared token ("" = the plane is open; ``allows`` compares in constant time) and the
    plane's TLS files (``tls``; off by default)."""

    token: str = ""
    tls: InternalTLS = InternalTLS()

    def __post_init__(self) -> None:
        if self.token != self.token.strip() or any(c in self.token for c in "\r\n"):
            raise ValueError("the internal token must be one line without surrounding blanks")

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    @classmethod
    def resolve(cls, token: str | None = None, token_file: str | None = None, env: Mapping[str, str] | None = None,
                tls: InternalTLS | None = None) -> InternalAuth:
        """From a flag value, a flag's file, ``DEEPSERVE_INTERNAL_TOKEN``, then
        ``DEEPSERVE_INTERNAL_TOKEN_FILE`` (the first one given); ``tls``: default from ``env``."""
        env = os.environ if env is None else env
        tls = InternalTLS.resolve(env=env) if tls is None else tls
        if token:
            return cls(token.strip(), tls)
        if token_file:
            return cls.read(token_file, tls)
        if env.get(ENV_TOKEN):
            return cls(env[ENV_TOKEN].strip(), tls)
        if env.get(ENV_TOKEN_FILE):
            return cls.read(env[ENV_TOKEN_FILE], tls)
        return cls(tls=tls)

    @classmethod
    def read(cls, path: str, tls: InternalTLS = InternalTLS()) -> InternalAuth:
        """The token in the file ``path`` (``SystemExit`` if unreadable or empty)."""
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise SystemExit(f"cannot read the internal token file {path}: {exc}") from None
        if not text:
            raise SystemExit(f"the internal token file {path} is empty")
        return cls(text, tls)

    @property
    def client_ssl(self) -> ssl.SSLContext | None:
        """What an internal caller connects with (None: plain TCP)."""
        return self.tls.client_context

    @property
    def server_ssl(self) -> ssl.SSLContext | None:
        """What an internal listener serves with (None: plain TCP)."""
        return self.tls.server_context

    def headers(self) -> dict[str, str]:
        """What a client sends (empty when the plane is open)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether a request's ``Authorization`` header value carries the token."""
        if not self.token:
            return True
        if authorization is None:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        return hmac.compare_digest(authorization.strip(), b"Bearer " + self.token.encode())

    def check_bind(self, host: str, what: str) -> None:
        """Refuse (``SystemExit``) to serve ``what`` beyond loopback without a token."""
        if self.token:
            return
        if not is_loopback(host):
            raise SystemExit(
                f"{what}: refusing to listen on {host} without an internal token "
                f"(--internal-token, --internal-token-file, {ENV_TOKEN} or {ENV_TOKEN_FILE})"
            )
        log.warning("%s: no internal token; the internal routes are open to any local process", what)


def add_flags(parser: argparse.ArgumentParser, *, metrics: bool = False) -> None:
    """``--internal-token`` / ``--internal-token-file``, the TLS flags (``deepserve.internal_tls``)
    and ``--open-metrics`` when asked, on a sub-command."""
    parser.add_argument("--internal-token", metavar="TOKEN", help=f"the internal plane's shared secret ({ENV_TOKEN}); prefer a file")
    parser.add_argument("--internal-token-file", metavar="PATH", help=f"a file holding it ({ENV_TOKEN_FILE}), e.g. a mounted Secret")
    if metrics:
        parser.add_argument("--open-metrics", action="store_true", help="serve /metrics without the internal token")
    internal_tls.add_flags(parser)


def from_args(args: argparse.Namespace) -> InternalAuth:
    """The credential the parsed ``add_flags`` arguments (then the environment) give."""
    return InternalAuth.resolve(args.internal_token, args.internal_token_file, tls=internal_tls.from_args(args))


def write_token_file(path: Path) -> bool:
    """Write a fresh token to ``path`` (mode 0600, parent 0700 if made) unless it already holds
    one; True when written. For a one-shot init step that the services' token files read."""
    if path.is_file() and path.read_text().strip():
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(generate_token() + "\n")
    return True


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``deepserve make-internal-token --out PATH``."""
    p = subparsers.add_parser("make-internal-token", help="write a fresh internal token to a file unless it holds one")
    p.add_argument("--out", required=True, type=Path, help="the token file (mode 0600)")
    p.set_defaults(func=lambda args: print(("wrote " if write_token_file(args.out) else "kept ") + str(args.out)) or 0)
