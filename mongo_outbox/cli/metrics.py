"""``mongo-outbox relay --metrics-port N``: Prometheus metrics at ``/metrics`` and the relay's
health at ``/healthz``, on one port, served by a thread beside the relay.

The library records through the OpenTelemetry API (``mongo_outbox.metrics``); this module is the
one place that installs an SDK: a ``MeterProvider`` whose ``PrometheusMetricReader`` collects
into prometheus-client's registry, which prometheus-client's own WSGI app renders. Both need
the ``prometheus`` extra, checked before anything else is done.

``/healthz`` answers 200 while the relay is active or standing by, and 503 otherwise: starting
(before it first holds or waits for its lease), stopped, or failed. The answer's body is the
state.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from mongo_outbox.cli.common import Failure, one_line, url_host

log = logging.getLogger("mongo_outbox.cli")

HEALTHY = frozenset({"active", "standby"})
EXTRA = "--metrics-port needs pip install 'mongo-outbox[prometheus]'"


def check_extra() -> None:
    """Fail in one line when the ``prometheus`` extra is missing."""
    try:
        import opentelemetry.exporter.prometheus
        import opentelemetry.metrics
        import opentelemetry.sdk.metrics  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as error:
        raise Failure(f"{EXTRA} (missing: {error.name or one_line(error)})") from None


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process up


class _Server6(_Server):
    address_family = socket.AF_INET6  # WSGIServer's is IPv4: "::" failed to resolve


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        # A scrape every few seconds is not worth a log line.
        pass


class Endpoint:
    """The metrics and health endpoint; ``state()`` says how the relay is."""

    def __init__(self, host: str, port: int) -> None:
        from opentelemetry import metrics
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import REGISTRY, make_wsgi_app

        self.state: Callable[[], str] = lambda: "starting"
        self._metrics = make_wsgi_app(REGISTRY)
        try:
            server = _Server6 if ":" in host else _Server  # an IPv6 address, as the console
            self._server = make_server(host, port, self._app, server, _Quiet)
        except OSError as error:
            raise Failure(f"cannot serve metrics on {host}:{port}: {one_line(error)}") from None
        self.port = self._server.server_port
        self._provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
        metrics.set_meter_provider(self._provider)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="mongo-outbox-metrics", daemon=True
        )
        self._thread.start()
        log.info("serving /metrics and /healthz on http://%s:%d", url_host(host), self.port)

    def _app(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            state = self.state()
            status = "200 OK" if state in HEALTHY else "503 Service Unavailable"
            return _text(start_response, status, state)
        return _text(start_response, "404 Not Found", "/metrics or /healthz")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._provider.shutdown()


def _text(start_response: Any, status: str, body: str) -> list[bytes]:
    data = f"{body}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [data]
