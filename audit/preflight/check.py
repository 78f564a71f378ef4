"""Pre-flight: is it safe to resume a run from a checkpoint on another topology?

The check shadow-runs the training loader builder (`tally.pipeline.shadow`) for every new host from
the checkpointed loader state, over a horizon (default: to the end of the current epoch, at
most 1000 steps), and compares the plan with what the ledger says the run already consumed:

- no record is planned for two hosts (or twice at all);
- no planned record was already consumed in its epoch (steps before the checkpoint, rolled
  back rows excluded);
- when the horizon reaches the end of the epoch, consumed plus planned covers the epoch;
- the global batch is unchanged, and the loader state is compatible with the new loader.

A new host h restores the state of old host `h % old_hosts`
(`tally.pipeline.loader.state_for_host`),
the transfer a trainer does when the host count changes. A state the loader would refuse is
restored anyway in the shadow, so the verdict can say what forcing it would do.

Statuses: `safe` (exit 0), `unsafe` (exit 1), `unknown` (exit 2: the inputs cannot answer, e.g.
a ledger behind the checkpoint). Unusable input (a missing file, a run not in the ledger) raises
`TallyError`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tally.audit.core.arrays import distinct
from tally.audit.core.errors import NotFound, TallyError
from tally.audit.core.exposure import effective_sql, start_sql
from tally.audit.ledger.database import Ledger, one
from tally.audit.preflight.verdict import PreflightVerdict
from tally.pipeline.loader import KeyedLoader, LoaderConfig, compatibility, explain, state_for_host
from tally.pipeline.progress import Progress
from tally.pipeline.shadow import Cancelled, ShadowSource, default_workers, shadow_run

DEFAULT_MAX_HORIZON = 1000


def load_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The JSON `meta` item of an orbax checkpoint (tally.trainer.checkpoint): of the latest step of
    a checkpoint directory, or of one step's directory."""
    import orbax.checkpoint as ocp

    from tally.audit.core import logs

    path = Path(path)
    if not path.is_dir():
        raise NotFound(f"checkpoint {path} is not a directory")
    root, step = path, None
    if (path / "meta").is_dir() and path.name.isdigit():
        root, step = path.parent, int(path.name)
    try:
        # Read-only: this only reads (a training may be saving there). Orbax warns that it
        # opened "Given directory is read only=..." (read as if the directory could not be
        # written) and, without save_interval_steps=0, that it set it so: no news.
        with logs.without("absl", "Given directory is read only=%s"):
            mngr = ocp.CheckpointManager(root.resolve(), item_names=("state", "meta"),
                                         options=ocp.CheckpointManagerOptions(
                                             read_only=True, create=False,
                                             save_interval_steps=0))
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise NotFound(f"no checkpoint in {path}")
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except TallyError:
        raise
    except Exception as exc:
        raise TallyError(f"cannot read the loader state of checkpoint {path}: {exc}") from None
    return meta


def _check_meta(meta: Any, where: str) -> tuple[int, dict[str, dict]]:
    if not isinstance(meta, dict) or not isinstance(meta.get("loaders"), dict) or \
            not isinstance(meta.get("step"), int) or not meta["loaders"]:
        raise TallyError(f"{where}: checkpoint meta has no step and loader states "
                         "(expected {'step', 'attempt', 'loaders': {host: state}})")
    loaders = meta["loaders"]
    first = loaders.get("0", {})
    old = first.get("host_count") if isinstance(first, dict) else None
    if not isinstance(old, int) or sorted(loaders) != sorted(str(h) for h in range(old)):
        raise TallyError(f"{where}: checkpoint holds loader states for hosts "
                         f"{sorted(loaders, key=lambda k: (len(k), k))}, expected one for each "
                         f"of the {old} hosts it was saved on")
    for h, st in loaders.items():
        if not isinstance(st, dict) or not {"config", "iterator", "host_count"} <= set(st):
            raise TallyError(f"{where}: loader state of host {h} is not a KeyedLoader state")
    return meta["step"], loaders


