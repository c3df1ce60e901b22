"""Reading what ``mongo_outbox.metrics`` recorded: an OpenTelemetry SDK ``MeterProvider`` with an
``InMemoryMetricReader`` (the SDK's own reader for tests), and a scrape of a real ``/metrics``
endpoint parsed by prometheus-client's parser."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

Points = dict[frozenset[tuple[str, Any]], Any]


def points(reader: Any, name: str) -> Points:
    """Collect once and return ``name``'s data points: attributes -> value (a histogram's
    point -> (count, sum))."""
    found: Points = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    key = frozenset(point.attributes.items())
                    value = getattr(point, "value", None)
                    found[key] = (point.count, point.sum) if value is None else value
    return found


def at(**attributes: Any) -> frozenset[tuple[str, Any]]:
    return frozenset(attributes.items())


def mine(found: Points, relay: str) -> Points:
    """The points of one relay: other tests' relay objects may still be alive."""
    return {key: v for key, v in found.items() if ("relay", relay) in key}


def get(url: str) -> tuple[int, str]:
    """GET ``url``: its status and body, also for an error status."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def samples(exposition: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus exposition: name, labels, value."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), sample.value


def value(exposition: str, name: str, **labels: str) -> float | None:
    """The value of the one sample ``name`` whose labels include ``labels``; None if absent."""
    found = [v for n, ls, v in samples(exposition) if n == name and labels.items() <= ls.items()]
    assert len(found) <= 1, f"{name}{labels}: {found}"
    return found[0] if found else None
