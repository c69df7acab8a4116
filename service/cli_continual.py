"""The commands of continual jobs: `continual` starts one on watched sources, `published` shows
the versions it published and the acceptance lengths of each publish decision, and `feed` sends
a file's records to it (POST /jobs/{id}/records in batches, waiting out a full buffer). Each
returns its exit code."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from .cli_files import open_file, read_json_object
from .cli_jobs import (
    EXIT_BAD_REQUEST,
    EXIT_CODES,
    EXIT_JOB_FAILED,
    EXIT_OK,
    _client,
    _positive_int,
    _print_outcome,
    follow_job,
)
from .client import BadArgument, DaemonClient, DaemonError
from .http_guard import MAX_BODY_BYTES

FEED_BATCH_LINES = 1000
FEED_BATCH_BYTES = MAX_BODY_BYTES // 2  # well under the daemon's bound (413 above it)
FEED_RETRIES = 600  # waits on a full buffer (429) before `feed` gives up


def cmd_continual(args: argparse.Namespace) -> int:
    """Submit a continual job: the sources, the settings given as options, and any other field
    from --job-file."""
    spec: dict[str, Any] = read_json_object(Path(args.job_file)) if args.job_file else {}
    spec["kind"] = "continual"
    if args.sources:
        spec["sources"] = list(args.sources)
    for option, field in (
        ("datasets", "datasets"),
        ("publish_dir", "publish_dir"),
        ("publish_every", "publish_every_steps"),
        ("margin", "publish_margin"),
        ("keep", "keep_versions"),
        ("replay_ratio", "replay_ratio"),
        ("reload_url", "reload_url"),
        ("name", "name"),
    ):
        value = getattr(args, option)
        if value is not None:
            spec[field] = value
    if args.no_yield:
        spec["yield_to_queue"] = False
    with _client(args) as client:
        status, job = client.submit(spec)
        print(f"{job['id']} {'queued' if status == 202 else 'already submitted'} ({job['state']})")
        if not args.follow:
            return EXIT_OK
        job = follow_job(client, job["id"])
        _print_outcome(job)
        return EXIT_CODES.get(job["state"], EXIT_JOB_FAILED)


def cmd_published(args: argparse.Namespace) -> int:
    """The job's published versions and, per publish decision, the candidate's and the published
    drafter's acceptance length (τ over time)."""
    with _client(args) as client:
        job = client.job(args.job_id)
        decisions = [e for e in client.events(args.job_id) if e["kind"] in ("publish", "publish_check")]
    if args.json:
        print(json.dumps({"published": job.get("published"), "decisions": decisions}, indent=2))
        return EXIT_OK
    latest = job.get("published")
    print(
        f"{job['id']} {job['state']}: "
        + (f"v{latest['version']:06d} τ {latest['tau']:.3f} at {latest['path']}" if latest else "nothing published yet")
    )
    print(f"{'TIME':<20} {'STEP':>8} {'CANDIDATE τ':>12} {'PUBLISHED τ':>12}  OUTCOME")
    for e in decisions:
        when = datetime.fromtimestamp(e["time"], UTC).strftime("%Y-%m-%d %H:%M:%S")
        outcome = f"published v{e['version']:06d}" if e.get("published") else e.get("reason", "")
        print(
            f"{when:<20} {e.get('step') or '-':>8} {_tau(e.get('candidate_tau')):>12} "
            f"{_tau(e.get('published_tau')):>12}  {outcome}"
        )
    return EXIT_OK


