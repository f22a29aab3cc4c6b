"""Unit tests of the cairn SDK: error mapping, address parsing, the NDJSON and SSE
parsers, and the client against a fake in-process daemon (no root, no cairnd)."""

import base64
import datetime as dt
import json
import os
import re
import threading
import time
import unittest
from unittest import mock

from _support import SANDBOX, SDK_DIR, FakeDaemon, closed_tcp_port, free_unix_path

import cairn
from cairn import errors

REPO = os.path.dirname(os.path.dirname(SDK_DIR))

ALL_CODES = {
    "not_found": cairn.NotFound,
    "already_exists": cairn.AlreadyExists,
    "invalid_argument": cairn.InvalidArgument,
    "failed_precondition": cairn.FailedPrecondition,
    "conflict": cairn.Conflict,
    "unavailable": cairn.Unavailable,
    "resource_exhausted": cairn.ResourceExhausted,
    "permission_denied": cairn.PermissionDenied,
    "internal": cairn.Internal,
    "canceled": cairn.Canceled,
    "deadline_exceeded": cairn.Timeout,
}


def read(*path):
    with open(os.path.join(*path)) as f:
        return f.read()


def problem(status, code, detail="it failed"):
    return json.dumps({"type": "urn:cairn:error:" + code, "title": "t", "status": status, "code": code,
                       "detail": detail}).encode()


class TestErrors(unittest.TestCase):
    def test_every_code_maps_to_its_class(self):
        for code, cls in ALL_CODES.items():
            e = cairn.error_from_problem(418, problem(418, code, "d-" + code))
            self.assertIs(type(e), cls, code)
            self.assertIsInstance(e, cairn.CairnError)
            self.assertEqual(e.code, code)
            self.assertEqual(e.detail, "d-" + code)
            self.assertEqual(str(e), "d-" + code)
            self.assertEqual(e.status, 418)

    def test_codes_match_errdefs(self):
        # Every code errdefs.Code can produce (and the OpenAPI Problem enum) has a class.
        src = read(REPO, "errdefs", "errdefs.go")
        go_codes = set(re.findall(r'return "([a-z_]+)"', src)) - {""}
        self.assertTrue(go_codes)
        self.assertEqual(go_codes, set(ALL_CODES))
        spec = read(REPO, "api", "openapi.yaml")
        enum = re.search(r"code:\s*\n\s*type: string\s*\n\s*enum: \[([^\]]*)\]", spec)
        self.assertIsNotNone(enum)
        self.assertEqual({c.strip() for c in enum.group(1).split(",")}, set(ALL_CODES))

    def test_unauthenticated_401(self):
        e = cairn.error_from_problem(401, problem(401, "permission_denied", "needs a token"))
        self.assertIs(type(e), cairn.Unauthenticated)
        self.assertIsInstance(e, cairn.PermissionDenied)
        self.assertEqual((e.code, e.status), ("permission_denied", 401))

    def test_unknown_code_is_internal_keeping_code(self):
        e = cairn.error_from_problem(500, problem(500, "brand_new"))
        self.assertIs(type(e), cairn.Internal)
        self.assertEqual(e.code, "brand_new")

    def test_non_problem_bodies_by_status(self):
        for status, cls in [(404, cairn.NotFound), (409, cairn.Conflict), (400, cairn.InvalidArgument),
                            (405, cairn.InvalidArgument), (403, cairn.PermissionDenied), (401, cairn.Unauthenticated),
                            (429, cairn.ResourceExhausted), (413, cairn.ResourceExhausted), (502, cairn.Unavailable),
                            (503, cairn.Unavailable), (504, cairn.Timeout), (500, cairn.Internal),
                            (418, cairn.Internal), (412, cairn.FailedPrecondition)]:
            e = cairn.error_from_problem(status, b"<html>proxy says no</html>", "Reason")
            self.assertIs(type(e), cls, status)
            self.assertEqual(e.status, status)
            self.assertIn("proxy says no", e.detail)
        e = cairn.error_from_problem(500, b"\xff\xfe not json")
        self.assertIs(type(e), cairn.Internal)
        e = cairn.error_from_problem(404, json.dumps({"code": 3}).encode())  # code of the wrong type
        self.assertIs(type(e), cairn.NotFound)

    def test_timeout_and_command_failed_carry_results(self):
        r = cairn.RunResult(args=["false"], exit_code=1, stderr_bytes=b"bad thing")
        with self.assertRaises(cairn.CommandFailed) as cm:
            r.check()
        self.assertIs(cm.exception.result, r)
        self.assertIn("bad thing", str(cm.exception))
        self.assertIsInstance(cm.exception, cairn.CairnError)
        t = cairn.Timeout("slow", result=r)
        self.assertEqual((t.code, t.result), ("deadline_exceeded", r))


