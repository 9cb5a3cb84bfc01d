"""The gateway serves https with the preset's certificate (gateway.tls_certfile / tls_keyfile).

A throwaway authority and a certificate for 127.0.0.1 are made at test time with the openssl CLI. The real
uvicorn server (the driver's embedded one) serves the app over TLS on loopback: the tinker SDK reaches it when
told to trust the authority (SSL_CERT_FILE, as docs/security.md says), plain http and an untrusting client get
nothing, and the job's watchdog probe gets through by pinning the certificate.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tinker
from runtime_double import BASE, DoubleRuntime, double_app

from miles.contract.tls import pinned_tls
from miles.gateway.server import GatewayTlsError, TlsFiles, embedded_gateway_server
from miles.job.monitor import probe

KEY = "tml-tls-key-0001"


@dataclass(frozen=True)
class Certificates:
    tls: TlsFiles  # what the gateway serves: a leaf for 127.0.0.1 and its key
    ca: str  # the self-made authority that signed it: what clients are told to trust


def make_certificates(directory: Path) -> Certificates:
    """A throwaway authority and a leaf for 127.0.0.1 (rustls, under the SDK's transport, refuses a
    certificate that is its own authority, so the leaf is not self-signed)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a test certificate")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "gateway.pem", directory / "gateway.key", directory / "gateway.csr"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    leaf = ["-days", "1", "-extfile", directory / "leaf.ext"]
    openssl = [
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=miles test CA"],
        ["req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=miles-gateway"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, *leaf],
    ]
    (directory / "leaf.ext").write_text("basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n")
    for argv in openssl:
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
    key.chmod(0o600)
    return Certificates(TlsFiles(str(cert), str(key)), str(ca))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tls_gateway(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[str, Certificates]]:
    certs = make_certificates(tmp_path / "certs")
    tls = certs.tls
    app = double_app(tmp_path, DoubleRuntime(tokenizer_path=str(tiny_model_dir)), {KEY: "alpha"})
    port = free_port()
    server = embedded_gateway_server(app, "127.0.0.1", port, tls)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the TLS gateway did not start"
        time.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}", certs
    finally:
        server.should_exit = True
        thread.join(15)


def test_the_sdk_reaches_the_gateway_over_https(tls_gateway, monkeypatch) -> None:
    address, certs = tls_gateway
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)  # how a client trusts a site's own authority
    rest = tinker.RestClient(base_url=f"https://{address}", api_key=KEY)
    models = rest.get_server_capabilities().result().supported_models
    # each base and its full-context variant, as the hosted lineup names them
    assert [m.model_name for m in models] == [BASE, f"{BASE}:peft:{models[0].max_context_length}"]
    trust = ssl.create_default_context(cafile=certs.ca)
    trusting = httpx.get(f"https://{address}/api/v1/healthz", verify=trust, trust_env=False)
    assert trusting.status_code == 200 and trusting.json() == {"status": "ok"}


def test_plain_http_and_untrusting_clients_get_nothing(tls_gateway) -> None:
    address, _ = tls_gateway
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{address}/api/v1/healthz", trust_env=False, timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://{address}/api/v1/healthz", trust_env=False, timeout=5)


def test_the_watchdog_pins_the_gateway_certificate(tls_gateway, tmp_path: Path) -> None:
    address, certs = tls_gateway
    url = f"https://{address}/api/v1/healthz"
    # what the job script passes: the gateway's own certificate file, no authority
    assert probe(url, 5, pinned_tls(Path(certs.tls.certfile))).status == 200
    assert probe(url, 5).status is None  # the system's trust store does not know this certificate
    other = make_certificates(tmp_path / "other").tls
    refused = probe(url, 5, pinned_tls(Path(other.certfile)))  # another certificate is not this gateway's
    assert refused.status is None and "CERTIFICATE_VERIFY_FAILED" in refused.detail


def test_unusable_tls_files_are_refused_before_serving(tmp_path: Path) -> None:
    tls = make_certificates(tmp_path).tls
    app = double_app(tmp_path, DoubleRuntime(), {KEY: "alpha"})
    missing = TlsFiles(str(tmp_path / "nope.pem"), tls.keyfile)
    with pytest.raises(GatewayTlsError, match=r"gateway\.tls_certfile .*nope\.pem is not a readable file"):
        embedded_gateway_server(app, "127.0.0.1", 0, missing)
    swapped = TlsFiles(tls.keyfile, tls.certfile)
    with pytest.raises(GatewayTlsError, match="do not load"):
        embedded_gateway_server(app, "127.0.0.1", 0, swapped)


def test_launcher_status_probes_a_tls_gateway_with_its_certificate(tls_gateway, tmp_path: Path) -> None:
    from launcher.run_state import gateway_tls_cert, healthz_url, probe_healthz
    from launcher.runs import Run

    address, certs = tls_gateway
    run = Run(tmp_path / "run")
    run.path.mkdir()
    host, port = address.split(":")
    preset = f"gateway:\n  host: {host}\n  port: {port}\n  tls_certfile: {certs.tls.certfile}\n"
    run.preset_file.write_text(preset)
    url = healthz_url(run)  # before the job wrote its URL: from the preset, with the scheme TLS implies
    assert url == f"https://{address}/api/v1/healthz"
    assert gateway_tls_cert(run) == Path(certs.tls.certfile)
    assert probe_healthz(url, gateway_tls_cert(run))["status_code"] == 200
    assert probe_healthz(url)["status_code"] is None  # httpx's bundled CAs do not know the test CA
    assert probe_healthz(url, tmp_path / "missing.pem")["status_code"] is None  # an answer, not a crash
