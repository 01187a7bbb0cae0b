"""/metrics behind a web config, for real: TLS handshakes with certificates made at test time,
basic auth against bcrypt hashes, client certificates, extra headers, and clients that
misbehave (plain HTTP to the TLS port, garbage, a byte at a time) while others scrape."""
import base64
import http.client
import socket
import ssl
import threading
import time

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.exporters.prometheus import PrometheusExporter
from gpuwatch.exporters.webconfig import load_web_config
from tests.conftest import bcrypt_hash

GPU = "GPU-8c2e6a2b-0000-1111-2222-333344445555"
USERS = f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n"
TLS_ERRORS = (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected, socket.timeout)


@pytest.fixture
def serve(pki, tmp_path):
    """serve(yaml) -> a started exporter with that web config (paths relative to the PKI's directory)."""
    started = []

    def start(text):
        path = pki.dir / f"web-{len(started)}-{tmp_path.name}.yml"
        path.write_text(text)
        exp = PrometheusExporter("127.0.0.1:0", load_web_config(str(path)))
        exp.start()
        exp.publish(Snapshot(ts=1.0, samples=(Sample("hw.power", 300.0, GPU),)))
        started.append(exp)
        return exp

    yield start
    for exp in started:
        exp.shutdown()


TLS = "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n"


def client_context(pki, cert=None, key=None, ca=None, max_version=None):
    ctx = ssl.create_default_context(cafile=str(ca or pki.ca))
    if cert:
        ctx.load_cert_chain(str(cert), str(key))
    if max_version:
        ctx.maximum_version = max_version
    return ctx


def get(exp, ctx=None, auth=None, path="/metrics", timeout=5):
    """(status, headers, body) of one GET; over TLS when ctx is given."""
    conn = (http.client.HTTPSConnection("127.0.0.1", exp.port, context=ctx, timeout=timeout) if ctx
            else http.client.HTTPConnection("127.0.0.1", exp.port, timeout=timeout))
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def test_tls_scrape_works_with_the_ca(serve, pki):
    exp = serve(TLS)
    assert exp.scheme == "https"
    status, headers, body = get(exp, client_context(pki))
    assert status == 200 and f'hw_power_watts{{gpu="{GPU}"}} 300.0' in body.decode()
    assert get(exp, client_context(pki), path="/")[0] == 200
    with pytest.raises(ssl.SSLCertVerificationError):  # a client that trusts another CA says so
        get(exp, client_context(pki, ca=pki.rogue_ca))


def test_plain_http_to_the_tls_port_fails_cleanly_and_tls_goes_on(serve, pki):
    exp = serve(TLS)
    status, _, body = get(exp)  # http:// to the https port
    assert status == 400 and b"HTTP request to an HTTPS server" in body
    assert get(exp, client_context(pki))[0] == 200


