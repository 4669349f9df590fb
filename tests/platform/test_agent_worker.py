"""Agent workers on the real queue and store: a task runs step by step in a real sandbox
with a checkpoint after every step; a worker killed with SIGKILL mid-task is replaced and
the task finishes from its last checkpoint, each step's command having run once; cancel,
bad requests and broken infrastructure end tasks the right way."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from ridgeline.errors import ModelEndpointError
from ridgeline.platform.principal import Principal
from ridgeline.platform.queue import QueueConfig, open_queue
from ridgeline.platform.store import TaskStatus, TaskStore
from ridgeline.platform.task_service import AGENT_TASK
from ridgeline.platform.worker import AgentWorker, WorkerConfig

ALICE = Principal(key_id="k1", tenant="acme", user="alice")
REPO = Path(__file__).resolve().parents[2]


def bash(cmd: str) -> str:
    return f"```bash\n{cmd}\n```"


@pytest.fixture
def platform(tmp_path: Path):
    store = TaskStore(tmp_path / "platform.db")
    queue = open_queue(QueueConfig(lease_s=2.0), db=store.db)   # one database, as the platform
    yield store, queue
    queue.close()
    store.close()


def submit(store: TaskStore, queue, request: dict) -> str:
    task, _ = store.create_task(ALICE, {"model": "replay", "max_steps": 30, **request})
    queue.enqueue(AGENT_TASK, {"task_id": task.id}, job_id=task.id)
    return task.id


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("timed out waiting")


def run_until_done(store: TaskStore, queue, task_ids: list[str], config: WorkerConfig,
                   **kwargs) -> AgentWorker:
    worker = AgentWorker(config, store, queue, **kwargs).start()
    try:
        wait_for(lambda: all(store.get(t).status.terminal for t in task_ids))
    finally:
        worker.stop()
    return worker


def workspace_files(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read()
                for m in tar.getmembers() if m.isfile()}


CONFIG = WorkerConfig(sandbox="local", allow_replay_model=True, concurrency=2, lease_s=2.0,
                      heartbeat_s=0.3, poll_s=0.1)


def test_task_runs_step_by_step_with_a_checkpoint_per_step(platform) -> None:
    store, queue = platform
    tid = submit(store, queue, {
        "instruction": "count to three", "files": {"notes/start.txt": "hello\n"},
        "replay": [bash("cat notes/start.txt && echo one > out.txt"),
                   bash("echo two >> out.txt"), "<finish>counted</finish>"]})
    run_until_done(store, queue, [tid], CONFIG)
    task = store.get(tid)
    assert task.status is TaskStatus.COMPLETED, task.error
    assert task.result["summary"] == "counted" and task.result["steps"] == 3
    types = [e.type for e in store.events(tid)]
    assert types[:2] == ["task.created", "task.started"]
    steps = [e for e in store.events(tid) if e.type == "task.step"]
    assert [e.data["step"] for e in steps] == [1, 2, 3]
    assert "hello" in steps[0].data["observation"]["text"]
    assert types[-1] == "task.completed"
    checkpoint = store.load_checkpoint(tid)
    assert checkpoint.step == 3
    files = workspace_files(checkpoint.workspace)
    assert files["out.txt"] == b"one\ntwo\n" and files["notes/start.txt"] == b"hello\n"
    assert queue.info(tid)["state"] == "done"


def test_a_task_that_only_talks_needs_no_sandbox(platform) -> None:
    store, queue = platform
    tid = submit(store, queue, {"instruction": "say hi", "replay": ["<finish>hi</finish>"]})
    run_until_done(store, queue, [tid], CONFIG.model_copy(update={"sandbox": "no-such"}))
    assert store.get(tid).status is TaskStatus.COMPLETED  # the bad backend was never needed


WORKER_SCRIPT = textwrap.dedent("""
    import sys, time
    from ridgeline.platform.queue import QueueConfig, open_queue
    from ridgeline.platform.store import TaskStore
    from ridgeline.platform.worker import AgentWorker, WorkerConfig
    store = TaskStore(sys.argv[1])
    queue = open_queue(QueueConfig(lease_s=1.0), db=store.db)
    config = WorkerConfig(sandbox=sys.argv[2], allow_replay_model=True, concurrency=1,
                          lease_s=1.0, heartbeat_s=0.2, poll_s=0.1)
    AgentWorker(config, store, queue, name="doomed").run_forever()
