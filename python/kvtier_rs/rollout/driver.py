"""Driving one concurrency level: every request of the workload sent through the async client,
at most `concurrency` in flight (a closed loop: a new request starts when one ends), or at the
trace's own arrival times (an open loop), with a progress bar."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from kvtier_rs.rollout.client import Client, Result
from kvtier_rs.rollout.workload import Request

TRACE_TIMING = "trace"


async def _run(
    client: Client,
    reqs: list[Request],
    level: str,
    concurrency: int | None,
    time_scale: float,
    tick: Callable[[], None],
) -> tuple[list[Result], float]:
    t0 = time.perf_counter()
    if concurrency is None:  # trace timing: each request at its (scaled) arrival time

        async def at(req: Request) -> Result:
            delay = req.arrival_s * time_scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            res = await client.send(req, level, t0)
            tick()
            return res

        results = await asyncio.gather(*(at(r) for r in reqs))
    else:
        gate = asyncio.Semaphore(concurrency)

        async def gated(req: Request) -> Result:
            async with gate:
                res = await client.send(req, level, t0)
            tick()
            return res

        # Requests are admitted in trace order: a semaphore wakes its waiters first come, first served.
        results = await asyncio.gather(*(gated(r) for r in reqs))
    return list(results), time.perf_counter() - t0


def run_level(
    url: str,
    model: str,
    reqs: list[Request],
    level: str,
    concurrency: int | None,
    *,
    time_scale: float = 1.0,
    progress: bool | None = None,
    desc: str = "",
) -> tuple[list[Result], float]:
    """The level's results (in trace order) and its wall time in seconds; `concurrency` None
    sends at the trace's arrival times, scaled by `time_scale`."""
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc=desc, unit="req", leave=False, file=sys.stderr)
        except ImportError:  # the bar is a nicety; the rollout extra installs tqdm
            bar = None

    def tick() -> None:
        if bar is not None:
            bar.update(1)

    async def main() -> tuple[list[Result], float]:
        # A client per level: asyncio.run gives each level its own event loop, and a client's
        # connection pool belongs to the loop it was made in.
        client = Client(url, model)
        try:
            return await _run(client, reqs, level, concurrency, time_scale, tick)
        finally:
            await client.close()

    try:
        return asyncio.run(main())
    finally:
        if bar is not None:
            bar.close()