def test_garbage_and_stalled_clients_do_not_block_scrapes(serve, pki):
    exp = serve(TLS)
    exp._server.header_timeout = 1.0
    # Garbage that looks like a TLS record, then a broken one.
    with socket.create_connection(("127.0.0.1", exp.port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x00\x05hello" + bytes(range(256)))
        try:
            while s.recv(100):  # an alert at most, then the server closes
                pass
        except ConnectionResetError:
            pass
    # A client that connects and says nothing, and one that sends a ClientHello a byte at a time.
    silent = socket.create_connection(("127.0.0.1", exp.port), timeout=5)
    trickle = socket.create_connection(("127.0.0.1", exp.port), timeout=5)
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 200
    stop = threading.Event()
    closed_after: list[float] = []

    def drip():
        t0 = time.monotonic()
        try:
            for b in hello:
                if stop.is_set():
                    return
                trickle.sendall(bytes([b]))
                time.sleep(0.2)
        except OSError:  # the server hung up on us: what it should do
            closed_after.append(time.monotonic() - t0)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        t = time.monotonic()
        for _ in range(3):
            assert get(exp, client_context(pki))[0] == 200
        assert time.monotonic() - t < 2, "scrapes waited for the stalled clients"
        # The silent client is dropped after the handshake timeout ...
        silent.settimeout(5)
        t = time.monotonic()
        assert silent.recv(10) == b""
        assert time.monotonic() - t < 3
        # ... and so is the trickling one: the timeout bounds the whole handshake, not each byte.
        dripper.join(10)
        assert closed_after and closed_after[0] < 5, closed_after
    finally:
        stop.set()
        silent.close()
        trickle.close()
    assert get(exp, client_context(pki))[0] == 200


def test_basic_auth_over_tls(serve, pki):
    exp = serve(TLS + USERS)
    ctx = client_context(pki)
    status, _, body = get(exp, ctx, auth="prometheus:s3cret")
    assert status == 200 and b"hw_power_watts" in body
    answers = []
    for auth in ("prometheus:wrong", "nobody:s3cret", None, "prometheus:"):
        status, headers, body = get(exp, ctx, auth=auth)
        assert status == 401, auth
        assert headers["WWW-Authenticate"] == 'Basic realm="gpuwatch"'
        answers.append(body)
    # The same answer whatever was wrong.
    assert len(set(answers)) == 1 and answers[0] == b"Unauthorized\n"
    assert get(exp, ctx, path="/")[0] == 401  # every path, not only /metrics
    conn = http.client.HTTPSConnection("127.0.0.1", exp.port, context=ctx, timeout=5)
    conn.request("GET", "/metrics", headers={"Authorization": "Basic %%%"})
    assert conn.getresponse().status == 401
    conn.close()


def test_basic_auth_without_tls(serve):
    exp = serve(USERS)
    assert exp.scheme == "http"
    assert get(exp, auth="prometheus:s3cret")[0] == 200
    assert get(exp, auth="prometheus:nope")[0] == 401


def test_extra_headers_are_sent_on_every_answer(serve, pki):
    exp = serve(TLS + USERS + "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
                "    X-Frame-Options: deny\n    Strict-Transport-Security: max-age=63072000\n")
    for auth, path, status in (("prometheus:s3cret", "/metrics", 200), ("prometheus:s3cret", "/nope", 404),
                               (None, "/metrics", 401)):
        got, headers, _ = get(exp, client_context(pki), auth=auth, path=path)
        assert got == status
        assert headers["X-Content-Type-Options"] == "nosniff" and headers["X-Frame-Options"] == "deny"
        assert headers["Strict-Transport-Security"] == "max-age=63072000"


def test_client_certificate_required(serve, pki):
    exp = serve(TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n")
    with pytest.raises(TLS_ERRORS):  # no certificate: the handshake fails
        get(exp, client_context(pki))
    with pytest.raises(TLS_ERRORS):  # a certificate from a CA the server does not trust
        get(exp, client_context(pki, pki.rogue_client_cert, pki.rogue_client_key))
    assert get(exp, client_context(pki, pki.client_cert, pki.client_key))[0] == 200


def test_client_certificate_verified_if_given(serve, pki):
    exp = serve(TLS + "  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: ca.pem\n")
    assert get(exp, client_context(pki))[0] == 200
    assert get(exp, client_context(pki, pki.client_cert, pki.client_key))[0] == 200
    with pytest.raises(TLS_ERRORS):
        get(exp, client_context(pki, pki.rogue_client_cert, pki.rogue_client_key))


def test_client_allowed_sans(serve, pki):
    exp = serve(TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n"
                "  client_allowed_sans: [scraper.example]\n")
    assert get(exp, client_context(pki, pki.client_cert, pki.client_key))[0] == 200
    with pytest.raises(TLS_ERRORS):  # signed by the right CA, but not a name on the list
        get(exp, client_context(pki, pki.other_client_cert, pki.other_client_key))


def test_tls_versions(serve, pki):
    default = serve(TLS)
    assert get(default, client_context(pki, max_version=ssl.TLSVersion.TLSv1_2))[0] == 200
    tls13 = serve(TLS + "  min_version: TLS13\n")
    with pytest.raises(TLS_ERRORS):
        get(tls13, client_context(pki, max_version=ssl.TLSVersion.TLSv1_2))
    assert get(tls13, client_context(pki))[0] == 200
