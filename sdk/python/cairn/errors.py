"""Typed exceptions of the cairn SDK.

cairnd reports every error as an RFC 9457 problem (``application/problem+json``) whose
``code`` is one of cairn's error classes (Go: ``errdefs.Code``). The SDK raises one
exception class per code, all subclasses of :class:`CairnError`::

    try:
        c.get("nope")
    except cairn.NotFound as e:
        print(e.code, e.status, e.detail)   # not_found 404 sandbox "nope" not found ...

Switch on the class (or ``e.code``), never on ``e.detail``: the detail is for people.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Type

__all__ = [
    "CairnError",
    "NotFound",
    "AlreadyExists",
    "InvalidArgument",
    "FailedPrecondition",
    "Conflict",
    "Unavailable",
    "ResourceExhausted",
    "PermissionDenied",
    "Unauthenticated",
    "Internal",
    "Timeout",
    "Canceled",
    "CommandFailed",
    "error_from_problem",
    "error_for_code",
    "code_of_status",
]


class CairnError(Exception):
    """Base class of every error the SDK raises.

    Attributes:
        code: the stable machine-readable code ("not_found", "conflict", ...).
        status: the HTTP status of the response (200 for an error reported inside an
            output stream, None for errors that never reached the daemon).
        detail: what failed and what to do about it (for people, not for matching).
    """

    #: The problem code this class stands for (the default of ``.code``).
    default_code: str = "internal"

    def __init__(self, detail: str = "", code: Optional[str] = None, status: Optional[int] = None):
        super().__init__(detail)
        self.detail = detail
        self.code = code if code is not None else self.default_code
        self.status = status

    def __str__(self) -> str:
        return self.detail or self.code

    def __repr__(self) -> str:
        return "%s(code=%r, status=%r, detail=%r)" % (type(self).__name__, self.code, self.status, self.detail)


class NotFound(CairnError):
    """The sandbox, checkpoint, process, file or template does not exist (404)."""

    default_code = "not_found"


class AlreadyExists(CairnError):
    """Something of that name already exists (409)."""

    default_code = "already_exists"


class InvalidArgument(CairnError):
    """The request is malformed or an argument is out of range (400; 405 for a wrong method)."""

    default_code = "invalid_argument"


class FailedPrecondition(CairnError):
    """The target is in the wrong state for the call, e.g. the sandbox is stopped (412)."""

    default_code = "failed_precondition"


class Conflict(CairnError):
    """The call conflicts with another one in progress or with the current state (409)."""

    default_code = "conflict"


class Unavailable(CairnError):
    """cairnd cannot be reached, is shutting down, or a stream broke before its end (503)."""

    default_code = "unavailable"


class ResourceExhausted(CairnError):
    """A limit was hit: a body too large (413), a pool full, too many sandboxes (429)."""

    default_code = "resource_exhausted"


class PermissionDenied(CairnError):
    """The caller may not do this (403)."""

    default_code = "permission_denied"


class Unauthenticated(PermissionDenied):
    """The bearer token is missing or wrong (401; set CAIRN_TOKEN or ``Client(token=)``).

    A subclass of :class:`PermissionDenied`: its ``code`` is "permission_denied", as the
    daemon sends it; only the status (401) tells the two apart.
    """

    default_code = "permission_denied"


class Internal(CairnError):
    """cairnd failed in a way that is not the caller's fault (500); also unknown codes."""

    default_code = "internal"


class Timeout(CairnError):
    """A deadline passed: ``run(timeout=)`` killed the process, ``wait(timeout=)`` or a
    stream read gave up, or the daemon answered ``deadline_exceeded`` (504).

    For ``run``, ``result`` holds the partial :class:`~cairn.RunResult` (output so far).
    """

    default_code = "deadline_exceeded"

    def __init__(self, detail: str = "", code: Optional[str] = None, status: Optional[int] = None,
                 result: Any = None):
        super().__init__(detail, code, status)
        self.result = result


class Canceled(CairnError):
    """The call was canceled before it finished (code "canceled", status 499)."""

    default_code = "canceled"


class CommandFailed(CairnError):
    """``run(..., check=True)`` (or ``RunResult.check()``) saw a non-zero exit status.

    Not a daemon error: ``code`` is "command_failed" and ``status`` is None; ``result``
    is the :class:`~cairn.RunResult`.
    """

    default_code = "command_failed"

    def __init__(self, detail: str = "", result: Any = None):
        super().__init__(detail, None, None)
        self.result = result


# The codes errdefs.Code produces, each to its class.
_CLASSES: Dict[str, Type[CairnError]] = {
    "not_found": NotFound,
    "already_exists": AlreadyExists,
    "invalid_argument": InvalidArgument,
    "failed_precondition": FailedPrecondition,
    "conflict": Conflict,
    "unavailable": Unavailable,
    "resource_exhausted": ResourceExhausted,
    "permission_denied": PermissionDenied,
    "internal": Internal,
    "canceled": Canceled,
    "deadline_exceeded": Timeout,
}


def error_for_code(code: str, detail: str = "", status: Optional[int] = None) -> CairnError:
    """Return the exception for a problem ``code`` (an unknown code gives :class:`Internal`,
    keeping the code, as Go's ``errdefs.FromCode`` does). Status 401 gives
    :class:`Unauthenticated`."""
    if status == 401:
        return Unauthenticated(detail, code or "permission_denied", status)
    cls = _CLASSES.get(code, Internal)
    return cls(detail, code or cls.default_code, status)


def code_of_status(status: int) -> str:
    """Classify a response that is not a problem (a proxy's, say) by its HTTP status,
    as the Go client does."""
    return {
        404: "not_found",
        409: "conflict",
        400: "invalid_argument",
        405: "invalid_argument",
        412: "failed_precondition",
        401: "permission_denied",
        403: "permission_denied",
        429: "resource_exhausted",
        413: "resource_exhausted",
        503: "unavailable",
        502: "unavailable",
        504: "deadline_exceeded",
        499: "canceled",
    }.get(status, "internal")


def error_from_problem(status: int, body: bytes, reason: str = "") -> CairnError:
    """Build the exception of an error response (status >= 400) from its body.

    A problem body (JSON with a ``code``) gives the class of its code; anything else is
    classified by status, with the body in the detail.
    """
    problem: Any = None
    try:
        problem = json.loads(body.decode("utf-8")) if body else None
    except (ValueError, UnicodeDecodeError):
        problem = None
    if isinstance(problem, dict) and isinstance(problem.get("code"), str) and problem["code"]:
        detail = problem.get("detail")
        if not isinstance(detail, str):
            detail = str(detail) if detail is not None else ""
        st = problem.get("status")
        if not isinstance(st, int) or isinstance(st, bool):
            st = status
        return error_for_code(problem["code"], detail, st)
    text = body.decode("utf-8", "replace").strip()[:2000]
    detail = "cairnd: %d %s: %s" % (status, reason, text) if reason else "cairnd: %d: %s" % (status, text)
    return error_for_code(code_of_status(status), detail, status)
