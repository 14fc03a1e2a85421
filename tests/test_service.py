"""`ridge service` and packaging/: the units written from the templates with
this installation's paths, `systemd-analyze verify` on them, the default
config file, and the explanations where systemd is absent (as on this machine:
systemctl may be installed, but PID 1 is not systemd)."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ridge.daemon.cli import service
from ridge.daemon.cli.config import add_serve_args, all_options, default_config, resolve
from ridge.daemon.transport.endpoint import EndpointError, load_curve
from ridge.daemon.cli.serve import check_listeners

ROOT = Path(__file__).resolve().parent.parent
RIDGE = Path(sys.executable).parent / "ridge"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (.ci/run installs it)")


def ridge(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ridge.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (units repeat keys, which configparser cannot hold)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, value = line.split("=", 1)
        section.setdefault(key, []).append(value)
    return out


def verify(unit: Path, user: bool, tmp: Path) -> None:
    """`systemd-analyze verify` exits 0 even for unknown keys and bad values, so its output must be empty."""
    env = dict(os.environ)
    if user:
        run = tmp / "xdg-run"
        run.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(run)
    r = subprocess.run([ANALYZE, *(["--user"] if user else []), "verify", str(unit)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


@pytest.fixture()
def home(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RIDGE_", "XDG_"))}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_RUNTIME_DIR=str(tmp_path / "run"), PYTHONPATH=str(ROOT))
    (tmp_path / "home").mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    return env


def test_user_install_status_uninstall(home, tmp_path):
    r = ridge("service", "install", "--user", env=home)
    assert r.returncode == 0, r.stderr
    unit_path = tmp_path / "config/systemd/user/ridge.service"
    config_path = tmp_path / "config/ridge/config.toml"
    assert f"wrote {unit_path}" in r.stdout and f"wrote {config_path}" in r.stdout
    if service.systemd_missing():  # here: says so, and what to run where systemd is
        assert "not enabled" in r.stdout and "systemctl --user enable --now ridge.service" in r.stdout

    unit = parse_unit(unit_path.read_text())
    s = unit["Service"]
    assert s["ExecStart"] == [f"{RIDGE} serve"] and RIDGE.is_file()
    assert s["Type"] == ["notify"] and s["Restart"] == ["on-failure"] and s["WatchdogSec"] == ["60"]
    assert s["TimeoutStopSec"] == ["45s"]  # drain_grace 30 + 15
    assert f"RIDGE_CONFIG={config_path}" in s["Environment"]
    assert s["NoNewPrivileges"] == ["yes"] and s["KillMode"] == ["mixed"]
    assert unit["Install"]["WantedBy"] == ["default.target"]
    assert unit["Unit"]["Documentation"] == [(ROOT / "docs/service.md").as_uri()]
    assert (config_path.stat().st_mode & 0o777) == 0o600
    assert config_path.read_text() == default_config()
    if ANALYZE:
        verify(unit_path, True, tmp_path)

    # a second install keeps the user's config and rewrites the unit (the upgrade path)
    config_path.write_text("drain_grace = 100.0\n")
    r = ridge("service", "install", "--user", env=home)
    assert r.returncode == 0 and f"kept {config_path}" in r.stdout
    assert parse_unit(unit_path.read_text())["Service"]["TimeoutStopSec"] == ["115s"]

    r = ridge("service", "status", "--user", env=home)
    assert r.returncode == 0, r.stderr
    assert f"user unit: {unit_path}" in r.stdout and f"ExecStart={RIDGE} serve" in r.stdout
    assert "daemon: not listening on ipc://" in r.stdout

    r = ridge("service", "uninstall", "--user", env=home)
    assert r.returncode == 0 and f"removed {unit_path}" in r.stdout
    assert not unit_path.exists() and config_path.exists()
    r = ridge("service", "status", "--user", env=home)
    assert r.returncode == 0 and "not installed" in r.stdout


def test_install_with_the_http_gateway(tmp_path, monkeypatch, capsys):
    """`--http ADDR` puts the gateway on the unit's command line; a non-loopback address is refused
    unless the config file names an API key, so a unit that could not start is never written. The
    system service's gateway always has a key, loopback or not: without one in the config, install
    makes /etc/ridge/api_key (0640, for group ridge) and the unit passes it; a second install keeps it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    user = service.Scope(False, tmp_path / "user-root")
    assert service.install(user, http="0.0.0.0:8000") == 1
    assert "API key" in capsys.readouterr().err and not user.unit_path.exists()
    system = service.Scope(True, tmp_path / "root")
    assert service.install(system, http="127.0.0.1:8000") == 0
    made = system.root / "etc/ridge/api_key"
    unit = parse_unit(system.unit_path.read_text())["Service"]
    assert unit["ExecStart"] == [f"{RIDGE} serve --system --http 127.0.0.1:8000 --api-key-file /etc/ridge/api_key"]
    (key_text,) = made.read_text().splitlines()
    assert len(key_text) >= 32 and (made.stat().st_mode & 0o777) == 0o640
    assert "Authorization: Bearer" in capsys.readouterr().out
    if ANALYZE:
        verify(system.unit_path, False, tmp_path)
    assert service.install(system, http="127.0.0.1:8001") == 0 and made.read_text() == key_text + "\n"
    key = tmp_path / "api_key"
    key.write_text("k\n")
    system.config_path.write_text(f'api_key_file = "{key}"\n')
    assert service.install(system, http="0.0.0.0:8000") == 0  # the config's key makes it allowed
    unit = parse_unit(system.unit_path.read_text())["Service"]
    assert unit["ExecStart"] == [f"{RIDGE} serve --system --http 0.0.0.0:8000"]  # the config's key serves
    assert service.install(user, http="127.0.0.1:8001") == 0
    capsys.readouterr()
    assert service.status(user) == 0
    out = capsys.readouterr().out
    assert "serve --http 127.0.0.1:8001" in out and "gateway: not answering on http://127.0.0.1:8001/v1" in out


