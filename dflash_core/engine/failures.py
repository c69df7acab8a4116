"""What a run raises, as the user reads it: every run of a job kind executes inside
`readable_failures`, so a failure ends the job with a JobError whose message says what went wrong."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .api import JobError


@contextlib.contextmanager
def readable_failures(out_of_memory_hint: str = "") -> Iterator[None]:
    """Whatever a run raises becomes a JobError the user can read (its own JobErrors pass)."""
    try:
        yield
    except JobError:
        raise
    except torch.OutOfMemoryError as e:
        raise JobError(f"out of memory: {str(e).splitlines()[0]}{out_of_memory_hint}") from e
    except Exception as e:  # noqa: BLE001 - becomes the job's readable failure
        raise JobError(f"{type(e).__name__}: {e}") from e
