"""The offline uv/curl/apt-get the harness puts on PATH, exercised on the host (they are
plain scripts; inside a sandbox they behave the same)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ridgeline.tasks.harness import OFFLINE_MARK, SYSTEM_PATH, harness_tools


@pytest.fixture
def sh(tmp_path):
    """Run a bash snippet with the harness tools first on PATH, in a fresh HOME."""
    tools = harness_tools()
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()

    def run(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {"HOME": str(home), "PATH": f"{tools.host_dir / 'bin'}:{tools.python_bin}:"
               f"{SYSTEM_PATH}", "RIDGELINE_STATE": str(home / ".state")}
        return subprocess.run(["bash", "-c", script], cwd=work, env=env, text=True,
                              capture_output=True, timeout=timeout)

    run.home, run.work = home, work
    return run


def test_uv_installer_idiom(sh):
    r = sh("curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh && "
           "source $HOME/.local/bin/env && command -v uv && uv --version")
    assert r.returncode == 0, r.stderr
    assert str(sh.home / ".local/bin/uv") in r.stdout
    assert "ridgeline offline" in r.stdout


def test_curl_other_urls_fail_like_no_network(sh):
    r = sh("curl -fsSL https://example.com/file.tar.gz -o out.tgz")
    assert r.returncode == 6 and OFFLINE_MARK in r.stderr
    assert "Could not resolve host: example.com" in r.stderr
    r = sh("wget -qO- https://example.com/x")
    assert r.returncode == 4
    r = sh("echo data > f.txt && curl -s file://$PWD/f.txt")
    assert r.returncode == 0 and r.stdout == "data\n"


def test_apt_get(sh):
    assert sh("apt-get update && apt-get install -y curl bash").returncode == 0
    r = sh("apt-get install -y no-such-package-xyz")
    assert r.returncode == 100 and OFFLINE_MARK in r.stderr and "no-such-package-xyz" in r.stderr


def test_tbench_v1_testing_venv_idiom(sh):
    (sh.work / "test_x.py").write_text("def test_ok():\n    assert True\n")
    r = sh("uv venv .tbench-testing-venv && source .tbench-testing-venv/bin/activate && "
           "uv pip install pytest==8.4.1 && uv run pytest test_x.py -rA")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "PASSED test_x.py::test_ok" in r.stdout
    assert (sh.work / ".tbench-testing-venv" / "bin" / "activate").is_file()


def test_uv_pip_refuses_what_is_missing(sh):
    r = sh("uv venv && uv pip install definitely-not-installed-pkg==1.0")
    assert r.returncode == 1 and OFFLINE_MARK in r.stderr


def test_uv_pip_installs_from_a_wheelhouse(sh):
    house = Path(__file__).resolve().parents[2] / "src/ridgeline/tasks/builtin/" \
        "dep-install-from-wheelhouse/files/wheelhouse"
    r = sh(f"uv venv v && source v/bin/activate && uv pip install --find-links {house} "
           f"tinyfmt && python -c 'import tinyfmt; print(tinyfmt.__version__)'", timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("2.0.0")
    assert list((sh.work / "v/lib/site-packages").glob("tinyfmt-2.0.0.dist-info"))


def test_uv_init_add_run_with_plugin(sh):
    (sh.work / "test_t.py").write_text("def test_ok():\n    assert True\n")
    r = sh("uv init && uv add pytest==8.4.1 pytest-timeout && "
           "uv run pytest test_t.py -rA --timeout 30")
    assert r.returncode == 0, r.stderr + r.stdout
    assert (sh.work / "pyproject.toml").is_file()
    assert "PASSED test_t.py::test_ok" in r.stdout


def test_uvx_pytest_with_ctrf_report(sh):
    (sh.work / "test_c.py").write_text("def test_a():\n    assert True\n\n"
                                       "def test_b():\n    assert False\n")
    r = sh("uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest "
           "--ctrf out/ctrf.json test_c.py -rA")
    assert r.returncode == 1, r.stderr
    report = json.loads((sh.work / "out/ctrf.json").read_text())["results"]
    assert report["summary"]["tests"] == 2 and report["summary"]["passed"] == 1
    assert {t["name"].split("::")[-1]: t["status"] for t in report["tests"]} == {
        "test_a": "passed", "test_b": "failed"}


def test_pytest_does_not_see_the_working_directory(sh):
    # like the pytest console script: a json.py in the cwd must not shadow the stdlib
    (sh.work / "json.py").write_text("raise SystemExit('shadowed')\n")
    (sh.work / "test_j.py").write_text("import json\n\ndef test_j():\n"
                                       "    assert json.dumps(1) == '1'\n")
    r = sh("uvx pytest test_j.py -rA")
    assert r.returncode == 0, r.stdout + r.stderr


def test_build_tools(tmp_path):
    """The image-build tools: pip checks the host, rm skips image cache directories."""
    tools = harness_tools()
    env = {"HOME": str(tmp_path), "PATH": f"{tools.host_dir / 'build-bin'}:"
           f"{tools.host_dir / 'bin'}:{SYSTEM_PATH}", "RIDGELINE_STATE": str(tmp_path / "s")}

    def run(script):
        return subprocess.run(["sh", "-c", script], env=env, cwd=tmp_path, text=True,
                              capture_output=True, timeout=120)

    assert run("pip install --no-cache-dir pytest==8.4.1").returncode == 0
    assert run("python3 -m pip install pytest").returncode == 0
    r = run("pip install not-a-real-package-xyz")
    assert r.returncode != 0 and OFFLINE_MARK in r.stderr
    (tmp_path / "keep.txt").write_text("x")
    # without -f a real rm of a missing path fails; the build rm skips cache paths
    r = run("rm /var/cache/ridgeline-missing-xyz/apt.bin && rm keep.txt")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "keep.txt").exists()
    assert run("rm missing-here.txt").returncode != 0