def test_the_system_daemon_refuses_keyless_tcp_and_http(home, tmp_path):
    """Loopback TCP and HTTP reach past the system socket's group check, so on the system daemon they
    need CURVE and an API key, or the daemon refuses to start, naming the options to set."""
    import zmq.auth

    no_file = ("--config", str(tmp_path / "absent.toml"))

    def values(*argv):
        p = argparse.ArgumentParser()
        add_serve_args(p)
        return resolve(p.parse_args([*no_file, *argv]), environ={}).values

    with pytest.raises(EndpointError, match="system daemon without an API key.*api_key_file"):
        check_listeners(values("--system", "--http", "127.0.0.1:8000"), True, None)
    assert check_listeners(values("--system", "--http", "127.0.0.1:8000", "--api-key", "k"), True, None).api_key == "k"
    assert check_listeners(values("--http", "127.0.0.1:8000"), False, None).api_key is None  # the user daemon
    with pytest.raises(EndpointError, match="system daemon without CURVE.*curve_secret_key_file"):
        check_listeners(values("--system", "--tcp", "tcp://127.0.0.1:5555"), True, None)
    with pytest.raises(EndpointError, match="leave pub_endpoint unset"):
        check_listeners(values("--system", "--pub-endpoint", "tcp://127.0.0.1:5556"), True, None)
    check_listeners(values("--tcp", "tcp://127.0.0.1:5555", "--pub-endpoint", "tcp://127.0.0.1:5556"), False, None)
    (tmp_path / "clients").mkdir()
    _, secret = zmq.auth.create_certificates(tmp_path, "server")
    curve = load_curve(secret, str(tmp_path / "clients"))
    assert check_listeners(values("--system", "--tcp", "tcp://127.0.0.1:5555"), True, curve) is None
    # the commands themselves, before any model loads or /run/ridge is touched
    for argv, option in ((("serve", "--system", "--http", "127.0.0.1:8000"), "api_key_file"),
                         (("serve", "--system", "--tcp", "tcp://127.0.0.1:5555"), "curve_secret_key_file"),
                         (("gateway", "--endpoint", "ipc:///run/ridge/ridge.sock", "--http", "127.0.0.1:8000"),
                          "api_key_file")):
        r = ridge(*argv, *no_file, env=home)
        assert r.returncode == 1 and option in r.stderr and "system daemon" in r.stderr, (argv, r.stderr)


