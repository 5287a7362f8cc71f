"""A scriptable OpenAI-compatible `/v1/chat/completions` server for judge tests (stdlib only).

Listens on 127.0.0.1 on a random free port. What it does with a request is chosen per "case":
the first `<<case:NAME>>` marker found in the request's messages selects the action list given
to `program(NAME, [...])`; actions are used in order and the last one repeats. Requests with
no marker (or an unprogrammed case) get `default`.

Actions (strings; `|` chains a `sleep:` prefix with a final action):
  "score:7"          200, content "...\\nScore: 7"
  "json:7"           200, content '{"score": 7}'
  "text:anything"    200, content "anything" (e.g. garbage)
  "status:500"       that HTTP status with an OpenAI-style error body
  "429:0.2"          429 with `Retry-After: 0.2`
  "drop"             close the connection without a reply
  "badjson"          200 with a body that is not JSON
  "sleep:0.5|score:7" sleep, then the action (beyond the client's timeout: a slow reply)

Authentication: `JudgeServer(api_key="...")` answers 401 (OpenAI's error body) to every
request whose `Authorization` header is not `Bearer <api_key>`, before any case applies.

Counters (read under `lock`): `requests`, `per_case`, `inflight`, `max_inflight`, `arrivals`
(case, monotonic time), `auth_headers`, `bodies`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_CASE_RE = re.compile(r"<<case:([A-Za-z0-9_.-]+)>>")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            self.close_connection = True

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        owner = self.server.owner
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send(404, b'{"error": {"message": "not found"}}')
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(400, b'{"error": {"message": "bad json"}}')
            return
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        match = _CASE_RE.search(text)
        case = match.group(1) if match else None
        with owner.lock:
            owner.requests += 1
            owner.per_case[case] += 1
            owner.inflight += 1
            owner.max_inflight = max(owner.max_inflight, owner.inflight)
            owner.arrivals.append((case, time.monotonic()))
            owner.auth_headers.append(self.headers.get("Authorization"))
            owner.bodies.append(body)
            queue = owner.programs.get(case)
            if owner.api_key is not None and (
                self.headers.get("Authorization") != f"Bearer {owner.api_key}"
            ):
                action = "unauthorized"
            elif queue:
                action = queue.popleft() if len(queue) > 1 else queue[0]
            else:
                action = owner.default
        try:
            self._act(action, body)
        finally:
            with owner.lock:
                owner.inflight -= 1

    def _act(self, action: str, body: dict) -> None:
        *prefixes, final = action.split("|")
        for p in prefixes:
            name, _, arg = p.partition(":")
            if name != "sleep":
                raise ValueError(f"unknown action prefix {p!r}")
            time.sleep(float(arg))
        name, _, arg = final.partition(":")
        if name == "score":
            self._reply(body, f"The reasoning is checked step by step.\nScore: {arg}")
        elif name == "json":
            self._reply(body, json.dumps({"score": float(arg)}))
        elif name == "text":
            self._reply(body, arg)
        elif name == "status":
            msg = json.dumps({"error": {"message": f"scripted {arg}", "type": "server_error"}})
            self._send(int(arg), msg.encode())
        elif name == "429":
            msg = json.dumps({"error": {"message": "rate limited", "type": "rate_limit"}})
            self._send(429, msg.encode(), {"Retry-After": arg})
        elif name == "drop":
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
        elif name == "unauthorized":
            msg = {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}
            self._send(401, json.dumps(msg).encode())
        elif name == "badjson":
            self._send(200, b"this is not json {")
        else:
            raise ValueError(f"unknown action {action!r}")

    def _reply(self, body: dict, content: str) -> None:
        reply = {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "judge"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        self._send(200, json.dumps(reply).encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: JudgeServer


class JudgeServer:
    """`with JudgeServer() as s: OpenAIJudge(base_url=s.base_url, ...)`."""

    def __init__(self, default: str = "score:5", api_key: str | None = None):
        self.default = default
        self.api_key = api_key
        self.lock = threading.Lock()
        self.programs: dict[str | None, collections.deque[str]] = {}
        self.reset_counters()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def reset_counters(self) -> None:
        with self.lock:
            self.requests = 0
            self.per_case: collections.Counter[str | None] = collections.Counter()
            self.inflight = 0
            self.max_inflight = 0
            self.arrivals: list[tuple[str | None, float]] = []
            self.auth_headers: list[str | None] = []
            self.bodies: list[dict] = []

    def program(self, case: str, actions: list[str]) -> None:
        if not actions:
            raise ValueError("a case needs at least one action")
        with self.lock:
            self.programs[case] = collections.deque(actions)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> JudgeServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> JudgeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
