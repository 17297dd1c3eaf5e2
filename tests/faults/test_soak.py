"""Soak: about a minute of steady load from one driver on one event loop (bounded in count),
with no growth in the driver's memory or open sockets, and every rollout served exactly once."""

from __future__ import annotations

import asyncio
import time
import urllib.parse

import pytest

from tests.faults.conftest import check_batch_exactly_once, mixed_batch
from tests.faults.test_trust import post_control
from tests.driver.sockets import my_connections_to
from tests.support.processes import own_rss_bytes

pytestmark = [pytest.mark.faults, pytest.mark.dynamo]
MAX_NEW, MAX_LEN = 16, 64
SOAK_S = 60.0
MAX_BATCHES = 240
BATCH = 128
CONCURRENCY = 64
RSS_GROWTH_LIMIT = 20 * 2**20  # generous: allocator noise, never a per-rollout leak


def test_a_minute_of_steady_load_grows_neither_memory_nor_sockets(start_fleet):
    fleet = start_fleet(workers=4, token_delay_s=0.002)
    prompts, data = mixed_batch(BATCH, seed=41, max_len=20)
    generation = fleet.generation(max_new_tokens=MAX_NEW, max_model_len=MAX_LEN,
                                  max_in_flight=CONCURRENCY)
    samples: list[tuple[int, int, int]] = []  # (batch, rss, sockets) after each batch
    # The driver's connections to the frontend, not every socket of this process: what an
    # earlier test left in it (a Ray driver, under another arrangement) keeps its own clock.
    frontend_port = urllib.parse.urlsplit(fleet.frontend_url).port
    def driver_sockets() -> int:
        return my_connections_to(frontend_port)
    sockets_before = driver_sockets()

    async def soak() -> list[list]:
        checked = []
        deadline = time.monotonic() + SOAK_S
        for batch in range(MAX_BATCHES):
            if time.monotonic() > deadline:
                break
            pairs = [pair async for pair in generation.generate_async(data, greedy=True)]
            if batch % 10 == 0:
                checked.append(pairs)  # checked after the soak, off the clock
            else:
                assert sorted(i for i, _ in pairs) == list(range(BATCH)), f"batch {batch}"
            samples.append((batch, own_rss_bytes(), driver_sockets()))
        return checked

    try:
        checked = asyncio.run(soak())
    finally:
        generation.shutdown()
    for pairs in checked:
        check_batch_exactly_once(pairs, prompts, max_new_tokens=MAX_NEW, max_model_len=MAX_LEN)

    batches = len(samples)
    assert batches >= 10, f"only {batches} batches in {SOAK_S:.0f} s"
    half = batches // 2
    first, second = samples[:half], samples[half:]
    rss_growth = max(r for _, r, _ in second) - max(r for _, r, _ in first)
    print(f"soak: {batches} batches of {BATCH} ({batches * BATCH} rollouts), RSS growth second "
          f"half vs first {rss_growth / 2**20:+.1f} MiB, sockets {samples[0][2]}..{samples[-1][2]}")
    assert rss_growth < RSS_GROWTH_LIMIT, (
        f"driver RSS grew by {rss_growth / 2**20:.1f} MiB in the second half of {batches} batches")
    assert max(s for _, _, s in second) <= max(s for _, _, s in first), samples
    # The pool holds at most one connection per allowed rollout (plus the control extras).
    assert max(s for _, _, s in samples) - sockets_before <= CONCURRENCY + 16
    # Each worker's engine served what was sent and no more: no rollout ran twice, except
    # where the driver itself sent an attempt again (counted, with its cause; the failed
    # attempt may or may not have reached an engine).
    served = sum(post_control(url, "engine_stats", {"control_secret": fleet.secret})
                 ["served_count"] for url in fleet.control_urls.values())
    retried = generation.retried_attempts()
    print(f"attempts sent again, by cause: {retried}")
    assert batches * BATCH <= served <= batches * BATCH + sum(retried.values()), (served, retried)
