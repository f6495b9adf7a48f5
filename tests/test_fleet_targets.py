"""Fleet campaigns without a cluster: the targets file, and bad input to ``fuzz campaign --ray``
(one line, exit 2, nothing stored)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from click.testing import CliRunner

from fuzzer.cli import cli
from fuzzer.fleet.targets import NODE_SHARE, FleetError, load, parse


def test_a_targets_file_names_each_server_and_where_its_worker_runs(tmp_path):
    path = tmp_path / "targets.toml"
    path.write_text(
        '[[target]]\nname = "h100"\nurl = "http://10.0.0.5:8000"\nnode = "10.0.0.5"\nkind = "vllm"\n\n'
        '[[target]]\nname = "a10"\nlaunch = "vllm serve m --port {port}"\nresources = { a10 = 1 }\n\n'
        '[[target]]\nname = "l4"\nlaunch = { command = "vllm serve m --port {port}", timeout = 60 }\n'
    )
    h100, a10, l4 = load(path)
    assert (h100.url, h100.kind, dict(h100.resources)) == ("http://10.0.0.5:8000", "vllm", {"node:10.0.0.5": NODE_SHARE})
    assert h100.identity == "http://10.0.0.5:8000"
    assert a10.launch is not None and a10.launch.command[:2] == ("vllm", "serve") and a10.kind == "a10"
    assert dict(a10.resources) == {"a10": 1.0}
    assert l4.launch is not None and l4.launch.timeout_s == 60 and l4.identity.startswith("launch:")


@pytest.mark.parametrize("data, message", [
    ({}, "no [[target]] entries"),
    ({"target": [{"url": "http://x:1"}]}, "'name' is missing"),
    ({"target": [{"name": "a"}]}, "exactly one of 'url'"),
    ({"target": [{"name": "a", "url": "http://x:1", "launch": "s --port {port}"}]}, "exactly one of 'url'"),
    ({"target": [{"name": "a", "url": "x:1"}]}, "http:// or https://"),
    ({"target": [{"name": "a", "launch": "server --port 80"}]}, "{port}"),
    ({"target": [{"name": "a", "url": "http://x:1", "gpus": 2}]}, "unknown key 'gpus'"),
    ({"target": [{"name": "a", "url": "http://x:1", "resources": {"gpu": -1}}]}, "'resources'"),
    ({"target": [{"name": "a", "url": "http://x:1"}, {"name": "a", "url": "http://y:1"}]}, "two targets are named 'a'"),
])
def test_a_bad_targets_file_names_the_entry_and_the_key(data, message):
    with pytest.raises(FleetError, match="targets file") as raised:
        parse(data)
    assert message in str(raised.value)


def _campaign(tmp_path, *args):
    return CliRunner().invoke(cli, ["campaign", "--db", str(tmp_path / "f.db"), *args])


def test_bad_fleet_input_is_one_line_and_exit_2(tmp_path):
    good = tmp_path / "targets.toml"
    good.write_text('[[target]]\nname = "a"\nurl = "http://127.0.0.1:9"\n')
    (tmp_path / "bad.toml").write_text("[[target]\nname=")
    ray = importlib.util.find_spec("ray") is not None
    cases = [
        (["--ray"], "--ray needs --targets"),
        (["--targets", str(good)], "--targets needs --ray"),
        (["--ray", "--targets", str(tmp_path / "missing.toml")], "cannot read the targets file"),
        (["--ray", "--targets", str(tmp_path / "bad.toml")], "not valid TOML"),
        (["--ray", "--targets", str(good), "--target", "http://127.0.0.1:9"], "does not apply to a fleet campaign"),
        (["--ray", "--targets", str(good), "--model", "m"], "--model does not apply to a fleet campaign"),
        # Without the ray extra (the README's test command installs only the test extra) no address is tried.
        (["--ray", "127.0.0.1:1", "--targets", str(good)],
         "cannot reach the Ray cluster at 127.0.0.1:1" if ray else "Ray is not installed"),
        (["--ray", "nowhere", "--targets", str(good)], "HOST:PORT" if ray else "Ray is not installed"),
    ]
    for args, message in cases:
        result = _campaign(tmp_path, *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "f.db").exists()  # nothing is stored before the fleet can start


def test_without_ray_installed_the_fleet_says_how_to_install_it(tmp_path, monkeypatch):
    good = tmp_path / "targets.toml"
    good.write_text('[[target]]\nname = "a"\nurl = "http://127.0.0.1:9"\n')
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    result = _campaign(tmp_path, "--ray", "--targets", str(good))
    assert result.exit_code == 2
    assert "pip install -e '.[ray]'" in result.output and "Traceback" not in result.output


def test_importing_the_fuzzer_and_its_fleet_does_not_import_ray():
    import subprocess

    code = ("import sys, fuzzer.cli, fuzzer.fleet.coordinator, fuzzer.fleet.pool, fuzzer.fleet.worker; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
