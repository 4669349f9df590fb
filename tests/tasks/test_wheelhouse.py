"""What a task's test script installs at test time is fetched before it runs
(tasks/wheelhouse.py) and installed offline from there."""

from __future__ import annotations

import shutil
from pathlib import Path

from ridgeline.tasks import VerdictStatus, load_task
from ridgeline.tasks.checks import check_task
from ridgeline.tasks.wheelhouse import prefetch, script_requirements

FIXTURES = Path(__file__).parent / "fixtures"


def test_install_lines_of_test_scripts_are_read(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "tests" / "requirements.txt").write_text("# pinned\nrequests==2.32.3\nidna\n")
    (d / "run-tests.sh").write_text(
        "#!/bin/bash\napt-get install -y curl\n"
        "uv pip install pytest==8.4.1 \\\n  'pandas==2.2.3' numpy>=1.26 --index-url https://x\n"
        "pip3 install -r /tests/requirements.txt && pip install $EXTRA\n"
        "uvx --with rdflib==7.1.4 -w pyyaml pytest /tests/test_outputs.py\n"
        "uv add scipy  # for the checks\nuv run --with=tabulate pytest\n"
        "pip install -q attrs 2>&1 >/dev/null && pip install idna > log.txt 2> err\n")
    assert script_requirements(load_task(d)) == sorted([
        "attrs", "idna", "numpy>=1.26", "pandas==2.2.3", "pytest==8.4.1", "pyyaml", "rdflib==7.1.4",
        "requests==2.32.3", "scipy", "tabulate"])


def test_a_package_the_tests_install_is_there_offline(tmp_path):
    d = tmp_path / "needs-termcolor"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "run-tests.sh").write_text(
        "#!/bin/bash\ncurl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n"
        "source $HOME/.local/bin/env\nuv venv .tbench-testing\n"
        "source .tbench-testing/bin/activate\n"
        "uv pip install pytest==8.4.1 termcolor==2.4.0\n"
        "uv run pytest $TEST_DIR/test_outputs.py -rA\n")
    test = (d / "tests" / "test_outputs.py").read_text()
    (d / "tests" / "test_outputs.py").write_text(
        "import termcolor  # installed by the test script, from PyPI\n" + test)
    task = load_task(d)
    wheels = prefetch(task)
    assert wheels is not None and any(p.name.startswith("termcolor-2.4.0")
                                      for p in wheels.iterdir())
    check = check_task(task, runs=1, save=False)
    assert check.ok, check.reasons
    assert check.oracle[0].status is VerdictStatus.PASSED
