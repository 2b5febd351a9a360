"""Optional mutual TLS on the internal plane (gateway, routers, workers).

With a CA, a certificate and its key (``--internal-tls-ca`` / ``--internal-tls-cert`` /
``--internal-tls-key``, or ``DEEPSERVE_INTERNAL_TLS_CA`` / ``_CERT`` / ``_KEY``, read here and nowhere
else; a flag wins), every worker and router service listens on TLS and requires a client
certificate signed by that CA, and every internal caller (the gateway, a router, a worker
registering, ``deepserve up``'s health checks) presents its own and checks the server's against the
CA, host name included. URLs on the plane are then ``https://``. One certificate per process may
serve both ends (extended key usage ``serverAuth, clientAuth``). The token
(``deepserve.internal_auth``) is still required on top: TLS says which machines may talk, the token
which callers may act.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

ENV_PREFIX = "DEEPSERVE_INTERNAL_TLS_"
_PARTS = ("ca", "cert", "key")


@dataclass(frozen=True)
class InternalTLS:
    """The plane's TLS files (all three, or none: TLS off)."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        given = [p for p in _PARTS if getattr(self, p)]
        if given and len(given) != len(_PARTS):
            missing = ", ".join(f"--internal-tls-{p}" for p in _PARTS if p not in given)
            raise SystemExit(f"internal TLS needs a CA, a certificate and its key: {missing} missing")
        for part in given:
            if not Path(getattr(self, part)).is_file():
                raise SystemExit(f"internal TLS: the {part} file {getattr(self, part)} does not exist")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def scheme(self) -> str:
        """The internal URLs' scheme."""
        return "https" if self.enabled else "http"

    @classmethod
    def resolve(cls, ca: str | None = None, cert: str | None = None, key: str | None = None,
                env: Mapping[str, str] | None = None) -> InternalTLS:
        """Each file from its flag, else from ``DEEPSERVE_INTERNAL_TLS_<CA|CERT|KEY>``."""
        env = os.environ if env is None else env
        flags = {"ca": ca, "cert": cert, "key": key}
        return cls(**{p: flags[p] or env.get(ENV_PREFIX + p.upper(), "") for p in _PARTS})

    def env(self) -> dict[str, str]:
        """The variables that give a child process these files."""
        return {ENV_PREFIX + p.upper(): getattr(self, p) for p in _PARTS} if self.enabled else {}

    @cached_property
    def server_context(self) -> ssl.SSLContext | None:
        """For a listening socket: our certificate, client certificates required (None: plain)."""
        if not self.enabled:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    @cached_property
    def client_context(self) -> ssl.SSLContext | None:
        """For a caller: the server checked against the CA, our certificate presented (None: plain)."""
        if not self.enabled:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--internal-tls-ca`` / ``--internal-tls-cert`` / ``--internal-tls-key`` on a sub-command."""
    for part, what in (("ca", "the CA that signs the plane's certificates"), ("cert", "this process's certificate (PEM)"),
                       ("key", "its private key (PEM)")):
        parser.add_argument(f"--internal-tls-{part}", metavar="PATH", help=f"mTLS: {what} ({ENV_PREFIX}{part.upper()})")


def from_args(args: argparse.Namespace) -> InternalTLS:
    return InternalTLS.resolve(args.internal_tls_ca, args.internal_tls_cert, args.internal_tls_key)
