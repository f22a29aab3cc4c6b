"""End-to-end tests of the Python SDK against a real cairnd built from this repository.

setUpModule builds cmd/cairnd, cmd/cairn-init and cmd/cairn, imports the default
template from a local rootfs outside CI (else the first create builds it with
debootstrap, ~70 s), and starts cairnd on a private socket (plus a TCP listener with a
bearer token) over the data directory $CAIRN_TEST_DATA_DIR (default
/var/tmp/cairn-test-py). tearDownModule destroys the sandboxes the tests made and stops
the daemon.

Needs root (namespaces, CRIU, btrfs). Outside CI a missing prerequisite skips these
tests with the reason; with CI=true it fails them.

Knobs: CAIRN_TEST_FORKS (forks in the issue example, default 4), CAIRN_TEST_ISOLATION
(gvisor or container; default the daemon's), CAIRN_TEST_ROOTFS (the rootfs imported as
"debian" outside CI; none by default).
"""

import datetime as dt
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import uuid
from concurrent.futures import ThreadPoolExecutor

from _support import SDK_DIR

import cairn

REPO = os.path.dirname(os.path.dirname(SDK_DIR))
CI = os.environ.get("CI") == "true"
DATA_DIR = os.environ.get("CAIRN_TEST_DATA_DIR") or "/var/tmp/cairn-test-py"
FORKS = int(os.environ.get("CAIRN_TEST_FORKS") or 4)
ISOLATION = os.environ.get("CAIRN_TEST_ISOLATION") or None
ROOTFS = os.environ.get("CAIRN_TEST_ROOTFS") or ""
RUN = uuid.uuid4().hex[:12]
LABEL = {"sdk-test": RUN}  # on every sandbox these tests create (forks inherit it)

S = {}  # module state: tmp, proc, log, sock, tcp, token, env, started, failed


def log(msg):
    sys.stderr.write("[e2e] %s\n" % msg)
    sys.stderr.flush()


def _go():
    go = shutil.which("go") or "/usr/local/go/bin/go"
    return go if os.path.exists(go) else None