class TestAddresses(unittest.TestCase):
    def test_parse(self):
        p = cairn.parse_url
        self.assertEqual(p("unix:///run/x.sock"), cairn.Endpoint("unix", socket_path="/run/x.sock"))
        self.assertEqual(p("unix:/run/x.sock").socket_path, "/run/x.sock")
        self.assertEqual(p("/tmp/y.sock").socket_path, "/tmp/y.sock")
        e = p("http://127.0.0.2:7070")
        self.assertEqual((e.scheme, e.host, e.port, e.base_path), ("http", "127.0.0.2", 7070, ""))
        e = p("https://cairn.example/api/")
        self.assertEqual((e.scheme, e.host, e.port, e.base_path), ("https", "cairn.example", None, "/api"))
        self.assertEqual(str(p("http://[::1]:80")), "http://[::1]:80")
        for bad in ["ftp://x", "localhost:8080", "unix://", "http://", ""]:
            with self.assertRaises(cairn.InvalidArgument, msg=bad):
                p(bad)

    def test_default_socket_is_the_go_clients(self):
        src = read(REPO, "client", "client.go")
        m = re.search(r'const DefaultSocket = "([^"]+)"', src)
        self.assertEqual(m.group(1), cairn.DEFAULT_SOCKET)
        with mock.patch.dict(os.environ, {}, clear=True):
            c = cairn.Client()
            self.assertEqual(c.url, "unix://" + cairn.DEFAULT_SOCKET)
            self.assertEqual(c._t.token, "")

    def test_environment(self):
        with mock.patch.dict(os.environ, {"CAIRN_URL": "http://127.0.0.1:9", "CAIRN_TOKEN": " tok \n"}):
            c = cairn.Client()
            self.assertEqual(c.url, "http://127.0.0.1:9")
            self.assertEqual(c._t.token, "tok")
            c2 = cairn.Client("unix:///a.sock", token="other")  # arguments win
            self.assertEqual((c2.url, c2._t.token), ("unix:///a.sock", "other"))


class TestStreams(unittest.TestCase):
    def test_ndjson(self):
        lines = [json.dumps(x).encode() + b"\n" for x in [
            {"type": "started", "handle": "p1"},
            {"type": "stdout", "data": "héllo "},
            {"type": "stderr", "data_base64": base64.b64encode(b"\xff\x00").decode()},
            {"type": "stdout", "data": "world"},
            {"type": "end", "exit": {"code": 3, "exited_at": "2026-01-01T00:00:00Z"}, "stdout_offset": 12,
             "stderr_offset": 2},
            {"type": "stdout", "data": "after the end: ignored"},
        ]]
        got = list(cairn.parse_ndjson(iter([b"\n"] + lines)))
        self.assertEqual([c.type for c in got], ["started", "stdout", "stderr", "stdout", "end"])
        self.assertEqual(got[0].handle, "p1")
        self.assertEqual(got[1].data, "héllo ".encode())
        self.assertEqual(got[2].data, b"\xff\x00")
        self.assertEqual((got[4].exit["code"], got[4].stdout_offset, got[4].stderr_offset), (3, 12, 2))

    def test_ndjson_error_line(self):
        lines = [b'{"type":"started","handle":"p"}\n',
                 b'{"type":"error","code":"unavailable","detail":"cairnd is shutting down"}\n']
        with self.assertRaises(cairn.Unavailable) as cm:
            list(cairn.parse_ndjson(iter(lines)))
        self.assertEqual((cm.exception.status, cm.exception.detail), (200, "cairnd is shutting down"))

    def test_ndjson_broken(self):
        with self.assertRaises(cairn.Unavailable):
            list(cairn.parse_ndjson(iter([b'{"type":"stdout","data":"x"}\n'])))  # no end line
        with self.assertRaises(cairn.Unavailable):
            list(cairn.parse_ndjson(iter([b'{"type":"stdout",\n'])))
        with self.assertRaises(cairn.Unavailable):
            list(cairn.parse_ndjson(iter([b'[1,2]\n'])))

    def test_sse(self):
        text = (": cairnd events\n\n"
                "id: 1\nevent: created\ndata: {\"seq\":1}\n\n"
                ": keepalive\n\n"
                "id: 2\r\nevent: checkpointed\r\ndata: line1\r\ndata:line2\r\n\r\n"
                "data: no event name\n\n"
                "event: lagged\ndata: {}\n\n"
                "event: unterminated\ndata: dropped\n")
        got = list(cairn.parse_sse(iter(text.encode().splitlines(keepends=True))))
        self.assertEqual([(m.event, m.data, m.id) for m in got], [
            ("created", '{"seq":1}', "1"), ("checkpointed", "line1\nline2", "2"),
            ("message", "no event name", "2"), ("lagged", "{}", "2")])

    def test_parse_time(self):
        t = cairn.parse_time("2026-01-02T03:04:05.123456789Z")
        self.assertEqual(t, dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.timezone.utc))
        t = cairn.parse_time("2026-01-02T03:04:05+02:00")
        self.assertEqual(t.utcoffset(), dt.timedelta(hours=2))
        self.assertIsNone(cairn.parse_time(""))


