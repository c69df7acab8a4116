"""Reading a parquet dataset as the tokenization tasks read it: every task's rows, through
dflash_core.data.chunks (the tasks a file is cut into, each read as the workers read it), against
one pass over the file (dflash_core.data.sources.iter_records) and, in the same run, against
reading the whole conversation column in every task (what the tasks did before they read only
their row groups).

    python -m bench.parquet_rows [--rows 100000,400000] [--group-rows 10000,1000000]

The conversations are synthetic (a user turn and an assistant turn of a few hundred bytes);
tokenization is not timed. Writes $OUT/parquet_rows.json and prints a table last.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import out_dir, report
from dflash_core.data import chunks
from dflash_core.data.sources import file_source, iter_records


def write_file(directory: Path, rows: int, group_rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = directory / f"rows{rows}_groups{group_rows}.parquet"
    records = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: " + "why is the sky blue " * 10},
                {"role": "assistant", "content": f"answer {i}: " + "because of scattering " * 20},
            ]
        }
        for i in range(rows)
    ]
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=group_rows)
    return path


def whole_column_tasks(src) -> int:
    """Every task reading the whole column, then its slice (the tasks' reading before)."""
    import pyarrow.parquet as pq

    n = 0
    for task, _ in chunks.chunk_tasks(src):
        _, start, stop = task
        table = pq.read_table(src.path, columns=["messages"]).slice(start, stop - start)
        n += len(table.column(0).to_pylist())
    return n


def task_reads(src) -> int:
    return sum(1 for task, _ in chunks.chunk_tasks(src) for _ in chunks._chunk_records(src, task))


def timed(fn, src) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn(src)
    return time.perf_counter() - t, n


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="100000,400000")
    p.add_argument("--group-rows", default="10000,1000000")
    args = p.parse_args(argv)
    out_dir()
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in (int(x) for x in args.rows.split(",")):
            for group_rows in (int(x) for x in args.group_rows.split(",")):
                path = write_file(Path(tmp), rows, group_rows)
                src = file_source(path, path.name)
                one_pass, n1 = timed(lambda s: sum(1 for _ in iter_records(s)), src)
                tasks, n2 = timed(task_reads, src)
                before, n3 = timed(whole_column_tasks, src)
                assert n1 == n2 == n3 == rows, (n1, n2, n3)
                row = {
                    "rows": rows,
                    "row_group_rows": min(rows, group_rows),
                    "tasks": sum(1 for _ in chunks.chunk_tasks(src)),
                    "file_mib": round(path.stat().st_size / 2**20, 1),
                    "one_pass_s": round(one_pass, 2),
                    "tasks_own_groups_s": round(tasks, 2),
                    "tasks_whole_column_s": round(before, 2),
                }
                rows_out.append(row)
                print(row, flush=True)
    report(
        "parquet_rows",
        {"args": vars(args), "rows": rows_out},
        f"reading a parquet dataset's rows as tokenization tasks of {chunks.CHUNK_ROWS} rows (CPU, one process)",
        rows_out,
        list(rows_out[0]),
    )


if __name__ == "__main__":
    main()
