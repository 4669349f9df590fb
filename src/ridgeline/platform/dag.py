"""Agent task graphs: plan, parallel subtasks, merge, as a persisted state machine.

A graph task (`kind="dag"`) is a set of nodes, each an agent task of its own (a child
task: queued, run, checkpointed and resumed like any other), started when every node it
depends on has completed. A node starts from its dependencies' final workspaces (merged in
order) and is told their summaries, so a merge node sees what the parallel ones did. A
node with `expand: true` is a planner: its finishing summary must be a JSON list of
`{"id", "instruction"}` subtasks, which become nodes depending on it, and every node that
depended on the planner then depends on all of them.

Why our own and not LangGraph: the state that matters already lives in the task store
(child tasks, their checkpoints and events), and the transitions are few; advancing is a
pure function of the children's statuses, so it is safe to run from any worker, any number
of times (child tasks are created under per-node idempotency keys: two workers advancing
the same graph at once create each node once). A crash between a child finishing and the
graph advancing is repaired by `advance_all`, which the API runs periodically.

Quotas. A graph is one request but makes many tasks, so each node is admitted under the
submitting key before its task is created (`admit`: one request of the key's rpm, and no
more live nodes than its concurrency); a node refused now stays unstarted and is tried
again on the next advance (a child finishing, or `advance_all`). A graph holds at most
`MAX_GRAPH_NODES` nodes after expansion. A planner's subtask ids are made unique (a
suffix when one is taken): a plan can never name a node twice.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ridgeline.errors import RateLimitError, RidgelineError
from ridgeline.platform.principal import Principal
from ridgeline.platform.queue import JobQueue
from ridgeline.platform.store import TaskRecord, TaskStatus, TaskStore

log = logging.getLogger(__name__)

MAX_NODES = 64
MAX_EXPANSION = 16
#: Nodes a graph may reach through its planners' subtasks (its request holds <= MAX_NODES).
MAX_GRAPH_NODES = 128


class GraphError(RidgelineError):
    """A malformed task graph (400)."""


class GraphNode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    instruction: str = Field(min_length=1, max_length=100_000)
    depends_on: list[str] = Field(default_factory=list)
    expand: bool = Field(False, description="a planner: its summary lists subtasks as JSON")
    replay: list[str] | None = None  # for model "replay" (load tests)


class TaskGraph(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nodes: list[GraphNode] = Field(min_length=1, max_length=MAX_NODES)

    @model_validator(mode="after")
    def _check(self) -> "TaskGraph":
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("node ids must be unique")
        known = set(ids)
        for n in self.nodes:
            missing = [d for d in n.depends_on if d not in known]
            if missing:
                raise ValueError(f"node {n.id!r} depends on unknown node(s) {missing}")
        order_of(self.nodes)  # raises on a cycle
        return self


def order_of(nodes: list[GraphNode]) -> list[str]:
    """A topological order; ValueError naming a node on a cycle."""
    deps = {n.id: set(n.depends_on) for n in nodes}
    order: list[str] = []
    while deps:
        ready = sorted(i for i, d in deps.items() if not d)
        if not ready:
            raise ValueError(f"the graph has a cycle through {sorted(deps)[0]!r}")
        for i in ready:
            order.append(i)
            del deps[i]
        for d in deps.values():
            d.difference_update(ready)
    return order


class GraphRunner:
    """Advances graph tasks. `child_request` builds a node's agent request from the graph
    task's request (model, limits, tools, webhook-free)."""

    def __init__(self, store: TaskStore, queue: JobQueue, enqueue: Any,
                 on_finish: Callable[[TaskRecord], None] | None = None,
                 admit: Callable[[Principal, int], None] | None = None) -> None:
        self.store = store
        self.queue = queue
        self.enqueue = enqueue  # (store, queue, task) -> None, as the API enqueues
        self.on_finish = on_finish  # a graph reached a terminal state (webhooks)
        # (owner, its graph's live nodes) -> None, or RateLimitError: may a node start now
        self.admit = admit

    def state(self, dag: TaskRecord) -> tuple[list[GraphNode], set[str]]:
        """The graph as it stands and the planners already expanded: kept in the graph
        task's checkpoint; the request's graph until the first expansion."""
        checkpoint = self.store.load_checkpoint(dag.id)
        if checkpoint is None:
            return [GraphNode.model_validate(n) for n in dag.request["graph"]["nodes"]], set()
        return ([GraphNode.model_validate(n) for n in checkpoint.state["nodes"]],
                set(checkpoint.state["expanded"]))

    def _finish(self, dag_id: str, status: TaskStatus, **kwargs: Any) -> None:
        if self.store.finish(dag_id, status, **kwargs) and self.on_finish is not None:
            self.on_finish(self.store.get(dag_id))

    def advance(self, dag_id: str) -> TaskStatus:
        dag = self.store.get(dag_id)
        if dag.status.terminal:
            return dag.status
        if dag.status is TaskStatus.QUEUED:
            self.store.start_attempt(dag_id)
            dag = self.store.get(dag_id)
        nodes, expanded = self.state(dag)
        children = {c.request.get("node_id"): c for c in self.store.list(None, parent_id=dag_id,
                                                                          limit=10_000)}
        # planners that completed expand the graph, once each
        for node in list(nodes):
            child = children.get(node.id)
            if node.expand and node.id not in expanded and child is not None \
                    and child.status is TaskStatus.COMPLETED:
                nodes = self._expand(dag, nodes, expanded, node, child)
        if dag.cancel_requested:
            return self._cancel(dag, children)
        failed = [n.id for n in nodes if (c := children.get(n.id)) is not None
                  and c.status in (TaskStatus.FAILED, TaskStatus.CANCELLED)]
        if failed:
            for c in children.values():
                if not c.status.terminal:
                    self.store.request_cancel(c.id, None)
                    self.queue.cancel(c.id)
            self._finish(dag_id, TaskStatus.FAILED, result=self._result(nodes, children),
                         error=f"node(s) {', '.join(failed)} did not complete")
            return TaskStatus.FAILED
        done = {n.id for n in nodes if (c := children.get(n.id)) is not None
                and c.status is TaskStatus.COMPLETED}
        if len(done) == len(nodes):
            self._finish(dag_id, TaskStatus.COMPLETED, result=self._result(nodes, children))
            return TaskStatus.COMPLETED
        live = sum(1 for c in children.values() if not c.status.terminal)
        for node in nodes:
            if node.id not in children and all(d in done for d in node.depends_on):
                if self.admit is not None:
                    try:
                        self.admit(Principal(key_id=dag.key_id, tenant=dag.tenant), live)
                    except RateLimitError as e:  # the next advance tries again
                        log.info("graph %s: node %s waits for its key's quota: %s",
                                 dag_id, node.id, e)
                        break
                child = self._start(dag, node, [children[d] for d in node.depends_on])
                children[node.id] = child
                live += 1
        return TaskStatus.IN_PROGRESS

    def advance_all(self) -> int:
        """Advance every unfinished graph (repairs a crash between a child finishing and
        its graph moving on). Returns how many were looked at."""
        graphs = [t for status in (TaskStatus.IN_PROGRESS, TaskStatus.QUEUED)
                  for t in self.store.list(None, status=status.value, kind="dag",
                                           limit=10_000)]
        for g in graphs:
            try:
                self.advance(g.id)
            except Exception as e:  # one broken graph must not stop the others
                log.error("advancing graph %s failed: %s", g.id, e)
        return len(graphs)

    # -- steps -----------------------------------------------------------------------------
    def _start(self, dag: TaskRecord, node: GraphNode, deps: list[TaskRecord]) -> TaskRecord:
        request = dict(dag.request)
        graph_goal = request.pop("instruction")
        for key in ("graph", "webhook", "files"):
            request.pop(key, None)
        instruction = node.instruction
        if deps:
            lines = [f"- {d.request.get('node_id')}: {(d.result or {}).get('summary') or 'done'}"
                     for d in deps]
            instruction += ("\n\nThe workspace holds the work of the steps this one builds "
                            "on. Their summaries:\n" + "\n".join(lines))
        request.update({"instruction": instruction, "node_id": node.id, "goal": graph_goal,
                        "workspace_from": [d.id for d in deps]})
        if node.replay is not None:
            request["replay"] = node.replay
        if not deps and dag.request.get("files"):
            request["files"] = dag.request["files"]
        owner = Principal(key_id=dag.key_id, tenant=dag.tenant)
        child, created = self.store.create_task(owner, request, parent_id=dag.id,
                                                idempotency_key=f"dag:{dag.id}:{node.id}")
        if created:
            self.enqueue(self.store, self.queue, child)
            self.store.append_event(dag.id, "dag.node_started",
                                    {"node": node.id, "task_id": child.id})
        return child

    def _expand(self, dag: TaskRecord, nodes: list[GraphNode], expanded: set[str],
                planner: GraphNode, child: TaskRecord) -> list[GraphNode]:
        summary = (child.result or {}).get("summary") or ""
        try:
            subtasks = json.loads(summary)
            if not isinstance(subtasks, list) or not 1 <= len(subtasks) <= MAX_EXPANSION:
                raise ValueError(f"expected a list of 1 to {MAX_EXPANSION} subtasks")
            if len(nodes) + len(subtasks) > MAX_GRAPH_NODES:
                raise ValueError(f"the graph would have {len(nodes) + len(subtasks)} nodes, "
                                 f"over the limit of {MAX_GRAPH_NODES}")
            taken = {n.id for n in nodes}
            new = []
            for sub in subtasks:
                # a name the graph holds already (or the plan twice) gets a suffix: two
                # nodes with one id would make the graph unable to tell them apart
                base = node_id = f"{planner.id}.{sub['id']}"
                k = 2
                while node_id in taken:
                    node_id, k = f"{base}-{k}", k + 1
                taken.add(node_id)
                new.append(GraphNode(id=node_id, instruction=sub["instruction"],
                                     depends_on=[planner.id], replay=sub.get("replay")))
        except (ValueError, KeyError, TypeError) as e:
            # the plan is unusable: the graph continues as if the planner had no subtasks
            expanded.add(planner.id)
            self._save(dag, nodes, expanded)
            self.store.append_event(dag.id, "dag.plan_rejected",
                                    {"node": planner.id, "error": str(e)[:500]})
            return nodes
        new_ids = [n.id for n in new]
        out = []
        for n in nodes:
            if planner.id in n.depends_on:
                n = n.model_copy(update={"depends_on": [d for d in n.depends_on
                                                        if d != planner.id] + new_ids})
            out.append(n)
        out += new
        order_of(out)  # cannot fail: the new ids are unique and depend only on the planner
        expanded.add(planner.id)
        self._save(dag, out, expanded)
        self.store.append_event(dag.id, "dag.expanded", {"node": planner.id, "added": new_ids})
        return out

    def _save(self, dag: TaskRecord, nodes: list[GraphNode], expanded: set[str]) -> None:
        self.store.save_checkpoint(dag.id, 0, {"nodes": [n.model_dump() for n in nodes],
                                               "expanded": sorted(expanded)}, None)

    def _cancel(self, dag: TaskRecord, children: dict[Any, TaskRecord]) -> TaskStatus:
        for c in children.values():
            if not c.status.terminal:
                self.store.request_cancel(c.id, None)
                self.queue.cancel(c.id)
        self._finish(dag.id, TaskStatus.CANCELLED, error="cancelled")
        return TaskStatus.CANCELLED

    @staticmethod
    def _result(nodes: list[GraphNode], children: dict[Any, TaskRecord]) -> dict[str, Any]:
        out = {}
        for n in nodes:
            c = children.get(n.id)
            out[n.id] = {"task_id": c.id if c else None,
                         "status": c.status.value if c else "not_started",
                         "summary": (c.result or {}).get("summary") if c else None}
        return {"nodes": out, "order": order_of(nodes)}