def test_system_install_staged(home, tmp_path):
    root = tmp_path / "root"
    r = ridge("service", "install", "--system", "--root", str(root), env=home)
    assert r.returncode == 0, r.stderr
    unit_path = root / "etc/systemd/system/ridge.service"
    unit = parse_unit(unit_path.read_text())
    s = unit["Service"]
    assert s["ExecStart"] == [f"{RIDGE} serve --system"]
    assert s["User"] == ["ridge"] and s["Group"] == ["ridge"]
    assert s["RuntimeDirectory"] == ["ridge"] and s["RuntimeDirectoryMode"] == ["0750"]
    assert "RIDGE_CONFIG=/etc/ridge/config.toml" in s["Environment"]  # the target path, not the staging one
    for key, want in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                      ("DevicePolicy", "closed"), ("ProtectKernelModules", "yes")):
        assert s[key] == [want], key
    assert "char-nvidia* rw" in s["DeviceAllow"]
    assert "PrivateDevices" not in s and "MemoryDenyWriteExecute" not in s  # the GPU, and JIT compilers
    groups = s.get("SupplementaryGroups", [""])[0].split()
    assert set(groups) <= {"video", "render"}
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert (root / "etc/ridge/config.toml").read_text() == default_config()
    assert "u     ridge" in (root / "etc/sysusers.d/ridge.conf").read_text()
    assert "staged under" in r.stdout
    if ANALYZE:
        verify(unit_path, False, tmp_path)


@needs_analyze
def test_units_fail_verify_when_broken(tmp_path):
    """The check above would catch a typo: verify's complaint is on stderr, with exit status 0."""
    vals = service.values(service.Scope(True, tmp_path))
    text = service.render(service.template(service.Scope(True, tmp_path)), vals).replace(
        "ProtectSystem=strict", "ProtectSytem=strict")
    bad = tmp_path / "ridge.service"
    bad.write_text(text)
    with pytest.raises(AssertionError, match="Unknown key"):
        verify(bad, False, tmp_path)


def test_system_install_needs_root_or_a_staging_root(home):
    if os.geteuid() == 0:
        pytest.skip("running as root")
    r = ridge("service", "install", "--system", env=home)
    assert r.returncode == 1 and "sudo" in r.stderr


def test_render_fills_and_drops_empty_settings():
    out = service.render("A=@X@\nB=@Y@\n# @Z@ stays in comments\nC=modprobe@a.service modprobe@b.service\n",
                         {"X": "1", "Y": ""})
    assert out == "A=1\n# @Z@ stays in comments\nC=modprobe@a.service modprobe@b.service\n"
    with pytest.raises(ValueError, match="unfilled"):
        service.render("A=@NOPE@\n", {})
    assert service._unit_word("/opt/my env/bin/ridge") == '"/opt/my env/bin/ridge"'
    assert service._unit_word("/a/100%/b$") == "/a/100%%/b$$"


def test_default_config_lists_every_option_and_is_the_shipped_file(tmp_path):
    text = default_config()
    assert (ROOT / "packaging/config.toml").read_text() == text, \
        "packaging/config.toml is stale: ridge service config > packaging/config.toml"
    assert tomllib.loads(text) == {}  # all commented out
    names = {o.name for o in all_options()}
    uncommented = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# ") and " = " in line
                            and line[2:].split(" = ")[0] in names)
    values = tomllib.loads(uncommented)
    assert set(values) == names
    path = tmp_path / "config.toml"
    path.write_text(uncommented)
    res = resolve(argparse.Namespace(config=str(path)), environ={})
    assert all(src.startswith("file ") for src in res.sources.values())
    defaults = {o.name: o.default for o in all_options() if o.default is not None}
    assert {k: res.values[k] for k in defaults} == defaults  # uncommented, the file changes nothing
