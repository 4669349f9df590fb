"""The asynchronous rollout buffer: admission control that bounds staleness (AReaL).

The trainer is at policy version `v` (0 at the start; `publish_version()` after each
weight sync makes it `v + 1`). Train step `v` takes `batch_groups` (B) groups from the
buffer while the weights are at version `v`, trains, syncs and publishes `v + 1`.
Rollout workers ask `admit()` before they *start* a group and `put()` it when it is done:

    ticket = buffer.admit()                  # blocks while starting would be too early
    group = run_group(task, ticket.version)  # every sample records its versions
    buffer.put(group, ticket)

    batch = buffer.get_batch(B)              # trainer, at version v
    ...train, sync weights...
    buffer.publish_version()

**The bound.** A group started under version `s` has the *deadline* `s + eta`: it must
be consumed by a train step `<= s + eta`, so no token in it is more than `eta` versions
older than the policy that trains on it (tokens of an interrupted, resumed rollout carry
newer versions, which only makes them fresher). `eta = 0` is synchronous: the rollouts
for step `k` start only once version `k` is published, and while step `k` trains nothing
new starts.

The buffer keeps every group it has admitted and not yet handed out (in flight or
finished) assignable to a future train step, B per step, none after its deadline:
writing `c` for the groups already taken at version `v`, for every step `w >= v`

    #{unconsumed groups with deadline <= w}  <=  (w - v + 1) * B - c        (*)

(Hall's condition: with it, earliest-deadline-first meets every deadline). Every method
keeps (*) true:

- `admit()` starts a group (deadline `v + eta`) only if (*) still holds with it; when
  each step takes B groups this is AReaL's rule `started + 1 <= (v + eta + 1) * B`.
- `get_batch(n)` hands out the oldest finished groups first, but skips a finished group
  when taking it would leave no room for an older one still in flight; it waits for that
  one instead (a group at its deadline is always eligible).
- `publish_version()` refuses (StalenessError) if the groups taken at `v` were too few
  for (*) to hold at `v + 1`.

So staleness is bounded by never starting rollouts too far ahead, never by dropping
samples afterwards (dropping biases training toward fast, easy episodes): every group
that is put is handed out exactly once.

**Groups and samples** are the caller's objects. A group is an object with `.samples`,
or a sequence of samples; each sample has `.versions` (a list of ints, one per token or
one per episode; negative entries or None mark tokens the policy did not sample, as in
`TokenEpisode`) or a single `.version` (attributes or mapping keys). They are stored as
they are: `state_dict()` is JSON-able when the groups are, pickleable when they are.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar

from ridgeline.errors import ConfigError, RidgelineError

STATE_FORMAT = 1

#: The caller's group type (`EpisodeGroup` in a run; anything with samples in tests).
G = TypeVar("G")


class BufferClosed(RidgelineError):
    """The buffer was closed (the run is ending): rollout workers and the trainer stop."""


class StalenessError(RidgelineError):
    """A version was published before the groups due at the current one were taken."""


@dataclass(frozen=True)
class Ticket:
    """Permission to start one group: under policy `version`, due by step `deadline`."""

    id: int
    version: int
    deadline: int


@dataclass
class _Entry(Generic[G]):
    ticket: Ticket
    group: G


class ReadyGroup(TypedDict, Generic[G]):
    """A finished group in `BufferState`, with its ticket's id and version."""

    id: int
    version: int
    group: G


class BufferState(TypedDict, Generic[G]):
    """`RolloutBuffer.state_dict()`: the queue and its counters (groups as they are)."""

    format: int
    eta: int
    batch_groups: int
    version: int
    taken_now: int
    next_id: int
    ready: list[ReadyGroup[G]]
    in_flight: list[dict[str, int]]             # {"id", "version"}: aborted on load
    counters: dict[str, dict[str, int]]         # per version (keys are strings)
    waits: dict[str, float]


