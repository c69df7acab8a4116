"""A small HTTP client of the daemon, shared by the CLI and the demo."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class DaemonError(RuntimeError):
    """The daemon answered with an error; the message is the daemon's `detail`."""

    def __init__(self, status: int, detail: str):
        self.status = status
        self.detail = detail
        super().__init__(f"HTTP {status}: {detail}")


class BadArgument(ValueError):
    """An argument no request can carry (a job id, a token); the message names it."""


MAX_JOB_ID_CHARS = 256  # far above any id the daemon gives; a longer one is a mistake, not a lookup


def job_path(job_id: str, tail: str = "") -> str:
    """/jobs/{job_id}{tail} with the id as one path segment: percent-encoded, so that no id reaches
    another route (a slash, '?', '#'), and refused where no segment can carry it."""
    if not job_id or job_id in (".", "..") or len(job_id) > MAX_JOB_ID_CHARS:
        raise BadArgument(f"job id {job_id[:40]!r}{'...' if len(job_id) > 40 else ''}: not a job id")
    return f"/jobs/{quote(job_id, safe='')}{tail}"


def _printable(value: str) -> bool:
    return not any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)


def default_url() -> str:
    return os.environ.get("DFLASH_URL", DEFAULT_URL)


def default_token() -> str | None:
    return os.environ.get("DFLASH_AUTH_TOKEN") or None


class DaemonClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or default_url()).rstrip("/")
        # as UTF-8 bytes: httpx encodes str header values as ASCII, and the daemon compares the token's
        # UTF-8 bytes, so a non-ASCII token works end to end; surrounding whitespace is no part of it
        if token and not _printable(token.strip()):
            raise BadArgument("--token: contains a control character (a newline?); a token is one line")
        headers = {b"Authorization": f"Bearer {token.strip()}".encode()} if token and token.strip() else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _check(response: httpx.Response, ok: tuple[int, ...] = (200,)) -> Any:
        if response.status_code not in ok:
            try:
                detail = response.json().get("detail", response.text)
            except (json.JSONDecodeError, AttributeError):
                detail = response.text
            raise DaemonError(response.status_code, str(detail))
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            # something answers at the URL, but not as the daemon does (another server, a proxy's page)
            raise DaemonError(
                response.status_code,
                f"the answer is not the daemon's JSON (is the URL a dflash-trainer daemon?): {response.text[:200]!r}",
            ) from None

    def health(self) -> tuple[int, dict[str, Any]]:
        r = self._http.get("/healthz")
        return r.status_code, self._check(r, ok=(r.status_code,))

    def wait_ready(self, timeout: float, on_progress=None, interval: float = 0.5) -> dict[str, Any]:
        """Poll /healthz until 200; raises DaemonError if the engine failed, TimeoutError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, body = self.health()
            except httpx.TransportError:
                status, body = 0, {"status": "unreachable"}
            if status == 200:
                return body
            if body.get("status") == "failed":
                raise DaemonError(503, f"engine failed: {body.get('error')}")
            if on_progress is not None:
                on_progress(body)
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon at {self.url} not ready after {timeout:.0f} s (last: {body})")
            time.sleep(interval)

    def submit(self, spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        r = self._http.post("/jobs", json=spec)
        return r.status_code, self._check(r, ok=(200, 202))

    def job(self, job_id: str) -> dict[str, Any]:
        return self._check(self._http.get(job_path(job_id)))

    def jobs(self, *, state: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """The jobs, oldest first: only those in `state`, the newest `limit` of them."""
        params = {k: v for k, v in (("state", state), ("limit", limit)) if v is not None}
        return self._check(self._http.get("/jobs", params=params))["jobs"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._check(self._http.post(job_path(job_id, "/cancel")), ok=(200, 202))

    def resume(self, job_id: str) -> dict[str, Any]:
        """A FAILED or STOPPED job back in the queue; it resumes from its newest checkpoint."""
        return self._check(self._http.post(job_path(job_id, "/resume")), ok=(202,))

    def events(self, job_id: str, *, follow: bool = False, after: int = 0) -> Iterator[dict[str, Any]]:
        params = {"follow": "true" if follow else "false", "after": after}
        with self._http.stream(
            "GET", job_path(job_id, "/events"), params=params, timeout=httpx.Timeout(30.0, read=None)
        ) as r:
            if r.status_code != 200:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        raise DaemonError(
                            r.status_code,
                            f"the answer is not the daemon's JSON (is the URL a dflash-trainer daemon?): {line[:200]!r}",
                        ) from None

    def post_records(self, job_id: str, body: bytes) -> tuple[int, dict[str, Any], float]:
        """NDJSON records to a running continual job: (status, answer, Retry-After seconds)."""
        r = self._http.post(
            job_path(job_id, "/records"), content=body, headers={"Content-Type": "application/x-ndjson"}
        )
        try:
            answer = r.json()
        except json.JSONDecodeError:
            answer = {"detail": r.text}
        return r.status_code, answer, float(r.headers.get("Retry-After") or 1)

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        if r.status_code != 200:
            raise DaemonError(r.status_code, r.text)
        return r.text
