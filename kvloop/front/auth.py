"""API keys of the HTTP fronts (the API server and the router): who may call which route.

Every route is one of three kinds:

    public  answers everyone: /health, /ping, /load, /version, /metrics (vLLM's public
            endpoints) and the few read-only routes a front names (they hide private facts
            from callers `AuthConfig.sees_private` refuses);
    admin   changes state (the server's POST /reset_prefix_cache, the router's POST and
            DELETE /workers): needs the --admin-api-key; refused (403) when none is set;
    api     everything else: with --api-key set, one of those keys (or the admin key) must be
            presented, else 401 (as vLLM's AuthenticationMiddleware, which guards every route
            it does not list as public).

A key is presented as `Authorization: Bearer KEY`, or as `x-api-key: KEY` (what Anthropic's
clients send; an Authorization header wins when both come: `presented_authorization`). Keys
are compared as SHA-256 digests with `hmac.compare_digest`, every configured key checked
whatever matched, so the time taken says nothing about the key.
`kvloop.front.guard.AuthMiddleware` applies these rules; its refusals are OpenAI error objects
(Anthropic's on the Messages routes) with a `WWW-Authenticate: Bearer` header.

Private facts (process ids, file paths) go only to a caller `sees_private` admits: one that
presents a configured key (API or admin); with no --api-key, also a caller on this host (a
loopback peer), which can read the same pids and paths with `ps` anyway; never a remote
caller without a key. (A reverse proxy on the same host makes every client a loopback peer:
set --api-key there.)
"""

from __future__ import annotations

import argparse
import enum
import functools
import hashlib
import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

API_KEY_ENV = "VLLM_API_KEY"
# an ASGI scope key set only by the front's own in-process calls (batch lines,
# kvloop/batch/inproc.py): no client can set a scope key, so the key check lets them through
INTERNAL_CALLER_SCOPE = "kvloop.internal_caller"
PUBLIC_PATHS = ("/health", "/ping", "/load", "/version", "/metrics")
WORKER_INFO_PATH = "/kvloop/worker"   # a worker's identity, read by routers; public


class Caller(enum.Enum):
    """What the caller's Authorization header proved."""

    NONE = "no key"
    INVALID = "a key that is not configured"
    API = "an API key"
    ADMIN = "the admin key"


@dataclass(frozen=True)
class AuthConfig:
    """The keys of one front. No key at all: every api route is open (as vLLM without
    --api-key); admin routes stay refused until `admin_api_key` is set."""

    api_keys: tuple[str, ...] = ()
    admin_api_key: str | None = None

    def __post_init__(self) -> None:
        for key in self.api_keys:
            check_key(key)
        if self.admin_api_key is not None:
            check_key(self.admin_api_key)

    @property
    def any_key(self) -> bool:
        return bool(self.api_keys) or self.admin_api_key is not None

    @functools.cached_property
    def _digests(self) -> tuple[bytes | None, tuple[bytes, ...]]:
        """SHA-256 of the admin key and of each API key, computed once, not per request."""
        admin = None if self.admin_api_key is None else _digest(self.admin_api_key)
        return admin, tuple(_digest(key) for key in self.api_keys)

    def identify(self, authorization: str | None) -> Caller:
        """Which configured key (if any) the header presents; constant time in the key."""
        token = bearer_token(authorization)
        if token is None:
            return Caller.NONE
        digest = _digest(token)
        admin, api = self._digests
        if admin is not None and hmac.compare_digest(digest, admin):
            return Caller.ADMIN
        return Caller.API if _matches(digest, api) else Caller.INVALID

    def owner(self, authorization: str | None) -> str | None:
        """Who owns what this caller stores (a stored response): a digest of the configured
        key it presents (API or admin), None for a caller with no configured key (with no
        keys at all every caller is that one owner)."""
        if self.identify(authorization) not in (Caller.API, Caller.ADMIN):
            return None
        token = bearer_token(authorization)
        assert token is not None
        return _digest(token).hex()

    def sees_private(self, authorization: str | None, peer_host: str | None) -> bool:
        """May this caller see process ids and file paths? (See the module docstring.)"""
        if self.identify(authorization) in (Caller.API, Caller.ADMIN):
            return True
        return not self.api_keys and is_loopback(peer_host)


def check_key(key: str) -> None:
    """A key must be something a Bearer header can carry: raises ValueError otherwise."""
    if not key or key != key.strip() or any(c.isspace() for c in key):
        raise ValueError("an API key must be non-empty and contain no spaces")


def bearer_token(authorization: str | None) -> str | None:
    """KEY of `Bearer KEY` (scheme case-insensitive), else None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def presented_authorization(headers: Mapping[str, str]) -> str | None:
    """The Authorization a request presents: its own header, else `Bearer KEY` for an
    `x-api-key: KEY` header (Anthropic's SDK), else None."""
    authorization = headers.get("authorization")
    if authorization is not None:
        return authorization
    key = (headers.get("x-api-key") or "").strip()
    return f"Bearer {key}" if key else None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _matches(digest: bytes, key_digests: Iterable[bytes]) -> bool:
    """Compares with every key (no early exit), in constant time each."""
    found = False
    for key in key_digests:
        found |= hmac.compare_digest(digest, key)
    return found


def is_loopback(host: str | None) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped loopback address; False for anything else."""
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass(frozen=True)
class RouteRules:
    """A front's public paths and its admin routes (method, path)."""

    public: tuple[str, ...] = PUBLIC_PATHS
    admin: frozenset[tuple[str, str]] = frozenset()

    def is_public(self, path: str) -> bool:
        return path in self.public


# --- flags ---------------------------------------------------------------------------------------
def add_auth_args(g: argparse._ArgumentGroup) -> None:
    """--api-key and --admin-api-key (the same flags on `kvloop serve`, `router` and `fleet`)."""
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health, "
                        "/ping, /load, /version and /metrics (repeatable: any of the keys; "
                        f"default: ${API_KEY_ENV})")
    g.add_argument("--admin-api-key", default=None, metavar="KEY",
                   help="the key of the routes that change state (without it they are "
                        "refused)")


def api_keys_from(flag_keys: Sequence[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """--api-key wins over $VLLM_API_KEY, as in vLLM."""
    if flag_keys:
        return tuple(flag_keys)
    env = environ.get(API_KEY_ENV, "")
    return (env,) if env else ()


def auth_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> AuthConfig:
    """Raises ValueError for an empty key."""
    return AuthConfig(api_keys_from(args.api_key, environ), args.admin_api_key)