#: `RolloutBuffer.metrics()`: counters, histograms by version or lag, wait times.
BufferMetrics = dict[str, int | float | dict[str, int]]


def sample_versions(sample: object) -> list[int]:
    """The policy versions a sample's tokens (or the whole episode) were sampled under;
    entries that are None or negative (prompt and observation tokens) are left out."""
    for name in ("versions", "version"):
        if isinstance(sample, Mapping):
            if name not in sample:
                continue
            value = sample[name]
        elif hasattr(sample, name):
            value = getattr(sample, name)
        else:
            continue
        values: Iterable[int | None] = value if name == "versions" else [value]
        return [int(v) for v in values if v is not None and int(v) >= 0]
    raise TypeError(f"a {type(sample).__name__} sample has neither `versions` nor `version`: "
                    "record the policy version each sample was generated under")


def group_samples(group: object) -> list[object]:
    """The samples of a group: its `.samples`, or the group itself if it is a sequence."""
    if isinstance(group, Mapping):
        if "samples" in group:
            return list(group["samples"])
        raise TypeError("a group given as a mapping needs a 'samples' entry")
    if hasattr(group, "samples"):
        return list(group.samples)
    if isinstance(group, Iterable) and not isinstance(group, (str, bytes)):
        return list(group)
    raise TypeError(f"a group must have `.samples` or be a sequence of samples, "
                    f"not {type(group).__name__}")


def group_versions(group: object) -> list[int]:
    return [v for s in group_samples(group) for v in sample_versions(s)]


