"""The scheduler's /metrics as the benchmarks read it: prometheus_client's own parser over one
scrape, so that each benchmark names the samples it wants instead of parsing the text again."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(url: str, timeout: float = 10.0) -> list[Sample]:
    """Every sample of one scrape of `url` (histograms as their _bucket, _sum and _count)."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def by_name(sample: Sample) -> str | None:
    return sample.name


def summed(url: str, key: Callable[[Sample], str | None] = by_name, timeout: float = 10.0) -> dict[str, float]:
    """The samples of one scrape summed by `key` (a sample whose key is None is left out):
    by default by name, over every label set."""
    out: dict[str, float] = {}
    for s in samples(url, timeout):
        k = key(s)
        if k is not None:
            out[k] = out.get(k, 0.0) + s.value
    return out
