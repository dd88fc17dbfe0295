"""A media host on loopback for the fetch tests: files, redirects, errors, and hosts too slow to answer.

Routes: `/<name>` a file (from `files`, else `folder`); `/missing` 404; `/big` and `/big_no_length` 5,000 bytes
(with and without `Content-Length`); `/redirect?to=URL` a 302 to URL (without `to`: to itself, a loop);
`/slow-redirect?hops=N` N redirects that each take `slow_hop_s`, then to `/image.png`; `/trickle-headers` a status line and then one
header byte every `trickle_s`, never ending the headers; `/trickle-body` headers for 1 MB, then one body byte every
`trickle_s`. `held` is the number of trickling requests held now, `peak` the most at once.
"""

from __future__ import annotations

import http.server
import threading
import time
import urllib.parse
from pathlib import Path


class MediaHost:
    """A threading HTTP server on 127.0.0.1 serving the routes above; a context manager; `url` is its base URL."""

    def __init__(self, files: dict[str, bytes] | None = None, folder: Path | None = None, trickle_s: float = 1.0,
                 slow_hop_s: float = 0.6):
        self.files, self.folder = dict(files or {}), folder
        self.trickle_s, self.slow_hop_s = trickle_s, slow_hop_s
        self.peak = self.held = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def file(self, name: str) -> bytes | None:
        if name in self.files:
            return self.files[name]
        path = (self.folder / name) if self.folder is not None and name and "/" not in name else None
        return path.read_bytes() if path is not None and path.is_file() else None

    def trickle(self, write_byte) -> None:
        """Write a byte every `trickle_s` until the client leaves or the host closes, counted in `peak`."""
        with self._lock:
            self.held += 1
            self.peak = max(self.peak, self.held)
        try:
            while not self._stopping.wait(self.trickle_s):
                write_byte()
        except OSError:
            pass  # the client went away
        finally:
            with self._lock:
                self.held -= 1

    def close(self) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> MediaHost:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many clients connect at once

    def handle_error(self, request, client_address) -> None:
        pass  # clients that give up on a slow route reset their connection


def _handler(host: MediaHost) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - the name http.server calls
            path, _, query = self.path.partition("?")
            params = urllib.parse.parse_qs(query)
            if path == "/redirect":
                return self._redirect(params.get("to", ["/redirect"])[0])
            if path == "/slow-redirect":
                hops = int(params["hops"][0])
                time.sleep(host.slow_hop_s)
                return self._redirect(f"/slow-redirect?hops={hops - 1}" if hops > 1 else "/image.png")
            if path == "/trickle-headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                return host.trickle(lambda: self.wfile.write(b"z"))
            if path == "/trickle-body":
                self._headers(200, 1_000_000)
                return host.trickle(lambda: self.wfile.write(b"z"))
            if path in ("/big", "/big_no_length"):
                return self._send(b"x" * 5000, length=path == "/big")
            body = host.file(path.lstrip("/"))
            if body is None:
                return self._send(b"not found", status=404)
            return self._send(body)

        def _redirect(self, target: str) -> None:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _headers(self, status: int, length: int | None) -> None:
            self.send_response(status)
            if length is None:
                self.send_header("Connection", "close")
                self.close_connection = True
            else:
                self.send_header("Content-Length", str(length))
            self.end_headers()

        def _send(self, body: bytes, status: int = 200, length: bool = True) -> None:
            self._headers(status, len(body) if length else None)
            self.wfile.write(body)

        def log_message(self, *_) -> None:
            pass

    return Handler
