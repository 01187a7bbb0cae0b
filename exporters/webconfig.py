"""The web config file that secures /metrics: TLS, basic auth and extra response headers.

The format is Prometheus exporter-toolkit's (docs/web-configuration.md in
github.com/prometheus/exporter-toolkit), the file node_exporter and friends take with
--web.config.file, so operators can reuse theirs. It is read once, at start: a file
that is missing, malformed, has a key we do not know, names a certificate that does
not load or holds a password that is not a bcrypt hash stops the agent (ConfigError
naming the file and the key) rather than let it serve unprotected. docs/security.md
lists what is supported and what is refused.
"""
from __future__ import annotations

import base64
import binascii
import difflib
import hashlib
import ipaddress
import os
import re
import ssl
import threading
from dataclasses import dataclass
from typing import Any

import bcrypt
import yaml

from gpuwatch.agent.config import MAX_FILE_BYTES, ConfigError, read_file

REALM = "gpuwatch"
UNAUTHORIZED_HEADER = ("WWW-Authenticate", f'Basic realm="{REALM}"')

TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# exporter-toolkit accepts these; OpenSSL 3 at its default security level has no cipher for them
# (measured with OpenSSL 3.0: every handshake fails "no ciphers available"), and RFC 8996 deprecates
# them. Refused at start rather than accepted for a server no client can reach.
UNUSABLE_TLS_VERSIONS = ("TLS10", "TLS11")
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
# Go can ask for a client certificate without verifying it; Python's ssl cannot. Refused rather
# than served with a different meaning.
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")

# exporter-toolkit lets the file set these headers only, some only to these values; so do we.
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}

TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "client_ca", "client_allowed_sans",
            "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites", "curve_preferences",
            "cert", "key")
HTTP_KEYS = ("headers", "http2")
TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")

_BCRYPT = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
_SSL_SUFFIX = re.compile(r"\s*\(_ssl\.c:\d+\)$")
MAX_PASSWORD_BYTES = 72  # bcrypt looks at no more; bcrypt >= 5 refuses longer ones
AUTH_CACHE_SIZE = 256


@dataclass(frozen=True)
class WebConfig:
    path: str
    ssl_context: ssl.SSLContext | None  # None: plain HTTP
    auth: "BasicAuth | None"  # None: no basic auth
    headers: tuple[tuple[str, str], ...]  # added to every response
    allowed_sans: frozenset[str]  # empty: any verified client certificate will do
    warnings: tuple[str, ...]  # settings accepted but not applied, for the log

    def client_allowed(self, cert: dict | None) -> bool:
        """client_allowed_sans: does the verified client certificate (getpeercert()) name one of them?"""
        return not self.allowed_sans or bool(peer_sans(cert) & self.allowed_sans)

    def describe(self) -> str:
        """For the start-up log line: what protects the port."""
        parts = []
        if self.ssl_context is not None:
            mode = {ssl.CERT_REQUIRED: ", client certificate required", ssl.CERT_OPTIONAL: ", client certificate "
                    "verified if given"}.get(self.ssl_context.verify_mode, "")
            parts.append("TLS" + mode)
        if self.auth is not None:
            n = len(self.auth.users)
            parts.append(f"basic auth for {n} user{'' if n == 1 else 's'}")
        return ", ".join(parts) or "no TLS, no auth"


