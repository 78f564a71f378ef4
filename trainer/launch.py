"""`tally train --hosts H`: H host processes on this machine, one data-parallel job.

If any host dies, the others are stopped too (they would otherwise wait forever in the next
all-reduce) and the job's exit status is the first failure's. `--resume` then restarts every
host from the latest checkpoint as a new attempt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from audit.errors import TallyError
from trainer.config import TrainConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_resume(cfg: TrainConfig, hosts: int, force: bool) -> None:
    """Refuse a resume whose checkpoint cannot feed `hosts` hosts without repeating or
    skipping data. Same host count: always fine."""
    from trainer import checkpoint

    if not Path(cfg.checkpoint_dir).is_dir():
        raise TallyError(f"--resume: no checkpoint in {cfg.checkpoint_dir}")
    _, meta = checkpoint.read_meta(cfg.checkpoint_dir)
    saved = meta.get("host_count", len(meta["loaders"]))
    if saved != hosts and not cfg.elastic and not force:
        raise TallyError(
            f"the checkpoint was written by {saved} host(s), this job has {hosts}: its "
            "per-host loader states would repeat and skip records on another host count. "
            "Use the elastic iterator (elastic=true), or --force to resume anyway (recorded "
            "in the ledger)")


def launch(cfg: TrainConfig, hosts: int, *, resume: bool = False, force: bool = False,
           grace_s: float = 5.0) -> int:
    if hosts < 1:
        raise TallyError(f"--hosts must be at least 1, got {hosts}")
    if cfg.global_batch % hosts:
        raise TallyError(f"global_batch {cfg.global_batch} is not divisible by {hosts} hosts")
    if resume:
        check_resume(cfg, hosts, force)
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "trainer.host", "--config-json",
         json.dumps(dataclasses.asdict(cfg)), "--host", str(h), "--hosts", str(hosts),
         "--coordinator", coordinator] + (["--resume"] if resume else []), env=env)
        for h in range(hosts)]
    try:
        return _wait(procs, grace_s)
    finally:
        _stop(procs, grace_s)


def _wait(procs: list[subprocess.Popen], grace_s: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(h, c) for h, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            host, code = failed[0]
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            print(f"tally: host {host} ended with {how}; stopping the other hosts",
                  file=sys.stderr)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
