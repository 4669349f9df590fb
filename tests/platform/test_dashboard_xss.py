"""Stored XSS against the dashboard, in headless Chromium (issue 25, finding 8).

Every payload below is first shown to be a live exploit in the context it targets (a page
without defences where it sets `window.__pwned` and calls a local listener: the positive
control). Then it is planted in every field the dashboard shows, through the channels an
attacker has: a tenant's instruction, model output (replayed replies: commands, their
output, the finish summary), a planner's subtasks (model-written graph children), and,
written straight into the store, the fields a tenant cannot set through the API (task id,
kind, parent, error, webhook URL, event type). The page must show each as text, run none of
it (no marker, no request to the listener, no element or attribute it could create) both
under the real Content-Security-Policy and with the header stripped (the DOM layer holds on
its own), and the header itself must block an inline script and handler."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.principal import Principal
from ridgeline.platform.service import Platform
from ridgeline.platform.store import TaskStatus
from ridgeline.serve.app import ServerThread

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is a dev dependency (make install)")
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (make system-deps does it)",
                allow_module_level=True)

HIT = "fetch('http://127.0.0.1:{port}/{name}')"
# name -> (payload, a page where it runs: the context it breaks out of, as the old
# dashboard built it from HTML strings). {port} is the listener's.
PAYLOADS: dict[str, tuple[str, str]] = {
    "attr_dq": ('" tabindex="0" autofocus onfocus="window.__pwned=1;' + HIT + '" x="',
                '<table><tr><td title="{p}">t</td></tr></table>'),
    "attr_sq": ("' tabindex='0' autofocus onfocus='window.__pwned=1;" + HIT.replace("'", '"')
                + "' x='", "<table><tr><td title='{p}'>t</td></tr></table>"),
    "img_onerror": ('<img src=x onerror="window.__pwned=1;' + HIT + '">', "<div>{p}</div>"),
    "script": ("<script>window.__pwned=1;" + HIT + "</script>", "<p>{p}</p>"),
    "close_title": ('</title></pre></textarea><svg onload="window.__pwned=1;' + HIT + '">',
                    "<title>{p}</title><pre>x</pre>"),
    "js_url": ("javascript:window.__pwned=1;" + HIT, '<a href="{p}">open</a>'),
    "template": ("${(window.__pwned=1," + HIT + ")}", "<script>const s = `{p}`;</script>"),
}
# Focus, hover and click every element: whatever handler a payload managed to attach runs.
POKE = """() => { for (const e of document.querySelectorAll('*')) {
    try { e.focus(); } catch (_) {}
    e.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));
    if (e.tagName === 'A') e.click(); } }"""
# What the dashboard itself creates: anything else (an element or attribute a payload
# brought) is an injection, even one that a browser would not run.
STRUCTURE = """() => {
  const bad = [...document.querySelectorAll('body :is(img, svg, iframe, object, embed, a, '
      + 'style, base, meta, link, script, title, textarea, form:not(#login), input:not(#key))')]
    .map(e => e.tagName);
  const head = [...document.head.children].map(e => e.tagName).join(' ');
  if (head !== 'META TITLE META LINK SCRIPT') bad.push('head: ' + head);
  for (const e of document.querySelectorAll('*'))
    for (const a of e.attributes)
      if (/^on|^(autofocus|style|tabindex|x|href|src|action|formaction)$/i.test(a.name)
          && !(e.parentNode === document.head && /^(href|src)$/.test(a.name)))
        bad.push(e.tagName + '@' + a.name);
  return bad; }"""


class _Listener(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        type(self).hits.append(self.path)
        self.send_response(200)
        self.send_header("access-control-allow-origin", "*")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def _payload(name: str, port: int, where: str = "planted") -> str:
    """The payload calling the listener at /<where>_<name>: the planted copies and the
    positive controls' are told apart."""
    return PAYLOADS[name][0].replace("{port}", str(port)).replace("{name}", f"{where}_{name}")