class FakeTestCase(unittest.TestCase):
    tcp = False

    def setUp(self):
        self.fake = FakeDaemon(tcp=self.tcp)
        self.addCleanup(self.fake.close)
        self.c = cairn.Client(self.fake.url, token="sekret" if self.tcp else None, timeout=10)
        self.addCleanup(self.c.close)


class TestFakeUnix(FakeTestCase):
    def test_create_and_fields(self):
        @self.fake.route("POST", "/v1/sandboxes")
        def _(h, req):
            h.send_json(201, dict(SANDBOX, labels=req.json()["labels"]))

        sb = self.c.create(template="debian", ttl=600, labels={"run": "r42"}, session="s-1", run="r42",
                           limits={"memory_bytes": 1 << 30}, idle_timeout=-1, expiry_policy="pause")
        body = self.fake.requests[0].json()
        self.assertEqual(body, {"template": "debian", "labels": {"run": "r42"}, "limits": {"memory_bytes": 1 << 30},
                                "session_id": "s-1", "run_id": "r42", "ttl_seconds": 600,
                                "expiry_policy": "pause", "idle_timeout_seconds": -1})
        self.assertEqual(self.fake.requests[0].headers["Content-Type"], "application/json")
        self.assertNotIn("Authorization", self.fake.requests[0].headers)
        self.assertEqual((sb.id, sb.state, sb.labels, sb.session_id), ("sb1", "running", {"run": "r42"}, "s-1"))
        self.assertEqual(sb.created_at.microsecond, 123456)
        with self.assertRaises(cairn.InvalidArgument):
            self.c.create(ttl=1.5)

    def test_list_query(self):
        @self.fake.route("GET", "/v1/sandboxes")
        def _(h, req):
            h.send_json(200, {"sandboxes": [SANDBOX, dict(SANDBOX, id="sb2")]})

        got = self.c.list(labels={"a": "1", "b": "x=y"}, session="s", run="r", state="running")
        self.assertEqual([s.id for s in got], ["sb1", "sb2"])
        q = self.fake.requests[0].query
        self.assertEqual(sorted(q["label"]), ["a=1", "b=x=y"])
        self.assertEqual((q["session"], q["run"], q["state"]), (["s"], ["r"], ["running"]))
        self.c.list()
        self.assertEqual(self.fake.requests[1].query, {})

    def test_problems_raise_typed_errors(self):
        @self.fake.route("GET", "/v1/sandboxes/missing")
        def _(h, req):
            h.problem(404, "not_found", 'sandbox "missing" not found')

        @self.fake.route("POST", "/v1/sandboxes/sb1/rollback")
        def _(h, req):
            h.problem(409, "conflict", "a rollback is in progress")

        with self.assertRaises(cairn.NotFound) as cm:
            self.c.get("missing")
        self.assertEqual((cm.exception.code, cm.exception.status), ("not_found", 404))
        self.assertIn("missing", cm.exception.detail)
        with self.assertRaises(cairn.Conflict):
            self.c.sandbox("sb1").rollback("ck1")
        self.assertEqual(self.fake.requests[-1].json(), {"checkpoint": "ck1"})

    def test_path_escaping(self):
        @self.fake.route("GET", "*")
        def _(h, req):
            h.problem(404, "not_found", h.path)

        with self.assertRaises(cairn.NotFound) as cm:
            self.c.get("a/b?c")
        self.assertIn("/v1/sandboxes/a%2Fb%3Fc", cm.exception.detail)

    def test_run_streams_output(self):
        seen = []

        @self.fake.route("POST", "/v1/sandboxes/sb1/exec")
        def _(h, req):
            self.assertEqual(h.headers["Accept"], "application/x-ndjson")
            h.ndjson([{"type": "started", "handle": "p1"},
                      {"type": "stdout", "data": "1\n"},
                      {"type": "stderr", "data": "warn\n"},
                      {"type": "stdout", "data_base64": base64.b64encode("é".encode()[:1]).decode()},
                      {"type": "stdout", "data_base64": base64.b64encode("é".encode()[1:] + b"\n").decode()},
                      {"type": "end", "exit": {"code": 2, "exited_at": "2026-01-01T00:00:00Z"}}])

        sb = self.c.sandbox("sb1")
        r = sb.run("pytest -q", env={"A": "1"}, cwd="/w", stdin="input", timeout=120,
                   on_stdout=seen.append)
        self.assertEqual(self.fake.requests[0].json(), {"args": ["sh", "-c", "pytest -q"], "env": ["A=1"],
                                                        "cwd": "/w", "stdin": "input", "timeout_seconds": 120.0})
        self.assertEqual((r.exit_code, r.stdout, r.stderr, r.handle, r.ok), (2, "1\né\n", "warn\n", "p1", False))
        self.assertEqual("".join(seen), "1\né\n")
        with self.assertRaises(cairn.CommandFailed):
            sb.run(["python3", "-c", "x"], check=True)
        self.assertEqual(self.fake.requests[1].json(), {"args": ["python3", "-c", "x"]})

    def test_run_timeout_raises_timeout_with_partial_result(self):
        @self.fake.route("POST", "/v1/sandboxes/sb1/exec")
        def _(h, req):
            h.ndjson([{"type": "started", "handle": "p1"}, {"type": "stdout", "data": "partial"},
                      {"type": "end", "exit": {"code": 137, "signal": 9, "exited_at": "2026-01-01T00:00:00Z"},
                       "timed_out": True}])

        with self.assertRaises(cairn.Timeout) as cm:
            self.c.sandbox("sb1").run("sleep 100", timeout=1)
        r = cm.exception.result
        self.assertEqual((r.stdout, r.exit_code, r.signal, r.timed_out), ("partial", 137, 9, True))

    def test_run_in_band_error_and_broken_stream(self):
        @self.fake.route("POST", "/v1/sandboxes/sb1/exec")
        def _(h, req):
            if req.json()["args"][-1] == "err":
                h.ndjson([{"type": "started", "handle": "p1"},
                          {"type": "error", "code": "unavailable", "detail": "cairnd is shutting down"}])
            else:
                h.ndjson([{"type": "started", "handle": "p1"}, {"type": "stdout", "data": "x"}], end=False)

        sb = self.c.sandbox("sb1")
        with self.assertRaises(cairn.Unavailable) as cm:
            sb.run("err")
        self.assertIn("shutting down", cm.exception.detail)
        with self.assertRaises(cairn.Unavailable):
            sb.run("cut")

    def test_run_before_start_problem(self):
        @self.fake.route("POST", "/v1/sandboxes/sb1/exec")
        def _(h, req):
            h.problem(412, "failed_precondition", "sandbox sb1 is stopped")

        with self.assertRaises(cairn.FailedPrecondition):
            self.c.sandbox("sb1").run("true")

    def test_process_io(self):
        out = b"line1\nline2\nmark!rest"

        @self.fake.route("POST", "/v1/sandboxes/sb1/processes")
        def _(h, req):
            h.send_json(201, {"handle": "p1", "pid": 5, "args": req.json()["args"], "running": True,
                              "started_at": "2026-01-01T00:00:00Z"})

        @self.fake.route("POST", "/v1/sandboxes/sb1/processes/p1/stdin")
        def _(h, req):
            h.no_content()

        @self.fake.route("POST", "/v1/sandboxes/sb1/processes/p1/signal")
        def _(h, req):
            h.no_content()

        @self.fake.route("GET", "/v1/sandboxes/sb1/processes/p1/output")
        def _(h, req):
            self.assertEqual(req.query["stream"], ["stdout"])
            off = int(req.query["stdout_offset"][0])
            h.ndjson(([{"type": "stdout", "data": out[off:].decode()}] if off < len(out) else []) +
                     [{"type": "end", "stdout_offset": max(off, len(out))}])

        @self.fake.route("POST", "/v1/sandboxes/sb1/processes/p1/wait")
        def _(h, req):
            ex = {"code": 0, "exited_at": "2026-01-01T00:00:01Z"} if "timeout_seconds" not in req.query else None
            h.send_json(200, dict({"handle": "p1", "pid": 5, "args": ["x"], "running": ex is None,
                                   "started_at": "2026-01-01T00:00:00Z"}, **({"exit": ex} if ex else {})))

        p = self.c.sandbox("sb1").spawn(["python3", "-i", "-u"])
        self.assertEqual((p.handle, p.pid, p.args, p.running), ("p1", 5, ["python3", "-i", "-u"], True))
        p.send("x = 1\n")
        p.send(b"\x00\xff", eof=True)
        p.close_stdin()
        bodies = [r.json() for r in self.fake.requests if r.path.endswith("/stdin")]
        self.assertEqual(bodies, [{"data": "x = 1\n"}, {"data_base64": "AP8=", "eof": True}, {"eof": True}])
        self.assertEqual(p.read_until("\n"), "line1\n")
        self.assertEqual(p.read(), "line2\nmark!rest")
        self.assertEqual(p.read(), "")
        self.assertEqual(p.output, out.decode())
        p.signal("INT")
        p.kill()
        import signal
        p.signal(signal.SIGTERM)
        sigs = [r.json()["signal"] for r in self.fake.requests if r.path.endswith("/signal")]
        self.assertEqual(sigs, ["INT", "KILL", "15"])
        with self.assertRaises(cairn.Timeout):
            p.wait(timeout=0.2)
        self.assertEqual(p.wait().code, 0)
        self.assertEqual(p.returncode, 0)

    def test_files(self):
        store = {}

        @self.fake.route("PUT", "/v1/sandboxes/sb1/files/content")
        def _(h, req):
            store[req.query["path"][0]] = req.body
            self.assertEqual(req.headers["Content-Type"], "application/octet-stream")
            h.send_json(200, {"name": "f", "path": req.query["path"][0], "size": len(req.body),
                              "mode": "-rwxr-xr-x" if req.query.get("mode") == ["755"] else "-rw-r--r--",
                              "is_dir": False, "mod_time": "2026-01-01T00:00:00Z"})

        @self.fake.route("GET", "/v1/sandboxes/sb1/files/content")
        def _(h, req):
            b = store[req.query["path"][0]]
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", str(len(b)))
            h.end_headers()
            h.wfile.write(b)

        @self.fake.route("GET", "/v1/sandboxes/sb1/files/stat")
        def _(h, req):
            h.problem(404, "not_found", "no such file")

        fs = self.c.sandbox("sb1").files
        fi = fs.write("/a/b.sh", "#!/bin/sh\n", mode=0o755)
        self.assertEqual((fi.size, fi.mode), (10, "-rwxr-xr-x"))
        fs.write("/bin.dat", b"\x00\x01\xff")
        self.assertEqual(fs.read("/bin.dat"), b"\x00\x01\xff")
        self.assertEqual(fs.read_text("/a/b.sh"), "#!/bin/sh\n")
        self.assertFalse(fs.exists("/nope"))

    def test_events(self):
        release = threading.Event()

        @self.fake.route("GET", "/v1/events")
        def _(h, req):
            self.assertEqual(sorted(req.query["sandbox"]), ["a", "b"])
            self.assertEqual(req.query["type"], ["checkpointed"])
            self.assertEqual(req.query["label"], ["k=v"])
            h.start_chunked("text/event-stream")
            h.chunk(": cairnd events\n\n")
            release.wait(5)
            h.chunk('id: 7\nevent: checkpointed\ndata: {"seq":7,"type":"checkpointed","time":'
                    '"2026-01-01T00:00:00Z","sandbox_id":"a","checkpoint":"c1","labels":{"k":"v"}}\n\n')
            h.chunk(": keepalive\n\n")
            h.chunk("event: lagged\ndata: {}\n\n")
            h.end_chunked()

        with self.c.events(sandbox=["a", self.c.sandbox("b")], labels={"k": "v"}, types=["checkpointed"],
                           timeout=10) as ev:
            release.set()  # the subscription exists once events() returned
            e = next(ev)
            self.assertEqual((e.seq, e.type, e.sandbox_id, e.checkpoint, e.labels), (7, "checkpointed", "a", "c1",
                                                                                      {"k": "v"}))
            with self.assertRaises(cairn.Unavailable):
                next(ev)
            with self.assertRaises(StopIteration):
                next(ev)

    def test_events_end_and_timeout(self):
        @self.fake.route("GET", "/v1/events")
        def _(h, req):
            h.start_chunked("text/event-stream")
            if req.query.get("session") == ["slow"]:
                time.sleep(2)
            h.end_chunked()

        self.assertEqual(list(self.c.events()), [])
        with self.assertRaises(cairn.Timeout):
            next(self.c.events(session="slow", timeout=0.3))

    def test_tree_and_checkpoints(self):
        cks = [{"id": "c1", "sandbox_id": "sb1", "label": "base", "created_at": "2026-01-01T00:00:00Z",
                "fs_volume": "v", "images": "i", "image_bytes": 5_000_000, "duration_ms": 80, "method": "criu"},
               {"id": "c2", "sandbox_id": "sb1", "parent": "c1", "created_at": "2026-01-01T00:00:01Z",
                "fs_volume": "v", "images": "i", "image_bytes": 6_000_000, "duration_ms": 90, "method": "criu"},
               {"id": "c3", "sandbox_id": "sb1", "parent": "c1", "label": "alt", "created_at": "2026-01-01T00:00:02Z",
                "fs_volume": "v", "images": "i", "image_bytes": 7_000_000, "duration_ms": 95, "method": "criu"}]

        @self.fake.route("GET", "/v1/sandboxes/sb1/tree")
        def _(h, req):
            h.send_json(200, {"sandbox": "sb1", "head": "c3", "checkpoints": cks})

        @self.fake.route("POST", "/v1/checkpoints/c3/fork")
        def _(h, req):
            h.send_json(201, {"sandboxes": [dict(SANDBOX, id="k%d" % i, origin="c3")
                                            for i in range(req.json()["count"])]})

        t = self.c.tree("sb1")
        self.assertEqual([c.id for c in t], ["c1", "c2", "c3"])
        self.assertEqual([c.id for c in t.children("c1")], ["c2", "c3"])
        self.assertEqual(t.find("alt")[0].image_bytes, 7_000_000)
        text = str(t)
        self.assertIn("'base'", text)
        self.assertIn("<- head", text)
        kids = t.get("c3").fork(count=3, labels={"x": "y"}, ttl=60)
        self.assertEqual([k.id for k in kids], ["k0", "k1", "k2"])
        self.assertEqual(self.fake.requests[-1].json(), {"count": 3, "labels": {"x": "y"}, "ttl_seconds": 60})
        with self.assertRaises(cairn.InvalidArgument):
            t.get("c3").fork(count=0)

    def test_prewarm_and_standbys(self):
        ready = {"c1": 1}

        @self.fake.route("POST", "/v1/checkpoints/c1/prewarm")
        def _(h, req):
            ready["c1"] += req.json()["count"]
            h.send_json(200, {"checkpoint": "c1", "standbys": ready["c1"]})

        @self.fake.route("GET", "/v1/checkpoints/c1/standbys")
        def _(h, req):
            h.send_json(200, {"checkpoint": "c1", "standbys": ready["c1"]})

        @self.fake.route("POST", "/v1/checkpoints/gone/prewarm")
        def _(h, req):
            h.problem(404, "not_found", 'checkpoint "gone" not found')

        self.assertEqual(self.c.prewarm("c1"), 2)
        self.assertEqual(self.fake.requests[-1].json(), {"count": 1})
        ck = cairn.Checkpoint(self.c, {"id": "c1"})
        self.assertEqual(ck.prewarm(count=16), 18)
        self.assertEqual(self.fake.requests[-1].json(), {"count": 16})
        self.assertEqual(self.c.standbys("c1"), 18)
        self.assertEqual(ck.standbys(), 18)
        self.assertEqual(self.fake.requests[-1].method, "GET")
        with self.assertRaises(cairn.NotFound):
            self.c.prewarm("gone", 2)
        sent = len(self.fake.requests)
        for bad in (0, -1, 257):
            with self.assertRaises(cairn.InvalidArgument):
                self.c.prewarm("c1", bad)
        self.assertEqual(len(self.fake.requests), sent)  # refused before asking the daemon

    def test_keepalive_reuse_and_stale_connections(self):
        @self.fake.route("GET", "/v1/health")
        def _(h, req):
            h.send_json(200, {"status": "ok", "version": "t", "uptime_seconds": 1, "data_dir": "/d",
                              "sandboxes": 0})
            if req.query.get("drop") == ["1"]:
                h.close_connection = True  # close the kept-alive connection behind the client's back

        self.assertEqual(self.c.health().status, "ok")
        self.assertEqual(len(self.c._t._idle), 1)
        conn = self.c._t._idle[0]
        self.assertEqual(self.c._t.call("GET", "/v1/health", query={"drop": "1"})["status"], "ok")
        self.assertIs(self.c._t._idle[0], conn)  # reused, and now closed by the server
        time.sleep(0.1)
        self.assertEqual(self.c.health().status, "ok")  # retried on a new connection
        self.assertEqual(len([r for r in self.fake.requests if r.path == "/v1/health"]), 3)


