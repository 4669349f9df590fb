"""The dashboard in headless Chromium (Debian's, driven by Playwright): a user enters a
key, sees the tenant's tasks and the stats, opens a task and watches its events arrive
live until it completes, and cancels another; a screenshot is written for a human look."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.service import Platform
from ridgeline.serve.app import ServerThread

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is a dev dependency (make install)")
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (make system-deps does it)",
                allow_module_level=True)


@pytest.fixture
def served(tmp_path: Path):
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp_path), "server": {"run_workers": 1},
        "worker": {"sandbox": "local", "allow_replay_model": True, "poll_s": 0.1},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"}})
    platform = Platform(config)
    key, _ = platform.keys.create("acme", user="ann")
    server = ServerThread(platform.app()).start()
    yield server, key
    server.stop()
    platform.close()


def test_dashboard_follows_a_task_live(served, tmp_path: Path) -> None:
    server, key = served
    api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"})
    # a task whose steps take a while, so the page sees events arrive while it watches
    slow = api.post("/v1/agent/tasks", json={
        "instruction": "count slowly", "model": "replay",
        "replay": [f"<bash>sleep 0.4; echo tick {i}</bash>" for i in range(4)]
        + ["<finish>counted</finish>"]}).json()["id"]

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(server.url + "/dashboard")
        page.fill("#key", key)
        page.click("#login button")
        row = page.locator(f'tr.task[data-id="{slow}"]')
        row.wait_for(timeout=15_000)
        assert "acme" not in page.locator("#error").inner_text()
        # the list holds summaries; the whole request is fetched when the task is opened
        assert row.locator("td.instruction").inner_text() == "count slowly"
        row.click()
        page.locator("#task-info pre.instruction").wait_for(timeout=10_000)
        assert page.locator("#task-info pre.instruction").inner_text() == "count slowly"
        page.locator(".event[data-type='task.step']").first.wait_for(timeout=30_000)
        steps_seen_early = page.locator(".event[data-type='task.step']").count()
        page.locator(".event[data-type='task.completed']").wait_for(timeout=30_000)
        assert page.locator(".event[data-type='task.step']").count() == 5 > steps_seen_early - 1
        assert page.locator("#task-status").inner_text() == "completed"
        assert page.locator("#cancel").count() == 0  # nothing left to cancel
        assert "tick 3" in page.locator("#events").inner_text()
        row.locator(".status.completed").wait_for(timeout=10_000)  # the list refreshes too
        assert "completed" in page.locator("#stats").inner_text()
        assert "step 4: bash sleep 0.4; echo tick 3" in page.locator("#events").inner_text()
        page.screenshot(path=str(tmp_path / "dashboard.png"))

        # a wrong key shows the server's message instead of data
        page.fill("#key", "rk-wrong-" + "x" * 40)
        page.click("#login button")
        page.wait_for_function("document.querySelector('#error').textContent.length > 0",
                               timeout=10_000)
        assert "API key" in page.locator("#error").inner_text()
        browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
