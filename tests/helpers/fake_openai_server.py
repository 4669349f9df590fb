"""A small OpenAI-compatible chat server on 127.0.0.1 for client tests: it answers
`/v1/models` and `/v1/chat/completions` from a script of responses, each a status code,
a JSON body, optional headers and an optional delay, and records every request."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any



@dataclass
class Reply:
    status: int = 200
    body: dict[str, Any] | str = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


def chat_body(content: str | None = "ok", tool_calls: list[dict[str, Any]] | None = None,
              finish_reason: str = "stop", **extra: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason}
    choice.update(extra.pop("choice_extra", {}))
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "tiny",
            "choices": [choice], "usage": {"prompt_tokens": 11, "completion_tokens": 3}, **extra}


class FakeOpenAIServer:
    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.requests: list[tuple[str, str, dict[str, Any] | None, dict[str, str]]] = []
        self.models = [{"id": "tiny", "object": "model", "max_model_len": 4096}]
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                server.requests.append((method, self.path, body, dict(self.headers)))
                if self.path.endswith("/models") and method == "GET":
                    reply = Reply(body={"object": "list", "data": server.models})
                elif server.script:
                    reply = server.script.pop(0)
                else:
                    reply = Reply(500, {"error": {"message": "script exhausted"}})
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                data = reply.body if isinstance(reply.body, str) else json.dumps(reply.body)
                try:
                    self.send_response(reply.status)
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data.encode())))
                    self.end_headers()
                    self.wfile.write(data.encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def chat_requests(self) -> list[dict[str, Any]]:
        return [body for method, path, body, _ in self.requests
                if method == "POST" and path.endswith("/chat/completions") and body is not None]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