def _wait(predicate: Any, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout  # a safety limit, not a measurement
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def listener() -> Iterator[tuple[int, list[str]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], _Listener.hits
    server.shutdown()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory, listener: tuple[int, list[str]]
            ) -> Iterator[dict[str, Any]]:
    """A platform holding every payload in every field the dashboard shows."""
    port, _ = listener
    tmp = tmp_path_factory.mktemp("xss")
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp), "server": {"run_workers": 2},
        "worker": {"sandbox": "local", "allow_replay_model": True, "poll_s": 0.05},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"}})
    platform = Platform(config)
    key, record = platform.keys.create("acme", user="ann")
    server = ServerThread(platform.app()).start()
    api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"})
    owner = Principal(key_id=record.key_id, tenant="acme", user="ann")
    agent, crafted, crafted_id = {}, {}, {}
    for name in PAYLOADS:
        p = _payload(name, port)
        # a tenant's instruction; the model's command, its output and its summary
        r = api.post("/v1/agent/tasks", json={
            "instruction": p, "model": "replay",
            "replay": [f"<bash>cat <<'RIDGELINE_EOF'\n{p}\nRIDGELINE_EOF</bash>",
                       f"<finish>{p}</finish>"]})
        assert r.status_code == 202, r.text
        agent[name] = r.json()["id"]
        # fields the API does not let a tenant set, written as a compromised or future
        # server might: kind, parent, error, webhook URL, an event's type and data
        task, _ = platform.store.create_task(
            owner, {"instruction": f"crafted {name}", "webhook": {"url": p}}, kind=p,
            parent_id=p, task_id=f"task_crafted_{name}")
        platform.store.append_event(task.id, p, {"note": p, "task_id": p})
        platform.store.finish(task.id, TaskStatus.FAILED, error=p)
        crafted[name] = task.id
        # a task id the page must show but never put into a request path
        odd, _ = platform.store.create_task(owner, {"instruction": "odd id"}, task_id=p)
        platform.store.finish(odd.id, TaskStatus.FAILED, error="odd")
        crafted_id[name] = odd.id
    # a planner (model-written text) whose subtasks carry the payloads
    plan = [{"id": name, "instruction": _payload(name, port),
             "replay": [f"<finish>{_payload(name, port)}</finish>"]} for name in PAYLOADS]
    # the nested replies' tags escaped, so the planner's own <finish> is not cut short
    plan_json = json.dumps(plan).replace("<", "\\u003c")
    r = api.post("/v1/agent/tasks", json={
        "instruction": "plan and fan out", "model": "replay",
        "graph": {"nodes": [{"id": "plan", "instruction": "plan", "expand": True,
                             "replay": [f"<finish>{plan_json}</finish>"]}]}})
    assert r.status_code == 202, r.text
    dag = r.json()["id"]
    ids = [*agent.values(), dag]
    _wait(lambda: all(platform.store.get(i).status.terminal for i in ids),
          what="the planted tasks to finish")
    assert platform.store.get(dag).status is TaskStatus.COMPLETED, platform.store.get(dag)
    children = {c.request["node_id"]: c.id
                for c in platform.store.list(None, parent_id=dag, limit=100)}
    assert set(children) == {"plan", *(f"plan.{n}" for n in PAYLOADS)}, \
        [(e.type, e.data) for e in platform.store.events(dag, 0)]
    yield {"url": server.url, "key": key, "agent": agent, "crafted": crafted,
           "crafted_id": crafted_id, "dag": dag, "children": children, "port": port}
    api.close()
    server.stop()
    platform.close()


def _open_dashboard(browser: Any, planted: dict[str, Any], *, strip_csp: bool
                    ) -> tuple[Any, Any, list[str]]:
    # bypass_csp: the same page with its policy off, so the DOM layer alone must hold (the
    # page still comes from the loopback server: a routed copy could not reach the listener)
    context = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=strip_csp)
    page = context.new_page()
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text)
            if re.search(r"Content Security Policy|Trusted Type", m.text) else None)
    page.goto(planted["url"] + "/dashboard")
    page.fill("#key", planted["key"])
    page.click("#login button")
    page.locator(f'tr.task[data-id="{planted["dag"]}"]').wait_for(timeout=15_000)
    return context, page, violations


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_payload_is_live_in_the_context_it_targets(browser: Any, listener: tuple[int, list[str]],
                                                   name: str) -> None:
    """Positive control: each payload runs where it was written for, and the listener and
    the marker see it; so their silence on the dashboard means the page stopped it."""
    port, hits = listener
    page = browser.new_page()
    page.set_content(PAYLOADS[name][1].replace("{p}", _payload(name, port, "control")))
    page.evaluate(POKE)
    page.wait_for_function("window.__pwned === 1", timeout=10_000)
    _wait(lambda: f"/control_{name}" in hits, timeout=10, what="the listener's hit")
    page.close()


