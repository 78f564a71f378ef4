"""The reconcile numbers, computed by DuckDB SQL straight from a ledger and the manifest.

This is the test oracle for the Beam job: written independently of `tally.audit.reconcile`, from the
definitions in docs/DESIGN.md ("Exposure semantics"), one query per number.
"""

from __future__ import annotations

import duckdb


def reference(ledger_path: str, manifest: str, run_id: str, at_step: int | None = None) -> dict:
    con = duckdb.connect(ledger_path, read_only=True)
    at = "" if at_step is None else f"AND step <= {int(at_step)}"
    con.execute(f"""
        CREATE TEMP VIEW m AS SELECT * FROM read_parquet('{manifest}');
        CREATE TEMP VIEW eff AS SELECT c.* FROM effective_consumption c JOIN runs USING (run)
            WHERE run_id = '{run_id}' {at};
        CREATE TEMP VIEW rb AS SELECT c.* FROM rolled_back_consumption c JOIN runs USING (run)
            WHERE run_id = '{run_id}' {at};
        CREATE TEMP VIEW j AS SELECT eff.*, m.split, m.domain, m.n_tokens AS m_tokens,
            m.content_hash AS m_hash, m.record_key IS NOT NULL AS known
            FROM eff LEFT JOIN m USING (record_key);
        CREATE TEMP VIEW starts AS SELECT * FROM j WHERE "offset" = 0 AND split = 'train';
        CREATE TEMP VIEW per_record AS SELECT m.record_key, m.domain, m.n_tokens, m.source,
            count(s.record_key) AS e FROM m LEFT JOIN starts s USING (record_key)
            WHERE m.split = 'train' GROUP BY ALL;
    """)

    def one(sql):
        return con.execute(sql).fetchall()[0]

    def all_(sql):
        return con.execute(sql).fetchall()

    n, total = one("SELECT count(*), sum(e) FROM per_record")
    total = int(total or 0)
    lo, hi = total // n, -(-total // n)
    out = {"train_records": n, "exposures": total}
    out["histogram"] = list(one("""SELECT count(*) FILTER (WHERE e = 0), count(*) FILTER (WHERE
        e = 1), count(*) FILTER (WHERE e = 2), count(*) FILTER (WHERE e >= 3) FROM per_record"""))
    out["excess"], out["missing"] = map(int, one(f"""SELECT coalesce(sum(greatest(0, e - {hi})),
        0), coalesce(sum(greatest(0, {lo} - e)), 0) FROM per_record"""))
    out["epoch_duplicates"], out["epoch_duplicate_records"] = map(int, one("""
        SELECT coalesce(sum(c - 1), 0), count(*) FROM (SELECT record_key, epoch, count(*) AS c
        FROM starts WHERE epoch >= 0 GROUP BY ALL HAVING count(*) > 1)"""))
    out["unknown_keys"], out["unknown_segments"] = one(
        "SELECT count(DISTINCT record_key), count(*) FROM j WHERE NOT known")
    (out["hash_checked"], out["hash_mismatches"], out["hash_unverifiable"],
     out["hash_overlong"]) = map(int, one("""
        SELECT count(*) FILTER (WHERE "offset" = 0 AND n_tokens = m_tokens),
               count(*) FILTER (WHERE "offset" = 0 AND n_tokens = m_tokens
                                AND content_hash <> m_hash),
               count(*) FILTER (WHERE NOT ("offset" = 0 AND n_tokens = m_tokens)),
               count(*) FILTER (WHERE "offset" = 0 AND n_tokens > m_tokens)
        FROM j WHERE known"""))
    out["heldout_consumed_records"], out["heldout_exposures"] = one("""
        SELECT count(DISTINCT record_key), count(*) FROM j
        WHERE known AND split <> 'train' AND "offset" = 0""")
    hosts = int(one("SELECT max(host_count) FROM attempts JOIN runs USING (run) "
                    f"WHERE run_id = '{run_id}'")[0])
    per_host = {h: [0, 0, 0, 0, 0] for h in range(hosts)}
    for h, seg, exp, tok in all_("""SELECT host, count(*), count(*) FILTER (WHERE "offset" = 0),
            sum(n_tokens) FROM eff GROUP BY host"""):
        per_host[h][:3] = [seg, exp, int(tok)]
    con.execute("""CREATE TEMP VIEW seen AS SELECT DISTINCT record_key, host FROM starts;
        CREATE TEMP VIEW multi AS SELECT record_key FROM seen GROUP BY ALL
            HAVING count(*) > 1""")
    for h, u in all_("SELECT host, count(*) FROM seen GROUP BY host"):
        per_host[h][3] = u
    for h, o in all_("SELECT host, count(*) FROM seen JOIN multi USING (record_key) "
                     "GROUP BY host"):
        per_host[h][4] = o
    out["per_host"] = per_host
    matrix = [[0] * hosts for _ in range(hosts)]
    for a, b, c in all_("""SELECT x.host, y.host, count(*) FROM seen x JOIN seen y
            USING (record_key) GROUP BY ALL"""):
        matrix[a][b] = c
    out["overlap_matrix"] = matrix
    out["steps"] = {r[0]: r[1:] for r in all_("""
        WITH firsts AS (SELECT record_key, min(step) AS step FROM starts GROUP BY ALL),
        new AS (SELECT step, count(*) AS new_unique FROM firsts GROUP BY ALL),
        ex AS (SELECT step, count(*) AS exposures FROM starts GROUP BY ALL),
        base AS (SELECT step, count(*) AS segments, sum(n_tokens) AS tokens,
                 count(DISTINCT (host, "row")) AS rows FROM eff GROUP BY ALL)
        SELECT step, segments, tokens, rows, coalesce(exposures, 0),
               coalesce(new_unique, 0)
        FROM base LEFT JOIN ex USING (step) LEFT JOIN new USING (step) ORDER BY step""")}
    out["domains"] = {r[0]: list(r[1:]) for r in all_("""
        SELECT m.domain, count(DISTINCT m.record_key), (SELECT sum(n_tokens) FROM m m2
               WHERE m2.split = 'train' AND m2.domain = m.domain),
               count(j.record_key) FILTER (WHERE j."offset" = 0),
               coalesce(sum(j.n_tokens), 0),
               (SELECT count(*) FROM per_record p WHERE p.domain = m.domain AND p.e = 0)
        FROM m LEFT JOIN j USING (record_key) WHERE m.split = 'train' GROUP BY m.domain""")}
    # Each domain against its own ideal (floor or ceil of its exposures per record); the run
    # is measured by those when it has more than one domain, read every one, is off the
    # split's ideal (or repeats within an epoch), and they leave at most a tenth of that.
    out["domain_distance"] = {r[0]: [int(r[1]), int(r[2])] for r in all_("""
        WITH d AS (SELECT domain, count(*) AS n, sum(e) AS c FROM per_record GROUP BY ALL)
        SELECT p.domain, sum(greatest(0, p.e - (d.c + d.n - 1) // d.n)),
               sum(greatest(0, d.c // d.n - p.e))
        FROM per_record p JOIN d USING (domain) GROUP BY p.domain""")}
    # Within-epoch repeats beyond what a domain's exposures in the epoch force (more of them
    # than it has records force the rest to repeat).
    out["domain_epoch_duplicates"] = int(one("""
        WITH d AS (SELECT domain, count(*) AS n FROM per_record GROUP BY ALL),
        de AS (SELECT domain, epoch, count(*) AS c, count(DISTINCT record_key) AS k
               FROM starts WHERE epoch >= 0 GROUP BY ALL)
        SELECT coalesce(sum(least(d.n, de.c) - de.k), 0) FROM de JOIN d USING (domain)""")[0])
    # Each epoch against its own ideal for each domain (floor or ceil of the domain's
    # exposures in the epoch per record, its records not seen in the epoch at 0), and whether
    # every exposure is in a known epoch.
    con.execute("""
        CREATE TEMP VIEW ce AS SELECT record_key, epoch, count(*) AS c FROM starts
            WHERE epoch >= 0 GROUP BY ALL;
        CREATE TEMP VIEW cells AS SELECT p.domain, g.epoch, coalesce(ce.c, 0) AS c
            FROM per_record p
            JOIN (SELECT DISTINCT p2.domain, ce.epoch FROM ce JOIN per_record p2
                  USING (record_key)) g USING (domain)
            LEFT JOIN ce ON ce.record_key = p.record_key AND ce.epoch = g.epoch""")
    uneven_in_epochs = int(one("""
        WITH t AS (SELECT domain, epoch, count(*) AS n, sum(c) AS s FROM cells GROUP BY ALL)
        SELECT coalesce(sum(greatest(0, x.c - (t.s + t.n - 1) // t.n)
                            + greatest(0, t.s // t.n - x.c)), 0)
        FROM cells x JOIN t USING (domain, epoch)""")[0])
    unknown_epoch = one("SELECT count(*) FROM starts WHERE epoch < 0")[0]
    out["domain_epochs_even"] = bool(total and not unknown_epoch and not uneven_in_epochs)
    within = sum(a + b for a, b in out["domain_distance"].values()) + out[
        "domain_epoch_duplicates"]
    all_read = one("SELECT bool_and(c > 0) FROM (SELECT sum(e) AS c FROM per_record "
                   "GROUP BY domain)")[0]
    off = out["excess"] + out["missing"] + out["epoch_duplicates"]
    out["domain_weighted"] = bool(len(out["domain_distance"]) > 1 and all_read and off > 0
                                  and within * 10 <= off)
    out["first_bad_step"] = None if out["domain_weighted"] else one(f"""
        WITH cum AS (SELECT step, sum(count(*)) OVER (ORDER BY step) AS c FROM starts
                     GROUP BY step),
        ranked AS (SELECT record_key, step, row_number() OVER (PARTITION BY record_key
                   ORDER BY step) AS k FROM starts)
        SELECT min(r.step) FROM ranked r JOIN cum USING (step)
        WHERE r.k > ceil(cum.c / {n})""")[0]
    # A rolled-back step compares with the replay on the hosts that published it when both
    # attempts have the same host count; on another host count only when every host of the
    # rolled-back attempt published it (else it is neither replayed nor differing).
    replay = all_(f"""
        WITH hc AS (SELECT attempt, host_count FROM attempts JOIN runs USING (run)
                    WHERE run_id = '{run_id}'),
        rp AS (SELECT step, max(attempt) AS by_attempt FROM eff GROUP BY step),
        rs AS (SELECT rb.attempt, rb.step, count(DISTINCT rb.host) AS nh,
                      any_value(hc.host_count) AS hosts_a, any_value(hb.host_count) AS hosts_by
               FROM rb JOIN hc USING (attempt) LEFT JOIN rp USING (step)
               LEFT JOIN hc hb ON hb.attempt = rp.by_attempt GROUP BY ALL),
        r AS (SELECT attempt, step, list((record_key, "offset", n_tokens, content_hash)
                   ORDER BY record_key, "offset", n_tokens, content_hash) AS rows
                   FROM rb GROUP BY ALL),
        e AS (SELECT rs.attempt, rs.step, list((eff.record_key, eff."offset", eff.n_tokens,
                     eff.content_hash) ORDER BY eff.record_key, eff."offset", eff.n_tokens,
                     eff.content_hash) AS rows
              FROM rs JOIN eff USING (step)
              WHERE rs.hosts_a IS DISTINCT FROM rs.hosts_by OR eff.host IN (
                  SELECT host FROM rb WHERE rb.attempt = rs.attempt AND rb.step = rs.step)
              GROUP BY ALL),
        c AS (SELECT r.attempt, r.rows AS r_rows, e.rows AS e_rows, e.step IS NOT NULL AND
                     (rs.hosts_a = rs.hosts_by OR rs.nh = rs.hosts_a) AS replayed
              FROM r JOIN rs USING (attempt, step) LEFT JOIN e USING (attempt, step))
        SELECT attempt, count(*), count(*) FILTER (WHERE replayed),
               count(*) FILTER (WHERE replayed AND r_rows = e_rows)
        FROM c GROUP BY attempt""")
    out["replay"] = {a: [rolled, replayed, identical] for a, rolled, replayed, identical in replay}
    con.close()
    return out


