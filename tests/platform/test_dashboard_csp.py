"""The dashboard's second line of defence (issue 25, finding 8): its response headers, a
Content-Security-Policy that Chromium enforces against markup injected into the page (an
inline script, an inline handler, an inline style, a javascript: URL, an HTML-string sink,
a request to another origin), each checked against the same page with the header removed
(the positive control), and the page's own files holding nothing that policy forbids."""

from __future__ import annotations

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
from ridgeline.platform.service import Platform
from ridgeline.serve.app import ServerThread

STATIC = Path(__file__).parents[2] / "src/ridgeline/platform/static"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _directives(csp: str) -> dict[str, list[str]]:
    out = {}
    for part in csp.split(";"):
        if part.strip():
            name, *values = part.split()
            out[name.lower()] = values
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp_path_factory.mktemp("csp")), "server": {"run_workers": 0},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"}})
    platform = Platform(config)
    server = ServerThread(platform.app()).start()
    yield server.url
    server.stop()
    platform.close()


def test_page_and_its_files_carry_the_security_headers(served: str) -> None:
    for path, kind in [("/dashboard", "text/html"), ("/dashboard/dashboard.js", "text/javascript"),
                       ("/dashboard/dashboard.css", "text/css")]:
        r = httpx.get(served + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "no-referrer"
        csp = _directives(r.headers["content-security-policy"])
        assert csp["default-src"] == ["'none'"]
        assert csp["script-src"] == ["'self'"] and csp["style-src"] == ["'self'"]
        assert csp["connect-src"] == ["'self'"]
        assert csp["frame-ancestors"] == csp["base-uri"] == csp["form-action"] == ["'none'"]
        assert csp["require-trusted-types-for"] == ["'script'"]
        flat = " ".join(v for values in csp.values() for v in values)
        assert "unsafe" not in flat and "*" not in flat and "data:" not in flat
    # only the page's own files: nothing else under /dashboard/ is read from disk
    for name in ["service.py", "..%2fservice.py", "dashboard.html", "%2e%2e", "x.js"]:
        r = httpx.get(f"{served}/dashboard/{name}")
        assert r.status_code == 404 and "import" not in r.text, name


def test_the_page_has_no_inline_code_and_builds_no_markup_from_strings() -> None:
    html = (STATIC / "dashboard.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/dashboard/dashboard.js" defer>']
    assert re.search(r"<script[^>]*>(?!</script>)", html) is None  # no inline body
    assert re.search(r"<style|\sstyle=|\son\w+=|javascript:", html, re.I) is None
    # the code with its comments removed: no HTML-string or URL sink that data could reach
    js = re.sub(r"(^|\s)//.*$", "", (STATIC / "dashboard.js").read_text(), flags=re.M)
    for sink in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "Function(", "setAttribute", ".href", ".src", "srcdoc", "location",
                 "setTimeout(\"", "createContextualFragment", "DOMParser"]:
        assert sink not in js, sink


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


# What an injection into the page would try: each sets a marker if the browser lets it run.
INJECTED = ('<script>window.__inline = 1</script>'
            '<img id="handler" src="/no-such-image" onerror="window.__handler = 1">'
            '<div id="styled" style="color: rgb(1, 2, 3)">styled</div>'
            '<a id="jsurl" href="javascript:window.__jsurl = 1">go</a>')


@pytest.mark.parametrize("csp", [True, False], ids=["csp", "no_csp_control"])
def test_the_policy_blocks_injected_code(served: str, csp: bool) -> None:
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is a dev dependency (make install)")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (make system-deps does it)")
    listener = ThreadingHTTPServer(("127.0.0.1", 0), _Listener)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    outside = f"http://127.0.0.1:{listener.server_address[1]}/exfiltrate"
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"])
            # the control turns the policy off in the browser; the server still sends it
            context = browser.new_context(bypass_csp=not csp)
            page = context.new_page()
            refused: list[str] = []
            page.on("console", lambda m: refused.append(m.text)
                    if "Content Security Policy" in m.text or "Trusted Type" in m.text else None)
            # the real page, unchanged: may its script reach another origin?
            page.goto(served + "/dashboard")
            assert "content-security-policy" in page.evaluate(
                "() => fetch('/dashboard').then(r => [...r.headers.keys()].join(' '))")
            sent = page.evaluate("(u) => fetch(u).then(() => 'sent', e => e.name)", outside)

            def inject(route: Any) -> None:
                # the real page and headers, with markup injected as a stored XSS would put it
                resp = route.fetch()
                route.fulfill(response=resp,
                              body=resp.text().replace("<body>", "<body>" + INJECTED))

            page.route(served + "/dashboard", inject)
            page.goto(served + "/dashboard")
            page.locator("#styled").wait_for()
            page.wait_for_load_state("load")  # the broken image has fired its error
            sink = page.evaluate("() => { try { document.createElement('div').innerHTML ="
                                 " '<b>x</b>'; return 'assigned'; } catch (e) { return e.name; } }")
            color = page.evaluate("() => getComputedStyle(document.getElementById('styled')).color")
            page.click("#jsurl")  # runs (or is refused) in a task of its own: wait for it
            deadline = time.monotonic() + 10  # a safety limit, not a measurement
            while time.monotonic() < deadline and not page.evaluate("() => window.__jsurl") \
                    and not any("JavaScript URL" in m for m in refused):
                page.wait_for_timeout(50)
            markers = page.evaluate("() => [window.__inline, window.__handler, window.__jsurl]")
            # the page's own script still runs under the policy
            assert page.evaluate("() => typeof follow") == "function"
            browser.close()
    finally:
        listener.shutdown()
    if csp:
        assert markers == [None, None, None]
        assert sink == "TypeError" and sent == "TypeError"
        assert color != "rgb(1, 2, 3)"
        assert _Listener.hits == []
        # and the browser says it was the policy that refused each one
        for what in ["connect-src", "inline script", "inline event handler", "inline style",
                     "JavaScript URL"]:
            assert any(what in m for m in refused), (what, refused)
    else:  # the control: the same injection runs when the browser ignores the policy
        assert markers == [1, 1, 1]
        assert sink == "assigned" and sent == "sent" and color == "rgb(1, 2, 3)"
        deadline = time.monotonic() + 10  # a safety limit for the request to land
        while "/exfiltrate" not in _Listener.hits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _Listener.hits == ["/exfiltrate"]
        _Listener.hits.clear()
