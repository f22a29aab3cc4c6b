"""Shared test helpers: the SDK on sys.path, and a fake cairnd (http.server on a unix
socket or on localhost TCP) whose routes the tests script."""

import json
import os
import socket
import socketserver
import sys
import tempfile
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler

SDK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if SDK_DIR not in sys.path:
    sys.path.insert(0, SDK_DIR)

import cairn  # noqa: E402,F401  (the repository's copy)


class Request:
    """A request the fake server received."""

    def __init__(self, method, path, query, headers, body):
        self.method, self.path, self.query, self.headers, self.body = method, path, query, headers, body

    def json(self):
        return json.loads(self.body.decode()) if self.body else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet (and client_address is "" on a unix socket)
        pass

    def _handle(self):
        u = urllib.parse.urlsplit(self.path)
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        req = Request(self.command, u.path, urllib.parse.parse_qs(u.query, keep_blank_values=True),
                      dict(self.headers), body)
        srv = self.server.fake
        srv.requests.append(req)
        route = srv.routes.get((self.command, u.path)) or srv.routes.get((self.command, "*"))
        if route is None:
            return self.problem(404, "not_found", "no route %s %s" % (self.command, u.path))
        route(self, req)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

    # responses

    def send_json(self, status, obj, ctype="application/json", close=False):
        b = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(b)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b)

    def problem(self, status, code, detail):
        self.send_json(status, {"type": "urn:cairn:error:" + code, "title": "x", "status": status,
                                "code": code, "detail": detail}, "application/problem+json")

    def no_content(self):
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def start_chunked(self, ctype):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data):
        if isinstance(data, str):
            data = data.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_chunked(self):
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def ndjson(self, chunks, end=True):
        self.start_chunked("application/x-ndjson")
        for c in chunks:
            self.chunk(json.dumps(c) + "\n")
        if end:
            self.end_chunked()
        else:
            self.close_connection = True


class _Quiet:
    def handle_error(self, request, client_address):
        # Clients hanging up mid-stream is what some tests do on purpose.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _UnixServer(_Quiet, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _TCPServer(_Quiet, socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class FakeDaemon:
    """A scripted HTTP server: routes[(METHOD, PATH)] = fn(handler, request)."""

    def __init__(self, tcp=False):
        self.routes = {}
        self.requests = []
        if tcp:
            self.server = _TCPServer(("127.0.0.1", 0), Handler)
            self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        else:
            self.dir = tempfile.mkdtemp(prefix="cairn-fake-")
            self.sock = os.path.join(self.dir, "cairnd.sock")
            self.server = _UnixServer(self.sock, Handler)
            self.url = "unix://" + self.sock
        self.server.fake = self
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def route(self, method, path):
        def deco(fn):
            self.routes[(method, path)] = fn
            return fn
        return deco

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        if getattr(self, "sock", None):
            try:
                os.unlink(self.sock)
                os.rmdir(self.dir)
            except OSError:
                pass


SANDBOX = {
    "id": "sb1", "template": "debian", "isolation": "container", "state": "running", "hostname": "sb1",
    "labels": {"run": "r42"}, "limits": {}, "created_at": "2026-01-02T03:04:05.123456789Z", "root": "sandboxes/sb1",
    "init": {"pid": 10, "start_time": 5}, "session_id": "s-1", "expires_at": "2026-01-02T04:04:05Z",
    "expiry_policy": "destroy", "last_activity_at": "2026-01-02T03:04:05Z",
}


def free_unix_path(testcase):
    """A socket path nothing listens on, in a directory removed when testcase ends."""
    d = tempfile.mkdtemp(prefix="cairn-none-")
    testcase.addCleanup(os.rmdir, d)
    return os.path.join(d, "nobody.sock")


def closed_tcp_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
