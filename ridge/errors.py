"""Errors as a client sees them: a request refused, and internal failures (an error id and a
generic message).

What an exception says (file paths, library versions, other requests' state)
is the operator's to read, not every client's. The exception goes to the log,
with its traceback, under the same id, so a user can quote the id and the
operator can find the failure (`journalctl -u ridge | grep ID`)."""
from __future__ import annotations

import logging
import uuid


def internal_error(log: logging.Logger, what: str, exc: BaseException) -> str:
    """Log `exc` with its traceback under a new error id; -> the message for the client."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s (error id %s)", what, error_id, exc_info=(type(exc), exc, exc.__traceback__))
    return f"internal error; id {error_id}"


class InvalidRequest(ValueError):
    """A request the engine can never serve; rejected at admission."""
