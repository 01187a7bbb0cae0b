"""The web config file (exporter-toolkit's format): what loads, what is refused and how it is said,
and the basic auth check (bcrypt, its cache, no faster failures for unknown users)."""
import base64
import ssl
import statistics
import time

import pytest

from gpuwatch.agent.config import ConfigError
from gpuwatch.exporters.webconfig import BasicAuth, load_web_config
from tests.conftest import bcrypt_hash

HASH = bcrypt_hash("s3cret")


def write(tmp_path, text, name="web.yml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def tls_yaml(pki, extra=""):
    return (f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n" + extra)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_full_config_loads(pki, tmp_path):
    web = load_web_config(str(write(tmp_path, tls_yaml(pki, f"""\
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki.ca}
  client_allowed_sans: [scraper.example, 127.0.0.1]
  min_version: TLS13
http_server_config:
  http2: true
  headers:
    X-Content-Type-Options: nosniff
    X-Frame-Options: deny
    Strict-Transport-Security: max-age=31536000
    Content-Security-Policy: ""
basic_auth_users:
  prometheus: {HASH}
  "ops": {HASH}
"""))))
    assert web.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert web.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert web.ssl_context.maximum_version == ssl.TLSVersion.TLSv1_3
    assert web.allowed_sans == {"scraper.example", "127.0.0.1"}
    # Blank means unset, as in exporter-toolkit.
    assert dict(web.headers) == {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "deny",
                                 "Strict-Transport-Security": "max-age=31536000"}
    assert set(web.auth.users) == {b"prometheus", b"ops"}
    assert web.warnings == ()
    assert web.describe() == "TLS, client certificate required, basic auth for 2 users"


def test_defaults_are_tls12_to_13_and_no_client_certificate(pki, tmp_path):
    web = load_web_config(str(write(tmp_path, tls_yaml(pki))))
    assert web.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert web.ssl_context.maximum_version == ssl.TLSVersion.TLSv1_3
    assert web.ssl_context.verify_mode == ssl.CERT_NONE
    assert web.auth is None and web.headers == ()


def test_relative_paths_are_taken_from_the_web_config_directory(pki, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the PKI's directory
    path = write(pki.dir, "tls_server_config:\n  cert_file: server.pem\n  key_file: ./server.key\n"
                 "  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: ca.pem\n", "relative.yml")
    web = load_web_config(str(path))
    assert web.ssl_context.verify_mode == ssl.CERT_OPTIONAL


def test_empty_file_means_plain_http_without_auth(tmp_path):
    web = load_web_config(str(write(tmp_path, "# nothing yet\n")))
    assert web.ssl_context is None and web.auth is None and web.headers == ()


def test_inline_client_ca_is_accepted(pki, tmp_path):
    ca = "\n".join("    " + line for line in pki.ca.read_text().splitlines())
    web = load_web_config(str(write(tmp_path, tls_yaml(pki, "  client_auth_type: RequireAndVerifyClientCert\n"
                                                            f"  client_ca: |\n{ca}\n"))))
    assert web.ssl_context.verify_mode == ssl.CERT_REQUIRED


def test_accepted_but_not_applied_settings_are_warned_about(pki, tmp_path):
    web = load_web_config(str(write(tmp_path, tls_yaml(pki, "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n"
                                                            "  curve_preferences: [X25519]\n"))))
    assert [w.split(" ")[0] for w in web.warnings] == ["tls_server_config.cipher_suites",
                                                       "tls_server_config.curve_preferences"]
    web = load_web_config(str(write(tmp_path, f"basic_auth_users:\n  a: {HASH}\n")))
    assert web.ssl_context is None and web.auth is not None
    assert any("clear text" in w for w in web.warnings)


# (file text, key named in the error or None for the whole file, words of the reason)
BAD = {
    "bad_yaml": ("tls_server_config:\n  cert_file: [a\n", None, "invalid YAML at line 3"),
    "not_a_mapping": ("- a\n- b\n", None, "expected a mapping"),
    "unknown_top_key": (f"basic_auth_user:\n  a: {HASH}\n", "basic_auth_user", "did you mean basic_auth_users?"),
    "unknown_tls_key": ("tls_server_config:\n  certfile: x.pem\n", "tls_server_config.certfile",
                        "did you mean cert_file?"),
    "unknown_http_key": ("http_server_config:\n  header: {}\n", "http_server_config.header", "unknown key"),
    "not_bcrypt": ("basic_auth_users:\n  alice: hunter2\n", "basic_auth_users.alice", "not a bcrypt hash"),
    "md5_crypt": ("basic_auth_users:\n  alice: $apr1$x$y\n", "basic_auth_users.alice", "not a bcrypt hash"),
    "user_twice": (f"basic_auth_users:\n  a: {HASH}\n  a: {HASH}\n", None, "'a' is given twice"),
    "user_with_colon": (f"basic_auth_users:\n  'a:b': {HASH}\n", "basic_auth_users.a:b", "cannot hold ':'"),
    "user_not_string": (f"basic_auth_users:\n  yes: {HASH}\n", "basic_auth_users.True", "strings"),
    "missing_key_file": ("tls_server_config:\n  cert_file: <cert>\n", "tls_server_config.key_file", "missing"),
    "missing_cert_file": ("tls_server_config:\n  key_file: <key>\n", "tls_server_config.cert_file", "missing"),
    "absent_key_file": ("tls_server_config:\n  cert_file: <cert>\n  key_file: nope.key\n",
                        "tls_server_config.key_file", "no such file: <dir>/nope.key"),
    "cert_not_pem": ("tls_server_config:\n  cert_file: <key>\n  key_file: <key>\n", "tls_server_config.cert_file",
                     "holds no PEM certificate"),
    "key_not_pem": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <cert>\n", "tls_server_config.key_file",
                    "holds no PEM private key"),
    "key_of_another_cert": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <client_key>\n",
                            "tls_server_config.cert_file", "do not load as a certificate and its key"),
    "encrypted_key": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <encrypted>\n",
                      "tls_server_config.key_file", "is encrypted"),
    "inline_key": ("tls_server_config:\n  cert_file: <cert>\n  key: abc\n", "tls_server_config.key",
                   "inline are not supported"),
    "bad_client_auth": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n  client_auth_type: Always\n",
                        "tls_server_config.client_auth_type", "expected one of NoClientCert"),
    "unverified_client_auth": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n"
                               "  client_auth_type: RequireAnyClientCert\n", "tls_server_config.client_auth_type",
                               "not supported"),
    "client_auth_without_ca": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n"
                               "  client_auth_type: RequireAndVerifyClientCert\n", "tls_server_config.client_ca_file",
                               "needs the CA"),
    "ca_without_client_auth": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n  client_ca_file: <ca>\n",
                               "tls_server_config.client_auth_type", "no client certificate is asked for"),
    "ca_file_without_ca": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n"
                           "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: <key>\n",
                           "tls_server_config.client_ca_file", "no CA certificate loads"),
    "sans_without_required_cert": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n"
                                   "  client_allowed_sans: [a]\n", "tls_server_config.client_allowed_sans",
                                   "RequireAndVerifyClientCert"),
    "bad_version": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n  min_version: TLS14\n",
                    "tls_server_config.min_version", "expected one of TLS10, TLS11, TLS12, TLS13"),
    "tls10_cannot_work": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n  min_version: TLS10\n",
                          "tls_server_config.min_version", "TLS10 cannot work: OpenSSL 3"),
    "tls11_cannot_work": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n  min_version: TLS11\n"
                          "  max_version: TLS11\n", "tls_server_config.min_version", "use TLS12 or TLS13"),
    "versions_reversed": ("tls_server_config:\n  cert_file: <cert>\n  key_file: <key>\n  min_version: TLS13\n"
                          "  max_version: TLS12\n", "tls_server_config.min_version", "above max_version"),
    "reserved_header": ("http_server_config:\n  headers:\n    Content-Type: text/html\n",
                        "http_server_config.headers.Content-Type", "cannot be set"),
    "auth_header": ("http_server_config:\n  headers:\n    WWW-Authenticate: Basic\n",
                    "http_server_config.headers.WWW-Authenticate", "cannot be set"),
    "bad_header_value": ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
                         "http_server_config.headers.X-Frame-Options", "expected one of deny, sameorigin"),
    "header_line_break": ("http_server_config:\n  headers:\n    Content-Security-Policy: \"a\\r\\nSet-Cookie: x\"\n",
                          "http_server_config.headers.Content-Security-Policy", "line break"),
    "http2_not_bool": ("http_server_config:\n  http2: maybe\n", "http_server_config.http2", "true or false"),
    "rate_limit": ("rate_limit:\n  interval: 1s\n  burst: 5\n", "rate_limit", "not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_web_config_is_refused_naming_file_key_and_reason(pki, tmp_path, case):
    text, key, reason = BAD[case]
    fill = dict(cert=pki.server_cert, key=pki.server_key, client_key=pki.client_key, ca=pki.ca,
                encrypted=pki.encrypted_key, dir=tmp_path)
    for name, value in fill.items():
        text, reason = text.replace(f"<{name}>", str(value)), reason.replace(f"<{name}>", str(value))
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_web_config(str(path))
    assert e.value.source == str(path) and e.value.key == key, str(e.value)
    assert reason in e.value.reason, str(e.value)
    assert str(e.value).startswith(f"{path}: {key + ': ' if key else ''}")


def test_clear_text_password_is_not_echoed(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_web_config(str(write(tmp_path, "basic_auth_users:\n  alice: hunter2\n")))
    assert "hunter2" not in str(e.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_web_config(str(tmp_path / "absent.yml"))
    with pytest.raises(ConfigError, match="is a directory"):
        load_web_config(str(tmp_path))
    blocker = write(tmp_path, "{}", "a-file")
    with pytest.raises(ConfigError, match="cannot read: Not a directory"):  # what root cannot read either
        load_web_config(str(blocker / "web.yml"))


# -- basic auth --------------------------------------------------------------------------------

def test_basic_auth_accepts_the_right_password_only():
    auth = BasicAuth({b"alice": HASH.encode(), b"bob": bcrypt_hash("other").encode()})
    assert auth.check(basic("alice", "s3cret"))
    assert auth.check(basic("alice", "s3cret"))  # from the cache
    assert auth.check(basic("bob", "other"))
    assert auth.check("basic " + base64.b64encode(b"alice:s3cret").decode())  # the scheme is case-insensitive
    for header in (basic("alice", "wrong"), basic("alice", ""), basic("bob", "s3cret"), basic("carol", "s3cret"),
                   basic("alice", "s3cret" + "x" * 80), basic("", ""), None, "", "Basic", "Basic !!!",
                   "Basic " + base64.b64encode(b"alice").decode(), "Bearer s3cret",
                   "Basic " + base64.b64encode(b"alice:s3cre").decode()):
        assert not auth.check(header), header


def test_a_password_longer_than_bcrypt_reads_is_refused():
    # bcrypt reads 72 bytes; a longer password that starts with the right ones must not pass.
    long = "p" * 72
    auth = BasicAuth({b"alice": bcrypt_hash(long).encode()})
    assert auth.check(basic("alice", long))
    assert not auth.check(basic("alice", long + "tail"))


def timed(auth, header, n=3):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        auth.check(header)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def test_success_is_cached_and_failures_always_cost_a_bcrypt():
    auth = BasicAuth({b"alice": bcrypt_hash("s3cret", cost=10).encode()})
    t = time.perf_counter()
    assert auth.check(basic("alice", "s3cret"))
    first = time.perf_counter() - t
    assert first > 0.01, "cost 10 bcrypt should take tens of milliseconds"
    assert timed(auth, basic("alice", "s3cret")) < first / 10
    wrong = timed(auth, basic("alice", "wrong"))
    unknown = timed(auth, basic("mallory", "wrong"))
    # Failures are never cached, and an unknown user costs what a known one does.
    assert wrong > first / 2 and unknown > first / 2, (first, wrong, unknown)


def test_the_example_in_docs_loads(pki, tmp_path):
    import re
    import shutil
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    example = re.search(r"```yaml\n(# /etc/gpuwatch/web.yml.*?)```", doc, re.S).group(1)
    shutil.copy(pki.server_cert, tmp_path / "gpuwatch.crt")
    shutil.copy(pki.server_key, tmp_path / "gpuwatch.key")
    web = load_web_config(str(write(tmp_path, example)))
    assert web.describe() == "TLS, basic auth for 1 user" and web.warnings == ()
    assert web.auth.check(basic("prometheus", "secret"))
    assert dict(web.headers)["X-Content-Type-Options"] == "nosniff"


# -- anything in the file: ConfigError naming the file, or a web config; never another exception ---

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpuwatch.agent.config import ConfigError as _ConfigError  # noqa: E402
from gpuwatch.exporters.webconfig import load_web_config as _load_web_config  # noqa: E402

_WEB_KEYS = ["tls_server_config", "basic_auth_users", "http_server_config", "rate_limit", "cert_file",
             "key_file", "client_auth_type", "headers", "min_version", "http2", "x"]
_YAML_DOCS = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda kids: st.one_of(st.lists(kids, max_size=3),
                           st.dictionaries(st.one_of(st.sampled_from(_WEB_KEYS), st.text(max_size=5)), kids,
                                           max_size=3)),
    max_leaves=10)


def _web_load_or_config_error(tmp_path, data: bytes) -> None:
    p = tmp_path / "web.yml"
    p.write_bytes(data)
    try:
        _load_web_config(str(p))
    except _ConfigError as e:
        assert e.source == str(p) and str(e).startswith(f"{p}: ") and e.reason, str(e)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_random_bytes_as_web_config(tmp_path, data):
    _web_load_or_config_error(tmp_path, data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_YAML_DOCS)
def test_random_yaml_as_web_config(tmp_path, doc):
    import yaml
    _web_load_or_config_error(tmp_path, yaml.safe_dump(doc).encode())


@pytest.mark.parametrize("text", ["a: " + "[" * 5000 + "]" * 5000, "&a [*a]", "!!python/object:os.system x",
                                  "a: !!binary AAAA\n"])
def test_hostile_yaml(tmp_path, text):
    p = tmp_path / "web.yml"
    p.write_text(text + "\n")
    with pytest.raises(_ConfigError) as e:
        _load_web_config(str(p))
    assert str(e.value).startswith(f"{p}: ")
