"""Helpers for the live API tests: a real uvicorn server on 127.0.0.1, spool files written by
the real LedgerWriter, and polling."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from tally.audit.hook.segments import Segments
from tally.audit.hook.writer import LedgerWriter
from tests.support.manifest import content_hash_of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A uvicorn server in a thread, serving `app` on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)


def poll(fn: Callable[[], object], timeout: float = 30.0, every: float = 0.05):
    """fn() until it returns something truthy; its last value otherwise (after timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(every)


def write_steps(spool: Path, run_id: str, *, host: int, hosts: int, steps: range, n: int,
                seed: int, attempt: int = 0, resumed: int | None = None, per_step: int = 8,
                outside: dict[int, int] | None = None, metrics: bool = True, **kw) -> int:
    """Steps of random keys (with replacement, so duplicates) through the real writer; every
    fourth segment continues the previous record (offset > 0); losses too unless `metrics` is
    false (a file fewer per flush). Returns rows written."""
    rng = np.random.default_rng(seed)
    rows = 0
    with LedgerWriter(spool, run_id, host=host, host_count=hosts, attempt=attempt,
                      resumed_from_step=resumed, fsync=False, **kw) as w:
        for step in steps:
            keys = rng.integers(0, n, per_step)
            if outside and step in outside:
                keys[0] = outside[step]
            offset = np.zeros(per_step, np.int64)
            offset[3::4] = 7
            keys[3::4] = keys[2::4][: len(keys[3::4])]
            w.write_segments(step, Segments.build(
                row=np.arange(per_step) // 2, record_key=keys, offset=offset,
                n_tokens=rng.integers(1, 50, per_step), content_hash=content_hash_of(keys),
                epoch=np.full(per_step, step % 1000 // 10)))  # epochs stay small at any step
            if not metrics:
                rows += per_step
                continue
            w.log_metric(step, "train_loss", 5.0 - step * 0.01 + host * 0.001)
            if step % 10 == 9:
                w.log_metric(step, "heldout_loss", 5.5 - step * 0.005)
                w.log_metric(step, "ppl/web", 100.0 - step)
            rows += per_step
    return rows
