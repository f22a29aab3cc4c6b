"""HTTP transport of the cairn SDK: address parsing, a unix-socket HTTPConnection, a small
connection pool, and requests that raise the SDK's typed errors. Standard library only."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import CairnError, InvalidArgument, Timeout, Unavailable, error_from_problem

#: The daemon's default unix socket (the same as the Go client's ``client.DefaultSocket``).
DEFAULT_SOCKET = "/run/cairn/cairnd.sock"

#: Query values: a mapping of name to a value or a list of values (repeated parameters).
Query = Optional[Mapping[str, Union[str, int, float, bool, Sequence[str], None]]]


class UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTPConnection over a unix stream socket (the Host header says "cairnd")."""

    def __init__(self, path: str, timeout: Optional[float] = None):
        super().__init__("cairnd", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        """Connect to the unix socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon is: a unix socket path, or an http(s) host with an optional base path."""

    scheme: str  # "unix", "http" or "https"
    socket_path: str = ""
    host: str = ""
    port: Optional[int] = None
    base_path: str = ""

    def __str__(self) -> str:
        if self.scheme == "unix":
            return "unix://" + self.socket_path
        netloc = self.host if self.port is None else "%s:%d" % (self.host, self.port)
        if ":" in self.host and not self.host.startswith("["):
            netloc = "[%s]" % self.host if self.port is None else "[%s]:%d" % (self.host, self.port)
        return "%s://%s%s" % (self.scheme, netloc, self.base_path)


def parse_url(url: str) -> Endpoint:
    """Parse a cairnd address the way the Go client does.

    Accepted: ``unix:///path/to.sock``, ``unix:/path/to.sock``, ``/path/to.sock``,
    ``http://host:port[/base]`` and ``https://host:port[/base]``. Anything else raises
    :class:`InvalidArgument`.
    """
    u = url.strip()
    if u.startswith("unix://"):
        path = u[len("unix://"):]
    elif u.startswith("unix:"):
        path = u[len("unix:"):]
    elif u.startswith("/"):
        path = u
    elif u.startswith("http://") or u.startswith("https://"):
        p = urllib.parse.urlsplit(u)
        if not p.hostname:
            raise InvalidArgument("cairnd URL %r: no host; give http://host:port" % url, status=None)
        try:
            port = p.port
        except ValueError:
            raise InvalidArgument("cairnd URL %r: bad port" % url, status=None) from None
        return Endpoint(scheme=p.scheme, host=p.hostname, port=port, base_path=p.path.rstrip("/"))
    else:
        raise InvalidArgument("cairnd URL %r: give unix:///path/to.sock or http://host:port" % url, status=None)
    if not path:
        raise InvalidArgument("cairnd URL %r: no socket path" % url, status=None)
    return Endpoint(scheme="unix", socket_path=path)


def resolve(url: Optional[str], token: Optional[str]) -> Tuple[Endpoint, str]:
    """The endpoint and token to use: the arguments, else $CAIRN_URL / $CAIRN_TOKEN,
    else the default unix socket (and no token)."""
    u = url or os.environ.get("CAIRN_URL") or ("unix://" + DEFAULT_SOCKET)
    tok = token if token is not None else os.environ.get("CAIRN_TOKEN", "")
    return parse_url(u), (tok or "").strip()


def encode_query(query: Query) -> str:
    """Encode query parameters; list values repeat the parameter, None values are dropped,
    booleans are written true/false."""
    if not query:
        return ""
    pairs: List[Tuple[str, str]] = []
    for k, v in query.items():
        if v is None:
            continue
        vals: Iterable[Any] = v if isinstance(v, (list, tuple)) else [v]
        for x in vals:
            if isinstance(x, bool):
                x = "true" if x else "false"
            pairs.append((k, str(x)))
    return urllib.parse.urlencode(pairs)


def quote(segment: str) -> str:
    """Escape one path segment."""
    return urllib.parse.quote(str(segment), safe="")


# Errors that mean a pooled (reused) connection was closed by the server while idle.
_STALE = (http.client.RemoteDisconnected, http.client.CannotSendRequest, BrokenPipeError,
          ConnectionResetError, ConnectionAbortedError)


class Transport:
    """Sends requests to cairnd and turns error responses into typed exceptions.

    Plain calls reuse idle keep-alive connections (a few, per transport); streams get a
    connection of their own, closed when the stream ends. Safe for use from many threads.
    """

    def __init__(self, endpoint: Endpoint, token: str = "", timeout: Optional[float] = None,
                 max_idle: int = 8):
        self.endpoint = endpoint
        self.token = token
        self.timeout = timeout
        self.max_idle = max_idle
        self._idle: List[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    # -- connections -------------------------------------------------------------------

    def new_connection(self, timeout: Optional[float] = None) -> http.client.HTTPConnection:
        """A new, not yet connected connection to the daemon."""
        ep = self.endpoint
        if ep.scheme == "unix":
            return UnixHTTPConnection(ep.socket_path, timeout=timeout)
        if ep.scheme == "https":
            return http.client.HTTPSConnection(ep.host, ep.port, timeout=timeout)
        return http.client.HTTPConnection(ep.host, ep.port, timeout=timeout)

    def _get(self) -> Tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self.new_connection(self.timeout), False

    def _put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    # -- requests ----------------------------------------------------------------------

    def _headers(self, ctype: Optional[str], accept: str) -> Dict[str, str]:
        h = {"Accept": accept, "User-Agent": "cairn-python"}
        if ctype:
            h["Content-Type"] = ctype
        if self.token:
            h["Authorization"] = "Bearer " + self.token
        return h

    def _target(self, path: str, query: Query) -> str:
        q = encode_query(query)
        return self.endpoint.base_path + path + ("?" + q if q else "")

    @staticmethod
    def _body(json_body: Any, raw: Optional[bytes]) -> Tuple[Optional[bytes], Optional[str]]:
        if raw is not None:
            return raw, "application/octet-stream"
        if json_body is not None:
            return json.dumps(json_body, separators=(",", ":")).encode("utf-8"), "application/json"
        return None, None

    def unavailable(self, err: BaseException, what: str = "") -> CairnError:
        """The error for a daemon that could not be reached or broke a connection."""
        if isinstance(err, socket.timeout):
            return Timeout("cairnd at %s: %sno answer within the timeout" % (self.endpoint, what), status=None)
        hint = " (is cairnd running?)" if isinstance(err, (FileNotFoundError, ConnectionRefusedError)) else ""
        return Unavailable("cairnd at %s: %s%s%s" % (self.endpoint, what, err or type(err).__name__, hint), status=None)

    def request(self, method: str, path: str, query: Query = None, json_body: Any = None,
                raw: Optional[bytes] = None, accept: str = "application/json") -> Tuple[int, bytes]:
        """Perform a plain request; return (status, body) of a successful response or raise
        the typed error of a failed one."""
        body, ctype = self._body(json_body, raw)
        headers = self._headers(ctype, accept)
        target = self._target(path, query)
        for attempt in (0, 1):
            conn, reused = self._get()
            try:
                conn.request(method, target, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except _STALE as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # the server closed the idle connection: retry on a new one
                raise self.unavailable(e) from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise self.unavailable(e) from None
            if resp.will_close:
                conn.close()
            else:
                self._put(conn)
            if resp.status >= 400:
                raise error_from_problem(resp.status, data, resp.reason)
            return resp.status, data
        raise AssertionError("unreachable")

    def call(self, method: str, path: str, query: Query = None, json_body: Any = None,
             raw: Optional[bytes] = None) -> Any:
        """Perform a request and decode its JSON response (None for an empty body)."""
        _, data = self.request(method, path, query=query, json_body=json_body, raw=raw)
        if not data.strip():
            return None
        try:
            return json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise Unavailable("cairnd at %s: the response is not JSON: %s" % (self.endpoint, e), status=None) from None

    def open_stream(self, method: str, path: str, query: Query = None, json_body: Any = None,
                    timeout: Optional[float] = None,
                    accept: str = "application/x-ndjson") -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Start a streaming request on a connection of its own and return it with the
        response once its headers arrived (an error response raises). ``timeout`` bounds
        every socket operation (None: wait as long as it takes). Close the connection when
        done."""
        body, ctype = self._body(json_body, None)
        conn = self.new_connection(timeout)
        try:
            conn.request(method, self._target(path, query), body=body, headers=self._headers(ctype, accept))
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self.unavailable(e) from None
        if resp.status >= 400:
            try:
                data = resp.read()
            except (OSError, http.client.HTTPException):
                data = b""
            conn.close()
            raise error_from_problem(resp.status, data, resp.reason)
        return conn, resp
