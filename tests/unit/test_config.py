"""Configuration: defaults, file, overrides, and errors that name the file, the key and the reason."""
import dataclasses
import re
from pathlib import Path

import pytest

from gpuwatch.agent import config
from gpuwatch.agent.config import SETTINGS, ConfigError, load

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_DEFAULT_PATH = config.DEFAULT_PATH


def write(tmp_path, text, name="gpuwatch.toml"):
    p = tmp_path / name
    p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
    return str(p)


@pytest.fixture(autouse=True)
def no_system_config(monkeypatch, tmp_path):
    # Never read the machine's /etc/gpuwatch/gpuwatch.toml.
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "absent" / "gpuwatch.toml"))


def test_defaults():
    c = load(None, {})
    assert c.path is None
    assert c.agent.state_dir == "/var/lib/gpuwatch"
    assert c.agent.runtime_dir == "/run/gpuwatch"
    assert (c.agent.log_level, c.agent.log_format) == ("info", "text")
    assert c.control.socket == "/run/gpuwatch/control.sock"
    assert c.control.group == ""
    assert c.prometheus.enabled is True
    assert c.prometheus.listen == f"127.0.0.1:{config.DEFAULT_PROMETHEUS_PORT}"
    assert c.nvml == config.NvmlConfig(enabled=True, interval=1.0, slow_interval=10.0, deadline=5.0,
                                       max_processes_per_gpu=16, xid_events=True, replay="", replay_gpus=0,
                                           replay_processes_per_gpu=0)
    assert c.history.points == 720


def test_every_setting_reaches_the_config_with_its_default():
    c = load(None, {})
    for s in SETTINGS:
        if s.name != "control.socket":  # filled in from runtime_dir
            assert getattr(getattr(c, s.section), s.key) == s.default, s.name


