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

from tally.audit.core.errors import TallyError
from tally.trainer.config import TrainConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refuse_reuse(cfg: TrainConfig) -> None:
    """A fresh start (no --resume) of a run that already has a spool, or that the ledger holds
    (its spool may have been removed after ingest), would write a second attempt 0: the ledger
    would quarantine it (tally.audit.ledger.ingest: a file of another spool id) and the run would
    go unaudited. The ledger is asked through the service that owns it (`api=URL`), else in
    its file (`ledger=PATH`); without either, only the spool is checked."""
    from tally.audit.hook import spool as sp

    run_dir = Path(cfg.spool) / cfg.run_id
    if run_dir.is_dir() and any(sp.published(p.name) for p in run_dir.glob("attempt=*/host=*/*")):
        raise TallyError(f"run {cfg.run_id} already has a spool in {cfg.spool}: resume it "
                         "(--resume) or choose another run id")
    if cfg.api:
        known, where = _run_in_service(cfg), f"the ledger of {cfg.api}"
    elif cfg.ledger:
        known, where = _run_in_ledger(cfg), f"the ledger {cfg.ledger}"
    else:
        return
    if known:
        raise TallyError(f"run {cfg.run_id} is already in {where} (its spool may have been "
                         "removed): resume it (--resume) or choose another run id")


def _run_in_ledger(cfg: TrainConfig) -> bool:
    from tally.audit.ledger.database import Ledger

    if not Path(cfg.ledger).exists():
        return False  # no ledger yet: no run in it
    try:
        with Ledger(cfg.ledger, read_only=True) as ledger:
            return bool(ledger.query("SELECT 1 FROM runs WHERE run_id = ?", [cfg.run_id]))
    except TallyError as exc:
        why = "another process holds it" if "held by another process" in str(exc) else str(exc)
        raise TallyError(f"cannot tell whether run {cfg.run_id} is already in the ledger "
                         f"{cfg.ledger} ({why}): set api=URL when `tally serve` owns it"
                         ) from None


def _run_in_service(cfg: TrainConfig) -> bool:
    import urllib.error
    import urllib.request

    url = f"{cfg.api.rstrip('/')}/v1/runs/{cfg.run_id}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_api_headers()),
                                    timeout=60):
            return True
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise TallyError(f"cannot tell whether run {cfg.run_id} is already in the ledger of "
                         f"{cfg.api}: {url}: HTTP {exc.code}") from None
    except OSError as exc:
        # Not up yet, or down: an audit service that cannot be reached does not stop a
        # training, and it refuses a reused run's files when it ingests them (their spool id).
        print(f"tally: cannot ask {url} whether run {cfg.run_id} is already in its ledger "
              f"({getattr(exc, 'reason', exc)}); starting anyway", file=sys.stderr)
        return False


