"""TLS on the HTTP fronts (API server and router), with vLLM's flags and meanings.

    --ssl-keyfile KEY --ssl-certfile CERT            HTTPS
    --ssl-ca-certs CA --ssl-cert-reqs 2              ... and clients must show a certificate
                                                     signed by CA (mutual TLS)

`--ssl-cert-reqs` takes Python's `ssl.VerifyMode` numbers as vLLM does (0 none, the default;
1 optional; 2 required). The router also speaks HTTPS to workers whose URL says `https://`,
verifying them against `--worker-ca-certs` (else the system's roots), and, where workers ask
for client certificates, presents `--worker-certfile`/`--worker-keyfile`.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsConfig:
    """How a front listens: `certfile` + `keyfile` (PEM) make it HTTPS; `ca_certs` and
    `cert_reqs` ask clients for certificates (mutual TLS)."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)

    def __post_init__(self) -> None:
        for flag, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if self.cert_reqs not in (m.value for m in ssl.VerifyMode):
            raise ValueError(f"--ssl-cert-reqs takes 0 (none), 1 (optional) or 2 (required), "
                             f"got {self.cert_reqs}")
        if self.cert_reqs != ssl.CERT_NONE and self.ca_certs is None:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs (the CA client "
                             "certificates must be signed by)")

    def uvicorn_options(self) -> dict[str, object]:
        """uvicorn.Config's keyword arguments for this front."""
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile,
                "ssl_ca_certs": self.ca_certs, "ssl_cert_reqs": self.cert_reqs}


@dataclass(frozen=True)
class WorkerTls:
    """How the router checks HTTPS workers (`ca_certs`: the CA their certificates are signed
    by; None: the system's roots) and the certificate it shows them, if they ask."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    def context(self) -> ssl.SSLContext:
        """A client context that verifies the worker's certificate and host name."""
        ctx = ssl.create_default_context(cafile=self.ca_certs)
        if self.certfile is not None:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        return ctx


def add_tls_args(g: argparse._ArgumentGroup) -> None:
    """vLLM's four TLS flags on a front's command line."""
    g.add_argument("--ssl-keyfile", default=None, metavar="PATH",
                   help="the private key (PEM) of --ssl-certfile: serve HTTPS")
    g.add_argument("--ssl-certfile", default=None, metavar="PATH",
                   help="the certificate chain (PEM) to serve HTTPS with")
    g.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="CA certificates (PEM) that client certificates must chain to")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), metavar="N",
                   help="client certificates: 0 not asked, 1 optional, 2 required "
                        "(mutual TLS; needs --ssl-ca-certs) (default: 0)")


def add_worker_tls_args(g: argparse._ArgumentGroup) -> None:
    """The router's side of HTTPS workers."""
    g.add_argument("--worker-ca-certs", default=None, metavar="PATH",
                   help="CA certificates (PEM) that https:// workers' certificates must chain "
                        "to (default: the system's roots)")
    g.add_argument("--worker-certfile", default=None, metavar="PATH",
                   help="the router's client certificate (PEM) for workers that require one")
    g.add_argument("--worker-keyfile", default=None, metavar="PATH",
                   help="the private key of --worker-certfile")


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """The front's TLS from its flags (None: plain HTTP); ValueError for a half setting."""
    if args.ssl_certfile is None and args.ssl_keyfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and "
                             "--ssl-keyfile")
        return None
    if args.ssl_certfile is None or args.ssl_keyfile is None:
        raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    return TlsConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)


def worker_tls(args: argparse.Namespace) -> WorkerTls:
    if (args.worker_certfile is None) != (args.worker_keyfile is None):
        raise ValueError("--worker-certfile and --worker-keyfile go together")
    for flag, path in (("--worker-ca-certs", args.worker_ca_certs),
                       ("--worker-certfile", args.worker_certfile),
                       ("--worker-keyfile", args.worker_keyfile)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    return WorkerTls(args.worker_ca_certs, args.worker_certfile, args.worker_keyfile)