def _tau(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _finite_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite number")
    return number


def batches(
    lines: Iterator[bytes], max_lines: int | Callable[[], int], max_bytes: int
) -> Iterator[tuple[bytes, list[int]]]:
    """Non-empty lines grouped into bodies of at most max_lines lines (a callable: asked once the
    first record is read) and about max_bytes bytes, each with the file line number (from 1) of
    each of its lines."""
    limit = max_lines if isinstance(max_lines, int) else None
    batch: list[bytes] = []
    numbers: list[int] = []
    size = 0
    for number, line in enumerate(lines, start=1):
        line = line.rstrip(b"\r\n")
        if not line.strip():
            continue
        if limit is None:
            limit = cast(Callable[[], int], max_lines)()
        if batch and (len(batch) >= limit or size + len(line) + 1 > max_bytes):
            yield b"\n".join(batch) + b"\n", numbers
            batch, numbers, size = [], [], 0
        batch.append(line)
        numbers.append(number)
        size += len(line) + 1
    if batch:
        yield b"\n".join(batch) + b"\n", numbers


def _refusal(path: Path, answer: dict[str, Any], numbers: list[int]) -> str:
    """The daemon's refusal of a batch, its `line N` (the body's) given as the file's line."""
    errors = answer.get("errors")
    if not isinstance(errors, list) or not errors:
        return str(answer.get("detail", answer))
    out = []
    for e in errors:
        field, message = str(e.get("field", "")), str(e.get("message", ""))
        n = field.removeprefix("line ")
        if n.isdigit() and 1 <= int(n) <= len(numbers):
            out.append(f"{path}:{numbers[int(n) - 1]}: {message}")
        else:
            out.append(f"{path}: {field}: {message}")
    return "\n".join(out)


def _batch_lines(client: DaemonClient, args: argparse.Namespace) -> int:
    """--batch, at most the job's max_pending_records: a larger batch could never be accepted."""
    try:
        limit = client.job(args.job_id).get("spec", {}).get("max_pending_records")
    except DaemonError:  # no such job, say: the first batch's answer says so
        return args.batch
    return min(args.batch, limit) if isinstance(limit, int) and limit > 0 else args.batch


def cmd_feed(args: argparse.Namespace, sleep: Callable[[float], None] = time.sleep) -> int:
    """Send a JSONL file's records to a running continual job, in batches; a full buffer (429) is
    waited out as the daemon's Retry-After says."""
    path = Path(args.file)
    accepted = sent = 0
    with open_file(path) as f, _client(args) as client:  # read as sent: a records file may be large
        # the job's bound asked once the file holds a record: a file of none is refused unsent
        for body, numbers in batches(iter(f), lambda: _batch_lines(client, args), FEED_BATCH_BYTES):
            sent += 1
            for _ in range(FEED_RETRIES):
                status, answer, retry_after = client.post_records(args.job_id, body)
                if status != 429:
                    break
                sleep(retry_after)
            if status != 202:
                print(
                    f"error: {_refusal(path, answer, numbers)}\n({accepted} records accepted before)", file=sys.stderr
                )
                return EXIT_BAD_REQUEST if status < 500 else EXIT_JOB_FAILED
            accepted += int(answer["accepted"])
    if not sent:
        raise BadArgument(f"{path}: no records (one JSON object per line)")
    print(f"{accepted} records accepted by {args.job_id}")
    return EXIT_OK


def register(sub, register_client_command) -> None:
    cont = register_client_command(
        sub, "continual", cmd_continual, "start a continual job that trains on watched sources and publishes"
    )
    cont.add_argument("sources", nargs="*", metavar="SOURCE_DIR", help="directories watched for new records")
    cont.add_argument("--job-file", help="a JSON spec with more fields (the options below override it)")
    cont.add_argument("--datasets", nargs="+", help="initial data, trained first")
    cont.add_argument("--publish-dir", help="default <output_dir>/published")
    cont.add_argument("--publish-every", type=int, metavar="STEPS", help="steps between publish evaluations")
    cont.add_argument("--margin", type=_finite_float, help="relative τ gain needed to publish (default 0)")
    cont.add_argument("--keep", type=int, help="published versions kept")
    cont.add_argument("--replay-ratio", type=_finite_float, help="share of each step drawn from older records")
    cont.add_argument("--reload-url", help="POSTed after each publish (a serving engine's reload hook)")
    cont.add_argument("--no-yield", action="store_true", help="keep the devices when other jobs are queued")
    cont.add_argument("--name")
    cont.add_argument("--follow", "-f", action="store_true", help="follow its progress until it ends")

    pub = register_client_command(sub, "published", cmd_published, "show a continual job's published versions and τ")
    pub.add_argument("job_id", metavar="JOB_ID")
    pub.add_argument("--json", action="store_true", help="print the raw JSON")

    feed = register_client_command(sub, "feed", cmd_feed, "send a JSONL file's records to a running continual job")
    feed.add_argument("job_id", metavar="JOB_ID")
    feed.add_argument("file", metavar="RECORDS.jsonl")
    feed.add_argument(
        "--batch", type=_positive_int, default=FEED_BATCH_LINES, help="records per request (default %(default)s)"
    )
