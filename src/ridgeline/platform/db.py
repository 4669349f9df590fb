"""One small SQL layer over SQLite (the embedded default) and PostgreSQL (many machines).

The platform's stores write plain SQL that both dialects accept, with `?` placeholders:

    db = open_database("sqlite:///platform.db", data_dir="platform-data")
    db = open_database("postgresql://ridgeline:pw@db:5432/ridgeline")
    db.executescript(SCHEMA)                     # CREATE ... IF NOT EXISTS, idempotent
    seq = db.run(lambda tx: append(tx, ...))     # one transaction, retried if it must be
    rows = db.fetchall("SELECT ... WHERE a = ?", (1,))

SQLite: a connection per thread, WAL (readers never block the writer), a busy timeout,
and `BEGIN IMMEDIATE` for write transactions, so writers in every thread and process on
the machine take turns. PostgreSQL: a small pool of connections shared by the threads,
transactions at READ COMMITTED, and `Transaction.lock(key)` (a transaction-scoped
advisory lock) wherever a read-then-write must not interleave with another writer's;
on SQLite that lock is a no-op because `BEGIN IMMEDIATE` already serialises writers.

Dialect differences the schemas may rely on: `BLOB`, `REAL` and `INTEGER` become
`BYTEA`, `DOUBLE PRECISION` and `BIGINT` on PostgreSQL (SQLite integers are 64-bit).
Upserts use `INSERT ... ON CONFLICT (...) DO UPDATE/NOTHING`, which both understand;
`INSERT OR REPLACE`, `rowid` and `FOR UPDATE` are SQLite-only or PostgreSQL-only: avoid.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hashlib
import os
import random
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ridgeline.errors import ConfigError

T = TypeVar("T")
Dialect = Literal["sqlite", "postgresql"]
Args = Sequence[Any]

POSTGRES_SCHEMES = ("postgresql://", "postgres://", "postgresql+psycopg://")
_PG_IDLE = 0   # psycopg.pq.TransactionStatus.IDLE, without importing psycopg here
#: Transactions retried this many times in all when the database asks for it.
RETRY_ATTEMPTS = 5


# ---- URLs ----------------------------------------------------------------------------------


def is_postgres_url(value: str) -> bool:
    return value.startswith(POSTGRES_SCHEMES)


def database_location(value: str | None) -> str | None:
    """A pydantic field validator's body for a database setting: the value unchanged, or
    a ValueError (what pydantic reports) naming what is wrong with its scheme, so a typo
    fails when the config loads rather than when the store opens."""
    if value is not None:
        try:
            resolve_location(value)
        except ConfigError as e:
            raise ValueError(str(e)) from None
    return value


def resolve_location(url_or_path: str | os.PathLike[str],
                     data_dir: str | os.PathLike[str] = ".") -> str:
    """Where a database lives: a `postgresql://` URL as it is, `:memory:`, or a SQLite
    file path (`sqlite:///abs`, `sqlite:///relative` and plain relative paths are taken
    relative to `data_dir`). Any other URL is a ConfigError."""
    value = os.fspath(url_or_path)
    if is_postgres_url(value):
        return "postgresql://" + value.split("://", 1)[1]
    if value.startswith("sqlite:///"):
        value = value[len("sqlite:///"):] or ":memory:"
    elif value == "sqlite://":
        value = ":memory:"
    elif "://" in value:
        raise ConfigError(f"database URL {mask_url(value)!r} is neither SQLite nor PostgreSQL",
                          hint="use sqlite:///path/to/file.db (one machine) or "
                               "postgresql://user:password@host:5432/dbname (many)")
    if value != ":memory:" and not os.path.isabs(value):
        value = str(Path(data_dir) / value)
    return value


def mask_url(url: str) -> str:
    """The URL with its password (in the authority or the query) replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = [(k, "***" if k.lower() == "password" else v)
                 for k, v in parse_qsl(query, keep_blank_values=True)]
        query = urlencode(pairs, safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# ---- SQL text ------------------------------------------------------------------------------


def _split_outside_quotes(sql: str) -> list[tuple[bool, str]]:
    """The SQL cut into (quoted, text) pieces, so rewrites never touch string literals or
    quoted identifiers."""
    pieces: list[tuple[bool, str]] = []
    i, start, n = 0, 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch in ("'", '"'):
            pieces.append((False, sql[start:i]))
            j = i + 1
            while j < n:
                if sql[j] == ch:
                    if j + 1 < n and sql[j + 1] == ch:   # a doubled quote is an escaped one
                        j += 2
                        continue
                    break
                j += 1
            pieces.append((True, sql[i:j + 1]))
            i = start = j + 1
            continue
        i += 1
    pieces.append((False, sql[start:]))
    return pieces


@functools.lru_cache(maxsize=1024)
def to_pyformat(sql: str) -> str:
    """`?` placeholders outside quotes as psycopg's `%s`, and every literal `%` (psycopg
    reads them in string literals too) as `%%`."""
    return "".join(text.replace("%", "%%") if quoted
                   else text.replace("%", "%%").replace("?", "%s")
                   for quoted, text in _split_outside_quotes(sql))


_PG_TYPES = ((re.compile(r"\bBLOB\b", re.I), "BYTEA"),
             (re.compile(r"\bREAL\b", re.I), "DOUBLE PRECISION"),
             (re.compile(r"\bINTEGER\b", re.I), "BIGINT"))


def to_postgres_ddl(sql: str) -> str:
    """A schema written for SQLite in PostgreSQL's types."""
    out = []
    for quoted, text in _split_outside_quotes(sql):
        if not quoted:
            for pattern, replacement in _PG_TYPES:
                text = pattern.sub(replacement, text)
        out.append(text)
    return "".join(out)


def split_statements(script: str) -> list[str]:
    """The statements of a script (separated by `;` outside quotes), without empty ones."""
    statements, current = [], []
    for quoted, text in _split_outside_quotes(script):
        if quoted:
            current.append(text)
            continue
        parts = text.split(";")
        current.append(parts[0])
        for part in parts[1:]:
            statements.append("".join(current))
            current = [part]
    statements.append("".join(current))
    return [s.strip() for s in statements if s.strip()]


def lock_id(key: str) -> int:
    """A signed 64-bit number for an advisory lock named `key` (stable across processes
    and server versions, unlike hashtext)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)


# ---- transactions --------------------------------------------------------------------------


class Transaction:
    """The statements of one transaction, on one connection. Made by
    `Database.transaction` or `Database.run`; not shared between threads."""

    def __init__(self, db: Database, conn: Any, write: bool) -> None:
        self.db = db
        self.conn = conn
        self.write = write

    def execute(self, sql: str, args: Args = ()) -> int:
        """Run one statement; the number of rows it changed."""
        return int(self.db._cursor(self.conn, sql, args).rowcount)

    def executemany(self, sql: str, rows: Sequence[Args]) -> None:
        if rows:
            self.db._executemany(self.conn, sql, rows)

    def fetchone(self, sql: str, args: Args = ()) -> tuple[Any, ...] | None:
        row = self.db._cursor(self.conn, sql, args).fetchone()
        return None if row is None else tuple(row)

    def fetchall(self, sql: str, args: Args = ()) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.db._cursor(self.conn, sql, args).fetchall()]

    def lock(self, key: str) -> None:
        """Hold a lock named `key` until this transaction ends: other transactions asking
        for the same key wait. For read-then-write sequences (the next event number of a
        task) that must not interleave."""
        assert self.write, "locks are for write transactions"
        self.db._lock_key(self.conn, key)


class Database(abc.ABC):
    """What the stores see of a database. `open_database` makes one of the two kinds."""

    dialect: Dialect
    #: Where it lives, for messages (a PostgreSQL URL with its password masked).
    location: str

    def __init__(self) -> None:
        self._local = threading.local()   # the transaction this thread is in, if any

    # -- to implement ---------------------------------------------------------------------
    @abc.abstractmethod
    def _begin(self, write: bool) -> contextlib.AbstractContextManager[Any]:
        """A connection in a new transaction, committed or rolled back at the end."""

    @abc.abstractmethod
    def _query(self, sql: str, args: Args, many: bool) -> Any:
        """One read statement outside any transaction: its row (None) or rows."""

    @abc.abstractmethod
    def _cursor(self, conn: Any, sql: str, args: Args) -> Any:
        ...

    @abc.abstractmethod
    def _executemany(self, conn: Any, sql: str, rows: Sequence[Args]) -> None:
        ...

    @abc.abstractmethod
    def _lock_key(self, conn: Any, key: str) -> None:
        ...

    @abc.abstractmethod
    def _retryable(self, error: BaseException) -> bool:
        ...

    def _ddl(self, statement: str) -> str:
        return statement

    @abc.abstractmethod
    def close(self) -> None:
        ...

    # -- the interface --------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self, write: bool = True) -> Iterator[Transaction]:
        """One transaction: committed when the block ends, rolled back if it raises.
        Inside another transaction of this thread, the block joins it (no savepoint)."""
        current: Transaction | None = getattr(self._local, "tx", None)
        if current is not None:
            if write and not current.write:
                raise RuntimeError("a write inside a read-only transaction")
            yield current
            return
        with self._begin(write) as conn:
            tx = Transaction(self, conn, write)
            self._local.tx = tx
            try:
                yield tx
            finally:
                self._local.tx = None

    def run(self, fn: Callable[[Transaction], T], *, write: bool = True,
            attempts: int = RETRY_ATTEMPTS) -> T:
        """`fn` in one transaction, run again from the start (after a short random pause)
        when the database aborted it for a deadlock or serialization failure, or found
        the database locked; so `fn` must only touch the database and its own locals."""
        if getattr(self._local, "tx", None) is not None:
            with self.transaction(write) as tx:   # joined: the outer one retries, if any
                return fn(tx)
        for attempt in range(1, attempts + 1):
            try:
                with self.transaction(write) as tx:
                    return fn(tx)
            except Exception as e:
                if attempt == attempts or not self._retryable(e):
                    raise
            time.sleep(random.uniform(0, 0.01 * 2 ** attempt))
        raise AssertionError("unreachable")

    def execute(self, sql: str, args: Args = ()) -> int:
        """One write statement in its own (retried) transaction; the rows it changed."""
        return self.run(lambda tx: tx.execute(sql, args))

    def fetchone(self, sql: str, args: Args = ()) -> tuple[Any, ...] | None:
        current: Transaction | None = getattr(self._local, "tx", None)
        if current is not None:
            return current.fetchone(sql, args)
        row = self._query(sql, args, False)
        return None if row is None else tuple(row)

    def fetchall(self, sql: str, args: Args = ()) -> list[tuple[Any, ...]]:
        current: Transaction | None = getattr(self._local, "tx", None)
        if current is not None:
            return current.fetchall(sql, args)
        return [tuple(r) for r in self._query(sql, args, True)]

    def executescript(self, script: str) -> None:
        """A schema of `CREATE ... IF NOT EXISTS` statements, in one transaction under a
        lock (PostgreSQL's IF NOT EXISTS is not safe against a concurrent CREATE)."""
        def create(tx: Transaction) -> None:
            tx.lock("ridgeline:schema")
            for statement in split_statements(script):
                tx.execute(self._ddl(statement))
        self.run(create)

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.location}>"


# ---- SQLite --------------------------------------------------------------------------------


class SQLiteDatabase(Database):
    """A SQLite file (a connection per thread) or a private in-memory database (one
    connection, one statement or transaction at a time)."""

    dialect: Dialect = "sqlite"

    def __init__(self, path: str, *, busy_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.path = path
        self.location = path
        self.busy_timeout_s = busy_timeout_s
        self.memory = path == ":memory:"
        if not self.memory:
            parent = Path(path).expanduser().resolve().parent
            if not parent.is_dir():
                raise ConfigError(f"the directory of database {path} does not exist",
                                  hint="create it, or point the setting at a writable place")
        self._conns: dict[threading.Thread, sqlite3.Connection] = {}
        self._conns_lock = threading.Lock()
        self._memory_lock = threading.RLock()   # serialises users of the one connection
        self._shared: sqlite3.Connection | None = None
        self._conn()   # open now, so a bad path fails here and not on first use

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            if not self.memory:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: safe if the
                # process dies; the last commits may be lost only if the machine does
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
        except sqlite3.Error as e:
            raise ConfigError(f"cannot open SQLite database {self.path}: {e}",
                              hint="check that the file is a SQLite database and writable")
        return conn

    def _conn(self) -> sqlite3.Connection:
        if self.memory:
            with self._conns_lock:
                if self._shared is None:
                    self._shared = self._connect()
                return self._shared
        me = threading.current_thread()
        conn = self._conns.get(me)
        if conn is None:
            conn = self._connect()
            with self._conns_lock:
                # connections of threads that ended are closed here (pools of short-lived
                # threads would otherwise leak one each)
                for thread in [t for t in self._conns if not t.is_alive()]:
                    with contextlib.suppress(sqlite3.Error):
                        self._conns.pop(thread).close()
                self._conns[me] = conn
        return conn

    @contextlib.contextmanager
    def _begin(self, write: bool) -> Iterator[sqlite3.Connection]:
        with self._memory_lock if self.memory else contextlib.nullcontext():
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _query(self, sql: str, args: Args, many: bool) -> Any:
        with self._memory_lock if self.memory else contextlib.nullcontext():
            cur = self._conn().execute(sql, tuple(args))
            return cur.fetchall() if many else cur.fetchone()

    def _cursor(self, conn: sqlite3.Connection, sql: str, args: Args) -> sqlite3.Cursor:
        return conn.execute(sql, tuple(args))

    def _executemany(self, conn: sqlite3.Connection, sql: str, rows: Sequence[Args]) -> None:
        conn.executemany(sql, [tuple(r) for r in rows])

    def _lock_key(self, conn: sqlite3.Connection, key: str) -> None:
        pass   # BEGIN IMMEDIATE: this transaction is the only writer already

    def _retryable(self, error: BaseException) -> bool:
        return isinstance(error, sqlite3.OperationalError) and (
            "locked" in str(error) or "busy" in str(error))

    def close(self) -> None:
        with self._conns_lock:
            for conn in [*self._conns.values(), *([self._shared] if self._shared else [])]:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._conns.clear()
            self._shared = None


# ---- PostgreSQL ----------------------------------------------------------------------------


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError("a postgresql:// database needs psycopg 3, which is not installed",
                          hint="pip install 'psycopg[binary]>=3.1' (or the platform extra), "
                               "or use sqlite:///path for the embedded default") from None
    return psycopg


class PostgresDatabase(Database):
    """A PostgreSQL database through a small pool of psycopg connections (autocommit
    mode, explicit BEGIN/COMMIT), shared by the threads of the process."""

    dialect: Dialect = "postgresql"

    def __init__(self, url: str, *, pool_size: int = 10, connect_timeout_s: float = 10.0,
                 acquire_timeout_s: float = 30.0) -> None:
        super().__init__()
        self._pg = _psycopg()
        self.url = url
        self.location = mask_url(url)
        self.pool_size = max(1, pool_size)
        self.connect_timeout_s = connect_timeout_s
        self.acquire_timeout_s = acquire_timeout_s
        self._idle: list[Any] = []
        self._available = threading.Condition()
        self._closed = False
        self._open = 1                          # connections made and not yet discarded
        self._release(self._connect(first=True))   # fail now, clearly, if unreachable

    def _connect(self, first: bool = False) -> Any:
        try:
            return self._pg.connect(self.url, autocommit=True,
                                    connect_timeout=max(1, int(self.connect_timeout_s)),
                                    application_name="ridgeline")
        except self._pg.OperationalError as e:
            if not first:
                raise   # it worked before: the server or the network failed, not the config
            reason = " ".join(str(e).split())[:300]
            raise ConfigError(
                f"cannot connect to PostgreSQL at {self.location}: {reason}",
                hint="check that the server is running and reachable from this machine, "
                     "and the user, password and database name in the URL; or use "
                     "sqlite:///platform.db to run on one machine") from None
        except self._pg.ProgrammingError as e:   # a malformed URL or option
            raise ConfigError(f"bad PostgreSQL URL {self.location}: {e}",
                              hint="postgresql://user:password@host:5432/dbname") from None

    def _acquire(self) -> tuple[Any, bool]:
        """A connection and whether it was reused (it may have died while idle)."""
        deadline = time.monotonic() + self.acquire_timeout_s
        with self._available:
            while True:
                if self._closed:
                    raise RuntimeError(f"database {self.location} is closed")
                while self._idle:
                    conn = self._idle.pop()
                    if not (conn.closed or conn.broken):
                        return conn, True
                    self._open -= 1
                if self._open < self.pool_size:
                    self._open += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"all {self.pool_size} connections to {self.location} "
                                       f"stayed busy for {self.acquire_timeout_s:g} s")
                self._available.wait(left)
        try:
            return self._connect(), False
        except BaseException:
            with self._available:
                self._open -= 1
                self._available.notify()
            raise

    def _release(self, conn: Any, discard: bool = False) -> None:
        # a connection left inside a transaction (its ROLLBACK failed) is not reused
        unusable = conn.closed or conn.broken or conn.info.transaction_status != _PG_IDLE
        with self._available:
            if discard or self._closed or unusable:
                self._open -= 1
                with contextlib.suppress(Exception):
                    conn.close()
            else:
                self._idle.append(conn)
            self._available.notify()

    def _first_statement(self, sql: str, args: Args = ()) -> tuple[Any, Any]:
        """A connection and the cursor of its first statement. A pooled connection whose
        link died while idle (a server restart, a proxy's idle timeout) fails only when
        used: then the statement, which cannot have run, goes to a new connection."""
        while True:
            conn, reused = self._acquire()
            try:
                return conn, conn.execute(sql, args)
            except self._pg.OperationalError:
                dead = conn.closed or conn.broken
                self._release(conn, discard=dead)
                if not (reused and dead):
                    raise
            except BaseException:
                self._release(conn)
                raise

    @contextlib.contextmanager
    def _begin(self, write: bool) -> Iterator[Any]:
        conn, _ = self._first_statement("BEGIN ISOLATION LEVEL READ COMMITTED"
                                        + ("" if write else " READ ONLY"))
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if not (conn.closed or conn.broken):
                with contextlib.suppress(self._pg.Error):
                    conn.execute("ROLLBACK")
            raise
        finally:
            self._release(conn)

    def _query(self, sql: str, args: Args, many: bool) -> Any:
        conn, cur = self._first_statement(to_pyformat(sql), tuple(args))
        try:
            return cur.fetchall() if many else cur.fetchone()
        finally:
            self._release(conn)

    def _cursor(self, conn: Any, sql: str, args: Args) -> Any:
        return conn.execute(to_pyformat(sql), tuple(args))

    def _executemany(self, conn: Any, sql: str, rows: Sequence[Args]) -> None:
        with conn.cursor() as cur:
            cur.executemany(to_pyformat(sql), [tuple(r) for r in rows])

    def _lock_key(self, conn: Any, key: str) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id(key),))

    def _retryable(self, error: BaseException) -> bool:
        errors = self._pg.errors
        return isinstance(error, (errors.SerializationFailure, errors.DeadlockDetected))

    def _ddl(self, statement: str) -> str:
        return to_postgres_ddl(statement)

    def close(self) -> None:
        with self._available:
            self._closed = True
            for conn in self._idle:
                with contextlib.suppress(Exception):
                    conn.close()
            self._open -= len(self._idle)
            self._idle.clear()
            self._available.notify_all()


# ---- opening -------------------------------------------------------------------------------


def open_database(url: str | os.PathLike[str], *, data_dir: str | os.PathLike[str] = ".",
                  pool_size: int = 10, busy_timeout_s: float = 30.0) -> Database:
    """A database from a URL or path: `sqlite:///path` or a plain path (relative ones
    under `data_dir`), `:memory:` (private to this object), or `postgresql://...`
    (`pool_size` connections at most). A ConfigError says what to fix when the server is
    unreachable, psycopg is missing or the URL is of another kind."""
    location = resolve_location(url, data_dir)
    if is_postgres_url(location):
        return PostgresDatabase(location, pool_size=pool_size)
    return SQLiteDatabase(location, busy_timeout_s=busy_timeout_s)


__all__ = ["Database", "Dialect", "PostgresDatabase", "SQLiteDatabase", "Transaction",
           "is_postgres_url", "lock_id", "mask_url", "open_database", "resolve_location",
           "split_statements", "to_postgres_ddl", "to_pyformat"]