@pytest.mark.parametrize("strip_csp", [False, True], ids=["csp", "no_csp"])
def test_every_payload_in_every_field_is_shown_as_text_and_never_runs(
        browser: Any, planted: dict[str, Any], listener: tuple[int, list[str]],
        strip_csp: bool) -> None:
    """One page for all payloads (each one's tasks opened in turn): a payload that ran
    or became markup at any point fails the stage where it was seen."""
    port, hits = listener
    context, page, violations = _open_dashboard(browser, planted, strip_csp=strip_csp)
    if strip_csp:  # the policy really is off in this variant, and the listener reachable
        assert page.evaluate("() => { try { document.createElement('div').innerHTML = '<b>';"
                             " return 'assigned'; } catch (e) { return e.name; } }") == "assigned"
        assert page.evaluate("(u) => fetch(u).then(() => 'sent', e => String(e))",
                             f"http://127.0.0.1:{port}/control_reachable") == "sent"

    def inert(stage: str) -> None:
        """Nothing a payload carries ran or even became markup, at this stage."""
        page.evaluate(POKE)
        assert page.evaluate("() => window.__pwned") is None, stage
        assert page.evaluate(STRUCTURE) == [], stage
        assert violations == [], stage  # nothing tried to run that the CSP had to refuse
        assert page.title() == "Ridgeline platform", stage

    inert("the task list")
    for name in PAYLOADS:
        _check_payload(page, planted, name, _payload(name, port), inert)
    page.wait_for_timeout(300)  # lets a request a payload might have started arrive
    context.close()
    assert [h for h in hits if h.startswith("/planted_")] == []


def _check_payload(page: Any, planted: dict[str, Any], name: str, p: str,
                   inert: Any) -> None:
    """Every field that holds payload `name` (text `p`) shows it as text."""
    # the list: the instruction as a tooltip and a cell, the crafted id and kind as text
    agent_row = page.locator(f'tr.task[data-id="{planted["agent"][name]}"]')
    assert agent_row.locator("td").first.get_attribute("title") == p
    assert agent_row.locator("td.instruction").text_content() == p
    rows = page.locator("#task-rows").text_content()
    assert rows.count(p) >= 4  # agent instruction, odd id, crafted kind, graph child
    assert page.evaluate("(id) => [...document.querySelectorAll('tr.task')]"
                         ".some(r => r.dataset.id === id)", planted["crafted_id"][name])

    # the agent task: instruction, the model's command and output, summary, result
    agent_row.click()
    page.locator(".event[data-type='task.completed']").wait_for(timeout=15_000)
    page.locator("#task-info pre.result").wait_for(timeout=15_000)
    assert page.locator("#task-info pre.instruction").text_content() == p
    assert page.locator(".event[data-type='task.step'] pre").first.text_content().splitlines()[
        -1] == p  # the command's output
    assert page.locator("#events").text_content().count(p) >= 3
    inert(f"{name}: an agent task's detail and events")

    # the crafted task: kind, parent, error, webhook URL, an event's type and data
    page.locator(f'tr.task[data-id="task_crafted_{name}"]').click()
    page.locator("#events .event").nth(1).wait_for(timeout=15_000)
    page.locator("#task-info .task-error").wait_for(timeout=15_000)
    detail = page.locator("#detail").text_content()
    assert detail.count(p) >= 5, detail
    assert page.locator("#task-info .task-error").text_content() == p
    assert page.evaluate("(t) => [...document.querySelectorAll('.event')]"
                         ".some(e => e.dataset.type === t)", p)
    parent = page.locator("#task-info dd button.link")
    assert parent.text_content() == p and parent.is_disabled()  # not an id it will request
    inert(f"{name}: the crafted task's detail and events")

    # the graph and its model-written child
    page.locator(f'tr.task[data-id="{planted["dag"]}"]').click()
    page.locator("ul.children li").nth(len(PAYLOADS)).wait_for(timeout=15_000)
    page.locator(".event[data-type='task.completed']").wait_for(timeout=15_000)
    assert page.locator("#task-info pre.result").text_content().count(
        json.dumps(p)[1:-1]) >= 1
    inert(f"{name}: the graph's detail")
    page.locator(f'tr.task[data-id="{planted["children"]["plan." + name]}"]').click()
    page.locator(".event[data-type='task.completed']").wait_for(timeout=15_000)
    assert page.locator("#task-info pre.instruction").text_content().startswith(p)
    inert(f"{name}: a graph child's detail")
