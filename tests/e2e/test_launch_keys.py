"""`mlxgw launch` and the operator's keys, against a real `mlxgw up` with keys on: launch never
revokes, replaces or makes again a key by name, and a key it makes has the least rights that
serve its client; a config that is a symlink is written through to its target."""

from __future__ import annotations

import getpass
import json

import pytest
import yaml
from helpers.gateway import start_gateway
from test_launch import ECHO_CONFIG, launch, stand_in

from mlxgw.gateway.access.key_admin import create_key, revoke_key


@pytest.fixture
def user_home(tmp_path):
    """A fresh HOME and MLXGW_HOME for the launched client (as test_launch.py's)."""
    (tmp_path / "user").mkdir()
    return tmp_path


@pytest.fixture
def keys_home(tmp_path):
    """A gateway of its own with keys on (each test edits its keys file)."""
    home = tmp_path / "keys-home"
    create_key(home / "keys.yaml", "operator", {"admin": True})
    gw = start_gateway(home, ECHO_CONFIG, "launch-own-keys", extra_args=("--keys", str(home / "keys.yaml")))
    yield gw, home
    gw.stop()


def _entries(home) -> dict[str, dict]:
    return {k["name"]: k for k in yaml.safe_load((home / "keys.yaml").read_text())["keys"]}


def _claude(user_home, tmp_path, gw, home):
    bin_dir = stand_in(tmp_path / "bin", "claude")
    return launch(user_home, gw.url, "claude", "--", "-p", "hi", path_dirs=[bin_dir], mlxgw_home=home)


def test_a_key_launch_makes_has_no_admin_and_only_the_launched_model(keys_home, user_home, tmp_path):
    gw, home = keys_home
    done = _claude(user_home, tmp_path, gw, home)
    assert done.returncode == 0, done.stderr
    entry = _entries(home)[f"launch-{getpass.getuser()}"]
    assert entry["models"] == ["echo-agent"] and not entry.get("admin") and not entry.get("manage_models"), entry
    again = _claude(user_home, tmp_path, gw, home)  # the limited key still serves the client
    assert again.returncode == 0, again.stderr


def test_an_operator_restricted_key_of_launchs_name_is_never_replaced(keys_home, user_home, tmp_path):
    """On main launch revoked it and made an unrestricted key under the same name."""
    gw, home = keys_home
    name = f"launch-{getpass.getuser()}"
    create_key(home / "keys.yaml", name, {"models": ["echo-other"], "rpm": 5})
    before = _entries(home)[name]
    done = _claude(user_home, tmp_path, gw, home)
    assert done.returncode == 2 and "never replaces a key" in done.stderr, done.stderr
    assert _entries(home)[name] == before


def test_a_revoked_launch_key_stays_revoked(keys_home, user_home, tmp_path):
    """On main the next launch made the revoked name again, unrestricted."""
    gw, home = keys_home
    assert _claude(user_home, tmp_path, gw, home).returncode == 0
    name = f"launch-{getpass.getuser()}"
    revoke_key(home / "keys.yaml", name)
    done = _claude(user_home, tmp_path, gw, home)
    assert done.returncode == 2 and "revoked" in done.stderr and "--key" in done.stderr, done.stderr
    assert name not in _entries(home)


def test_a_symlinked_config_is_written_through_its_link(keys_home, user_home, tmp_path):
    """A dotfiles repository's link stays a link; its target gets the settings (on main the
    link was replaced by a regular file)."""
    gw, home = keys_home
    dotfiles = tmp_path / "dotfiles" / "opencode.json"
    dotfiles.parent.mkdir()
    dotfiles.write_text(json.dumps({"theme": "tokyonight"}))
    config = user_home / "user" / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    config.symlink_to(dotfiles)
    bin_dir = stand_in(tmp_path / "bin", "opencode")
    done = launch(user_home, gw.url, "opencode", "--", "run", path_dirs=[bin_dir], mlxgw_home=home)
    assert done.returncode == 0, done.stderr
    assert config.is_symlink() and config.resolve() == dotfiles.resolve()
    written = json.loads(dotfiles.read_text())
    assert written["theme"] == "tokyonight" and "mlxgw" in written["provider"]