def test_config_is_immutable():
    c = load(None, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nvml.interval = 2.0


def test_default_path_is_read_when_it_exists(tmp_path, monkeypatch):
    p = write(tmp_path, "[nvml]\ninterval = 3\n")
    monkeypatch.setattr(config, "DEFAULT_PATH", p)
    c = load(None, {})
    assert c.path == p and c.nvml.interval == 3.0


def test_file_values(tmp_path):
    p = write(tmp_path, """
[agent]
state_dir = "/srv/gw"
log_level = "DEBUG"
[control]
group = "root"
[prometheus]
listen = "[::1]:9400"
enabled = false
[nvml]
interval = 2          # an integer is fine for seconds
deadline = 0.5
max_processes_per_gpu = 4
replay_gpus = 8
[history]
points = 60
""")
    c = load(p, {})
    assert c.path == p
    assert c.agent.state_dir == "/srv/gw"
    assert c.agent.log_level == "debug"
    assert c.control.group == "root"
    assert c.prometheus.listen == "[::1]:9400" and c.prometheus.enabled is False
    assert c.nvml.interval == 2.0 and isinstance(c.nvml.interval, float)
    assert (c.nvml.deadline, c.nvml.max_processes_per_gpu, c.nvml.replay_gpus) == (0.5, 4, 8)
    assert c.history.points == 60


def test_socket_follows_runtime_dir_unless_set(tmp_path):
    assert load(write(tmp_path, '[agent]\nruntime_dir = "/run/x"\n'), {}).control.socket == "/run/x/control.sock"
    p = write(tmp_path, '[agent]\nruntime_dir = "/run/x"\n[control]\nsocket = "/run/y.sock"\n')
    assert load(p, {}).control.socket == "/run/y.sock"


def test_overrides_beat_the_file_and_none_means_not_given(tmp_path):
    p = write(tmp_path, '[nvml]\ninterval = 2.0\nenabled = true\n[prometheus]\nlisten = "0.0.0.0:1"\n')
    c = load(p, {"nvml.interval": 0.25, "nvml.enabled": False, "prometheus.listen": None})
    assert c.nvml.interval == 0.25
    assert c.nvml.enabled is False
    assert c.prometheus.listen == "0.0.0.0:1"


def test_overrides_as_text_from_environment_variables(tmp_path):
    c = load(None, {"nvml.interval": "0.5", "nvml.xid_events": "off", "history.points": "10",
                    "agent.log_format": "json"})
    assert (c.nvml.interval, c.nvml.xid_events, c.history.points, c.agent.log_format) == (0.5, False, 10, "json")


def test_relative_paths_in_overrides_are_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load(None, {"agent.state_dir": "state"}).agent.state_dir == str(tmp_path / "state")


def test_replay_file_must_exist(tmp_path):
    rec = write(tmp_path, "{}", name="h200.json")
    assert load(None, {"nvml.replay": rec}).nvml.replay == rec
    with pytest.raises(ConfigError, match=r"nvml\.replay: no such file: .*missing\.json"):
        load(None, {"nvml.replay": str(tmp_path / "missing.json")})


def test_overrides_from_click_params():
    got = config.overrides_from_params({"nvml_interval": 2.0, "socket_group": None, "prometheus": False,
                                        "config": "/x.toml", "listen": "[::1]:1"})
    assert got == {"nvml.interval": 2.0, "prometheus.enabled": False, "prometheus.listen": "[::1]:1"}


def test_env_names_and_flags_are_unique_and_prefixed():
    envs = [s.env for s in SETTINGS]
    flags = [s.flag for s in SETTINGS]
    assert len(set(envs)) == len(envs)
    assert len(set(flags)) == len(flags)
    assert len({s.param for s in SETTINGS}) == len(SETTINGS)
    assert config.CONFIG_ENV not in envs
    for s in SETTINGS:
        assert re.fullmatch(r"GPUWATCH_[A-Z0-9_]+", s.env), s.env
        assert re.fullmatch(r"--[a-z0-9-]+", s.flag), s.flag
        assert s.help and s.expect
    assert config.BY_NAME["prometheus.listen"].env == "GPUWATCH_LISTEN"
    assert config.BY_NAME["prometheus.enabled"].decls == "--prometheus/--no-prometheus"


def test_every_default_passes_its_own_validation():
    for s in SETTINGS:
        assert config._validate(s, s.default, "defaults", from_text=False) == s.default


# -- errors ------------------------------------------------------------------------------

def err(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load(path, overrides or {})
    return str(e.value)


def test_the_documented_example_message(tmp_path):
    p = write(tmp_path, '[nvml]\ninterval = "fast"\n')
    assert err(p) == f'{p}: nvml.interval: expected a number of seconds > 0, got "fast"'


def test_unknown_key_suggests_the_closest(tmp_path):
    p = write(tmp_path, "[nvml]\nintervall = 2\n")
    assert err(p) == f"{p}: nvml.intervall: unknown setting (did you mean nvml.interval?)"


def test_key_in_the_wrong_section_points_to_the_right_one(tmp_path):
    p = write(tmp_path, "[agent]\ninterval = 2\n")
    assert err(p) == f"{p}: agent.interval: unknown setting (did you mean nvml.interval or otlp.interval or baseline.interval or host.interval?)"


def test_unknown_section_suggests_the_closest(tmp_path):
    p = write(tmp_path, "[promethus]\nlisten = '127.0.0.1:1'\n")
    assert err(p) == f"{p}: unknown section [promethus] (did you mean [prometheus]?)"
    p = write(tmp_path, "[zzz]\n")
    assert "known sections: agent, control, prometheus, nvml, ebpf, history" in err(p)


def test_key_outside_any_section(tmp_path):
    p = write(tmp_path, "interval = 2\n")
    assert err(p) == f"{p}: interval: unknown setting outside any section (settings go in sections: did you mean nvml.interval or otlp.interval or baseline.interval or host.interval?)"


def test_section_that_is_not_a_table(tmp_path):
    p = write(tmp_path, "nvml = 3\n")
    assert "nvml: expected a [nvml] section, got 3" in err(p)


def test_nested_table_is_unknown(tmp_path):
    p = write(tmp_path, "[nvml.extra]\nx = 1\n")
    assert err(p) == f"{p}: nvml.extra: unknown setting"


@pytest.mark.parametrize("text, key, reason", [
    ("[nvml]\ninterval = 0", "nvml.interval", "expected a number of seconds > 0, got 0"),
    ("[nvml]\ninterval = -1.5", "nvml.interval", "expected a number of seconds > 0, got -1.5"),
    ("[nvml]\ninterval = inf", "nvml.interval", "expected a number of seconds > 0, got inf"),
    ("[nvml]\ndeadline = true", "nvml.deadline", "expected a number of seconds > 0, got true"),
    ("[nvml]\nenabled = 1", "nvml.enabled", "expected true or false, got 1"),
    ("[nvml]\nenabled = \"yes\"", "nvml.enabled", 'expected true or false, got "yes"'),
    ("[nvml]\nmax_processes_per_gpu = 2.5", "nvml.max_processes_per_gpu", "expected an integer >= 1, got 2.5"),
    ("[nvml]\nmax_processes_per_gpu = 0", "nvml.max_processes_per_gpu", "expected an integer >= 1, got 0"),
    ("[nvml]\nreplay_gpus = -1", "nvml.replay_gpus", "expected an integer >= 0, got -1"),
    ("[history]\npoints = [1]", "history.points", "expected an integer >= 1, got a list"),
    ("[agent]\nlog_level = \"loud\"", "agent.log_level", 'expected one of debug, info, warning, error, got "loud"'),
    ("[agent]\nstate_dir = \"var/lib\"", "agent.state_dir", 'expected an absolute path, got "var/lib"'),
    ("[agent]\nstate_dir = 5", "agent.state_dir", "expected an absolute path, got 5"),
    ("[control]\ngroup = \"no-such-group-gw\"", "control.group", "no such group: 'no-such-group-gw'"),
    ("[prometheus]\nlisten = \"::1:9835\"", "prometheus.listen", "an IPv6 address needs brackets: [::1]:9835"),
    ("[prometheus]\nlisten = \"127.0.0.1\"", "prometheus.listen", "expected HOST:PORT with a port 0-65535"),
    ("[prometheus]\nlisten = \"127.0.0.1:70000\"", "prometheus.listen", "expected HOST:PORT with a port 0-65535"),
    ("[prometheus]\nlisten = \":9835\"", "prometheus.listen", "no host in ':9835'"),
    ("[prometheus]\nlisten = \"[fe80::zz]:1\"", "prometheus.listen", "[fe80::zz] is not an IPv6 address"),
    ("[prometheus]\nlisten = \"bad host:1\"", "prometheus.listen", "'bad host' is not an IP address or host name"),
])
def test_wrong_values(tmp_path, text, key, reason):
    p = write(tmp_path, text + "\n")
    msg = err(p)
    assert msg.startswith(f"{p}: {key}: "), msg
    assert reason in msg


@pytest.mark.parametrize("listen, host", [("127.0.0.1:9835", "127.0.0.1"), ("[::]:1", "::"),
                                          ("gpu-node-7.example.com:0", "gpu-node-7.example.com"),
                                          ("0.0.0.0:9835", "0.0.0.0")])
def test_listen_addresses_accepted(listen, host):
    assert config.parse_listen(listen)[0] == host
    assert load(None, {"prometheus.listen": listen}).prometheus.listen == listen


def test_bad_override_names_the_flag_and_variable():
    assert err(None, {"nvml.interval": "fast"}) == \
        '--nvml-interval / $GPUWATCH_NVML_INTERVAL: nvml.interval: expected a number of seconds > 0, got "fast"'
    assert "expected true or false" in err(None, {"prometheus.enabled": "maybe"})
    assert "expected an integer >= 1" in err(None, {"history.points": "2.5"})


def test_pool_libraries_are_glob_name_pairs(tmp_path):
    p = write(tmp_path, '[ebpf]\npool_libraries = " libfakepool.so*=fakepool ,, */myco/libarena.so=arena,"\n')
    assert load(p, {}).ebpf.pool_libraries == "libfakepool.so*=fakepool,*/myco/libarena.so=arena"
    assert load(None, {"ebpf.pool_libraries": "libx.so=pytorch"}).ebpf.pool_libraries == "libx.so=pytorch"
    assert load(None, {}).ebpf.pool_libraries == ""
    for value, reason in [
            ("libfakepool.so", "'libfakepool.so' has no allocator name: expected GLOB=NAME pairs separated by "
                               "commas, e.g. \"libmypool.so*=mypool\""),
            ("=fakepool", "'=fakepool' has no library glob before \"=\""),
            ("libx.so=my pool", "'libx.so=my pool': the allocator name 'my pool' may hold only letters, digits "
                                "and . _ + - (1 to 64 of them)"),
            ("libx.so=", "'libx.so=': the allocator name '' may hold only letters, digits and . _ + - (1 to 64 of "
                         "them)"),
            ("**=all", "'**=all': the glob '**' names no library (it would match every file)"),
            ("*.so*=all", "'*.so*=all': the glob '*.so*' matches libcudart.so.13, which every allocation's call "
                          "stack runs through; name the allocator's own library"),
            ("libx.so=ok, libc.so*=c", "'libc.so*=c': the glob 'libc.so*' matches libc.so.6, which every "
                                       "allocation's call stack runs through; name the allocator's own library"),
            ("libx.so=none", "'libx.so=none': 'none' means outside any allocator; choose another name")]:
        assert err(None, {"ebpf.pool_libraries": value}) == (
            f"--ebpf-pool-libraries / $GPUWATCH_EBPF_POOL_LIBRARIES: ebpf.pool_libraries: {reason}"), value
    p = write(tmp_path, '[ebpf]\npool_libraries = ["libx.so=x"]\n')
    assert err(p) == f"{p}: ebpf.pool_libraries: expected GLOB=NAME pairs separated by commas, or empty, got a list"


def test_unknown_override_is_refused():
    assert "nvml.intervl: unknown setting (did you mean nvml.interval?)" in err(None, {"nvml.intervl": 1})


def test_invalid_toml_gives_the_line(tmp_path):
    p = write(tmp_path, "[nvml]\ninterval = 1\njunk junk\n")
    msg = err(p)
    assert msg.startswith(f"{p}: invalid TOML: ") and "line 3" in msg


def test_truncated_toml_gives_the_line(tmp_path):
    p = write(tmp_path, "[nvml]\ninterval =")
    assert "line 2" in err(p)


def test_duplicate_key_is_invalid_toml(tmp_path):
    p = write(tmp_path, "[nvml]\ninterval = 1\ninterval = 2\n")
    assert err(p).startswith(f"{p}: invalid TOML: ")


def test_empty_and_comment_only_files_mean_defaults(tmp_path):
    assert load(write(tmp_path, ""), {}).nvml.interval == 1.0
    assert load(write(tmp_path, "# nothing\n\n[nvml]\n"), {}).history.points == 720


def test_non_utf8(tmp_path):
    p = write(tmp_path, b'[agent]\nstate_dir = "/var/lib/\xff"\n')
    assert err(p) == f"{p}: not UTF-8 text: byte 0xff on line 2 (TOML files must be UTF-8)"


def test_huge_file(tmp_path):
    p = write(tmp_path, "# " + "x" * (config.MAX_FILE_BYTES + 10) + "\n")
    assert err(p).startswith(f"{p}: file is larger than {config.MAX_FILE_BYTES} bytes")


def test_missing_explicit_path(tmp_path):
    p = str(tmp_path / "nope.toml")
    assert err(p) == f"{p}: no such file"


def test_directory_as_path(tmp_path):
    assert err(str(tmp_path)) == f"{tmp_path}: is a directory, not a file"


# -- generated documents --------------------------------------------------------------------

def test_configuration_doc_is_current(monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_PATH", SHIPPED_DEFAULT_PATH)
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config.render_config_doc(), \
        "regenerate: python -m gpuwatch.agent.config docs > docs/configuration.md"


def test_sample_config_is_current_and_lists_every_setting_at_its_default(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_PATH", SHIPPED_DEFAULT_PATH)
    sample = (ROOT / "systemd" / "gpuwatch.toml").read_text()
    assert sample == config.render_sample_config(), \
        "regenerate: python -m gpuwatch.agent.config sample > systemd/gpuwatch.toml"
    # As shipped (all commented out) it is the defaults; uncommented, still the defaults.
    defaults = load(None, {"agent.state_dir": None})
    assert dataclasses.replace(load(write(tmp_path, sample), {}), path=None) == defaults
    uncommented = re.sub(r"^#(\w+ = )", r"\1", sample, flags=re.M)
    c = load(write(tmp_path, uncommented, name="u.toml"), {})
    assert dataclasses.replace(c, path=None) == defaults
    for s in SETTINGS:
        assert re.search(rf"^\[{s.section}\]$", sample, re.M)
        assert re.search(rf"^#{s.key} = ", sample, re.M), s.name


# -- anything at all in the file: ConfigError naming the file, or a config; never another exception ---

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_KEYS = sorted({s.key for s in SETTINGS}) + ["x", "intervall"]
_SECTION_NAMES = list(dict.fromkeys(s.section for s in SETTINGS)) + ["zzz"]
_TOML_VALUES = st.one_of(
    st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
    st.sampled_from(["/abs/path", "127.0.0.1:1", "[::1]:0", "debug", "grpc", "root", "", "var/lib"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _toml_scalar(v) -> str:
    import json as _json
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == float("-inf") else repr(v))
    if isinstance(v, str):
        return _json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_json.dumps(k)} = {_toml_scalar(x)}" for k, x in v.items()) + "}"
    return str(v)


@st.composite
def _toml_documents(draw) -> bytes:
    """Structurally valid TOML over real and wrong sections, keys and value types."""
    lines = []
    for section in draw(st.lists(st.sampled_from(_SECTION_NAMES), max_size=4, unique=True)):
        lines.append(f"[{section}]")
        for key in draw(st.lists(st.sampled_from(_KEYS), max_size=4, unique=True)):
            lines.append(f"{key} = {_toml_scalar(draw(_TOML_VALUES))}")
    return "\n".join(lines).encode()


def _load_or_config_error(tmp_path, data: bytes) -> None:
    p = tmp_path / "fuzz.toml"
    p.write_bytes(data)
    try:
        load(str(p), {})
    except ConfigError as e:
        assert e.source == str(p) and str(e).startswith(f"{p}: "), str(e)
        assert e.reason and "Traceback" not in e.reason


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_random_bytes_load_or_raise_config_error_naming_the_file(tmp_path, data):
    _load_or_config_error(tmp_path, data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_random_text_loads_or_raises_config_error_naming_the_file(tmp_path, text):
    _load_or_config_error(tmp_path, text.encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_toml_documents())
def test_random_toml_with_real_and_wrong_keys_and_types(tmp_path, doc):
    _load_or_config_error(tmp_path, doc)


@pytest.mark.parametrize("data, reason", [
    (b"\xef\xbb\xbf[nvml]\ninterval = 2\n", "invalid TOML"),  # a UTF-8 byte order mark
    (b"\x00\x01\x02\x03", "invalid TOML"),
    (b"\xff\xfe[\x00n\x00", "not UTF-8 text"),  # UTF-16
    (b"[nvml]\ninterval = 2\n" + b"\x80", "not UTF-8 text: byte 0x80 on line 3"),
    (b'[agent]\nstate_dir = "/a\x00b"\n', "invalid TOML"),
])
def test_binary_junk(tmp_path, data, reason):
    p = write(tmp_path, data)
    msg = err(p)
    assert msg.startswith(f"{p}: ") and reason in msg, msg


def test_a_path_that_is_a_character_device_is_refused_not_read_forever(tmp_path):
    # /dev/zero never ends, a FIFO may block its opener for ever: neither is read at all.
    assert err("/dev/zero") == "/dev/zero: is a device, not a regular file"


def test_unreadable_file(tmp_path):
    p = write(tmp_path, "[nvml]\n")
    os_chmod = __import__("os").chmod
    os_chmod(p, 0)
    try:
        if __import__("os").geteuid() == 0:
            pytest.skip("root reads any file")
        assert err(p) == f"{p}: cannot read: Permission denied"
    finally:
        os_chmod(p, 0o600)


def test_deeply_nested_toml_is_a_config_error(tmp_path):
    p = write(tmp_path, "x = " + "[" * 5000 + "]" * 5000 + "\n")
    msg = err(p)
    assert msg.startswith(f"{p}: "), msg
