"""Run an ASGI app (the OpenAI-compatible front) with uvicorn in a background thread, next to Triton."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from deploy.startup import DeployError, check_port_free

LOGGER = logging.getLogger(__name__)


class OpenAIServer:
    """uvicorn serving `app` on `host:port` in a daemon thread: `start()` returns once it listens, `stop()` ends it."""

    def __init__(self, app, host: str = "0.0.0.0", port: int = 8080, log_level: str = "warning"):
        self.app = app
        self.host = host
        self.port = port
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                     timeout_graceful_shutdown=5))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL of the API (`http://host:port/v1`)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> None:
        """Listen on the port; DeployError if it is taken or the server does not come up in `timeout_s`."""
        if self._thread is not None:
            raise DeployError("the OpenAI server was already started")
        check_port_free(self.host, self.port, "OpenAI API", "--openai_port")
        self._thread = threading.Thread(target=self._server.run, name="openai-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise DeployError(f"the OpenAI API server on {self.host}:{self.port} failed to start (see the log)")
            if time.monotonic() > deadline:
                self.stop()
                raise DeployError(f"the OpenAI API server on {self.host}:{self.port} did not start in {timeout_s} s")
            time.sleep(0.02)
        LOGGER.info("OpenAI-compatible API on %s", self.url)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting requests, let running ones finish (up to `timeout_s`), end the thread; safe to call twice."""
        if self._thread is None:
            return
        if hasattr(self.app, "state"):
            self.app.state.ready = False
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._thread = None