# -- reading the file ------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice (Go's strict unmarshal does; PyYAML would keep the last)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _read_yaml(path: str) -> Any:
    data = read_file(path, "no such file (set by prometheus.web_config)")
    try:
        return yaml.load(data.decode("utf-8"), Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError:
        raise ConfigError(path, None, "not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(path, None, f"invalid YAML{where}: {problem}") from None
    except RecursionError:  # the composer recurses once per nested list or mapping
        raise ConfigError(path, None, "invalid YAML: lists or mappings nested too deeply") from None


def _table(path: str, name: str, v: Any, known: tuple[str, ...]) -> dict:
    """A mapping whose keys are all known; {} for an empty one."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(path, name or None, f"expected a mapping, got {type(v).__name__}")
    for k in v:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(known)}"
            raise ConfigError(path, f"{name}.{k}" if name else str(k), "unknown key" + hint)
    return v


def _string(path: str, key: str, v: Any) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ConfigError(path, key, f"expected a string, got {v!r}")
    return v


def _strings(path: str, key: str, v: Any) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(path, key, f"expected a list of strings, got {v!r}")
    return v


def _bool(path: str, key: str, v: Any, default: bool) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(path, key, f"expected true or false, got {v!r}")
    return v


def _file(path: str, key: str, v: str) -> tuple[str, bytes]:
    """A file named in the web config: relative to the web config's directory, as exporter-toolkit does."""
    full = os.path.normpath(os.path.join(os.path.dirname(path), v))
    try:
        with open(full, "rb") as f:
            return full, f.read(MAX_FILE_BYTES)
    except FileNotFoundError:
        raise ConfigError(path, key, f"no such file: {full}") from None
    except OSError as e:
        raise ConfigError(path, key, f"cannot read {full}: {e.strerror or e}") from None


def _ssl_reason(e: ssl.SSLError) -> str:
    return _SSL_SUFFIX.sub("", str(e.args[1] if len(e.args) > 1 else e))


def load_web_config(path: str) -> WebConfig:
    """Read and check the web config file; ConfigError(path, key, reason) when it is not right."""
    doc = _read_yaml(path)
    top = _table(path, "", doc, TOP_KEYS)
    if top.get("rate_limit") is not None:
        raise ConfigError(path, "rate_limit", "not supported by gpuwatch: remove it (a scrape is served from "
                                              "memory; limit clients with a firewall or a proxy)")
    warnings: list[str] = []
    ctx, sans = _tls(path, _table(path, "tls_server_config", top.get("tls_server_config"), TLS_KEYS), warnings)
    http = _table(path, "http_server_config", top.get("http_server_config"), HTTP_KEYS)
    _bool(path, "http_server_config.http2", http.get("http2"), True)  # checked, not used: we speak HTTP/1.x
    headers = _headers(path, http.get("headers"))
    users = _users(path, top.get("basic_auth_users"))
    if users and ctx is None:
        warnings.append("basic_auth_users without TLS: passwords cross the network in clear text "
                        "(add tls_server_config)")
    return WebConfig(path=path, ssl_context=ctx, auth=BasicAuth(users) if users else None, headers=headers,
                     allowed_sans=sans, warnings=tuple(warnings))


def _tls(path: str, tls: dict, warnings: list[str]) -> tuple[ssl.SSLContext | None, frozenset[str]]:
    k = lambda key: f"tls_server_config.{key}"  # noqa: E731
    for inline, use in (("cert", "cert_file"), ("key", "key_file")):
        if tls.get(inline):
            raise ConfigError(path, k(inline), f"certificates and keys inline are not supported: put it in a file "
                                               f"and name it with {use}")
    cert_file = _string(path, k("cert_file"), tls.get("cert_file"))
    key_file = _string(path, k("key_file"), tls.get("key_file"))
    ca_file = _string(path, k("client_ca_file"), tls.get("client_ca_file"))
    ca_text = _string(path, k("client_ca"), tls.get("client_ca"))
    client_auth = _string(path, k("client_auth_type"), tls.get("client_auth_type"))
    if not (cert_file or key_file or ca_file or ca_text or client_auth):
        if tls:
            warnings.append("tls_server_config has no cert_file and key_file: serving plain HTTP")
        return None, frozenset()
    if not cert_file:
        raise ConfigError(path, k("cert_file"), "missing: TLS needs cert_file and key_file")
    if not key_file:
        raise ConfigError(path, k("key_file"), "missing: TLS needs cert_file and key_file")

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    versions = {}
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = _string(path, k(key), tls.get(key)) or default
        if v not in TLS_VERSIONS:
            raise ConfigError(path, k(key), f"expected one of {', '.join(TLS_VERSIONS)}, got {v!r}")
        if v in UNUSABLE_TLS_VERSIONS:
            raise ConfigError(path, k(key), f"{v} cannot work: {ssl.OPENSSL_VERSION} at its default security level "
                                            f"has no cipher for TLS 1.0 or 1.1 (deprecated by RFC 8996), so no "
                                            f"client could connect; use TLS12 or TLS13")
        versions[key] = TLS_VERSIONS[v]
    if versions["min_version"] > versions["max_version"]:
        raise ConfigError(path, k("min_version"), "is above max_version")
    try:
        ctx.minimum_version, ctx.maximum_version = versions["min_version"], versions["max_version"]
    except (ValueError, ssl.SSLError) as e:
        raise ConfigError(path, k("min_version"), f"this OpenSSL refuses it: {e}") from None

    cert_path, cert_pem = _file(path, k("cert_file"), cert_file)
    key_path, key_pem = _file(path, k("key_file"), key_file)
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise ConfigError(path, k("cert_file"), f"{cert_path} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key_pem:
        raise ConfigError(path, k("key_file"), f"{key_path} holds no PEM private key")

    def encrypted() -> str:  # OpenSSL would otherwise ask for a passphrase on the terminal
        raise ConfigError(path, k("key_file"), f"{key_path} is encrypted: give an unencrypted key, readable by "
                                               f"the agent only")

    try:
        ctx.load_cert_chain(cert_path, key_path, password=encrypted)
    except ssl.SSLError as e:
        raise ConfigError(path, k("cert_file"), f"{cert_path} and {key_path} do not load as a certificate "
                                                f"and its key: {_ssl_reason(e)}") from None

    if client_auth in UNVERIFIED_CLIENT_AUTH:
        raise ConfigError(path, k("client_auth_type"), f"{client_auth} (a certificate taken without verifying it) is "
                                                       "not supported: use RequireAndVerifyClientCert with "
                                                       "client_ca_file")
    if client_auth and client_auth not in CLIENT_AUTH:
        raise ConfigError(path, k("client_auth_type"), f"expected one of {', '.join(CLIENT_AUTH)}, got {client_auth!r}")
    ctx.verify_mode = CLIENT_AUTH[client_auth or "NoClientCert"]
    if ca_file and ca_text:
        raise ConfigError(path, k("client_ca"), "give client_ca_file or client_ca, not both")
    if (ca_file or ca_text) and ctx.verify_mode == ssl.CERT_NONE:
        raise ConfigError(path, k("client_auth_type"), "client CAs are set but no client certificate is asked for: "
                                                       "set client_auth_type: RequireAndVerifyClientCert")
    if ctx.verify_mode != ssl.CERT_NONE:
        if not (ca_file or ca_text):  # Go would trust the system's CAs: any public certificate would do
            raise ConfigError(path, k("client_ca_file"), f"client_auth_type {client_auth} needs the CA that signs "
                                                         f"the client certificates in client_ca_file")
        try:
            if ca_file:
                ca_path, _ = _file(path, k("client_ca_file"), ca_file)
                ctx.load_verify_locations(cafile=ca_path)
            else:
                ctx.load_verify_locations(cadata=ca_text)
        except ssl.SSLError as e:
            key = k("client_ca_file" if ca_file else "client_ca")
            raise ConfigError(path, key, f"no CA certificate loads from it: {_ssl_reason(e)}") from None

    sans = _strings(path, k("client_allowed_sans"), tls.get("client_allowed_sans"))
    if sans and ctx.verify_mode != ssl.CERT_REQUIRED:
        raise ConfigError(path, k("client_allowed_sans"), "needs client_auth_type: RequireAndVerifyClientCert")
    # Server preference is OpenSSL's (and exporter-toolkit's) default.
    if _bool(path, k("prefer_server_cipher_suites"), tls.get("prefer_server_cipher_suites"), True):
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    for key in ("cipher_suites", "curve_preferences"):
        if _strings(path, k(key), tls.get(key)):
            warnings.append(f"tls_server_config.{key} is ignored: gpuwatch uses Python's ssl defaults (forward "
                            f"secret AEAD ciphers, OpenSSL's curves)")
    return ctx, frozenset(_normal_san(s) for s in sans)


def _headers(path: str, headers: Any) -> tuple[tuple[str, str], ...]:
    if headers is None:
        return ()
    if not isinstance(headers, dict):
        raise ConfigError(path, "http_server_config.headers", "expected a mapping of header names to values")
    out = []
    for name, value in headers.items():
        key = f"http_server_config.headers.{name}"
        if name not in HEADERS:  # Content-Type, Server, WWW-Authenticate ... are the exporter's to set
            raise ConfigError(path, key, f"this header cannot be set; the ones that can: {', '.join(HEADERS)}")
        value = _string(path, key, value)
        if not value:  # exporter-toolkit: blank means unset
            continue
        if "\r" in value or "\n" in value:
            raise ConfigError(path, key, "a header value cannot hold a line break")
        allowed = HEADERS[name]
        if allowed and value not in allowed:
            raise ConfigError(path, key, f"expected one of {', '.join(allowed)}, got {value!r}")
        out.append((name, value))
    return tuple(out)


def _users(path: str, users: Any) -> dict[bytes, bytes]:
    if users is None:
        return {}
    if not isinstance(users, dict):
        raise ConfigError(path, "basic_auth_users", "expected a mapping of user names to bcrypt hashes")
    out = {}
    for user, hashed in users.items():
        key = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user:
            raise ConfigError(path, key, "user names must be non-empty strings (quote it)")
        if ":" in user:
            raise ConfigError(path, key, "a user name cannot hold ':' (basic auth splits user and password there)")
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            # Never echo the value: it may be a clear-text password put there by mistake.
            raise ConfigError(path, key, "not a bcrypt hash ($2a$, $2b$ or $2y$, cost, 53 characters); make one "
                                         "with: htpasswd -nBC 10 \"\" | tr -d ':\\n'")
        if not 4 <= int(_BCRYPT.match(hashed).group(1)) <= 31:
            raise ConfigError(path, key, "bcrypt cost must be 4 to 31")
        out[user.encode("utf-8")] = hashed.encode("ascii")
    return out


def _normal_san(value: str) -> str:
    """IP addresses compared in one spelling (OpenSSL writes IPv6 in full, people write it short)."""
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        return value


def peer_sans(cert: dict | None) -> set[str]:
    """The DNS names, IP addresses, e-mail addresses and URIs of a verified peer certificate (getpeercert())."""
    out = set()
    for kind, value in (cert or {}).get("subjectAltName", ()):
        if kind in ("DNS", "IP Address", "email", "URI"):
            out.add(_normal_san(value))
    return out


# -- basic auth ------------------------------------------------------------------------------

def _credentials(header: str | None) -> tuple[bytes, bytes] | None:
    """(user, password) from an `Authorization: Basic ...` header; None when there is none or it is malformed."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    return (user, password) if sep else None


class BasicAuth:
    """Checks basic auth against bcrypt hashes.

    bcrypt takes 50-250 ms by design, too slow for every scrape: a successful check is
    remembered under a salted hash of the user and password (as exporter-toolkit caches
    them), so a scraper pays once. A failed check always costs one bcrypt: an unknown
    user is checked against a dummy hash of the configured users' highest cost, so the
    time does not tell which users exist. One bcrypt runs at a time, so a flood of bad
    guesses takes one core, not all of them; remembered scrapers do not wait for it.
    """

    def __init__(self, users: dict[bytes, bytes]) -> None:
        self.users = users
        cost = max(int(h[4:6]) for h in users.values())
        self._dummy = bcrypt.hashpw(os.urandom(16).hex().encode(), bcrypt.gensalt(cost))
        self._salt = os.urandom(32)  # the cache's keys are no rainbow-table lookup of the passwords
        self._ok: set[bytes] = set()
        self._bcrypt = threading.Lock()

    def _key(self, user: bytes, password: bytes) -> bytes:
        return hashlib.sha256(self._salt + len(user).to_bytes(4, "big") + user + password).digest()

    def check(self, header: str | None) -> bool:
        """True when the Authorization header names a configured user with the right password."""
        creds = _credentials(header)
        if creds is None:
            return False
        user, password = creds
        key = self._key(user, password)
        if key in self._ok:
            return True
        hashed = self.users.get(user)
        too_long = len(password) > MAX_PASSWORD_BYTES
        with self._bcrypt:
            try:
                ok = bcrypt.checkpw(b"x" if too_long else password, hashed or self._dummy)
            except ValueError:  # input bcrypt refuses: a failure like any other
                ok = False
        if not (ok and hashed is not None and not too_long):
            return False
        if len(self._ok) >= AUTH_CACHE_SIZE:
            self._ok.clear()
        self._ok.add(key)
        return True