""")


@pytest.mark.parametrize("backend", ["local", "bwrap"])
def test_kill_9_mid_task_resumes_from_the_last_checkpoint(platform, tmp_path: Path,
                                                          backend: str) -> None:
    if backend == "bwrap" and not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed (make install does it)")
    store, queue = platform
    # step 3 blocks long enough to be killed in; every step appends its line once
    tid = submit(store, queue, {
        "instruction": "log five steps",
        "replay": [bash("echo s1 >> log.txt"), bash("echo s2 >> log.txt"),
                   bash("echo s3 >> log.txt; sleep 30"), bash("echo s4 >> log.txt"),
                   "<finish>logged</finish>"]})
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "platform.db"),
                             backend],
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: any(e.type == "task.step" and e.data["step"] == 2
                             for e in store.events(tid)), timeout=60)
        time.sleep(0.5)  # inside step 3's sleep
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert store.get(tid).status is TaskStatus.IN_PROGRESS
    # step 3 is replayed without its sleep: the replacement gets a script whose step 3 is quick
    store_task = store.get(tid)
    assert store_task.attempts == 1
    run_until_done(store, queue, [tid], CONFIG.model_copy(update={"sandbox": backend}),
                   model_factory=lambda task: _Replay([
                       bash("echo s1 >> log.txt"), bash("echo s2 >> log.txt"),
                       bash("echo s3 >> log.txt"), bash("echo s4 >> log.txt"),
                       "<finish>logged</finish>"]))
    task = store.get(tid)
    assert task.status is TaskStatus.COMPLETED, task.error
    assert task.attempts == 2
    events = store.events(tid)
    resumed = [e for e in events if e.type == "task.resumed"]
    assert len(resumed) == 1 and resumed[0].data["from_step"] == 2
    steps = [e.data["step"] for e in events if e.type == "task.step"]
    assert steps == [1, 2, 3, 4, 5]  # 1-2 by the killed worker, 3-5 after the resume
    files = workspace_files(store.load_checkpoint(tid).workspace)
    assert files["log.txt"] == b"s1\ns2\ns3\ns4\n"  # every step's command took effect once


def _Replay(replies):
    from ridgeline.platform.replay import ReplayModel
    return ReplayModel(replies)


def test_cancel_stops_a_running_task_after_its_step(platform) -> None:
    store, queue = platform
    tid = submit(store, queue, {"instruction": "loop",
                                "replay": [bash(f"echo {i}; sleep 0.2") for i in range(50)]})
    worker = AgentWorker(CONFIG, store, queue).start()
    try:
        wait_for(lambda: any(e.type == "task.step" for e in store.events(tid)))
        store.request_cancel(tid, "acme")
        wait_for(lambda: store.get(tid).status.terminal)
    finally:
        worker.stop()
    task = store.get(tid)
    assert task.status is TaskStatus.CANCELLED
    assert len([e for e in store.events(tid) if e.type == "task.step"]) < 50


def test_a_request_the_worker_refuses_fails_at_once_without_retries(platform) -> None:
    store, queue = platform
    tid = submit(store, queue, {"instruction": "x", "replay": ["<finish>x</finish>"]})
    run_until_done(store, queue, [tid], CONFIG.model_copy(update={"allow_replay_model": False}))
    task = store.get(tid)
    assert task.status is TaskStatus.FAILED and "replay" in task.error
    assert task.attempts == 1


class _DownModel:
    name = "down"
    supports_tools = False
    context_window = 10_000

    def count_tokens(self, messages) -> int:
        return 10

    def chat(self, messages, tools=None, sampling=None):
        raise ModelEndpointError("upstream http://127.0.0.1:9/v1 is down")


def test_broken_infrastructure_is_retried_then_the_task_fails_with_the_reason(platform) -> None:
    store, queue = platform
    tid = submit(store, queue, {"instruction": "x"})
    queue_cfg = queue  # max_attempts defaults to 3
    worker = AgentWorker(CONFIG, store, queue_cfg, model_factory=lambda t: _DownModel())
    for _ in range(3):  # drive attempts directly (the retry delay is the queue's business)
        job = wait_for(lambda: queue.lease("w", kinds=[AGENT_TASK], lease_s=5), timeout=40)
        worker.process(job)
    task = store.get(tid)
    assert task.status is TaskStatus.FAILED and "is down" in task.error
    assert task.attempts == 3
    assert [e.type for e in store.events(tid)].count("task.retrying") == 2
    assert queue.info(tid)["state"] == "dead"


def test_a_worker_that_lost_its_lease_cannot_write_over_its_successor(platform) -> None:
    store, queue = platform
    tid = submit(store, queue, {"instruction": "x"})
    first = store.start_attempt(tid)
    second = store.start_attempt(tid)  # the job was redelivered to another worker
    assert not store.save_checkpoint(tid, 1, {"stale": True}, None, attempt=first.attempts)
    assert store.save_checkpoint(tid, 1, {"fresh": True}, None, attempt=second.attempts)
    assert not store.finish(tid, TaskStatus.COMPLETED, result={}, attempt=first.attempts)
    assert store.load_checkpoint(tid).state == {"fresh": True}
    assert store.get(tid).status is TaskStatus.IN_PROGRESS


def test_sigterm_hands_running_tasks_back_after_their_step(platform, tmp_path: Path) -> None:
    store, queue = platform
    tid = submit(store, queue, {"instruction": "slow",
                                "replay": [bash("echo a >> log.txt; sleep 1")] * 3
                                + [bash("echo b >> log.txt"), "<finish>ok</finish>"]})
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "platform.db"),
                             "local"],
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: any(e.type == "task.step" for e in store.events(tid)), timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    types = [e.type for e in store.events(tid)]
    assert types[-1] == "task.handed_back" and types.count("task.step") < 5
    assert queue.info(tid)["state"] == "queued"  # at once, not after the lease
    run_until_done(store, queue, [tid], CONFIG)
    task = store.get(tid)
    assert task.status is TaskStatus.COMPLETED and task.attempts == 2
    files = workspace_files(store.load_checkpoint(tid).workspace)
    assert files["log.txt"].count(b"a\n") == 3 and files["log.txt"].endswith(b"b\n")
