"""The warm pool: fast leases, resets between them, a concurrency limit."""

from __future__ import annotations

import threading
import time

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import SandboxPool, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import needs_bwrap, pids_in_namespace

pytestmark = needs_bwrap


def test_released_sandboxes_come_back_clean(tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "keep.txt").write_text("original")
    with SandboxPool(SandboxSpec(workspace_path="/app", workspace_from=seed), size=1) as pool:
        sb = pool.acquire()
        ns = sb.namespaces["pid"]
        sb.run("echo dirty > keep.txt; echo junk > extra.txt; echo t > /tmp/t; sleep 1000 &")
        pool.release(sb)
        again = pool.acquire(timeout=30)
        assert again is sb  # the same warm sandbox, reset
        assert sorted(again.list_files()) == ["keep.txt"]
        assert again.read_file("keep.txt") == b"original"
        assert again.run("ls -A /tmp").stdout == ""
        assert pids_in_namespace(ns) == []  # the old processes are gone
        assert "sleep" not in again.run("ps -eo args").stdout
        pool.release(again)
    assert sb.closed


def test_acquire_waits_for_a_release_up_to_its_timeout():
    with SandboxPool(SandboxSpec(), size=1, max_concurrency=2) as pool:
        a, b = pool.acquire(), pool.acquire()
        with pytest.raises(SandboxError, match="no sandbox became free"):
            pool.acquire(timeout=0.2)
        got = []
        t = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30)))
        t.start()
        time.sleep(0.1)
        pool.release(a)
        t.join()
        assert got and got[0].run("echo ok").stdout == "ok\n"
        pool.release(b)
        pool.release(got[0])
        with pool.lease() as sb:
            assert sb.alive


def test_releasing_what_is_not_leased_is_an_error():
    with SandboxPool(SandboxSpec(), size=1) as pool:
        sb = pool.acquire()
        pool.release(sb)
        with pytest.raises(SandboxError, match="not leased"):
            pool.release(sb)  # twice
        with create_sandbox(SandboxSpec()) as stranger:
            with pytest.raises(SandboxError, match="not leased"):
                pool.release(stranger)


def test_a_closed_pool_lends_nothing():
    with SandboxPool(SandboxSpec(), size=1) as pool:
        pass
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire()


def test_a_sandbox_closed_by_its_user_is_replaced():
    with SandboxPool(SandboxSpec(), size=1) as pool:
        sb = pool.acquire()
        sb.close()
        pool.release(sb)
        fresh = pool.acquire(timeout=30)
        assert fresh is not sb and fresh.run("echo ok").stdout == "ok\n"
        pool.release(fresh)