def from_report(r: dict, steps, records=None) -> dict:
    """The same numbers, picked out of a Beam report (and its steps table)."""
    c, i = r["coverage"], r["integrity"]
    hist = [c["histogram"][b] for b in ("0", "1", "2", "3+")]
    per_host = {p["host"]: [p["segments"], p["exposures"], p["tokens"], p["unique"],
                            p["overlap_with_others"]] for p in r["hosts"]["per_host"]}
    st = steps.to_pydict()
    return {
        "train_records": c["train_records"], "exposures": c["exposures"], "histogram": hist,
        "excess": c["excess_exposures"], "missing": c["missing_exposures"],
        "epoch_duplicates": c["epoch_duplicates"],
        "epoch_duplicate_records": c["epoch_duplicate_records"],
        **{k: i[k] for k in ("unknown_keys", "unknown_segments", "hash_checked",
                             "hash_mismatches", "hash_unverifiable", "hash_overlong",
                             "heldout_consumed_records", "heldout_exposures")},
        "per_host": per_host,
        "overlap_matrix": r["hosts"]["overlap_matrix"],
        "steps": {s: (seg, tok, rows, e, nu) for s, seg, tok, rows, e, nu in zip(
            st["step"], st["segments"], st["tokens"], st["rows"], st["exposures"],
            st["new_unique"], strict=True)},
        "domains": {d["domain"]: [d["records"], d["tokens"], d["exposures"],
                                  d["tokens_consumed"], d["never_seen"]] for d in r["domains"]},
        "domain_distance": {d["domain"]: [d["excess_exposures"], d["missing_exposures"]]
                            for d in r["domains"]},
        "domain_epoch_duplicates": r["domain_ideal"]["epoch_duplicates"],
        "domain_epochs_even": r["domain_ideal"]["epochs_even"],
        "domain_weighted": r["domain_ideal"]["weighted"],
        "first_bad_step": r["first_bad_step"],
        "replay": {x["attempt"]: [x["rolled_back_steps"], x["replayed_steps"],
                                  x["identical_steps"]] for x in r["restarts"]
                   if x["rolled_back_steps"]},
    }