def _api_headers() -> dict[str, str]:
    """The service's token, when the environment has one ($TALLY_API_TOKEN)."""
    token = os.environ.get("TALLY_API_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_paths(cfg: TrainConfig, resume: bool) -> None:
    """The directories the hosts will write in, checked before any starts: `spool=/etc/passwd/x`
    or `checkpoint_dir=/proc/x` failed in every host with a traceback from deep in the writer
    or orbax."""
    from tally.audit.core.paths import unwritable_dir

    keys = {"spool": cfg.spool}
    if cfg.checkpoint_every or resume:  # the only cases in which the hosts write checkpoints
        keys["checkpoint_dir"] = cfg.checkpoint_dir
    for key, path in keys.items():
        problem = unwritable_dir(path)
        if problem is not None:
            raise TallyError(f"{key}={path}: {problem}")


def check_resume(cfg: TrainConfig, hosts: int, force: bool) -> dict | None:
    """Before any host starts: resuming on the checkpoint's own topology needs nothing; on
    another host count or global batch the pre-flight check must say it is safe, or the job
    refuses to start (`force` goes ahead anyway; the ledger records that it did). Returns the
    verdict when a check ran."""
    from tally.trainer import checkpoint

    if not Path(cfg.checkpoint_dir).is_dir():
        raise TallyError(f"--resume: no checkpoint in {cfg.checkpoint_dir}")
    step, meta = checkpoint.read_meta(cfg.checkpoint_dir)
    saved_hosts = meta.get("host_count", len(meta["loaders"]))
    saved_batch = meta["loaders"]["0"]["config"]["global_batch"]
    if (saved_hosts, saved_batch) == (hosts, cfg.global_batch):
        return None
    verdict = preflight(cfg, hosts, force)
    print(verdict["headline"], file=sys.stderr)
    if verdict["status"] != "safe":
        if not force:
            raise TallyError(
                f"refusing to resume step {step} on {hosts} host(s) (checkpoint: "
                f"{saved_hosts} host(s), global batch {saved_batch}): the pre-flight check "
                f"says {verdict['status']}. Fix the loader (the elastic iterator resumes on "
                "any host count) or pass --force to resume anyway (recorded in the ledger)")
        print("tally: --force: resuming against the pre-flight verdict (recorded in the "
              "ledger)", file=sys.stderr)
    return verdict


def preflight(cfg: TrainConfig, hosts: int, force: bool) -> dict:
    """The verdict, from the API service that owns the ledger (`api=URL`), or from the ledger
    file itself (`ledger=PATH`, brought up to date with the spool first); recorded either way."""
    if not cfg.manifest:
        raise TallyError("resuming on another topology runs the pre-flight check, which needs "
                         "the corpus manifest: set manifest=PATH")
    if cfg.api:
        return _preflight_api(cfg, hosts, force)
    if not cfg.ledger:
        raise TallyError("resuming on another topology runs the pre-flight check against the "
                         "ledger: set ledger=PATH, or api=URL when `tally serve` owns it")
    from tally.audit.preflight import check_and_record
    from tally.trainer.loop import loader_config

    return check_and_record(cfg.ledger, cfg.spool, cfg.run_id, cfg.manifest, cfg.checkpoint_dir,
                            hosts, loader_config(cfg), forced=force,
                            requested_by="trainer").to_dict()


def _preflight_api(cfg: TrainConfig, hosts: int, force: bool) -> dict:
    import urllib.error
    import urllib.request

    body = json.dumps({"checkpoint": str(Path(cfg.checkpoint_dir).resolve()), "hosts": hosts,
                       "global_batch": cfg.global_batch, "forced": force,
                       "requested_by": "trainer"}).encode()
    headers = {"Content-Type": "application/json", **_api_headers()}
    url = f"{cfg.api.rstrip('/')}/v1/runs/{cfg.run_id}/preflight"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers),
                                    timeout=600) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise TallyError(f"pre-flight via {url}: HTTP {exc.code}: {detail}") from None
    except OSError as exc:
        raise TallyError(f"pre-flight via {url}: {exc}") from None


def launch(cfg: TrainConfig, hosts: int, *, resume: bool = False, force: bool = False,
           grace_s: float = 5.0) -> int:
    if hosts < 1:
        raise TallyError(f"--hosts must be at least 1, got {hosts}")
    if cfg.global_batch % hosts:
        raise TallyError(f"global_batch {cfg.global_batch} is not divisible by {hosts} hosts")
    check_paths(cfg, resume)
    if resume:
        check_resume(cfg, hosts, force)
    else:
        refuse_reuse(cfg)
    coordinator = f"127.0.0.1:{free_port()}"
    env = {"JAX_PLATFORMS": "cpu", **os.environ}  # CPU unless the caller chose otherwise
    # `tally train` runs this launcher in a session of its own (tally.audit.cli supervises it), so a
    # Ctrl-C at the terminal reaches neither it nor the hosts; the supervisor stops the group.
    # A SIGTERM here still stops the hosts first.
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tally.trainer.host", "--config-json",
         json.dumps(dataclasses.asdict(cfg)), "--host", str(h), "--hosts", str(hosts),
         "--coordinator", coordinator] + (["--resume"] if resume else [])
        + (["--force"] if force else []), env=env)
        for h in range(hosts)]

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return _wait(procs, grace_s)
    finally:
        _stop(procs, grace_s)
        signal.signal(signal.SIGTERM, previous)


def _wait(procs: list[subprocess.Popen], grace_s: float) -> int:
    from tally.trainer.host import PEER_LOST

    lost_since = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(h, c) for h, c in enumerate(codes) if c not in (None, 0)]
        # A host that failed only because another one is gone (tally.trainer.host.peer_lost) may end
        # before the one that died is reaped: the line names the one that died.
        causes = [(h, c) for h, c in failed if c != PEER_LOST]
        if failed and not causes:
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since < grace_s:
                time.sleep(0.2)
                continue
        if failed:
            host, code = (causes or failed)[0]
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
