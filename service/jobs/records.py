"""Records sent to a running continual job (POST /jobs/{id}/records): validated line by line,
then appended to the job's ingest spool (<output_dir>/records/ingested-NNNNNN.jsonl) and fsync'd before
the request is answered, so that an accepted record survives a SIGKILL of the daemon. The job's
run watches the spool as it watches its sources, and reports how far it has read it: records
accepted and not yet trained are bounded by the job's `max_pending_records` (429 beyond it).

Each record is a conversation (`{"messages": [...]}`, OpenAI or ShareGPT form) or, for a job that
regenerates, a prompt (`{"prompt": ...}` or messages up to a user turn); a line that is neither
refuses the whole request, naming the line, and nothing of it is written."""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any

from dflash_core.confine import ConfinedDir, OutsideRoots
from dflash_core.continual.job import SPOOL_DIR, SPOOL_FILE_BYTES, spool_name, spool_number
from dflash_core.data.bounded import LONE_SURROGATE, MAX_JSON_DEPTH, lone_surrogate, too_deep
from dflash_core.data.conversations import parse_conversation
from dflash_core.data.errors import DatasetError
from dflash_core.data.prompts import parse_prompt

from .errors import JobConflict, JobNotFound
from .schemas import SpecError
from .store import RUNNING

if TYPE_CHECKING:
    from .worker import JobWorker

CONTINUAL = "continual"
RETRY_AFTER_SECONDS = 2
MAX_LINE_ERRORS = 20  # problems named per refused request at most


class BufferFull(Exception):
    """The job holds as many untrained records as it may (HTTP 429 with Retry-After)."""

    retry_after = RETRY_AFTER_SECONDS


def parse_records(body: bytes, prompts_allowed: bool) -> list[str]:
    """The body's records as compact JSON lines; SpecError naming each bad line (`line N`)."""
    lines: list[str] = []
    errors: list[dict[str, str]] = []
    for n, raw in enumerate(body.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"line {n}"
        try:  # UTF-8, as the spool stores it (json.loads would also take UTF-16 and UTF-32 bytes)
            text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark, as the file readers take it
        except UnicodeDecodeError as e:
            errors.append({"field": where, "message": f"not UTF-8 text (byte {e.start} of the line)"})
            continue
        try:
            record = json.loads(text)
        except (ValueError, RecursionError) as e:
            errors.append({"field": where, "message": f"not JSON ({type(e).__name__})"})
            continue
        if too_deep(record, MAX_JSON_DEPTH):
            errors.append({"field": where, "message": f"nested deeper than {MAX_JSON_DEPTH} levels"})
            continue
        if lone_surrogate(text, record):
            errors.append({"field": where, "message": LONE_SURROGATE})
            continue
        problem = _problem(record, prompts_allowed)
        if problem is not None:
            errors.append({"field": where, "message": problem})
            continue
        lines.append(json.dumps(record, separators=(",", ":"), ensure_ascii=False))
    if errors:
        raise SpecError(errors=errors[:MAX_LINE_ERRORS], subject="records")
    if not lines:
        raise SpecError("body", "no records; send one JSON object per line", subject="records")
    return lines


def _problem(record: Any, prompts_allowed: bool) -> str | None:
    try:
        parse_conversation(record, "record", 0)
        return None
    except DatasetError as e:
        conversation_error = e.reason
    try:
        parse_prompt(record, "record", 0)
    except DatasetError:
        return conversation_error
    if prompts_allowed:
        return None
    return "a prompt without an answer: this job has no `regenerate` settings to answer it (send conversations)"


class RecordSpool:
    """One continual job's spool: appends under a lock, each fsync'd, to the newest file (a new one
    once it reached SPOOL_FILE_BYTES; the run removes files it has read and trained); the lines of
    each file there."""

    def __init__(self, directory: str, roots: list[str], file_bytes: int = SPOOL_FILE_BYTES):
        self.directory, self.roots, self.file_bytes = directory, roots, file_bytes
        self.lock = threading.Lock()
        self.lines = {name: self._count(name) for name in self._names()}  # per spool file
        self.number = max((spool_number(n) or 0 for n in self.lines), default=1) or 1

    def _names(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self.directory) if spool_number(name) is not None)
        except FileNotFoundError:
            return []

    def _count(self, name: str) -> int:
        try:
            with open(os.path.join(self.directory, name), "rb") as f:
                return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
        except FileNotFoundError:
            return 0

    def pending(self, read: dict[str, int]) -> int:
        """Lines of the spool files still there that the run has not read (`read`: lines read per file)."""
        present = set(self._names())
        self.lines = {name: n for name, n in self.lines.items() if name in present}
        return sum(max(0, n - read.get(name, 0)) for name, n in self.lines.items())

    def append(self, lines: list[str]) -> None:
        data = ("\n".join(lines) + "\n").encode()
        try:
            directory = ConfinedDir(self.directory, self.roots, "output_dir")
        except OutsideRoots as e:
            raise JobConflict(f"the job's spool cannot be written: {e}") from None
        with directory:
            try:
                if os.stat(directory.at(spool_name(self.number))).st_size >= self.file_bytes:
                    self.number += 1
            except FileNotFoundError:
                pass
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(directory.at(spool_name(self.number)), flags, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            directory.fsync()
        name = spool_name(self.number)
        self.lines[name] = self.lines.get(name, 0) + len(lines)


class Ingest:
    """The ingest route's side of the manager: the spools of the continual jobs it was sent records for."""

    def __init__(self, worker: JobWorker):
        self.worker = worker
        self._spools: dict[str, RecordSpool] = {}
        self._lock = threading.Lock()

    def _spool(self, job_id: str, output_dir: str, roots: list[str]) -> RecordSpool:
        with self._lock:
            if job_id not in self._spools:
                self._spools[job_id] = RecordSpool(os.path.join(output_dir, SPOOL_DIR), roots)
            return self._spools[job_id]

    def accept(self, job_id: str, body: bytes) -> int:
        """Append the body's records to the job's spool; how many. Raises JobNotFound (404),
        JobConflict (409: not a running continual job), SpecError (422: a bad line, or more lines than
        the job may hold), BufferFull (429)."""
        job = self.worker.store.get_job(job_id, with_checkpoints=False)
        if job is None:
            raise JobNotFound(job_id)
        kind = job.spec.get("kind", "train")
        if kind != CONTINUAL or job.state != RUNNING:
            raise JobConflict(
                f"job {job_id} is a {kind} job in state {job.state}; records go to a RUNNING continual job"
            )
        lines = parse_records(body, prompts_allowed=job.spec.get("regenerate") is not None)
        limit = int(job.spec.get("max_pending_records") or 1)
        if len(lines) > limit:  # never accepted, however long it waits: not a 429 to send again
            raise SpecError(
                "body",
                f"{len(lines)} records in one request, where job {job_id} holds at most {limit} not yet "
                f"trained (max_pending_records): send at most {limit} a request",
                subject="records",
            )
        spool = self._spool(job_id, job.output_dir, self.worker.roots.for_engine()["output_roots"])
        with spool.lock:
            reported = self.worker.records_of(job_id)
            # before the run's first report (it starts in a moment) how far it read is not known:
            # the spool takes the records, bounded by the request size, and the run reads them
            pending = spool.pending(reported["spool_lines_read"]) + reported["pending"] if reported else 0
            if pending + len(lines) > limit:
                raise BufferFull(
                    f"job {job_id} holds {pending} records not yet trained (max_pending_records {limit}); "
                    f"send again in {RETRY_AFTER_SECONDS} s"
                )
            spool.append(lines)
        return len(lines)
