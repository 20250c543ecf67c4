"""A webhook receiver for the alert tests: a real HTTP server on 127.0.0.1:0 (http.server in a
thread) that keeps every JSON body POSTed to it (tests start it and `close()` it in `finally`)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Hook:
    """A webhook receiver: keeps every POSTed JSON body; answers `status` after `delay_s`."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.status = 200
        self.delay_s = 0.0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(hook.delay_s)
                hook.bodies.append(json.loads(body))
                hook.headers.append(dict(self.headers))
                self.send_response(hook.status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/dldctl"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kinds(self) -> list[str]:
        return [str(b.get("kind")) for b in self.bodies]