class TestFakeTCP(FakeTestCase):
    tcp = True

    def test_bearer_token(self):
        @self.fake.route("GET", "/v1/templates")
        def _(h, req):
            if req.headers.get("Authorization") != "Bearer sekret":
                return h.problem(401, "permission_denied", "needs a token")
            h.send_json(200, {"templates": [{"name": "debian", "volume": "t/d", "source": "s", "bytes": 1,
                                             "created_at": "2026-01-01T00:00:00Z"}]})

        self.assertEqual([t.name for t in self.c.templates()], ["debian"])
        with cairn.Client(self.fake.url, token="wrong") as c2:
            with self.assertRaises(cairn.Unauthenticated) as cm:
                c2.templates()
        self.assertEqual(cm.exception.status, 401)
        with mock.patch.dict(os.environ, {"CAIRN_TOKEN": ""}), cairn.Client(self.fake.url) as c3:
            with self.assertRaises(cairn.PermissionDenied):
                c3.templates()


class TestNoDaemon(unittest.TestCase):
    def test_unreachable(self):
        with self.assertRaises(cairn.Unavailable) as cm:
            cairn.Client("unix://" + free_unix_path(self)).health()
        self.assertIn("is cairnd running?", cm.exception.detail)
        self.assertIsNone(cm.exception.status)
        with self.assertRaises(cairn.Unavailable):
            cairn.Client("http://127.0.0.1:%d" % closed_tcp_port()).list()


class TestPublicSurface(unittest.TestCase):
    def test_docstrings(self):
        missing = []
        for name in cairn.__all__:
            obj = getattr(cairn, name)
            if isinstance(obj, str):
                continue
            if not (getattr(obj, "__doc__", None) or "").strip():
                missing.append(name)
            if isinstance(obj, type):
                for attr, v in vars(obj).items():
                    if attr.startswith("_") or not (callable(v) or isinstance(v, property)):
                        continue
                    if not (getattr(v, "__doc__", None) or "").strip():
                        missing.append("%s.%s" % (name, attr))
        self.assertEqual(missing, [])

    def test_error_classes(self):
        for name in ["CairnError", "NotFound", "AlreadyExists", "InvalidArgument", "FailedPrecondition", "Conflict",
                     "Unavailable", "ResourceExhausted", "PermissionDenied", "Unauthenticated", "Internal", "Timeout"]:
            self.assertTrue(issubclass(getattr(cairn, name), cairn.CairnError), name)
        self.assertTrue(issubclass(errors.CairnError, Exception))


if __name__ == "__main__":
    unittest.main()
