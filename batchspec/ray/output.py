"""Writing a job's rows: JSONL, or Parquet when the path ends with .parquet.

Rows go to a temporary file beside the target that is renamed into place only when the whole job
succeeded, so a failed job never leaves an output that looks complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

COLUMNS = ("id", "prompt", "text", "token_ids", "finish_reason", "prompt_tokens", "rounds", "drafted", "accepted",
           "acceptance_rate")
ROW_GROUP = 1024  # Parquet rows buffered per write


def parquet_schema():
    import pyarrow as pa

    i64 = pa.int64()
    return pa.schema([("id", i64), ("prompt", pa.string()), ("text", pa.string()), ("token_ids", pa.list_(i64)),
                      ("finish_reason", pa.string()), ("prompt_tokens", i64), ("rounds", i64), ("drafted", i64),
                      ("accepted", i64), ("acceptance_rate", pa.float64())])


class OutputFile:
    """`with OutputFile(path) as out: out.write(rows)`: COLUMNS of each row, in the order given."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.parent.exists():
            raise ValueError(f"output folder {self.path.parent} does not exist")
        self.parquet = self.path.suffix == ".parquet"
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        self._buffer: list[dict] = []
        self._writer = None
        self._file = None

    def __enter__(self) -> OutputFile:
        if self.parquet:
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(self.tmp, parquet_schema())
        else:
            self._file = open(self.tmp, "w", encoding="utf-8")
        return self

    def write(self, rows: list[dict]) -> None:
        rows = [{k: row[k] for k in COLUMNS} for row in rows]
        if self._file is not None:
            self._file.writelines(json.dumps(r) + "\n" for r in rows)
            return
        self._buffer.extend(rows)
        if len(self._buffer) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._buffer:
            self._writer.write_table(pa.Table.from_pylist(self._buffer, schema=parquet_schema()))
            self._buffer = []

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._writer is not None:
            if exc_type is None:
                self._flush()
            self._writer.close()
        if self._file is not None:
            self._file.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)
