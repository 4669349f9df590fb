"""Task graphs on real workers: a planner's subtasks run as parallel child tasks, the merge
node starts from their merged workspaces and sees their summaries; a failing node fails
the graph; malformed graphs are refused; advancing twice creates each node once."""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from ridgeline.platform.dag import GraphRunner, TaskGraph
from ridgeline.platform.principal import Principal
from ridgeline.platform.queue import QueueConfig, open_queue
from ridgeline.platform.store import TaskStatus, TaskStore
from ridgeline.platform.task_service import enqueue
from ridgeline.platform.worker import AgentWorker, WorkerConfig

ALICE = Principal(key_id="k1", tenant="acme", user="alice")
CONFIG = WorkerConfig(sandbox="local", allow_replay_model=True, concurrency=3, lease_s=5.0,
                      heartbeat_s=0.5, poll_s=0.1)


def bash(cmd: str) -> str:
    return f"<bash>{cmd}</bash>"


def as_finish_json(obj) -> str:
    # '<' escaped inside the JSON so the reply's only tag is <finish>
    return "<finish>" + json.dumps(obj).replace("<", "\\u003c") + "</finish>"


@pytest.fixture
def env(tmp_path: Path):
    store = TaskStore(tmp_path / "platform.db")
    queue = open_queue(QueueConfig(), db=store.db)   # the platform's way: one database
    finished: list[str] = []

    def on_finish(task):
        finished.append(task.id)

    runner = GraphRunner(store, queue, enqueue, on_finish=on_finish)

    def child_done(task):
        if task.parent_id:
            runner.advance(task.parent_id)

    worker = AgentWorker(CONFIG, store, queue, on_finish=child_done).start()
    yield store, queue, runner, finished
    worker.stop()
    queue.close()
    store.close()


def submit_graph(store, runner, nodes, files=None) -> str:
    request = {"instruction": "the goal", "model": "replay", "max_steps": 10,
               "graph": TaskGraph(nodes=nodes).model_dump(), "files": files or {}}
    dag, _ = store.create_task(ALICE, request, kind="dag")
    runner.advance(dag.id)
    return dag.id


def wait_terminal(store, task_id, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = store.get(task_id)
        if task.status.terminal:
            return task
        time.sleep(0.05)
    raise AssertionError(f"{task_id} still {store.get(task_id).status}")


def files_of(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read()
                for m in tar.getmembers() if m.isfile()}


def test_plan_parallel_subtasks_merge(env) -> None:
    store, queue, runner, finished = env
    plan = [{"id": "a", "instruction": "write a",
             "replay": [bash("echo A > a.txt"), "<finish>wrote a.txt</finish>"]},
            {"id": "b", "instruction": "write b",
             "replay": [bash("echo B > b.txt"), "<finish>wrote b.txt</finish>"]}]
    dag_id = submit_graph(store, runner, [
        {"id": "plan", "instruction": "split the work", "expand": True,
         "replay": [as_finish_json(plan)]},
        {"id": "merge", "instruction": "combine", "depends_on": ["plan"],
         "replay": [bash("cat a.txt b.txt base.txt > all.txt"), "<finish>merged</finish>"]},
    ], files={"base.txt": "BASE\n"})
    dag = wait_terminal(store, dag_id)
    assert dag.status is TaskStatus.COMPLETED, dag.error
    nodes = dag.result["nodes"]
    assert set(nodes) == {"plan", "plan.a", "plan.b", "merge"}
    assert all(n["status"] == "completed" for n in nodes.values())
    order = dag.result["order"]
    assert order.index("plan") < order.index("plan.a") < order.index("merge")
    merge = store.get(nodes["merge"]["task_id"])
    assert set(merge.request["workspace_from"]) == {nodes["plan.a"]["task_id"],
                                                   nodes["plan.b"]["task_id"]}
    assert "wrote a.txt" in merge.request["instruction"]  # it was told what its inputs did
    files = files_of(store.load_checkpoint(merge.id).workspace)
    assert files["all.txt"] == b"A\nB\nBASE\n"
    types = [e.type for e in store.events(dag_id)]
    assert "dag.expanded" in types and types.count("dag.node_started") == 4
    assert types[-1] == "task.completed" and finished == [dag_id]


def test_a_failing_node_fails_the_graph_and_stops_the_rest(env) -> None:
    store, queue, runner, finished = env
    dag_id = submit_graph(store, runner, [
        {"id": "ok", "instruction": "fine", "replay": ["<finish>ok</finish>"]},
        {"id": "bad", "instruction": "runs out of steps",
         "replay": [bash("echo again")] * 20},
        {"id": "after", "instruction": "never", "depends_on": ["ok", "bad"],
         "replay": ["<finish>x</finish>"]},
    ])
    dag = wait_terminal(store, dag_id)
    assert dag.status is TaskStatus.FAILED and "bad" in dag.error
    assert dag.result["nodes"]["after"]["status"] == "not_started"


def test_advancing_twice_creates_each_node_once(env) -> None:
    store, queue, runner, _ = env
    dag_id = submit_graph(store, runner, [
        {"id": "x", "instruction": "x", "replay": [bash("sleep 0.5"), "<finish>x</finish>"]},
        {"id": "y", "instruction": "y", "replay": [bash("sleep 0.5"), "<finish>y</finish>"]}])
    for _ in range(5):
        runner.advance(dag_id)
    assert len(store.list(None, parent_id=dag_id)) == 2
    assert wait_terminal(store, dag_id).status is TaskStatus.COMPLETED


def test_an_unusable_plan_is_recorded_and_the_graph_goes_on(env) -> None:
    store, queue, runner, _ = env
    dag_id = submit_graph(store, runner, [
        {"id": "plan", "instruction": "plan", "expand": True,
         "replay": ["<finish>not json</finish>"]},
        {"id": "end", "instruction": "end", "depends_on": ["plan"],
         "replay": ["<finish>end</finish>"]}])
    dag = wait_terminal(store, dag_id)
    assert dag.status is TaskStatus.COMPLETED
    assert [e for e in store.events(dag_id) if e.type == "dag.plan_rejected"]


@pytest.mark.parametrize("nodes, message", [
    ([{"id": "a", "instruction": "a", "depends_on": ["b"]},
      {"id": "b", "instruction": "b", "depends_on": ["a"]}], "cycle"),
    ([{"id": "a", "instruction": "a", "depends_on": ["zz"]}], "unknown node"),
    ([{"id": "a", "instruction": "a"}, {"id": "a", "instruction": "b"}], "unique"),
    ([{"id": "a b", "instruction": "a"}], "pattern"),
    ([], "at least 1"),
])
def test_malformed_graphs_are_refused(nodes, message) -> None:
    with pytest.raises(ValidationError, match=message):
        TaskGraph(nodes=nodes)
