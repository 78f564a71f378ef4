"""The columns of a consumed segment and of a metric, defined once.

Every other form is derived from these tuples: the spool's Arrow schemas (tally.audit.hook.spool),
the ledger's DuckDB tables (tally.audit.ledger.database), the columns reconcile reads
(tally.audit.reconcile) and the numpy dtypes and Arrow tables the writer builds. A new column is
added here and nowhere else; docs/DESIGN.md ("Spool segment files") describes the same contract
in words.

pyarrow's own conversions (`pa.array`, `Table.from_pydict`, `to_numpy`, `to_pandas_dtype`) load
pandas at their first call: 0.26-0.4 s here, in every process, and on a training host in the
writer's thread at its first publish, holding the GIL while the training thread waits. So the
dtypes come from Arrow's kind and bit width, and the writer's tables from buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Column:
    name: str
    arrow: pa.DataType
    sql: str  # the DuckDB type
    doc: str
    required: bool = True  # optional columns may be absent from a file, null in the ledger

    @property
    def dtype(self) -> np.dtype:
        """The column's numpy dtype (without pandas: the module's docstring)."""
        return numpy_dtype(self.arrow)

    @property
    def quoted(self) -> str:
        """The name as SQL reads it ("row" and "offset" are keywords in DuckDB)."""
        return f'"{self.name}"'


def numpy_dtype(t: pa.DataType) -> np.dtype:
    """The numpy dtype of an Arrow type, from its kind and bit width (object: not numeric)."""
    if pa.types.is_floating(t):
        return np.dtype(f"f{t.bit_width // 8}")
    if pa.types.is_boolean(t):
        return np.dtype(bool)
    if pa.types.is_integer(t):
        return np.dtype(f"{'u' if pa.types.is_unsigned_integer(t) else 'i'}{t.bit_width // 8}")
    return np.dtype(object)


def arrow_table(schema: pa.Schema, columns: Mapping[str, np.ndarray | Sequence[str]]
                ) -> pa.Table:
    """`pa.Table.from_pydict(columns, schema=schema)` for integer, floating and string columns
    (the schema's kinds) without nulls, built from buffers (without pandas: the module's
    docstring). Numbers are cast to the column's type (integers must fit); NaN stays a value,
    as from_pydict keeps it."""
    arrays = []
    for field in schema:
        values = columns[field.name]
        if pa.types.is_string(field.type):
            data = [v.encode() for v in values]
            offsets = np.zeros(len(data) + 1, np.int32)
            np.cumsum([len(d) for d in data], out=offsets[1:])
            buffers = [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))]
        else:
            if not (pa.types.is_integer(field.type) or pa.types.is_floating(field.type)):
                raise TypeError(f"column {field.name}: {field.type} is not built from buffers")
            want = numpy_dtype(field.type)
            a = np.asarray(values)
            if a.dtype != want:  # integers must fit, as pyarrow's own conversion checks
                cast = a.astype(want)
                if want.kind in "iu" and not np.array_equal(cast, a):
                    raise ValueError(f"column {field.name}: values do not fit {field.type}")
                a = cast
            buffers = [None, pa.py_buffer(np.ascontiguousarray(a))]
        arrays.append(pa.Array.from_buffers(field.type, len(values), buffers))
    return pa.Table.from_arrays(arrays, schema=schema)


SEGMENT_COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), "BIGINT", "training step that consumed the segment"),
    Column("host", pa.int32(), "INTEGER", "host (process index) that consumed it"),
    Column("row", pa.int32(), "INTEGER", "batch row within the host's share of the step"),
    Column("record_key", pa.int64(), "BIGINT", "the record's row in the corpus manifest"),
    Column("offset", pa.int32(), "INTEGER", "first token's position within the record"),
    Column("n_tokens", pa.int32(), "INTEGER", "tokens of the record inside this segment"),
    Column("content_hash", pa.uint64(), "UBIGINT", "xxh3_64 of exactly these tokens"),
    Column("epoch", pa.int32(), "INTEGER", "epoch of the carried index; -1 when unknown"),
)
# Optional: a file may carry it or not (files written before it existed do not); the ledger
# holds null where a file did not.
SEGMENT_LOSS = Column("loss", pa.float32(), "REAL", "mean training loss over the tokens the "
                      "segment's own tokens predict; NaN where none (a one-token segment)",
                      required=False)
SEGMENT_COLUMNS_ALL = SEGMENT_COLUMNS + (SEGMENT_LOSS,)
METRIC_COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), "BIGINT", "training step the value belongs to"),
    Column("host", pa.int32(), "INTEGER", "host that logged it"),
    Column("name", pa.string(), "VARCHAR", "train_loss, heldout_loss, ppl/<domain>, ..."),
    Column("value", pa.float64(), "DOUBLE", "the value"),
)
# Columns the ledger puts before a file's own columns (which run and attempt it belongs to) and
# after them (which file it came from).
LEDGER_PREFIX: tuple[Column, ...] = (
    Column("run", pa.int32(), "INTEGER", "the run's number in the ledger (runs.run)"),
    Column("attempt", pa.int32(), "INTEGER", "the attempt (restart) that wrote the file"),
)
LEDGER_SUFFIX: tuple[Column, ...] = (
    Column("file_id", pa.int32(), "INTEGER", "the spool file the row came from (segments)"),
)


def names(columns: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name for c in columns)


def arrow_schema(columns: tuple[Column, ...]) -> pa.Schema:
    return pa.schema([(c.name, c.arrow) for c in columns])


def sql_columns(columns: tuple[Column, ...]) -> str:
    """`"name" TYPE [NOT NULL], ...` for a CREATE TABLE."""
    return ",\n    ".join(f"{c.quoted} {c.sql}{' NOT NULL' if c.required else ''}"
                          for c in columns)


def sql_select(columns: tuple[Column, ...]) -> str:
    """`"a", "b", ...` for a SELECT list."""
    return ", ".join(c.quoted for c in columns)


SEGMENT_SCHEMA = arrow_schema(SEGMENT_COLUMNS)
SEGMENT_SCHEMA_WITH_LOSS = arrow_schema(SEGMENT_COLUMNS_ALL)
METRIC_SCHEMA = arrow_schema(METRIC_COLUMNS)
SEGMENT_DTYPES = {c.name: c.dtype for c in SEGMENT_COLUMNS_ALL}

# ---- bounds of the contract -----------------------------------------------------------------
# What a spool file may claim, checked before anything it holds reaches the ledger (files beyond
# them are quarantined with the reason), and what the writer refuses up front. They bound the
# memory one file, or the live state, can take; each is far beyond a real run.
MAX_HOSTS = 65_536  # host_count; host < host_count
MAX_RECORD_KEY = 2**40  # record keys and records_per_epoch: a trillion records
MAX_EPOCH = 2**20  # epoch * records_per_epoch + record_key must fit in an int64
MAX_STEP = 2**62  # steps (int64 end to end)
# A run id: a spool directory name, a URL path segment and a Prometheus label value alike.
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_FILE_ROWS = 16_000_000  # rows in one spool file (a writer flushes ~100 steps: ~500k rows)
MAX_DECODED_BYTES = 2**31  # a file's columns, uncompressed, as its footer declares them
MAX_METRIC_NAME = 256  # characters of a metric name
