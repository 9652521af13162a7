"""Parquet files as rows: record batches sized by bytes, columns of one name told apart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmops.core.rejects import Reject, RejectCode
from llmops.data.readers import DataSourceError, first_line, unique_header
from llmops.data.rows import UNREAD, Row, Span

# the rows a Parquet batch holds: at most BATCH_ROWS, and about BATCH_BYTES of them as the file's metadata sizes them
BATCH_ROWS = 10_000
BATCH_BYTES = 64 << 20


def read_parquet(path: Path, max_bytes: int, span: Span | None = None) -> Iterator[Row]:
    """Parquet in record batches of about BATCH_BYTES, so memory stays bounded by bytes, not rows (10,000 rows of
    megabytes each are gigabytes); row numbers count from 1. A span is row groups [start, end) and the number of the
    first row. Columns of one name are told apart as a CSV header's are (`a`, `a.1`). A file that cannot be opened
    is a source error; one that breaks partway ends in a reject at the break."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    groups = None if span is None else range(span[0], span[1])
    try:
        handle = pq.ParquetFile(path)
        names = handle.schema_arrow.names
        batches = handle.iter_batches(batch_size=batch_rows(handle.metadata), row_groups=groups)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise DataSourceError(f"{path}: not a readable Parquet file ({first_line(err)})") from None
    unique = unique_header(names)
    number = 0 if span is None else span[2] - 1
    try:
        for batch in batches:
            if unique != names:
                batch = pa.RecordBatch.from_arrays(batch.columns, names=unique)
            for row in batch.to_pylist():
                number += 1
                yield number, row, None
    except (pa.ArrowException, OSError, ValueError) as err:
        yield number + 1, None, Reject(RejectCode.FILE_UNREADABLE, f"cannot read the file as Parquet from here "
                                       f"({first_line(err)})" + UNREAD, stops_file=True)


def batch_rows(meta: Any) -> int:
    """Rows a batch of about BATCH_BYTES holds, by the file's uncompressed size per row."""
    rows = sum(meta.row_group(group).num_rows for group in range(meta.num_row_groups))
    size = sum(meta.row_group(group).total_byte_size for group in range(meta.num_row_groups))
    return max(1, min(BATCH_ROWS, BATCH_BYTES * rows // max(size, 1)))
