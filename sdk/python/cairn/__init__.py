"""cairn — the Python SDK of cairnd, cairn's sandbox daemon (standard library only).

Sandboxes whose whole state — the filesystem and every process in it — is
checkpointed, rolled back and forked together::

    from cairn import Client
    c = Client()                               # $CAIRN_URL (+ $CAIRN_TOKEN), else /run/cairn/cairnd.sock
    sb = c.create(template="debian", ttl=600, labels={"run": "r42"})
    repl = sb.spawn(["python3", "-i", "-u"])   # interactive process
    repl.send("import json; data = list(range(10**6))\\n")
    ck = sb.checkpoint(label="loaded")
    r = sb.run("pytest -q", timeout=120)       # r.exit_code, r.stdout, r.stderr
    sb.rollback(ck)                            # files and the REPL's memory are back
    kids = ck.fork(count=16)                   # 16 sandboxes at ck, in parallel
    for k in kids: k.run("python3 step.py")
    print(c.tree(sb.id))                       # lineage with labels, sizes, times

Errors are typed: one exception class per problem code of the API (:class:`NotFound`,
:class:`Conflict`, :class:`InvalidArgument`, ...), all subclasses of :class:`CairnError`.
"""

from ._http import DEFAULT_SOCKET, Endpoint, UnixHTTPConnection, parse_url
from ._streams import Chunk, SSEMessage, parse_ndjson, parse_sse
from .client import Checkpoint, Client, EventStream, Files, Process, Sandbox, Tree
from .errors import (AlreadyExists, CairnError, Canceled, CommandFailed, Conflict, FailedPrecondition, Internal,
                     InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, Timeout, Unauthenticated,
                     Unavailable, error_for_code, error_from_problem)
from .types import (Change, Event, ExitStatus, FileInfo, GCReport, Health, Limits, RunResult, Template,
                    parse_time)

__version__ = "0.1.0"

__all__ = [
    "Client", "Sandbox", "Process", "Checkpoint", "Tree", "Files", "EventStream",
    "RunResult", "ExitStatus", "FileInfo", "Template", "Change", "Event", "Health", "GCReport", "Limits",
    "CairnError", "NotFound", "AlreadyExists", "InvalidArgument", "FailedPrecondition", "Conflict",
    "Unavailable", "ResourceExhausted", "PermissionDenied", "Unauthenticated", "Internal", "Timeout",
    "Canceled", "CommandFailed",
    "DEFAULT_SOCKET", "Endpoint", "UnixHTTPConnection", "parse_url", "parse_time",
    "Chunk", "SSEMessage", "parse_ndjson", "parse_sse", "error_for_code", "error_from_problem",
]
