"""Why a request about a job was refused: the HTTP layer answers each with its status."""

from __future__ import annotations


class JobNotFound(KeyError):
    """No job with this id (HTTP 404)."""


class JobConflict(Exception):
    """The request conflicts with the job's state or with another job (HTTP 409)."""


class Unavailable(Exception):
    """The daemon cannot take the request now (HTTP 503)."""
