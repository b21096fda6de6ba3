"""Reading metrics back the way Prometheus does: parse the text format, scrape over HTTP."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Sample values keyed by (sample name, sorted label pairs)."""


def scraped(text: str) -> Samples:
    """Every sample of an exposition text, parsed by prometheus_client, without the `_created` stamps."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def http_get(url: str) -> tuple[int, str, str]:
    """GET `url` (blocking: run it in a worker thread): status, Content-Type and body."""
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return response.status, response.headers["Content-Type"], body.decode()