def _missing():
    if os.geteuid() != 0:
        return "these tests need root (namespaces, CRIU, btrfs)"
    if not _go():
        return "go not found (PATH or /usr/local/go/bin)"
    if not shutil.which("mkfs.btrfs"):
        return "mkfs.btrfs not found (run scripts/install-deps.sh)"
    return ""


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _log_tail(n=60):
    try:
        with open(S["log"], errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except (KeyError, OSError):
        return ""


def setUpModule():
    missing = _missing()
    if missing:
        if CI:
            raise RuntimeError("prerequisite missing in CI: " + missing)
        raise unittest.SkipTest(missing)
    S["started"] = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)
    tmp = S["tmp"] = tempfile.mkdtemp(prefix="cairn-sdk-e2e-")
    env = dict(os.environ, CGO_ENABLED="0")
    env["PATH"] = env.get("PATH", "") + ":/usr/local/go/bin"
    for pkg in ("cairnd", "cairn-init", "cairn"):
        t = time.monotonic()
        out = subprocess.run([_go(), "build", "-o", os.path.join(tmp, pkg), "./cmd/" + pkg], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
        if out.returncode != 0:
            raise RuntimeError("go build ./cmd/%s failed:\n%s" % (pkg, out.stdout.decode(errors="replace")))
        log("built %s (%.1f s)" % (pkg, time.monotonic() - t))
    if not CI and ROOTFS and os.path.isdir(ROOTFS):
        out = subprocess.run([os.path.join(tmp, "cairn"), "--data-dir", DATA_DIR, "template", "import", "debian",
                              "--dir", ROOTFS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
        if out.returncode == 0:
            log("imported template debian from %s into %s" % (ROOTFS, DATA_DIR))
        elif out.returncode != 4:  # 4: it exists already
            raise RuntimeError("template import failed (exit %d):\n%s" % (out.returncode, out.stdout.decode()))
    S["sock"] = os.path.join(tmp, "cairnd.sock")
    S["token"] = uuid.uuid4().hex
    with open(os.path.join(tmp, "tokens"), "w") as f:
        f.write("# test token\n%s\n" % S["token"])
    S["tcp"] = "127.0.0.1:%d" % _free_port()
    S["log"] = os.path.join(tmp, "cairnd.log")
    logf = open(S["log"], "wb")
    S["proc"] = subprocess.Popen([os.path.join(tmp, "cairnd"), "--data-dir", DATA_DIR, "--socket", S["sock"],
                                  "--tcp", S["tcp"], "--token-file", os.path.join(tmp, "tokens")],
                                 stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    logf.close()
    log("cairnd pid %d: data dir %s, socket %s, tcp %s, log %s" % (S["proc"].pid, DATA_DIR, S["sock"], S["tcp"],
                                                                   S["log"]))
    S["env"] = {k: os.environ.get(k) for k in ("CAIRN_URL", "CAIRN_TOKEN")}
    os.environ["CAIRN_URL"] = "unix://" + S["sock"]  # so that Client() and the examples find it
    os.environ.pop("CAIRN_TOKEN", None)
    c = cairn.Client()
    deadline = time.monotonic() + 300
    while True:
        try:
            c.health()
            break
        except cairn.Unavailable:
            pass
        if S["proc"].poll() is not None:
            _stop_daemon()
            raise RuntimeError("cairnd exited at start (%s):\n%s" % (S["proc"].returncode, _log_tail()))
        if time.monotonic() > deadline:
            _stop_daemon()
            raise RuntimeError("cairnd did not serve within 5 minutes:\n" + _log_tail())
        time.sleep(0.05)
    if "debian" not in [t.name for t in c.templates()]:
        log("template debian missing: the first create builds it with debootstrap (minutes)")
    c.close()


def _stop_daemon():
    p = S.get("proc")
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(120)
    except subprocess.TimeoutExpired:
        log("cairnd did not stop within 2 minutes of SIGTERM: killing it")
        p.kill()
        p.wait(30)


def tearDownModule():
    try:
        if S.get("proc") is not None and S["proc"].poll() is None:
            c = cairn.Client("unix://" + S["sock"], timeout=120)
            mine = []
            for sb in c.list():
                ours = sb.labels.get("sdk-test") == RUN
                example = sb.labels.get("example") in ("tree_search", "rl_reset") and sb.created_at and \
                    sb.created_at >= S["started"]
                if ours or example:
                    mine.append(sb)
            for sb in mine:
                try:
                    sb.destroy()
                except cairn.NotFound:
                    pass
                except cairn.CairnError as e:
                    log("destroy %s: %s" % (sb.id, e))
            if mine:
                log("destroyed %d leftover sandboxes" % len(mine))
            try:
                r = c.gc()
                log("gc removed %d checkpoints, %d volumes" % (len(r.checkpoints), len(r.volumes)))
            except cairn.CairnError as e:
                log("gc: %s" % e)
            c.close()
    finally:
        _stop_daemon()
        if S.get("failed"):
            log("cairnd log (tail):\n" + _log_tail())
        for k, v in (S.get("env") or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if S.get("tmp"):
            shutil.rmtree(S["tmp"], ignore_errors=True)


class E2E(unittest.TestCase):
    """Base: records failures (for the daemon log dump) and creates labelled sandboxes."""

    def run(self, result=None):
        n = len(result.failures) + len(result.errors) if result is not None else 0
        out = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > n:
            S["failed"] = True
        return out

    def setUp(self):
        self.c = cairn.Client()
        self.addCleanup(self.c.close)

    def create(self, **kw):
        labels = dict(kw.pop("labels", {}) or {}, **LABEL)
        kw.setdefault("ttl", 900)
        kw.setdefault("isolation", ISOLATION)
        sb = self.c.create(labels=labels, **kw)
        self.addCleanup(self._destroy, sb)
        return sb

    def _destroy(self, sb):
        try:
            sb.destroy()
        except cairn.NotFound:
            pass


class TestIssueExample(E2E):
    def test_issue_example(self):
        """The issue's example, end to end: create, spawn a REPL, send, checkpoint, run,
        rollback (REPL state back), fork, run in each fork, tree, destroy all."""
        from cairn import Client
        c = Client()
        t0 = time.monotonic()
        sb = c.create(template="debian", ttl=600, labels=dict({"run": "r42"}, **LABEL), isolation=ISOLATION)
        self.addCleanup(self._destroy, sb)
        log("created %s (%s) in %.2f s" % (sb.id, sb.isolation, time.monotonic() - t0))
        self.assertEqual((sb.state, sb.template, sb.labels["run"]), ("running", "debian", "r42"))
        self.assertTrue(sb.session_id)
        left = (sb.expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
        self.assertTrue(540 < left <= 605, left)

        # Files the forks and the test run use, present at the checkpoint.
        sb.files.write("/step.py", "import os, socket\nprint('step in', socket.gethostname(), os.getcwd())\n")
        sb.files.write("/proj/test_it.py", "import unittest\nclass T(unittest.TestCase):\n"
                                           "    def test_ok(self):\n        self.assertEqual(6 * 7, 42)\n")

        repl = sb.spawn(["python3", "-i", "-u"])
        self.assertTrue(repl.handle)
        repl.send("import json; data = list(range(10**6))\n")
        repl.send("print('len', len(data))\n")
        self.assertEqual(repl.read_until("\n", timeout=60), "len 1000000\n")

        ck = sb.checkpoint(label="loaded")
        self.assertEqual((ck.label, ck.sandbox_id), ("loaded", sb.id))
        self.assertGreater(ck.image_bytes, 0)
        log("checkpoint %s: %.1f MB in %.0f ms" % (ck.id, ck.image_bytes / 1e6, ck.duration_ms))

        # Change both halves of the state after the checkpoint.
        repl.send("data = data[:3]; after = True; print('len', len(data))\n")
        self.assertEqual(repl.read_until("\n", timeout=60), "len 3\n")
        sb.files.write("/root/after.txt", "written after the checkpoint")

        r = sb.run("cd /proj && python3 -m unittest -q", timeout=120)  # the issue's "pytest -q"
        self.assertEqual(r.exit_code, 0, r.stderr)
        self.assertIn("OK", r.stderr)
        r = sb.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
        self.assertEqual((r.exit_code, r.stdout, r.stderr), (3, "out\n", "err\n"))

        t = time.monotonic()
        sb.rollback(ck)
        log("rollback in %.2f s" % (time.monotonic() - t))
        self.assertEqual(sb.head, ck.id)
        repl.send("print('len', len(data), 'after' in dir())\n")
        self.assertEqual(repl.read_until("\n", timeout=60), "len 1000000 False\n")  # the REPL's memory is back
        self.assertFalse(sb.files.exists("/root/after.txt"))  # and the files

        t = time.monotonic()
        kids = ck.fork(count=FORKS)
        log("forked %d in %.2f s" % (len(kids), time.monotonic() - t))
        self.assertEqual(len(kids), FORKS)
        for k in kids:
            self.addCleanup(self._destroy, k)
        self.assertEqual(len({k.id for k in kids} | {sb.id}), FORKS + 1)

        def in_fork(k):
            r = k.run("python3 step.py")
            p = k.process(repl.handle)  # the fork's copy of the REPL
            p.send("print('kid', len(data))\n")
            line = p.read_until("kid", timeout=60) + p.read_until("\n", timeout=60)
            return k, r, line

        with ThreadPoolExecutor(max_workers=FORKS) as pool:
            for k, r, line in pool.map(in_fork, kids):
                self.assertEqual(r.exit_code, 0, r.stderr)
                self.assertEqual(r.stdout, "step in %s /\n" % k.hostname)
                self.assertTrue(line.endswith("kid 1000000\n"), line)
                self.assertEqual((k.origin, k.labels.get("run"), k.session_id), (ck.id, "r42", sb.session_id))

        tree = c.tree(sb.id)
        self.assertEqual((tree.sandbox, tree.head), (sb.id, ck.id))
        got = tree.get(ck.id)
        self.assertIsNotNone(got)
        self.assertEqual(got.label, "loaded")
        self.assertGreater(got.image_bytes, 0)
        self.assertIsNotNone(got.created_at)
        self.assertIn("'loaded'", str(tree))
        kt = c.tree(kids[0].id)
        self.assertIn(ck.id, [x.id for x in kt])

        self.assertEqual({s.id for s in c.list(labels={"run": "r42", **LABEL})}, {sb.id} | {k.id for k in kids})
        for k in kids + [sb]:
            k.destroy()
        for k in kids + [sb]:
            with self.assertRaises(cairn.NotFound):
                c.get(k.id)
        log("issue example: %.1f s" % (time.monotonic() - t0))


class TestAPI(E2E):
    def test_errors(self):
        with self.assertRaises(cairn.NotFound) as cm:
            self.c.get("nosuchsandbox0")
        self.assertEqual((cm.exception.code, cm.exception.status), ("not_found", 404))
        with self.assertRaises(cairn.NotFound):
            self.c.create(template="no-such-template", labels=LABEL)
        with self.assertRaises(cairn.InvalidArgument) as cm:
            self.c.list(state="bogus")
        self.assertEqual(cm.exception.status, 400)
        with self.assertRaises(cairn.InvalidArgument):
            self.c.create(ttl=10 ** 9, labels=LABEL)  # over --max-ttl
        with self.assertRaises(cairn.NotFound):
            self.c._t.call("GET", "/v1/no/such/route")
        with self.assertRaises(cairn.InvalidArgument) as cm:
            self.c._t.call("PUT", "/v1/health", json_body={})
        self.assertEqual(cm.exception.status, 405)

    def test_prewarm(self):
        """Prewarm makes standbys of a container checkpoint ready; a rollback to it still
        brings the REPL's state back; unknown checkpoints and bad counts raise."""
        sb = self.create(isolation="container")
        repl = sb.spawn(["python3", "-i", "-u"])
        repl.send("x = 41; print('X', x)\n")
        repl.read_until("X 41")
        ck = sb.checkpoint(label="warm")
        n = ck.prewarm(count=2)
        self.assertGreaterEqual(n, 2)  # plus any the daemon made in the background
        self.assertGreaterEqual(self.c.standbys(ck.id), 2)
        repl.send("x += 1\n")
        sb.rollback(ck)
        repl.send("print('Y', x)\n")
        self.assertIn("Y 41", repl.read_until("Y 41"))
        with self.assertRaises(cairn.NotFound):
            self.c.prewarm("nosuchckpt0")
        with self.assertRaises(cairn.NotFound):
            self.c.standbys("nosuchckpt0")
        with self.assertRaises(cairn.InvalidArgument) as cm:
            self.c._t.call("POST", "/v1/checkpoints/%s/prewarm" % ck.id, json_body={"count": 0})
        self.assertEqual(cm.exception.status, 400)

    def test_tcp_token(self):
        url = "http://" + S["tcp"]
        with cairn.Client(url, token=S["token"]) as c:
            self.assertEqual(c.health().status, "ok")
            self.assertIsInstance(c.list(), list)
        with cairn.Client(url, token="wrong") as c:
            with self.assertRaises(cairn.Unauthenticated) as cm:
                c.list()
            self.assertEqual((cm.exception.code, cm.exception.status), ("permission_denied", 401))

    def test_run_process_files_events_lifecycle(self):
        sb = self.create()
        with self.c.events(sandbox=sb.id, timeout=120) as ev:
            # run: timeout, check, stdin, env, cwd, streaming callbacks
            with self.assertRaises(cairn.Timeout) as cm:
                sb.run("echo started; sleep 30", timeout=1)
            self.assertEqual((cm.exception.result.stdout, cm.exception.result.timed_out), ("started\n", True))
            with self.assertRaises(cairn.CommandFailed):
                sb.run("exit 5", check=True)
            seen = []
            r = sb.run(["sh", "-c", 'cat; echo "$FOO" "$(pwd)"'], stdin="in\n", env={"FOO": "bar"}, cwd="/tmp",
                       on_stdout=seen.append)
            self.assertEqual(r.stdout, "in\nbar /tmp\n")
            self.assertEqual("".join(seen), r.stdout)
            r = sb.run("printf '\\377\\376'")
            self.assertEqual(r.stdout_bytes, b"\xff\xfe")

            # a background process: wait with timeout, signal, exit status
            p = sb.spawn("sleep 300")
            with self.assertRaises(cairn.Timeout):
                p.wait(timeout=0.5)
            self.assertIsNone(p.poll())
            p.kill()
            st = p.wait(timeout=30)
            self.assertEqual((st.code, st.signal), (137, 9))
            self.assertIn(p.handle, [x.handle for x in sb.processes()])
            cat = sb.spawn(["cat"])
            cat.send("a line\n")
            cat.send(b"\x00bytes\n")
            cat.close_stdin()
            self.assertEqual(cat.wait(timeout=30).code, 0)
            self.assertEqual(cat.read_bytes(), b"a line\n\x00bytes\n")
            # records: run() removes its own unless keep=True; remove() the others
            handles = [x.handle for x in sb.processes()]
            self.assertNotIn(r.handle, handles)
            kept = sb.run("true", keep=True)
            self.assertIn(kept.handle, [x.handle for x in sb.processes()])
            with self.assertRaises(cairn.FailedPrecondition):
                sb.spawn("sleep 300").remove()
            cat.remove()
            self.assertNotIn(cat.handle, [x.handle for x in sb.processes()])

            # files
            fi = sb.files.write("/opt/x/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
            self.assertEqual((fi.size, fi.mode, fi.is_dir), (19, "-rwxr-xr-x", False))
            self.assertEqual(sb.run("/opt/x/run.sh").stdout, "ran\n")
            self.assertEqual(sb.files.read("/opt/x/run.sh"), b"#!/bin/sh\necho ran\n")
            self.assertEqual([e.name for e in sb.files.list("/opt/x")], ["run.sh"])
            self.assertTrue(sb.files.stat("/opt/x").is_dir)
            sb.files.remove("/opt/x")
            self.assertFalse(sb.files.exists("/opt/x/run.sh"))
            with self.assertRaises(cairn.NotFound):
                sb.files.read("/opt/x/run.sh")

            # lifecycle
            ck = sb.checkpoint("a")
            sb.rollback(ck)
            self.assertEqual(sb.stop().state, "stopped")
            with self.assertRaises(cairn.FailedPrecondition):
                sb.run("true")
            self.assertEqual(sb.files.read_text("/etc/hostname").strip(), sb.hostname)  # files work when stopped
            self.assertEqual(sb.resume().state, "running")
            self.assertEqual(sb.run("echo back").stdout, "back\n")
            sb.update(ttl=1200)
            self.assertGreater((sb.expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds(), 1100)
            sb.destroy()

            got = []
            for e in ev:
                self.assertEqual(e.sandbox_id, sb.id)
                got.append(e.type)
                if e.type == "destroyed":
                    break
            self.assertEqual(got, ["checkpointed", "rolled_back", "stopped", "resumed", "destroyed"])
        self.assertEqual(ev.closed, True)

    def test_read_positions_follow_rollback(self):
        sb = self.create()
        repl = sb.spawn(["python3", "-i", "-u"])
        repl.send("print('one')\n")
        self.assertEqual(repl.read_until("\n", timeout=60), "one\n")
        ck = sb.checkpoint()
        repl.send("print('two, a longer line after the checkpoint')\n")
        self.assertIn("two", repl.read_until("\n", timeout=60))
        other = self.c.get(sb.id)  # a rollback through another object: resync by hand
        other.rollback(ck)
        repl.resync()
        repl.send("print('three')\n")
        self.assertEqual(repl.read_until("\n", timeout=60), "three\n")
        self.assertEqual(repl.output, "one\nthree\n")


class TestExamples(E2E):
    def _example(self, name, *args):
        t = time.monotonic()
        env = dict(os.environ)
        if ISOLATION:
            env["CAIRN_ISOLATION"] = ISOLATION
        out = subprocess.run([sys.executable, os.path.join(SDK_DIR, "examples", name)] + list(args), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
        text = out.stdout.decode(errors="replace")
        log("%s %s: exit %d in %.1f s" % (name, " ".join(args), out.returncode, time.monotonic() - t))
        self.assertEqual(out.returncode, 0, text)
        return text

    def test_tree_search(self):
        text = self._example("tree_search.py", "--start", "1", "--target", "10", "--max-depth", "3")
        self.assertIn("bad branch, rollback", text)
        self.assertIn("backtrack", text)
        self.assertIn("REPL and file agree: v=10", text)
        self.assertIn("RESULT found", text)
        self.assertIn("destroyed sandbox", text)

    def test_rl_reset(self):
        text = self._example("rl_reset.py", "--envs", "2", "--episodes", "2", "--steps", "2")
        self.assertIn("episode 1:", text)
        self.assertRegex(text, r"prewarmed \w+: \d+ standbys ready")
        self.assertIn("RESULT 2 episodes x 2 envs", text)
        self.assertIn("destroyed 3 sandboxes", text)


if __name__ == "__main__":
    unittest.main()
