"""kvloop.trust: derived keys, signed messages (fresh, once, on their subject) and CURVE sockets
that admit only fleet members."""

from __future__ import annotations

import os

import pytest
import zmq

from kvloop.trust import (
    FLEET_SECRET_ENV,
    FLEET_SECRET_FILE_ENV,
    PURPOSE_BUS,
    PURPOSE_INTERNAL_HTTP,
    PURPOSE_KV_SIDE_CHANNEL,
    FleetSecret,
    MessageVerifier,
    curve_authenticator,
    load_fleet_secret,
    sign_message,
    write_secret_file,
)

SECRET = FleetSecret.from_text("a" * 32)
OTHER = FleetSecret.from_text("b" * 32)


def test_secret_never_printed_and_keys_differ_by_purpose():
    assert "a" * 8 not in repr(SECRET) and "a" * 8 not in repr(SECRET.curve_keys("x"))
    assert SECRET.derive(PURPOSE_BUS) != SECRET.derive(PURPOSE_INTERNAL_HTTP)
    assert SECRET.derive(PURPOSE_BUS) != OTHER.derive(PURPOSE_BUS)
    assert SECRET.check_token(PURPOSE_INTERNAL_HTTP, SECRET.token(PURPOSE_INTERNAL_HTTP))
    assert not SECRET.check_token(PURPOSE_INTERNAL_HTTP, OTHER.token(PURPOSE_INTERNAL_HTTP))
    assert not SECRET.check_token(PURPOSE_INTERNAL_HTTP, None)
    with pytest.raises(ValueError, match="at least 16"):
        FleetSecret.from_text("short")


def test_mac_parts_do_not_collide():
    assert SECRET.mac("p", b"ab", b"c") != SECRET.mac("p", b"a", b"bc")


def test_signed_message_admitted_once_fresh_and_on_its_subject():
    v = MessageVerifier(SECRET, window_s=30)
    h = sign_message(SECRET, "ns.workers", b"payload", now=1000.0)
    assert v.refusal("ns.workers", b"payload", h, now=1001.0) is None
    assert v.refusal("ns.workers", b"payload", h, now=1001.0) == "replayed"
    h = sign_message(SECRET, "ns.workers", b"payload", now=1000.0)
    assert v.refusal("ns.other", b"payload", h, now=1001.0) == "bad signature"
    assert v.refusal("ns.workers", b"payload!", h, now=1001.0) == "bad signature"
    assert v.refusal("ns.workers", b"payload", h, now=1031.0).startswith("stale")
    assert v.refusal("ns.workers", b"payload", {}, now=1000.0) == "unsigned"
    forged = sign_message(OTHER, "ns.workers", b"payload", now=1000.0)
    assert v.refusal("ns.workers", b"payload", forged, now=1000.0) == "bad signature"


def test_nonce_memory_is_bounded():
    v = MessageVerifier(SECRET, window_s=30, max_nonces=10)
    for i in range(50):
        h = sign_message(SECRET, "s", b"x", now=1000.0 + i)
        assert v.refusal("s", b"x", h, now=1000.0 + i) is None
    assert len(v._seen) <= 10


def test_load_from_file_env_and_refuse_loose_files(tmp_path):
    assert load_fleet_secret(None, {}) is None
    assert load_fleet_secret(None, {FLEET_SECRET_ENV: "c" * 20}).key == b"c" * 20
    path = str(tmp_path / "secret")
    write_secret_file(path, SECRET)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_fleet_secret(path, {}).key == SECRET.key
    assert load_fleet_secret(None, {FLEET_SECRET_FILE_ENV: path}).key == SECRET.key
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        load_fleet_secret(path, {})
    with pytest.raises(ValueError, match="cannot read"):
        load_fleet_secret(str(tmp_path / "missing"), {})


@pytest.mark.slow   # each refused client is given 1.5 s to arrive
def test_curve_admits_only_fleet_members():
    keys, other = SECRET.curve_keys(PURPOSE_KV_SIDE_CHANNEL), OTHER.curve_keys(
        PURPOSE_KV_SIDE_CHANNEL)
    ctx = zmq.Context()
    auth = curve_authenticator(ctx, [keys])
    srv = ctx.socket(zmq.ROUTER)
    srv.setsockopt(zmq.LINGER, 0)
    keys.make_server(srv)
    port = srv.bind_to_random_port("tcp://127.0.0.1")

    def arrives(configure) -> bool:
        c = ctx.socket(zmq.DEALER)
        c.setsockopt(zmq.LINGER, 0)
        configure(c)
        c.connect(f"tcp://127.0.0.1:{port}")
        c.send(b"hello")
        got = srv.poll(1500)
        if got:
            srv.recv_multipart()
        c.close()
        return bool(got)

    def right_server_wrong_client(c):
        c.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        c.setsockopt(zmq.CURVE_PUBLICKEY, other.client_public)
        c.setsockopt(zmq.CURVE_SECRETKEY, other.client_secret)

    try:
        assert arrives(keys.make_client)
        assert not arrives(lambda c: None)                 # plain ZMQ
        assert not arrives(other.make_client)              # another fleet's keys
        assert not arrives(right_server_wrong_client)      # a leaked server key is not enough
    finally:
        auth.stop()
        srv.close()
        ctx.destroy(linger=0)   # term() alone waited for ever on a socket left open once (CI)


def test_the_signature_covers_every_header_and_the_reply_subject():
    """A message altered in transit (a header changed, added or dropped, or its answers
    sent to another inbox) is refused: a query cannot be turned into another or answered
    to an eavesdropper, a batch cannot be renumbered or given to another worker."""
    sent = {"Kvloop-Cmd": "info", "Kvloop-Seq": "7"}
    signed = {**sent, **sign_message(SECRET, "q", b"", now=1000.0, headers=sent,
                                     reply="_INBOX.a")}
    assert MessageVerifier(SECRET).refusal("q", b"", signed, now=1000.0,
                                           reply="_INBOX.a") is None
    for altered, reply in (({**signed, "Kvloop-Cmd": "snapshot"}, "_INBOX.a"),
                           ({**signed, "Kvloop-Seq": "8"}, "_INBOX.a"),
                           ({**signed, "Kvloop-Worker": "9"}, "_INBOX.a"),
                           ({k: v for k, v in signed.items() if k != "Kvloop-Seq"}, "_INBOX.a"),
                           (signed, "_INBOX.eavesdropper"), (signed, "")):
        assert MessageVerifier(SECRET).refusal("q", b"", altered, now=1000.0,
                                               reply=reply) == "bad signature"
