"""Agent tasks as queue jobs: the job kind workers lease, and how a stored task is queued.

One owner for both, below the HTTP router (`tasks_api.py`), the worker (`worker.py`), the
graph runner and maintenance (`service.py`), which all queue or lease agent tasks.
"""

from __future__ import annotations

from ridgeline.platform.queue import JobQueue
from ridgeline.platform.store import TaskRecord, TaskStatus, TaskStore

#: The queue's job kind for an agent task; the job id is the task id.
AGENT_TASK = "agent_task"


def enqueue(store: TaskStore, queue: JobQueue, task: TaskRecord) -> None:
    """Queue the task's job; if the queue refuses, the task fails with the reason (the
    client sees it in the status instead of a task that never starts)."""
    try:
        # grouped by tenant: workers take turns between tenants (queue fairness)
        queue.enqueue(AGENT_TASK, {"task_id": task.id}, job_id=task.id, group=task.tenant)
    except Exception as e:
        store.finish(task.id, TaskStatus.FAILED, error=f"could not be queued: {e}")
        raise