class _Run:
    """What the ledger says a run consumed before a step (rolled-back rows left out)."""

    def __init__(self, ledger: Ledger, run_id: str, before: int) -> None:
        self.cur, self.before = ledger.cursor(), before
        row = one(self.cur, "SELECT run, manifest_fingerprint FROM runs WHERE run_id = ?",
                  [run_id])
        if row is None:
            raise TallyError(f"run {run_id!r} is not in ledger {ledger.path} (ingest its spool "
                             "first)")
        self.run, self.fingerprint = row

    def close(self) -> None:
        self.cur.close()

    def hosts_at(self, step: int) -> tuple[int, int | None]:
        """(hosts with rows at `step`, last step the ledger holds) in the surviving lineage."""
        rows = self.cur.execute(f"""
            SELECT h.step, count(DISTINCT h.host) FROM agg_steps h JOIN attempts a
                USING (run, attempt)
            WHERE h.run = ? AND {effective_sql("h", "a")} AND h.step < ?
            GROUP BY h.step ORDER BY h.step DESC LIMIT 1""", [self.run, self.before]).fetchall()
        if not rows:
            return 0, None
        last, hosts = rows[0]
        return (hosts if last == step else 0), last

    def epochs(self) -> tuple[int | None, int | None]:
        row = one(self.cur, "SELECT min(epoch), max(epoch) FROM effective_consumption "
                  "WHERE run = ? AND step < ?", [self.run, self.before])
        return row if row else (None, None)

    def distinct_in_epoch(self, epoch: int) -> int:
        return one(self.cur, 'SELECT count(DISTINCT record_key) FROM effective_consumption '
                   f'WHERE run = ? AND step < ? AND epoch = ? AND {start_sql()}',
                   [self.run, self.before, epoch])[0]

    def consumed(self, n: int, from_epoch: int) -> np.ndarray:
        """Carried indices (epoch * n + record key) of records started in epochs >= from_epoch."""
        got = self.cur.execute(
            'SELECT DISTINCT epoch::BIGINT * ? + record_key AS idx FROM effective_consumption '
            f'WHERE run = ? AND step < ? AND {start_sql()} AND epoch >= ?',
            [n, self.run, self.before, from_epoch]).fetchnumpy()["idx"]
        return np.asarray(got, dtype=np.int64)


def run_preflight(ledger: Ledger | str | Path, run_id: str, manifest: str | Path,
                  checkpoint: dict[str, Any] | str | Path, new_hosts: int,
                  loader_config: LoaderConfig | None = None, *, global_batch: int | None = None,
                  horizon: int | None = None, workers: int | None = None,
                  cancel: threading.Event | None = None, progress: bool = False
                  ) -> PreflightVerdict:
    """Shadow-run the loader on `new_hosts` from `checkpoint` (a directory, or its meta dict)
    and check the plan against the ledger. `loader_config` is the new topology's loader config
    (default: the checkpointed one); `global_batch` overrides its batch; `horizon` fixes the
    steps to plan (default: to the end of the current epoch, at most 1000); setting `cancel`
    stops the shadow run (Cancelled); `progress` shows the stages on stderr."""
    t0 = time.perf_counter()
    if new_hosts < 1:
        raise TallyError(f"--hosts must be at least 1, got {new_hosts}")
    if horizon is not None and horizon < 1:
        raise TallyError(f"--horizon must be at least 1 step, got {horizon}")
    where = "checkpoint meta" if isinstance(checkpoint, dict) else str(checkpoint)
    meta = checkpoint if isinstance(checkpoint, dict) else load_checkpoint_meta(checkpoint)
    step, loaders = _check_meta(meta, where)
    source = ShadowSource.from_manifest(manifest)
    state0 = loaders["0"]
    cfg = loader_config or _saved_config(state0, where)
    if global_batch is not None:
        cfg = dataclasses.replace(cfg, global_batch=global_batch)
    resume = _Resume(run_id, source, step, loaders, cfg, new_hosts, horizon, workers, cancel)
    with Progress(f"preflight {run_id}", progress) as bar:
        if isinstance(ledger, Ledger):
            return _check(ledger, resume, t0, bar)
        with Ledger(_existing(ledger), read_only=True) as opened:
            return _check(opened, resume, t0, bar)


