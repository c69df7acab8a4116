"""The commands that talk to a daemon (`submit`, `status`, `resume`, `logs`, `cancel`) and how
they print jobs and events. Each returns its exit code."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .cli_files import read_json_object
from .client import DaemonClient, DaemonError
from .jobs.store import STATES, TERMINAL
from .progress import StepRate, duration, progress_line

if TYPE_CHECKING:
    pass

# Exit codes, distinct per outcome (scripts and CI branch on them; the README lists them)
EXIT_OK = 0  # the command did what it was asked; a followed job SUCCEEDED
EXIT_JOB_FAILED = 1
EXIT_BAD_REQUEST = 2  # the daemon refused the request (4xx), or the arguments or files are wrong
EXIT_JOB_STOPPED = 3
EXIT_UNREACHABLE = 4  # no daemon answered at --url
EXIT_DAEMON_ERROR = 5  # the daemon answered with a server error (5xx)
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # stdout's reader closed it (`| head`): a SIGPIPE death's status, without the death
EXIT_CODES = {"SUCCEEDED": EXIT_OK, "FAILED": EXIT_JOB_FAILED, "STOPPED": EXIT_JOB_STOPPED}
# how long a follower keeps reconnecting to a daemon that went away (a restart takes seconds to
# minutes: warm-up); then it gives up with EXIT_UNREACHABLE
RECONNECT_SECONDS = 900.0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _events_reconnecting(
    client: DaemonClient, job_id: str, out: TextIO, reconnect_seconds: float
) -> Iterator[dict[str, Any]]:
    """The job's events until it ends, resuming after the last one seen (?after=) when the stream
    breaks or the daemon restarts; gives up after `reconnect_seconds` without an answer."""
    import httpx

    after = 0
    while True:
        try:
            for event in client.events(job_id, follow=True, after=after):
                after = max(after, int(event.get("event_id") or 0))
                yield event
            if client.job(job_id)["state"] in TERMINAL:
                return
        except (httpx.TransportError, DaemonError) as e:
            if isinstance(e, DaemonError) and e.status < 500:
                raise
        # the stream ended or broke while the job runs: the daemon went away (a restart)
        out.write(("\r\033[K" if out.isatty() else "") + "daemon unreachable; reconnecting...\n")
        out.flush()
        deadline = time.monotonic() + reconnect_seconds
        while True:
            try:
                client.job(job_id)
                break
            except (httpx.TransportError, DaemonError) as e:
                if isinstance(e, DaemonError) and e.status < 500:
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


def follow_job(
    client: DaemonClient,
    job_id: str,
    out: TextIO = sys.stdout,
    *,
    quiet_steps_seconds: float = 1.0,
    reconnect_seconds: float = RECONNECT_SECONDS,
) -> dict[str, Any]:
    """Stream the job's events, drawing a progress line; returns the job when it ends. Survives a
    daemon restart (the events resume where they stopped)."""
    tty = out.isatty()
    last_print = 0.0
    pending_line = ""
    rate = StepRate()  # on the events' timestamps: a re-attached follower gets the past in one burst
    for event in _events_reconnecting(client, job_id, out, reconnect_seconds):
        kind = event["kind"]
        rate.observe(event)
        if kind == "step":
            elapsed, eta = rate.times(event.get("total_steps") or 0)
            pending_line = progress_line(event, elapsed, eta)
            now = time.monotonic()
            if tty:
                out.write("\r" + pending_line)
                out.flush()
            elif now - last_print >= quiet_steps_seconds or event.get("step") == event.get("total_steps"):
                out.write(pending_line + "\n")
                out.flush()
                last_print = now
            continue
        message = _event_message(event)
        if message:
            out.write(("\r\033[K" if tty else "") + message + "\n")
            if tty and pending_line:
                out.write(pending_line)
            out.flush()
    if tty:
        out.write("\n")
    return client.job(job_id)


def _riding(event: dict[str, Any]) -> str:
    """A decoder event's riding rows: up to the widest, at each width it records."""
    rows, widths = event.get("ride_rows") or 0, event.get("ride_widths") or []
    if not rows:
        return "0"
    return f"up to {rows}" + (f" (steps of {'/'.join(map(str, widths))} rows)" if len(widths) > 1 else "")


