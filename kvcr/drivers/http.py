"""A small HTTP endpoint: /metrics for Prometheus, /info for discovery, /healthz.

With a token set, /info answers only requests bearing it (`Authorization: Bearer <token>`)."""

from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry


class HttpServer:
    def __init__(self, host: str, port: int, *, registry: CollectorRegistry, info: Callable[[], dict],
                 health: Callable[[], list[str]], token: str = "") -> None:
        outer = self
        self.num_unauthorized = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                path = self.path.split("?")[0]
                if path == "/metrics":
                    outer._send(self, 200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/info" and not outer._authorized(self, token):
                    outer.num_unauthorized += 1
                    outer._send(self, 401, b"/info needs the runner's token: Authorization: Bearer <runner.http_token>\n",
                                "text/plain")
                elif path == "/info":
                    outer._send(self, 200, json.dumps(info()).encode(), "application/json")
                elif path == "/healthz":
                    problems = health()
                    body = ("\n".join(problems) if problems else "ok") + "\n"
                    outer._send(self, 503 if problems else 200, body.encode(), "text/plain")
                else:
                    outer._send(self, 404, b"not found\n", "text/plain")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvcr-http", daemon=True)

    @staticmethod
    def _authorized(handler: BaseHTTPRequestHandler, token: str) -> bool:
        given = handler.headers.get("Authorization", "")
        return not token or hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, body: bytes, ctype: str) -> None:
        handler.send_response(code)
        handler.send_header("Content-Type", ctype)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
