"""The fleet secret: one shared key that proves a process belongs to the fleet.

Every member of a fleet (workers, routers, the prefill and decode engines) holds the same
secret, read from a file or an environment variable (never from a command line, where `ps`
shows it: `load_fleet_secret`). Nothing sends the secret itself anywhere; each use derives its
own key from it (`FleetSecret.derive(purpose)`), so a key leaked from one use opens no other:

    signed messages   NATS announcements, withdrawals and event batches carry an HMAC of
                      (subject, reply subject, time, nonce, payload, every other header)
                      in headers (`sign_message`); a router
                      accepts only those `MessageVerifier` admits (right key, fresh, unseen);
    HTTP token        the router proves itself to a worker with `token("internal-http")`, which
                      authorizes the `kv_transfer_params` only a router may send;
    CURVE keys        ZMQ sockets that carry KV or prompts (the KV side channel, the KV-event
                      PUB and replay sockets) are encrypted and authenticated with CURVE keys
                      derived from the secret (`curve_keys`): a peer that cannot derive them
                      cannot complete the handshake, in either direction.

The rules for each use live with the use; this module holds only the derivations.
Importing it loads no zmq.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FLEET_SECRET_ENV = "KVLOOP_FLEET_SECRET"            # the secret itself
FLEET_SECRET_FILE_ENV = "KVLOOP_FLEET_SECRET_FILE"  # a file holding it
MIN_SECRET_CHARS = 16
_DOMAIN = b"kvloop/fleet/v1/"

# Headers of a signed NATS message.
SIG_HEADER = "Kvloop-Sig"
TIME_HEADER = "Kvloop-Time"
NONCE_HEADER = "Kvloop-Nonce"
DEFAULT_WINDOW_S = 60.0          # how old (or how far ahead) a signed message may be
DEFAULT_MAX_NONCES = 200_000     # nonces remembered against replays (LRU)

# Purposes (each use derives its own key).
PURPOSE_BUS = "nats-bus"
PURPOSE_INTERNAL_HTTP = "internal-http"
PURPOSE_KV_SIDE_CHANNEL = "kv-side-channel"
PURPOSE_KV_EVENTS = "kv-events"

INTERNAL_TOKEN_HEADER = "x-kvloop-fleet-token"
ZAP_DOMAIN = "kvloop"   # the ZAP domain of CURVE server sockets


@dataclass(frozen=True, repr=False)
class FleetSecret:
    """The fleet's shared key. `repr` never shows it."""

    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < MIN_SECRET_CHARS:
            raise ValueError(f"a fleet secret must be at least {MIN_SECRET_CHARS} bytes long")

    def __repr__(self) -> str:
        return "FleetSecret(***)"

    @classmethod
    def generate(cls) -> FleetSecret:
        """A fresh random secret (what `kvloop fleet` makes for its members)."""
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_text(cls, text: str) -> FleetSecret:
        """The secret as an environment variable or a file holds it (surrounding blanks
        ignored). ValueError when it is too short."""
        return cls(text.strip().encode())

    def to_text(self) -> str:
        return self.key.decode()

    def derive(self, purpose: str) -> bytes:
        """A 32-byte key for one use: HMAC-SHA256(secret, domain | purpose)."""
        return hmac.new(self.key, _DOMAIN + purpose.encode(), hashlib.sha256).digest()

    def token(self, purpose: str) -> str:
        """A bearer token for one use (hex of its derived key)."""
        return self.derive(purpose).hex()

    def check_token(self, purpose: str, presented: str | None) -> bool:
        """Is `presented` this purpose's token? Constant time."""
        return presented is not None and hmac.compare_digest(
            presented.encode(), self.token(purpose).encode())

    def mac(self, purpose: str, *parts: bytes) -> str:
        """HMAC-SHA256 (hex) of `parts`, each length-prefixed (no two part lists collide)."""
        h = hmac.new(self.derive(purpose), digestmod=hashlib.sha256)
        for part in parts:
            h.update(struct.pack(">Q", len(part)))
            h.update(part)
        return h.hexdigest()

    def curve_keys(self, purpose: str) -> CurveKeys:
        """The CURVE key pairs of one socket kind: every holder derives the same pairs."""
        import zmq  # noqa: PLC0415 (lazy: importing kvloop.trust loads no zmq)
        from zmq.utils import z85  # noqa: PLC0415

        def pair(role: str) -> tuple[bytes, bytes]:
            secret_z85 = z85.encode(self.derive(f"{purpose}/curve-{role}"))
            return zmq.curve_public(secret_z85), secret_z85

        return CurveKeys(*pair("server"), *pair("client"))


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """Z85 CURVE keys: the server's pair and the one client pair every member uses."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return "CurveKeys(***)"

    def make_server(self, sock: Any) -> None:
        """Before bind: `sock` accepts only CURVE clients that know the server key. (Clients
        are further checked by the context's authenticator, `curve_authenticator`.)"""
        import zmq  # noqa: PLC0415

        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())

    def make_client(self, sock: Any) -> None:
        """Before connect: `sock` talks only to a server holding the derived server key."""
        import zmq  # noqa: PLC0415

        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


def curve_authenticator(ctx: Any, keys: list[CurveKeys]) -> Any:
    """Start (and return) a ZAP authenticator on `ctx` admitting only the fleet's client keys
    of `keys`. Stop it with `.stop()` before terminating the context."""
    from zmq.auth.thread import ThreadAuthenticator  # noqa: PLC0415

    allowed = {k.client_public for k in keys}

    class _Fleet:
        def callback(self, domain: str, key: bytes) -> bool:
            return key in allowed

    auth = ThreadAuthenticator(ctx, log=_quiet_logger())
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Fleet())
    return auth