def _existing(path: str | Path) -> Path:
    if not Path(path).is_file():
        raise TallyError(f"no ledger at {path}")
    return Path(path)


def _saved_config(state: dict[str, Any], where: str) -> LoaderConfig:
    try:
        return LoaderConfig(**state["config"])
    except TypeError as exc:
        raise TallyError(f"{where}: the saved loader config is not a LoaderConfig: {exc}") from None


@dataclasses.dataclass(frozen=True)
class _Resume:
    """What the check is asked: may `run_id` resume from the checkpoint at `step` (its hosts'
    loader states, `loaders`) on `new_hosts` hosts with loader config `cfg`, its plan shadow-run
    over `source` for `horizon` steps (None: to the epoch's end) by `workers` processes (None:
    as many as help); setting `cancel` stops the shadow run."""

    run_id: str
    source: ShadowSource
    step: int
    loaders: dict
    cfg: LoaderConfig
    new_hosts: int
    horizon: int | None
    workers: int | None
    cancel: threading.Event | None = None


def _check(ledger: Ledger, resume: _Resume, t0: float,
           bar: Progress | None = None) -> PreflightVerdict:
    run_id, source, step, loaders, cfg = (resume.run_id, resume.source, resume.step,
                                          resume.loaders, resume.cfg)
    new_hosts, horizon, workers = resume.new_hosts, resume.horizon, resume.workers
    bar = bar or Progress("", enabled=False)
    bar.stage("reading the ledger")
    state0 = loaders["0"]
    old_hosts = state0["host_count"]
    n = len(source)
    old_batch = state0["config"].get("global_batch")
    numbers: dict[str, Any] = {
        "checkpoint_step": step, "old_hosts": old_hosts, "new_hosts": new_hosts,
        "old_global_batch": old_batch, "new_global_batch": cfg.global_batch,
        "records_per_epoch": n}
    v = PreflightVerdict(run_id, "safe", numbers=numbers)

    add = v.findings.add

    def done() -> PreflightVerdict:
        sev = v.findings.severities()
        v.status = "unsafe" if "FAIL" in sev else "unknown" if "UNKNOWN" in sev else "safe"
        numbers["seconds"] = round(time.perf_counter() - t0, 3)
        return v

    run = _Run(ledger, run_id, step)
    try:
        if run.fingerprint and source.fingerprint and run.fingerprint != source.fingerprint:
            add("UNKNOWN", "manifest_mismatch",
                f"the run trained against manifest {run.fingerprint}, this one is "
                f"{source.fingerprint}: give the run's manifest")
            return done()
        if state0.get("records_per_epoch") != n:
            add("UNKNOWN", "manifest_mismatch",
                f"the checkpointed loader read {state0.get('records_per_epoch')} train records "
                f"an epoch, the manifest has {n}: give the run's manifest")
            return done()
        hosts, last = run.hosts_at(step - 1)
        if step > 0 and hosts != old_hosts:
            held = "nothing" if last is None else f"steps up to {last}"
            add("UNKNOWN", "ledger_behind",
                f"the checkpoint is at step {step} on {old_hosts} host(s), but the ledger holds "
                f"{held} ({hosts} host(s) at step {step - 1}): ingest the spool first",
                ledger_last_step=last, hosts_at_last_step=hosts)
            return done()
        lo, hi = run.epochs()
        if lo is not None and lo < 0:
            add("UNKNOWN", "epochs_unknown",
                "the ledger has no epochs for this run (its writer was not given "
                "records_per_epoch): cannot tell what the current epoch consumed")
            return done()
        epoch = 0 if hi is None else hi + (run.distinct_in_epoch(hi) >= n)
        numbers["epoch"] = epoch

        try:
            cfg.check(new_hosts)
        except ValueError as exc:
            add("FAIL", "topology", f"the loader cannot run on {new_hosts} host(s): {exc}")
            return done()
        if old_batch != cfg.global_batch:
            add("FAIL", "global_batch_changed",
                f"the global batch would change from {old_batch} to {cfg.global_batch} rows "
                f"at step {step}: a position recomputed as step x batch no longer names the "
                "next record (records skipped or repeated at the boundary); resume with the "
                "same global batch",
                before=old_batch, after=cfg.global_batch)
        probe = KeyedLoader(source, dataclasses.replace(cfg, read_threads=0, read_buffer=0,
                                                        workers=0), 0, new_hosts)
        problems = [p for p in compatibility(state0, probe)
                    if p not in ("global_batch", "records_per_epoch")]
        if problems:
            add("FAIL", "state_incompatible",
                "; ".join(explain(p, state0, probe) for p in problems)
                + (" (the loader's naive_reshard switch restores it anyway)"
                   if cfg.fault == "naive_reshard" else
                   " (the loader would refuse it; the plan below is what forcing it would do)"),
                problems=problems)

        steps = horizon or DEFAULT_MAX_HORIZON
        states = [state_for_host(loaders, h) for h in range(new_hosts)]
        if workers is None:
            workers = default_workers(new_hosts, steps, cfg.global_batch // new_hosts)
        bar.stage(f"shadow run of the loader on {new_hosts} host(s), up to {steps} steps")
        try:
            plans, steps = shadow_run(source, cfg, new_hosts, states, steps=steps,
                                      until_epoch=epoch, to_epoch_end=horizon is None,
                                      workers=workers, cancel=resume.cancel)
        except Cancelled:
            raise
        except Exception as exc:  # a forced state that does not fit this pipeline at all
            if not problems:
                raise
            add("INFO", "no_plan", f"the shadow loader cannot restore this state: {exc}")
            return done()
        reached = all(p.passed is not None and p.passed <= steps for p in plans)
        numbers.update(horizon_steps=steps, reached_epoch_end=reached, workers=workers)
        bar.stage("checking the plan against the ledger")
        _plan_findings(plans, run, n, epoch, step, reached, numbers, add)
        return done()
    finally:
        run.close()


def _plan_findings(plans, run: _Run, n: int, epoch: int, step: int, reached: bool,
                   numbers: dict[str, Any], add) -> None:
    idx = np.concatenate([p.index for p in plans])
    at = np.concatenate([p.step for p in plans]).astype(np.int64) + step
    host = np.concatenate([np.full(len(p.index), p.host, np.int32) for p in plans])
    numbers["planned"] = len(idx)
    bad_steps: list[np.ndarray] = []

    # Records planned more than once, and on two or more hosts.
    order = np.argsort(idx, kind="stable")
    s_idx, s_host = idx[order], host[order]
    uniq, first, counts = np.unique(s_idx, return_index=True, return_counts=True)
    dup = counts > 1
    if dup.any():
        lo = np.minimum.reduceat(s_host, first)
        hi = np.maximum.reduceat(s_host, first)
        cross = int((dup & (lo != hi)).sum())
        twice = np.isin(idx, uniq[dup])
        bad_steps.append(at[twice])
        add("FAIL", "planned_twice",
            f"{int(dup.sum()):,} records are planned more than once ({cross:,} of them for two "
            f"or more hosts) between steps {int(at[twice].min())} and {int(at[twice].max())}: "
            "hosts are not reading disjoint shards (per-host shuffle seeds, no sharding?)",
            records=int(dup.sum()), on_several_hosts=cross)
    numbers["duplicates"] = int(dup.sum())

    # Records already consumed in their epoch before the checkpoint.
    from_epoch = min(epoch, int(idx.min()) // n) if len(idx) else epoch
    consumed = run.consumed(n, from_epoch)
    numbers["consumed_in_epoch"] = int((consumed // n == epoch).sum())
    numbers["planned_in_epoch"] = int((idx // n == epoch).sum())
    again = np.isin(idx, consumed)
    repeats = len(distinct(idx[again]))
    numbers["repeats"] = repeats
    if repeats:
        bad_steps.append(at[again])
        add("FAIL", "repeats",
            f"would repeat {repeats:,} records already consumed in their epoch, planned between "
            f"steps {int(at[again].min())} and {int(at[again].max())}",
            records=repeats, first_step=int(at[again].min()), last_step=int(at[again].max()))

    # With the horizon at the epoch's end, consumed + planned must be the whole epoch.
    numbers["skipped"] = None
    if reached:
        mine = idx[idx // n == epoch]
        covered = len(np.union1d(consumed[consumed // n == epoch], mine))
        skipped = n - covered
        numbers["skipped"] = skipped
        if skipped:
            end = step + numbers["horizon_steps"] - 1
            bad_steps.append(np.array([step, end]))
            add("FAIL", "skips",
                f"would skip {skipped:,} of the {n:,} records of epoch {epoch}: neither consumed "
                f"before step {step} nor planned by step {end}, where the epoch ends",
                records=skipped, epoch=epoch)
    else:
        add("INFO", "horizon_short",
            f"the {numbers['horizon_steps']}-step horizon ends before epoch {epoch} does: "
            "records skipped later in the epoch are not checked")
    if bad_steps:
        allbad = np.concatenate(bad_steps)
        numbers["first_bad_step"], numbers["last_bad_step"] = int(allbad.min()), int(allbad.max())
    else:
        numbers["first_bad_step"] = numbers["last_bad_step"] = None


def record_verdict(ledger: Ledger, verdict: PreflightVerdict, *, forced: bool = False,
                   requested_by: str = "cli") -> int:
    """Insert a verdict into the ledger's `preflight_verdicts` table; returns its id.
    `forced`: the resume went ahead against an unsafe verdict."""
    n = verdict.numbers
    cur = ledger.cursor()
    try:
        cur.execute("BEGIN")
        vid = one(cur, "SELECT nextval('preflight_ids')")[0]
        cur.execute(
            "INSERT INTO preflight_verdicts (id, run_id, checkpoint_step, old_hosts, new_hosts, "
            "old_global_batch, new_global_batch, horizon_steps, status, forced, requested_by, "
            "headline, verdict) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [vid, verdict.run_id, n.get("checkpoint_step"), n.get("old_hosts"),
             n.get("new_hosts"), n.get("old_global_batch"), n.get("new_global_batch"),
             n.get("horizon_steps"), verdict.status, forced, requested_by, verdict.headline(),
             json.dumps(verdict.to_dict())])
        cur.execute("COMMIT")
    except BaseException:
        cur.execute("ROLLBACK")
        raise
    finally:
        cur.close()
    return vid


def check_and_record(ledger_path: str | Path, spool: str | Path, run_id: str,
                     manifest: str | Path, checkpoint: str | Path, new_hosts: int,
                     loader_config: LoaderConfig | None = None, *, forced: bool = False,
                     requested_by: str = "trainer") -> PreflightVerdict:
    """For a resume on a new topology where no service owns the ledger: bring the ledger up to
    date with the spool, run the check, and record the verdict (with `forced` when the caller
    resumes against it)."""
    from tally.audit.ledger.ingest import ingest

    with Ledger(ledger_path) as ledger:
        ingest(spool, ledger)
        verdict = run_preflight(ledger, run_id, manifest, checkpoint, new_hosts, loader_config)
        record_verdict(ledger, verdict, forced=forced and not verdict.ok,
                       requested_by=requested_by)
    return verdict
