"""Parquet files as rows: record batches sized by bytes, columns of one name told apart, damage kept to its rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmops.data.readers import DataSourceError, first_line, unique_header
from llmops.data.rows import Row, Span, excerpt
from llmops.io.rejects import Reject, RejectCode

# the rows a Parquet batch holds: at most BATCH_ROWS, and about BATCH_BYTES of them as the file's metadata sizes them
BATCH_ROWS = 10_000
BATCH_BYTES = 64 << 20


def read_parquet(path: Path, max_bytes: int, span: Span | None = None) -> Iterator[Row]:
    """Parquet in record batches of about BATCH_BYTES, so memory stays bounded by bytes, not rows (10,000 rows of
    megabytes each are gigabytes); row numbers count from 1. A span is row groups [start, end) and the number of the
    first row. Columns of one name are told apart as a CSV header's are (`a`, `a.1`). A file that cannot be opened
    is a source error. Row groups decode apart, so damage costs only its own rows: a row group that breaks partway
    quarantines its rows from the break on (the footer counts them), a value that is not UTF-8 its row, and the
    reading goes on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
        names, meta = handle.schema_arrow.names, handle.metadata
    except (pa.ArrowException, OSError, ValueError) as err:
        raise DataSourceError(f"{path}: not a readable Parquet file ({first_line(err)})") from None
    size, unique = batch_rows(meta), unique_header(names)
    number = 0 if span is None else span[2] - 1
    for group in range(meta.num_row_groups) if span is None else range(span[0], span[1]):
        yield from group_rows(handle, group, number, size, unique)
        number += meta.row_group(group).num_rows


def group_rows(handle: Any, group: int, number: int, size: int, names: list[str]) -> Iterator[Row]:
    """One row group's rows, numbered on from `number`; the rows its decoding never reached, each a reject."""
    import pyarrow as pa

    rows, done = handle.metadata.row_group(group).num_rows, 0
    try:
        for batch in handle.iter_batches(batch_size=size, row_groups=[group]):
            for row, reject in decoded_rows(pa.RecordBatch.from_arrays(batch.columns, names=names)):
                done += 1
                yield number + done, row, reject
        why = f"the footer counts {rows} rows and {done} decode"
    except (pa.ArrowException, OSError, ValueError) as err:
        why = first_line(err)
    # the rows the footer counts that did not decode, each quarantined under its own number
    for line in range(number + done + 1, number + rows + 1):
        yield line, None, Reject(RejectCode.FILE_UNREADABLE, f"row group {group} (rows {number + 1}-{number + rows}) "
                                 f"cannot be decoded from row {number + done + 1} on ({why})")


def decoded_rows(batch: Any) -> Iterator[tuple[dict[str, Any] | None, Reject | None]]:
    """A batch's rows as Python values; where a text is not UTF-8 (Parquet does not check), row by row, rejecting
    the rows that hold one."""
    try:
        rows = batch.to_pylist()
    except UnicodeDecodeError:
        rows = None
    if rows is not None:
        for row in rows:
            yield row, None
        return
    for index in range(batch.num_rows):
        try:
            yield batch.slice(index, 1).to_pylist()[0], None
        except UnicodeDecodeError as err:
            field, value = next(((name, column[index]) for name, column in
                                 zip(batch.schema.names, batch.columns, strict=True) if not decodes(column[index])),
                                (None, None))
            shown = value.as_buffer().to_pybytes().decode("utf-8", "replace") if hasattr(value, "as_buffer") else ""
            yield None, Reject(RejectCode.UTF8_INVALID, f"{field or 'a value'}: bytes that are not UTF-8 "
                               f"({err.reason} at byte {err.start})", field=field, excerpt=excerpt(shown))


def decodes(value: Any) -> bool:
    try:
        value.as_py()
    except UnicodeDecodeError:
        return False
    return True


def batch_rows(meta: Any) -> int:
    """Rows a batch of about BATCH_BYTES holds, by the file's uncompressed size per row."""
    rows = sum(meta.row_group(group).num_rows for group in range(meta.num_row_groups))
    size = sum(meta.row_group(group).total_byte_size for group in range(meta.num_row_groups))
    return max(1, min(BATCH_ROWS, BATCH_BYTES * rows // max(size, 1)))
