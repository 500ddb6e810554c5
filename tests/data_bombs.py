"""Decompression bombs for the data-file tests, built in code."""

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def parquet_bomb(num_rows: int, value_bytes: int, *, arrow_schema: bool = True, columns=("prompt",)) -> bytes:
    """`num_rows` rows whose every column holds one `value_bytes` string: dictionary-encoded (the
    value stored once, in the dictionary page; the indices run-length encoded) and zstd-compressed,
    so the file is a few hundred bytes and decodes to num_rows x value_bytes per column. With the
    arrow schema stored, pyarrow reads each column back as a dictionary array; without it, as
    plain strings."""
    column = pa.DictionaryArray.from_arrays(pa.array(np.zeros(num_rows, np.int32)), pa.array(["x" * value_bytes]))
    buf = io.BytesIO()
    pq.write_table(pa.table({name: column for name in columns}), buf, compression="zstd", store_schema=arrow_schema)
    return buf.getvalue()


def metadata_bytes(data: bytes) -> int:
    """What the upload's old check bounded: the row groups' total_byte_size from the footer (the
    dictionary page once, not the rows it expands to)."""
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