def _event_message(event: dict[str, Any]) -> str | None:
    kind = event["kind"]
    if kind == "state":
        extra = f": {event['error']}" if event.get("error") else ""
        return f"state {event.get('state')}{extra}"
    if kind == "checkpoint":
        path = str(event.get("path") or "")
        if path.endswith(".parquet"):  # a regeneration's checkpoint is a shard; its count is rows
            return f"shard {Path(path).name} written: {event.get('step')} rows so far"
        return f"checkpoint step {event.get('step')}: {path}"
    if kind == "eval":
        return f"eval step {event.get('step')}: acceptance length {_fmt(event.get('acceptance_length'), '.3f')}"
    if kind == "resumed":
        return f"resumed from step {event.get('step')} ({event.get('reason')}): {event.get('checkpoint')}"
    if kind == "data":
        return (
            f"data: {event.get('documents')} documents, {event.get('micro_batches_per_epoch')} micro-batches per epoch,"
            f" {event.get('total_steps')} steps"
        )
    if kind == "generate":
        return generation_line(event)
    if kind == "decoder":
        return (
            f"decoder: {event.get('slots')} slots x {event.get('length')} positions, KV cache "
            f"{(event.get('kv_cache_bytes') or 0) / 2**30:.2f} GiB, stacked q/k/v weights "
            f"{(event.get('stacked_qkv_bytes') or 0) / 2**30:.2f} GiB, CUDA graph {'yes' if event.get('cuda_graph') else 'no'}, "
            f"prompt tokens riding per step {_riding(event)}"
        )
    if kind == "prompts":
        return f"prompts: {event.get('prompts')}, {event.get('rows')} rows in {event.get('shards')} shards"
    if kind == "skipped_lines":
        return f"skipped {event.get('count')} bad dataset lines, first: {event.get('first')}"
    if kind == "first_step":  # seconds per phase before the job's first step, and their total
        phases = dict(event.get("seconds") or {})
        total = phases.pop("total", None)
        parts = ", ".join(f"{name} {_fmt(v, '.2f')} s" for name, v in phases.items())
        return f"first step after {_fmt(total, '.2f')} s ({parts})"
    if kind in ("cancel_requested", "interrupted"):
        return kind.replace("_", " ")
    return None


def generation_line(p: dict[str, Any]) -> str:
    """A regeneration's progress (a `generate` event, or a job's progress.data)."""
    eta = p.get("eta_seconds")  # absent once the job is not running: nothing is left to estimate
    return (
        f"prompts {p.get('prompts_done')}/{p.get('prompts_total')}  rows {p.get('rows_done')}/{p.get('rows_total')}"
        f"  {p.get('tokens_generated')} tokens  {_fmt(p.get('tokens_per_second'), ',.0f')} tok/s"
        + (f"  ETA {duration(eta)}" if eta is not None else "")
    )


def _client(args: argparse.Namespace) -> DaemonClient:
    return DaemonClient(args.url, args.token)


def cmd_submit(args: argparse.Namespace) -> int:
    spec = read_json_object(Path(args.job_file))
    if args.name:
        spec["name"] = args.name
    if args.submission_id:
        spec["submission_id"] = args.submission_id
    with _client(args) as client:
        status, job = client.submit(spec)
        verb = "queued" if status == 202 else "already submitted"
        print(f"{job['id']} {verb} ({job['state']})")
        if not args.follow:
            return 0
        job = follow_job(client, job["id"])
        _print_outcome(job)
        return EXIT_CODES.get(job["state"], 1)


