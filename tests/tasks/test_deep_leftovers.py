"""Deep trees an agent leaves in HOME, /logs/verifier, /logs/agent and the workspace never
crash an episode: `run_task_episode` used to raise RecursionError out of the staging
clean-up (shutil.rmtree), which crashed an RL step. The episode ends with the honest
verdict, and sandboxes keep being created afterwards."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ridgeline.agent.run import run_task_episode
from ridgeline.tasks import VerdictStatus, load_task, prepare_environment

FIXTURES = Path(__file__).parent / "fixtures"
DEPTH = 1200  # the report's depth: past Python's recursion limit
PLACES = ["/root", "/logs/verifier", "/logs/agent", "/app"]
#: A chain of DEPTH directories under each place (relative mkdir/chdir: no long paths),
#: then a count of the first one's depth as the positive control.
DEEP = f"""
python3 - <<'EOF'
import os
for top in {PLACES!r}:
    os.chdir(top)
    os.mkdir("deep"); os.chdir("deep")
    for _ in range({DEPTH}):
        os.mkdir("d"); os.chdir("d")
fd, n = os.open("/root/deep", os.O_RDONLY), 0
while True:
    try:
        nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
    except FileNotFoundError:
        break
    os.close(fd); fd, n = nfd, n + 1
print("depth", n)
EOF
"""


def _task(tmp_path: Path, solve: bool) -> Path:
    d = tmp_path / "task"
    shutil.copytree(FIXTURES / "harbor-hello", d)
    solution = d / "solution" / "solve.sh"
    body = solution.read_text() if solve else "#!/bin/bash\n"
    solution.write_text(body + DEEP)
    return d


@pytest.mark.parametrize("solve", [True, False], ids=["solved", "unsolved"])
def test_deep_leftovers_end_in_the_honest_verdict(tmp_path, solve):
    task = load_task(_task(tmp_path, solve))
    ep = run_task_episode(task, "oracle")
    assert ep.error is None, ep.error
    # Positive control: the oracle's script really built the chains.
    text = " ".join(s.observation.text for s in ep.agent.trajectory.steps
                    if s.observation is not None)
    assert f"depth {DEPTH}" in text, text[-2000:]
    want = VerdictStatus.PASSED if solve else VerdictStatus.FAILED
    assert ep.verdict.status is want, ep.verdict
    # This process still prepares environments.
    with prepare_environment(load_task(FIXTURES / "harbor-hello")) as sb:
        assert sb.run(["true"]).ok