class RolloutBuffer(Generic[G]):
    """A staleness-bounded queue of finished rollout groups between rollout workers and
    the trainer. Thread-safe: every method may be called from any thread."""

    def __init__(self, batch_groups: int, eta: int = 1) -> None:
        if not isinstance(batch_groups, int) or batch_groups < 1:
            raise ConfigError(f"batch_groups must be a positive integer, not {batch_groups!r}",
                              hint="set the number of groups each train step consumes")
        if not isinstance(eta, int) or eta < 0:
            raise ConfigError(f"eta (max staleness) must be an integer >= 0, not {eta!r}",
                              hint="0 is synchronous; 1 or 2 overlap rollouts and training")
        self.batch_groups = batch_groups
        self.eta = eta
        self._cond = threading.Condition()
        self._closed = False
        self._version = 0
        self._taken_now = 0  # groups handed out at the current version
        self._next_id = 0
        self._in_flight: dict[int, Ticket] = {}
        self._ready: list[_Entry[G]] = []  # kept in (version, id) order: oldest first
        # per start version
        self._started: Counter[int] = Counter()
        self._finished: Counter[int] = Counter()
        self._consumed: Counter[int] = Counter()
        self._aborted: Counter[int] = Counter()
        # staleness at consumption: per version entry (token or episode) and per group
        self._staleness: Counter[int] = Counter()
        self._group_staleness: Counter[int] = Counter()
        self._waits = {"admit_waits": 0, "admit_wait_s": 0.0, "admit_timeouts": 0,
                       "get_waits": 0, "get_wait_s": 0.0, "get_timeouts": 0}
        self._waiting = {"admit": 0, "get": 0}

    # -- the questions, asked under the lock -------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    @property
    def num_ready(self) -> int:
        with self._cond:
            return len(self._ready)

    def _deadlines(self) -> Counter[int]:
        d = Counter(t.deadline for t in self._in_flight.values())
        d.update(e.ticket.deadline for e in self._ready)
        return d

    def _feasible(self, deadlines: Counter[int], version: int, taken: int) -> bool:
        """Condition (*): the unconsumed groups fit B per step from `version` on (with
        `taken` of this step's B already used), none after its deadline."""
        due = 0
        for w in sorted(d for d, n in deadlines.items() if n > 0):
            if w < version:
                return False
            due += deadlines[w]
            if due > (w - version + 1) * self.batch_groups - taken:
                return False
        return True

    def can_admit(self) -> bool:
        """Would a group started now (deadline `version + eta`) still be consumable in time?"""
        with self._cond:
            return self._can_admit()

    def _can_admit(self) -> bool:
        d = self._deadlines()
        d[self._version + self.eta] += 1
        return self._feasible(d, self._version, self._taken_now)

    def _select(self, n: int) -> list[_Entry[G]] | None:
        """The `n` oldest finished groups that can be taken now without leaving an older
        in-flight group without a slot before its deadline; None if there are not `n`."""
        d = self._deadlines()
        taken = self._taken_now
        chosen: list[_Entry[G]] = []
        for e in self._ready:  # oldest first; eligibility only shrinks with the deadline
            if len(chosen) == n:
                break
            d[e.ticket.deadline] -= 1
            if self._feasible(d, self._version, taken + 1):
                chosen.append(e)
                taken += 1
            else:
                d[e.ticket.deadline] += 1
                break
        return chosen if len(chosen) == n else None

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise BufferClosed(f"the rollout buffer is closed ({where}): the run is ending",
                               hint="stop this rollout worker or trainer loop")

    def _wait(self, kind: str, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait on the condition until `ready()`; False on timeout. Raises BufferClosed."""
        self._check_open(kind)
        if ready():
            return True
        self._waits[f"{kind}_waits"] += 1
        self._waiting[kind] += 1
        t0 = time.monotonic()
        end = None if timeout is None else t0 + max(0.0, timeout)
        try:
            while True:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    self._waits[f"{kind}_timeouts"] += 1
                    return False
                self._cond.wait(left)
                self._check_open(kind)
                if ready():
                    return True
        finally:
            self._waiting[kind] -= 1
            self._waits[f"{kind}_wait_s"] += time.monotonic() - t0

    # -- rollout workers ----------------------------------------------------------------

    def admit(self, timeout: float | None = None) -> Ticket | None:
        """Reserve the start of one rollout group. Blocks while starting it now would let
        it be consumed more than `eta` versions after its own; returns None (falsy) if
        `timeout` seconds pass first. Raises BufferClosed once `close()` is called."""
        with self._cond:
            if not self._wait("admit", self._can_admit, timeout):
                return None
            t = Ticket(self._next_id, self._version, self._version + self.eta)
            self._next_id += 1
            self._in_flight[t.id] = t
            self._started[t.version] += 1
            return t

    def _match(self, versions: list[int]) -> Ticket:
        """A ticket for a group put without one: the newest in flight that is not newer
        than the group's oldest version (a group never has versions older than its own
        ticket, so some worker's ticket always fits and the bound still holds)."""
        if not self._in_flight:
            raise RuntimeError("put() of a group that was never admitted: call admit() before "
                               "starting a rollout group")
        oldest = min(versions) if versions else None
        fits = [t for t in self._in_flight.values() if oldest is None or t.version <= oldest]
        if not fits:
            raise RuntimeError(f"put() of a group sampled at version {oldest}, older than "
                               "every admitted group in flight: admit() before sampling")
        return max(fits, key=lambda t: (t.version, t.id))

    def put(self, group: G, ticket: Ticket | None = None) -> Ticket:
        """Hand in a finished group (all its samples, masked ones included: filtering is
        the trainer's, after `get_batch`). `ticket` is the one `admit()` gave for it; if
        omitted, one in flight that fits is used. Returns the ticket the group took."""
        versions = group_versions(group)
        with self._cond:
            self._check_open("put")
            if ticket is None:
                ticket = self._match(versions)
            elif self._in_flight.get(ticket.id) != ticket:
                raise RuntimeError(f"ticket {ticket.id} is not in flight (already put or "
                                   "aborted, or from another buffer)")
            if versions and min(versions) < ticket.version:
                raise RuntimeError(f"group admitted at version {ticket.version} has a sample "
                                   f"of version {min(versions)}: sample only after admit()")
            del self._in_flight[ticket.id]
            self._ready.append(_Entry(ticket, group))
            self._ready.sort(key=lambda e: (e.ticket.version, e.ticket.id))
            self._finished[ticket.version] += 1
            self._cond.notify_all()
            return ticket

    def abort(self, ticket: Ticket | None = None) -> None:
        """Give back an admitted group that will never be put (its rollout crashed before it
        produced even a masked episode). Without a ticket, the newest in flight is given
        back, which is always safe for the bound."""
        with self._cond:
            if ticket is None:
                if not self._in_flight:
                    raise RuntimeError("abort() with no group in flight")
                ticket = max(self._in_flight.values(), key=lambda t: (t.version, t.id))
            if self._in_flight.pop(ticket.id, None) is None:
                raise RuntimeError(f"ticket {ticket.id} is not in flight")
            self._aborted[ticket.version] += 1
            self._cond.notify_all()

    # -- the trainer ----------------------------------------------------------------------

    def get_batch(self, num_groups: int | None = None,
                  timeout: float | None = None) -> list[G] | None:
        """Take `num_groups` (default B) finished groups for the train step at the current
        version, oldest first, waiting for in-flight groups that are due. All or nothing:
        None (and nothing taken) if `timeout` seconds pass first. At most B groups may be
        taken per version. Raises BufferClosed once `close()` is called."""
        n = self.batch_groups if num_groups is None else num_groups
        with self._cond:
            left = self.batch_groups - self._taken_now
            if not isinstance(n, int) or n < 1 or n > left:
                raise ValueError(f"get_batch({n!r}) at version {self._version}: this version "
                                 f"has {left} of its {self.batch_groups} groups left; "
                                 "ask for 1..that many, or publish_version() first")
            chosen: list[_Entry[G]] = []

            def ready() -> bool:
                chosen[:] = self._select(n) or []
                return bool(chosen)

            if not self._wait("get", ready, timeout):
                return None
            ids = {e.ticket.id for e in chosen}
            self._ready = [e for e in self._ready if e.ticket.id not in ids]
            self._taken_now += len(chosen)
            for e in chosen:
                assert e.ticket.deadline >= self._version, "a group was consumed too late"
                self._consumed[e.ticket.version] += 1
                self._group_staleness[self._version - e.ticket.version] += 1
                for v in group_versions(e.group):
                    self._staleness[self._version - v] += 1
            self._cond.notify_all()
            return [e.group for e in chosen]

    def publish_version(self) -> int:
        """The trainer has synced new weights: the current version is now `v + 1` (returned).
        Raises StalenessError, changing nothing, if the groups taken at `v` were too few to
        keep every admitted group within its deadline."""
        with self._cond:
            if not self._feasible(self._deadlines(), self._version + 1, 0):
                due = sum(1 for t in [*self._in_flight.values(), *(e.ticket for e in self._ready)]
                          if t.deadline <= self._version)
                raise StalenessError(
                    f"publishing version {self._version + 1} would leave admitted groups more "
                    f"than eta={self.eta} versions stale ({due} due at version {self._version}, "
                    f"{self._taken_now} of {self.batch_groups} taken)",
                    hint="take the batch with get_batch() before publish_version()")
            self._version += 1
            self._taken_now = 0
            self._cond.notify_all()
            return self._version

    def close(self) -> None:
        """End the run: every waiter in admit()/get_batch() and every later call raises
        BufferClosed. Finished groups stay readable through state_dict()."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- metrics and checkpoints ----------------------------------------------------------

    def metrics(self) -> BufferMetrics:
        """JSON-able counters: per start version (keys are strings), staleness histograms
        (current version minus behaviour version, per token/episode version entry and per
        group), groups in flight and ready, and time spent waiting."""
        with self._cond:
            def hist(c: Counter[int]) -> dict[str, int]:
                return {str(k): c[k] for k in sorted(c)}

            return {
                "version": self._version, "eta": self.eta, "batch_groups": self.batch_groups,
                "groups_in_flight": len(self._in_flight), "groups_ready": len(self._ready),
                "groups_taken_this_version": self._taken_now,
                "started": sum(self._started.values()),
                "finished": sum(self._finished.values()),
                "consumed": sum(self._consumed.values()),
                "aborted": sum(self._aborted.values()),
                "started_per_version": hist(self._started),
                "finished_per_version": hist(self._finished),
                "consumed_per_version": hist(self._consumed),
                "aborted_per_version": hist(self._aborted),
                "staleness_hist": hist(self._staleness),
                "group_staleness_hist": hist(self._group_staleness),
                "max_staleness": max(self._staleness, default=0),
                "waiting_admit": self._waiting["admit"], "waiting_get": self._waiting["get"],
                **self._waits,
            }

    def state_dict(self) -> BufferState[G]:
        """The queue and its counters, for a checkpoint: plain data (JSON-able if the
        groups are, else pickleable). Groups in flight are recorded as tickets only; their
        rollouts do not survive a restart, so loading counts them as aborted."""
        with self._cond:
            def plain(c: Counter[int]) -> dict[str, int]:
                return {str(k): v for k, v in sorted(c.items())}

            return {
                "format": STATE_FORMAT, "eta": self.eta, "batch_groups": self.batch_groups,
                "version": self._version, "taken_now": self._taken_now,
                "next_id": self._next_id,
                "ready": [{"id": e.ticket.id, "version": e.ticket.version, "group": e.group}
                          for e in self._ready],
                "in_flight": [{"id": t.id, "version": t.version}
                              for t in sorted(self._in_flight.values(), key=lambda t: t.id)],
                "counters": {"started": plain(self._started), "finished": plain(self._finished),
                             "consumed": plain(self._consumed), "aborted": plain(self._aborted),
                             "staleness": plain(self._staleness),
                             "group_staleness": plain(self._group_staleness)},
                "waits": dict(self._waits),
            }

    def load_state_dict(self, state: BufferState[G]) -> None:
        """Restore a `state_dict()` into this buffer (before any worker starts)."""
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(f"rollout buffer state of format {state.get('format')!r}; this "
                              f"Ridgeline reads format {STATE_FORMAT}",
                              hint="resume with the Ridgeline version that wrote the checkpoint")
        if (state["eta"], state["batch_groups"]) != (self.eta, self.batch_groups):
            raise ConfigError(
                f"the checkpoint's buffer has eta={state['eta']}, batch_groups="
                f"{state['batch_groups']}; this run has eta={self.eta}, batch_groups="
                f"{self.batch_groups}", hint="resume with the same rl config")
        with self._cond:
            if self._in_flight or self._ready or self._next_id:
                raise RuntimeError("load_state_dict() into a buffer already in use: load it "
                                   "before any rollout worker starts")
            self._version = int(state["version"])
            self._taken_now = int(state["taken_now"])
            self._next_id = int(state["next_id"])
            self._ready = [_Entry(Ticket(int(r["id"]), int(r["version"]),
                                         int(r["version"]) + self.eta), r["group"])
                           for r in state["ready"]]
            self._ready.sort(key=lambda e: (e.ticket.version, e.ticket.id))
            c = state["counters"]
            for mine, name in ((self._started, "started"), (self._finished, "finished"),
                               (self._consumed, "consumed"), (self._aborted, "aborted"),
                               (self._staleness, "staleness"),
                               (self._group_staleness, "group_staleness")):
                mine.clear()
                mine.update({int(k): int(v) for k, v in c[name].items()})
            for t in state["in_flight"]:
                self._aborted[int(t["version"])] += 1
            self._waits.update(state.get("waits", {}))
            assert self._feasible(self._deadlines(), self._version, self._taken_now), \
                "the restored buffer breaks its staleness bound"
            self._cond.notify_all()
