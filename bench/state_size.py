"""Per-record live state: bytes per record and cost per record start, by loader shape.

Feeds record starts through the live aggregates (`tally.audit.ledger.aggregates`, the ingest path's
numpy part: grouping, the state's gathers and scatters, the agg-table deltas, the watermark;
no DuckDB) in batches of one ingest round, for loader shapes the state must hold:

- `healthy`: a fresh permutation of the records each epoch, sharded over the hosts (`--epochs`
  of them, 1.1 by default as the seed run);
- `per_host_seed`: every host draws from the whole corpus with its own seed (sampling with
  replacement: the fault that leaves records on several hosts);
- `many_epochs`: the healthy loader over 20 epochs of a corpus 20 times smaller (records in the
  epoch map beyond the row's window of 16).

Prints, per shape: the state's bytes per record (rows, maps, pending table), the microseconds
per record start, and the ratio to the reference measured in the same run: one DuckDB
GROUP BY over the same starts computing what the state needs to hold (per record: exposures,
the three earliest steps, the distinct hosts and epochs), its time per start and the bytes per
record of its result.

    python -m bench.state_size [--records 2000000] [--hosts 128] [--rows-per-batch 1000000]
"""

from __future__ import annotations

import argparse
import time

import duckdb
import numpy as np
import pyarrow as pa

from tally.audit.ledger.aggregates import Aggregates, _Staged
from tally.audit.ledger.state import Starts


def starts(shape: str, records: int, hosts: int, epochs: float, seed: int = 0):
    """(keys, steps, epochs, hosts) of every start, in step order, 32 starts a host a step."""
    rng = np.random.default_rng(seed)
    total = int(records * epochs)
    if shape == "per_host_seed":
        keys = rng.integers(0, records, total)
        ep = (np.arange(total) // records).astype(np.int32)
    else:
        parts = [rng.permutation(records) for _ in range(int(np.ceil(epochs)))]
        keys = np.concatenate(parts)[:total]
        ep = (np.arange(total) // records).astype(np.int32)
    per_step = 32 * hosts
    step = np.arange(total) // per_step
    host = np.arange(total) % hosts
    return keys.astype(np.int64), step.astype(np.int64), ep, host


def feed(shape: str, records: int, hosts: int, epochs: float, batch: int) -> dict:
    keys, steps, ep, host = starts(shape, records, hosts, epochs)
    agg = Aggregates()
    seconds = 0.0
    for lo in range(0, len(keys), batch):
        sl = slice(lo, lo + batch)
        order = np.argsort(host[sl], kind="stable")
        k, s, e, h = keys[sl][order], steps[sl][order], ep[sl][order], host[sl][order]
        cuts = np.flatnonzero(np.diff(h)) + 1
        parts = [Starts(k[a:b], s[a:b], e[a:b], int(h[a]), 0, int(s[b - 1]), hosts)
                 for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(h)], strict=True)]
        t0 = time.perf_counter()  # the state's work only, not the batch's preparation
        inc = agg.increments(1, parts)
        agg._pending.append(_Staged(1, inc.new, inc.seen, once=inc.once))
        agg.reserve()
        agg.commit()
        seconds += time.perf_counter() - t0
    st = agg.runs[1]
    parts = st.nbytes()
    return {"starts": len(keys), "seconds": seconds, "bytes": parts,
            "per_record": sum(parts.values()) / records,
            "many_hosts": len(st.many_hosts), "far_epochs": len(st.far_epochs),
            "ref": reference(keys, steps, ep, host, records)}


def reference(keys, steps, ep, host, records: int) -> dict:
    con = duckdb.connect()
    con.register("s", pa.table({"k": keys, "step": steps, "epoch": ep, "host": host}))
    t0 = time.perf_counter()
    res = con.sql("""SELECT k, count(*) AS e, min(step, 3) AS steps,
        list(DISTINCT host) AS hosts, list(DISTINCT epoch) AS epochs FROM s GROUP BY k"""
                      ).to_arrow_table()
    seconds = time.perf_counter() - t0
    con.close()
    return {"seconds": seconds, "per_record": res.nbytes / records}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--epochs", type=float, default=1.1)
    ap.add_argument("--rows-per-batch", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    out = {}
    for shape, records, epochs in (("healthy", args.records, args.epochs),
                                   ("per_host_seed", args.records, args.epochs),
                                   ("many_epochs", args.records // 20, 20.0)):
        r = out[shape] = feed(shape, records, args.hosts, epochs, args.rows_per_batch)
        us = r["seconds"] / r["starts"] * 1e6
        ref_us = r["ref"]["seconds"] / r["starts"] * 1e6
        b = r["bytes"]
        print(f"{shape}: {records:,} records, {r['starts']:,} starts, {args.hosts} hosts: state "
              f"{r['per_record']:.1f} bytes a record (rows {b['rows'] / records:.1f}, "
              f"3+ host map {b['many_hosts'] / records:.1f} for {r['many_hosts']:,} records, "
              f"epoch map {b['far_epochs'] / records:.1f} for {r['far_epochs']:,}, pending "
              f"{b['pending'] / records:.1f}); {us:.2f} us a start | reference DuckDB GROUP BY "
              f"{ref_us:.2f} us a start, result {r['ref']['per_record']:.1f} bytes a record | "
              f"ratio time {ref_us / us:.2f}, bytes {r['ref']['per_record'] / r['per_record']:.1f}")
    return out


if __name__ == "__main__":
    main()
