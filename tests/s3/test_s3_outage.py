"""A storage outage seen by a serving loop, on real S3 servers (moto and the JuiceFS gateway).

The server is killed while a cache serves requests: after `storage_breaker_threshold` failed lookups the
breaker opens, and from then on prefetch and write-through skip storage without a single request
(`storage_unavailable`), the failures counted as errors, never as misses. The server is restarted on
the same port; once the probe is due (a fake clock, no sleeps) one request probes, the breaker closes,
write-through reaches storage again and another instance's prefetch hits it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from s3_helpers import FAST_RETRIES, unique_prefix
from s3_instance import PAGE, instance_config, kv_payload
from s3_servers import S3Server, start_juicefs, start_moto

from hicache import BreakerState, CircuitBreaker, HiCache
from storage_backends.s3 import S3Backend

HANG_GUARD_S = 60
"""Not a timing assertion: only turns a hang into a failure well before the pytest timeout."""
THRESHOLD = 2
BACKOFF_S = 30.0


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt(i: int) -> list[int]:
    """Request `i`'s tokens: 4 whole pages of its own."""
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + 4 * PAGE))


@pytest.fixture(params=["moto", "juicefs"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[S3Server]:
    """A server of this test's own, which it kills and restarts."""
    started = start_moto(tmp_path) if request.param == "moto" else start_juicefs(tmp_path)
    try:
        yield started
    finally:
        started.stop()


async def serve(cache: HiCache, request_id: str, tokens: list[int]) -> dict[str, int]:
    """One request as a serving loop runs it: acquire, compute the uncached suffix, insert."""
    lease = await cache.acquire(request_id, tokens)
    new = await cache.alloc_device(len(tokens) - lease.cached_len)
    assert new is not None, "device pool exhausted"
    cache.device_pool.write_tokens(new, kv_payload(tokens)[:, :, lease.cached_len :])
    await cache.insert(lease, tokens, torch.cat([lease.device_indices, new]))
    return lease.hit_tokens_by_tier


def counter(cache: HiCache, name: str, **labels: str) -> float:
    """The value of hicache's series `name` (without its prefix) with `labels`, read from the registry."""
    value = cache.registry.get_sample_value(f"hicache_{name}", labels)
    return 0.0 if value is None else value


def requests_made(cache: HiCache) -> int:
    storage = cache.storage
    assert isinstance(storage, S3Backend)
    return storage.statistics().requests


async def test_outage_opens_the_breaker_then_prefetch_resumes_after_restart(server: S3Server) -> None:
    url = server.url(unique_prefix())
    options = {**server.options(), **FAST_RETRIES}
    with anyio.fail_after(HANG_GUARD_S):
        # Another instance wrote the pages of requests 0-5 while storage was up.
        async with HiCache(instance_config(url, storage_options=options)) as writer:
            for i in range(6):
                await serve(writer, f"w-{i}", prompt(i))
            await writer.wait_idle()

        clock = FakeClock()
        breaker = CircuitBreaker(threshold=THRESHOLD, backoff_initial_s=BACKOFF_S, clock=clock)
        async with HiCache(instance_config(url, storage_options=options), storage_breaker=breaker) as cache:
            await anyio.to_thread.run_sync(server.kill)

            # The first lookups (and the write-through they queue) fail: errors, not misses. After
            # THRESHOLD of them in a row the breaker is open.
            for i in range(THRESHOLD):
                hits = await serve(cache, f"down-{i}", prompt(i))
                assert hits["storage"] == 0
            await cache.wait_idle()
            assert breaker.state is BreakerState.OPEN
            assert counter(cache, "prefetch_skipped_total", reason="storage_error") >= 1
            assert counter(cache, "storage_errors_total", op="exists", kind="unavailable") >= THRESHOLD
            assert counter(cache, "storage_breaker_state", tier="storage") == BreakerState.OPEN
            skipped_before = counter(cache, "prefetch_skipped_total", reason="storage_unavailable")

            # While open: requests are served without touching storage, and their write-through is shed.
            before = requests_made(cache)
            for i in range(THRESHOLD, 6):
                hits = await serve(cache, f"open-{i}", prompt(i))
                assert hits["storage"] == 0
            await cache.wait_idle()
            assert requests_made(cache) == before, "no request reached the dead server while open"
            skipped = counter(cache, "prefetch_skipped_total", reason="storage_unavailable") - skipped_before
            assert skipped == 6 - THRESHOLD
            assert counter(cache, "prefetch_skipped_total", reason="storage_miss") == 0
            assert counter(cache, "writes_shed_total", tier="storage", reason="storage_unavailable") >= 1
            cache.sanity_check()

            # Restarted (moto forgets its objects; the JuiceFS volume keeps them). Once the probe is due
            # the next request probes, which closes the breaker, and its pages are written through again.
            await anyio.to_thread.run_sync(server.restart)
            clock.now += BACKOFF_S
            await serve(cache, "up-6", prompt(6))
            assert breaker.state is BreakerState.CLOSED
            assert breaker.statistics().probes == 1
            assert counter(cache, "storage_breaker_state", tier="storage") == BreakerState.CLOSED
            await cache.wait_idle()
            cache.sanity_check()

        # A fresh instance prefetches those pages from storage.
        async with HiCache(instance_config(url, storage_options=options)) as reader:
            lease = await reader.acquire("r-6", prompt(6))
            assert lease.hit_tokens_by_tier["storage"] == 4 * PAGE
            expected = kv_payload(prompt(6))
            assert torch.equal(reader.device_pool.read_tokens(lease.device_indices), expected)
            reader.release(lease)
            await reader.wait_idle()
            reader.sanity_check()
