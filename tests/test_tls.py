"""TLS on the fronts with vLLM's flags: a worker and a router serving HTTPS, the openai SDK
verifying the CA, a client without the CA refused, mutual TLS (a client without a
certificate refused), and the router checking its https:// workers against its own CA flag.
Certificates are made in the test (`cryptography`)."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import openai
import pytest

from kvloop.front.launcher import ROUTER_URL_LINE, ServeProcess, UrlProcess, kvloop_command

from .pki_helpers import write_pki

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    return write_pki(tmp_path_factory.mktemp("pki"))


def _ask(url: str, ca: str | None, cert: tuple[str, str] | None = None) -> str:
    verify: ssl.SSLContext | bool = True
    if ca is not None:
        verify = ssl.create_default_context(cafile=ca)
        if cert is not None:
            verify.load_cert_chain(*cert)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           http_client=httpx.Client(verify=verify, timeout=30))
    out = client.completions.create(model=client.models.list().data[0].id, prompt="Hi",
                                    max_tokens=4)
    return out.choices[0].text


def test_https_worker_and_router_with_the_sdk(tmp_path: Path, pki: dict[str, str]) -> None:
    tls = ["--ssl-certfile", pki["server"], "--ssl-keyfile", pki["server_key"]]
    with ServeProcess(["--model", "sim", "--sim-speedup", "100", *tls],
                      tmp_path / "w.log").start(timeout_s=60) as worker:
        assert worker.url.startswith("https://127.0.0.1:")
        assert _ask(worker.url, pki["ca"])
        with pytest.raises(openai.APIConnectionError):     # no CA: the certificate is refused
            _ask(worker.url, None)
        router = UrlProcess(kvloop_command("router", "--port", "0", "--worker", worker.url,
                                           "--worker-ca-certs", pki["ca"], *tls),
                            tmp_path / "r.log", ROUTER_URL_LINE)
        with router.start(timeout_s=60):
            assert router.url.startswith("https://")
            assert _ask(router.url, pki["ca"])
            with pytest.raises(openai.APIConnectionError):
                _ask(router.url, None)


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path: Path,
                                                           pki: dict[str, str]) -> None:
    mtls = ["--ssl-certfile", pki["server"], "--ssl-keyfile", pki["server_key"],
            "--ssl-ca-certs", pki["ca"], "--ssl-cert-reqs", "2"]
    with ServeProcess(["--model", "sim", "--sim-speedup", "100", *mtls],
                      tmp_path / "w.log").start(timeout_s=60) as worker:
        assert _ask(worker.url, pki["ca"], (pki["client"], pki["client_key"]))
        with pytest.raises(openai.APIConnectionError):
            _ask(worker.url, pki["ca"])
        # the router shows its own client certificate to such a worker
        router = UrlProcess(kvloop_command(
            "router", "--port", "0", "--worker", worker.url, "--worker-ca-certs", pki["ca"],
            "--worker-certfile", pki["client"], "--worker-keyfile", pki["client_key"]),
            tmp_path / "r.log", ROUTER_URL_LINE)
        with router.start(timeout_s=60):
            out = httpx.post(router.url + "/v1/completions", timeout=30,
                             json={"model": "sim", "prompt": "Hi", "max_tokens": 4})
            assert out.status_code == 200, out.text


@pytest.mark.parametrize("flags, says", [
    (["--ssl-certfile", "/nonexistent.pem", "--ssl-keyfile", "/nonexistent.key"],
     "--ssl-certfile /nonexistent.pem: no such file"),
    (["--ssl-cert-reqs", "2"], "need --ssl-certfile and --ssl-keyfile"),
])
def test_half_a_tls_setting_is_a_one_line_error(tmp_path: Path, flags: list[str],
                                                says: str) -> None:
    import subprocess

    for cmd in (["serve", "sim"], ["router"]):
        done = subprocess.run(kvloop_command(*cmd, "--port", "0", *flags), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode != 0 and says in done.stderr + done.stdout
        assert "Traceback" not in done.stderr + done.stdout