def _print_outcome(job: dict[str, Any]) -> None:
    p = job["progress"]
    print(f"{job['id']} {job['state']} at step {p['step']}/{p['total_steps'] or '-'}")
    if p.get("last_checkpoint"):
        print(f"checkpoint: {p['last_checkpoint']}")
    if p.get("eval_acceptance_length") is not None:
        print(f"eval acceptance length: {p['eval_acceptance_length']:.3f}")
    if job.get("error"):
        print(f"error: {job['error']}")


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.job_id is not None:
            job = client.job(args.job_id)
            if args.json:
                print(json.dumps(job, indent=2))
            else:
                p = job["progress"]
                print(f"id          {job['id']}\nname        {job['name'] or '-'}\nstate       {job['state']}")
                if job.get("kind") == "regenerate":
                    print(f"kind        regenerate\nprogress    {generation_line(p.get('data') or {})}")
                    print(f"output      {job['output_dir']}")
                    if job.get("error"):
                        print(f"error       {job['error']}")
                    return 0
                print(f"step        {p['step']}/{p['total_steps'] or '?'}\nloss        {_fmt(p['loss'], '.4f')}")
                print(f"tokens/s    {_fmt(p['tokens_per_second'], ',.0f')}\ncheckpoint  {p['last_checkpoint'] or '-'}")
                print(f"eval tau    {_fmt(p['eval_acceptance_length'], '.3f')}\noutput      {job['output_dir']}")
                if job.get("published"):  # a continual job's newest version
                    v = job["published"]
                    print(f"published   v{v['version']:06d} tau {_fmt(v['tau'], '.3f')} {v['path']}")
                if job.get("error"):
                    print(f"error       {job['error']}")
            return 0
        jobs = client.jobs(state=args.state, limit=args.limit)
        if args.json:
            print(json.dumps(jobs, indent=2))
            return 0
        _, health = client.health()
        print(
            f"daemon {client.url}: {health['status']} ({health.get('phase')}, "
            f"{health.get('drafters_ready')}/{health.get('drafters_total')} drafters)"
        )
        if not jobs:
            print(f"no {args.state.upper()} jobs" if args.state else "no jobs")
            return 0
        print(f"{'ID':<18} {'STATE':<10} {'STEP':>13} {'LOSS':>8} {'TOK/S':>9}  NAME")
        for job in jobs:
            p = job["progress"]
            step = f"{p['step']}/{p['total_steps'] or '?'}"
            print(
                f"{job['id']:<18} {job['state']:<10} {step:>13} {_fmt(p['loss'], '.4f'):>8} "
                f"{_fmt(p['tokens_per_second'], ',.0f'):>9}  {job['name'] or ''}"
            )
        return 0


def _job_state(value: str) -> str:
    if value.upper() not in STATES:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(STATES)}")
    return value.upper()


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return n


def cmd_resume(args: argparse.Namespace) -> int:
    """POST /jobs/{id}/resume; with --follow, the job's progress until it ends."""
    with _client(args) as client:
        job = client.resume(args.job_id)
        print(f"{job['id']} {job['state']}: resumes from its newest checkpoint when its turn comes")
        if not args.follow:
            return EXIT_OK
        job = follow_job(client, job["id"])
        _print_outcome(job)
        return EXIT_CODES.get(job["state"], EXIT_JOB_FAILED)


def cmd_logs(args: argparse.Namespace) -> int:
    """A job's events as lines (like `ray job logs`); with --follow, until the job ends, across
    daemon restarts. The exit code is the job's when it was followed to its end."""
    with _client(args) as client:
        if args.follow:
            # the job as the daemon has it first: a follower reconnects to a daemon that went away
            # (a restart), not to one that never answered, and an unknown id ends here
            client.job(args.job_id)
            job = follow_job(client, args.job_id)
            _print_outcome(job)
            return EXIT_CODES.get(job["state"], EXIT_JOB_FAILED)
        for event in client.events(args.job_id):
            if args.json:
                print(json.dumps(event))
            elif event["kind"] == "step":
                print(progress_line(event))
            elif (message := _event_message(event)) is not None:
                print(message)
        return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.job_id)
        if job["state"] in TERMINAL:
            print(f"{job['id']} {job['state']}")
        else:
            print(f"{job['id']} stops at its next step (a checkpoint is written)")
        return 0
