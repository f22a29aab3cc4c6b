"""Parsers of cairnd's two streaming formats, over iterables of lines (bytes):

* NDJSON output streams (``POST .../exec``, ``GET .../output``): one Chunk JSON object
  per line; the last line is of type ``end`` or ``error``.
* Server-sent events (``GET /v1/events``): ``id:``/``event:``/``data:`` fields, blank
  line terminated; ``:`` comment lines are keepalives; ``event: lagged`` ends a stream
  whose client fell behind.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, Optional

from .errors import Unavailable, error_for_code


@dataclass
class Chunk:
    """One line of an NDJSON output stream.

    ``type`` is "started" (with ``handle``), "stdout"/"stderr" (with ``data`` as bytes),
    "end" (with ``exit``, ``timed_out`` and the offsets reached) or "error" (with
    ``code`` and ``detail``).
    """

    type: str
    handle: str = ""
    data: bytes = b""
    exit: Optional[Dict[str, Any]] = None
    timed_out: bool = False
    stdout_offset: int = 0
    stderr_offset: int = 0
    code: str = ""
    detail: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Chunk":
        """Build a Chunk from its decoded JSON object."""
        data = b""
        if d.get("data_base64"):
            data = base64.b64decode(d["data_base64"])
        elif d.get("data"):
            data = str(d["data"]).encode("utf-8")
        return cls(type=str(d.get("type", "")), handle=d.get("handle") or "", data=data,
                   exit=d.get("exit"), timed_out=bool(d.get("timed_out")),
                   stdout_offset=int(d.get("stdout_offset") or 0), stderr_offset=int(d.get("stderr_offset") or 0),
                   code=d.get("code") or "", detail=d.get("detail") or "", raw=d)


def parse_ndjson(lines: Iterable[bytes], where: str = "cairnd") -> Iterator[Chunk]:
    """Yield the Chunks of an NDJSON stream up to and including its ``end`` line.

    An ``error`` line raises the typed error of its code (status 200: the stream's); a
    stream that ends before its end line, or a line that is not JSON, raises
    :class:`Unavailable`.
    """
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise Unavailable("%s: bad line in the output stream: %s" % (where, e), status=None) from None
        if not isinstance(d, dict):
            raise Unavailable("%s: bad line in the output stream: %r" % (where, line[:200]), status=None)
        ch = Chunk.from_json(d)
        if ch.type == "error":
            raise error_for_code(ch.code or "internal", ch.detail, 200)
        yield ch
        if ch.type == "end":
            return
    raise Unavailable("%s: the output stream broke before its end" % where, status=None)


@dataclass
class SSEMessage:
    """One server-sent event: its ``id``, ``event`` type and ``data`` (lines joined with \\n)."""

    event: str = "message"
    data: str = ""
    id: str = ""


def parse_sse(lines: Iterable[bytes]) -> Iterator[SSEMessage]:
    """Yield the events of a ``text/event-stream`` (comments and empty events skipped).

    Follows the SSE rules cairnd uses: a field is ``name: value`` (one optional space
    after the colon), data lines accumulate, a blank line dispatches. A final event not
    terminated by a blank line is dropped, as browsers do.
    """
    ev, data, eid, has_data = "", [], "", False
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line == "":
            if has_data:
                yield SSEMessage(event=ev or "message", data="\n".join(data), id=eid)
            ev, data, has_data = "", [], False
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            ev = value
        elif name == "data":
            data.append(value)
            has_data = True
        elif name == "id":
            eid = value


def iter_lines(resp: Any) -> Iterator[bytes]:
    """The lines of an http.client response as they arrive (works with chunked bodies)."""
    while True:
        line = resp.readline()
        if not line:
            return
        yield line
