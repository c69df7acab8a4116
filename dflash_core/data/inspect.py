"""A quick look at a dataset before a job is queued: its layout, its schema and its first
records, so that what cannot be read is refused at submission rather than failing the job
later. Reads a few records per file whatever the dataset's size; never imports torch."""

from __future__ import annotations

from pathlib import Path

from ..confine import OutsideRoots, resolved_under
from .conversations import DatasetError, parse_conversation
from .sources import MAX_RECORD_BYTES, conversation_column, dataset_files, iter_records

FIRST_RECORDS = 20  # records read per file
# bytes of a JSONL file looked at, whatever its records: skipping an over-long line (skip_bad_lines)
# would otherwise read a huge newline-free file to its end while the submission waits
INSPECT_BYTES = 4 * MAX_RECORD_BYTES


def check_dataset(
    entry: str | Path, *, skip_bad_lines: bool = False, name: str | None = None, roots: list[Path] | None = None
) -> int:
    """Raise DatasetError (file and line or row) for a dataset entry that cannot be trained on;
    the number of files it has. With skip_bad_lines a bad record among the first ones is
    tolerated, as the job would skip it; a file none of whose first records is usable is not.
    name: how errors name the entry, e.g. as the user gave it (default: the entry). roots: where
    each file must lie, symlinks followed (a file of a directory may be a link leading out), checked
    before it is opened."""
    files = dataset_files(entry, name)
    for src in files:
        if roots:
            try:
                resolved_under(src.path, roots, "the dataset file", src.name)
            except OutsideRoots:
                raise DatasetError(src.name, 0, "resolves outside the allowed roots (a symlink leading out?)") from None
        if src.kind in ("parquet", "arrow"):
            conversation_column(src)
        first_error: DatasetError | None = None
        usable = seen = 0
        for position, record in iter_records(src, INSPECT_BYTES):
            seen += 1
            try:
                if isinstance(record, DatasetError):
                    raise record
                parse_conversation(record, src.name, position, src.unit)
                usable += 1
            except DatasetError as err:
                if not skip_bad_lines:
                    raise
                first_error = first_error or err
            if seen >= FIRST_RECORDS:
                break
        if seen == 0:
            raise DatasetError(src.name, 0, "holds no records")
        if usable == 0 and first_error is not None:
            raise first_error
    return len(files)