def _quiet_logger() -> Any:
    log = logging.getLogger("kvloop.trust.zap")
    log.setLevel(logging.WARNING)
    return log


# --- signed messages (the NATS bus) ------------------------------------------------------------
_SIGNATURE_HEADERS = frozenset((SIG_HEADER, TIME_HEADER, NONCE_HEADER))


def _message_mac(secret: FleetSecret, subject: str, reply: str, ts: str, nonce: str,
                 payload: bytes, headers: Mapping[str, str]) -> str:
    """The MAC of everything a receiver acts on: subject, reply subject, time, nonce,
    payload and every other header (sorted), each part length-prefixed."""
    covered = sorted((k, v) for k, v in headers.items() if k not in _SIGNATURE_HEADERS)
    parts = [p.encode() for kv in covered for p in kv]
    return secret.mac(PURPOSE_BUS, subject.encode(), reply.encode(), ts.encode(),
                      nonce.encode(), payload, *parts)


def sign_message(secret: FleetSecret, subject: str, payload: bytes, now: float | None = None,
                 headers: Mapping[str, str] | None = None, reply: str = "") -> dict[str, str]:
    """Signature headers proving that a fleet member sent `payload` with `headers` (sent
    beside these) on `subject`, asking for answers on `reply`, at `now`."""
    ts = f"{time.time() if now is None else now:.6f}"
    nonce = secrets.token_hex(12)
    sig = _message_mac(secret, subject, reply, ts, nonce, payload, headers or {})
    return {SIG_HEADER: sig, TIME_HEADER: ts, NONCE_HEADER: nonce}


class MessageVerifier:
    """Admits a signed message once: right key, time within `window_s` of ours, nonce not
    seen in the window. Not thread-safe: one owner (the thread that receives)."""

    def __init__(self, secret: FleetSecret, window_s: float = DEFAULT_WINDOW_S,
                 max_nonces: int = DEFAULT_MAX_NONCES):
        self.secret = secret
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()   # nonce -> its message time

    def refusal(self, subject: str, payload: bytes, headers: Mapping[str, str] | None,
                now: float | None = None, reply: str = "") -> str | None:
        """None when the message is admitted (its nonce is then remembered), else why not."""
        headers = headers or {}
        sig, ts, nonce = (headers.get(h) for h in (SIG_HEADER, TIME_HEADER, NONCE_HEADER))
        if not sig or not ts or not nonce:
            return "unsigned"
        if len(nonce) > 64 or len(ts) > 32:
            return "malformed signature headers"
        expected = _message_mac(self.secret, subject, reply, ts, nonce, payload, headers)
        if not hmac.compare_digest(sig.encode(), expected.encode()):
            return "bad signature"
        now = time.time() if now is None else now
        try:
            sent = float(ts)
        except ValueError:
            return "malformed signature headers"
        if not abs(now - sent) <= self.window_s:
            return f"stale ({now - sent:+.1f}s old)"
        if nonce in self._seen:
            return "replayed"
        self._remember(nonce, sent, now)
        return None

    def _remember(self, nonce: str, sent: float, now: float) -> None:
        self._seen[nonce] = sent
        while self._seen:
            oldest, t = next(iter(self._seen.items()))
            if len(self._seen) <= self.max_nonces and now - t <= self.window_s:
                break
            del self._seen[oldest]


# --- loading ------------------------------------------------------------------------------
def load_fleet_secret(path: str | None = None,
                      environ: Mapping[str, str] = os.environ) -> FleetSecret | None:
    """The secret from `path` (a --fleet-secret-file flag), else from the file named by
    $KVLOOP_FLEET_SECRET_FILE, else from $KVLOOP_FLEET_SECRET; None when none is given.
    ValueError when the file is missing, readable by other users, or the secret too short."""
    path = path or environ.get(FLEET_SECRET_FILE_ENV) or None
    if path is not None:
        return FleetSecret.from_text(_read_secret_file(path))
    text = environ.get(FLEET_SECRET_ENV, "")
    return FleetSecret.from_text(text) if text.strip() else None


def _read_secret_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the fleet secret file {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"the fleet secret file {path} is readable by other users "
                         f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    return text


def add_fleet_secret_arg(g: argparse._ArgumentGroup) -> None:
    """--fleet-secret-file (the same flag on `kvloop serve`, `router` and `fleet`)."""
    g.add_argument("--fleet-secret-file", default=None, metavar="PATH",
                   help="the fleet secret (a file only its owner may read; default: "
                        f"${FLEET_SECRET_FILE_ENV}, else the secret itself in "
                        f"${FLEET_SECRET_ENV}). It signs bus messages, authorizes the "
                        "router's kv_transfer_params and keys the KV side channel "
                        "(docs/security.md)")


def fleet_secret_from_args(args: argparse.Namespace,
                           environ: Mapping[str, str] = os.environ) -> FleetSecret | None:
    """The secret --fleet-secret-file or the environment names (ValueError: unreadable)."""
    return load_fleet_secret(getattr(args, "fleet_secret_file", None), environ)


def write_secret_file(path: str, secret: FleetSecret) -> None:
    """Write `secret` into a new file only its owner can read."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret.to_text())


def secret_env(secret: FleetSecret | None) -> dict[str, str]:
    """The environment that hands `secret` to a child process (never its command line)."""
    return {} if secret is None else {FLEET_SECRET_ENV: secret.to_text()}
