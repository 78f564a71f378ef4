"""The ledger: the DuckDB file one process owns, exactly-once ingest of the spool, the aggregates
kept at ingest with the per-record state behind them, the live snapshot and cache engine, and
the answers the API, the CLI and the pre-flight check read from it."""
