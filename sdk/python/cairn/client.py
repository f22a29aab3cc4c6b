"""The cairn client: :class:`Client`, and the objects it hands out — :class:`Sandbox`,
:class:`Process`, :class:`Checkpoint`, :class:`Tree`, :class:`Files` and
:class:`EventStream`. Synchronous; safe to share one Client between threads."""

from __future__ import annotations

import base64
import codecs
import datetime as _dt
import http.client
import json
import signal as _signal
import socket
import time
import weakref
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union)

from ._http import Endpoint, Transport, quote, resolve
from ._streams import Chunk, iter_lines, parse_ndjson, parse_sse
from .errors import CairnError, FailedPrecondition, InvalidArgument, NotFound, Timeout, Unavailable
from .types import (Change, Event, ExitStatus, FileInfo, GCReport, Health, Limits, RunResult, Template,
                    parse_time)

__all__ = ["Client", "Sandbox", "Process", "Checkpoint", "Tree", "Files", "EventStream"]

Command = Union[str, Sequence[str]]
Seconds = Union[int, float, _dt.timedelta]
SignalLike = Union[int, str, _signal.Signals]

# Extra time a socket waits for the daemon beyond a timeout the daemon enforces itself.
_GRACE = 30.0


def _argv(cmd: Command) -> List[str]:
    """A shell command string becomes ["sh", "-c", cmd]; a sequence is the argv."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("empty command", status=None)
        return ["sh", "-c", cmd]
    args = [str(a) for a in cmd]
    if not args or not args[0]:
        raise InvalidArgument("the command needs a program: give a string or a non-empty argv list", status=None)
    return args


def _env(env: Union[Mapping[str, str], Sequence[str], None]) -> Optional[List[str]]:
    if env is None:
        return None
    if isinstance(env, Mapping):
        return ["%s=%s" % (k, v) for k, v in env.items()]
    return [str(e) for e in env]


def _seconds(v: Optional[Seconds], name: str, integer: bool = True) -> Optional[Union[int, float]]:
    if v is None:
        return None
    if isinstance(v, _dt.timedelta):
        v = v.total_seconds()
    if integer:
        if int(v) != v:
            raise InvalidArgument("%s=%r: give whole seconds" % (name, v), status=None)
        return int(v)
    return float(v)


def _lifetime(body: Dict[str, Any], session: Optional[str], run: Optional[str], ttl: Optional[Seconds],
              expiry_policy: Optional[str], idle_timeout: Optional[Seconds]) -> Dict[str, Any]:
    if session:
        body["session_id"] = session
    if run:
        body["run_id"] = run
    if ttl is not None:
        body["ttl_seconds"] = _seconds(ttl, "ttl")
    if expiry_policy:
        body["expiry_policy"] = expiry_policy
    if idle_timeout is not None:
        body["idle_timeout_seconds"] = _seconds(idle_timeout, "idle_timeout")
    return body


def _label_query(labels: Optional[Mapping[str, str]]) -> Optional[List[str]]:
    if not labels:
        return None
    return ["%s=%s" % (k, v) for k, v in labels.items()]


def _signal_name(sig: SignalLike) -> str:
    if isinstance(sig, _signal.Signals):
        return str(int(sig))
    if isinstance(sig, int):
        return str(sig)
    return str(sig)


class Client:
    """A client of cairnd, the cairn daemon.

    With no arguments it talks to ``$CAIRN_URL`` (with ``$CAIRN_TOKEN`` as bearer token)
    if set, else to the local daemon's unix socket ``/run/cairn/cairnd.sock`` — as the Go
    client does. ``url`` is ``unix:///path/to.sock``, a socket path, or
    ``http://host:port`` (TCP listeners need a token). ``timeout`` bounds each socket
    operation of plain calls (None: no limit; streams, ``wait`` and ``run`` have their own).

    >>> c = Client()
    >>> sb = c.create(template="debian", ttl=600, labels={"run": "r42"})
    >>> sb.run("echo hi").stdout
    'hi\\n'
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, timeout: Optional[float] = None):
        endpoint, tok = resolve(url, token)
        self._t = Transport(endpoint, tok, timeout)

    @property
    def endpoint(self) -> Endpoint:
        """Where this client sends its requests."""
        return self._t.endpoint

    @property
    def url(self) -> str:
        """The daemon's address as a URL string."""
        return str(self._t.endpoint)

    def close(self) -> None:
        """Close idle connections (the client stays usable)."""
        self._t.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Client(%r)" % self.url

    # -- daemon --------------------------------------------------------------------

    def health(self) -> Health:
        """The daemon's health: version, uptime, data directory, sandbox count."""
        return Health.from_json(self._t.call("GET", "/v1/health"))

    def openapi(self) -> Dict[str, Any]:
        """The API's OpenAPI 3.1 document, as served at /v1/openapi.json."""
        return self._t.call("GET", "/v1/openapi.json")

    # -- sandboxes -----------------------------------------------------------------

    def create(self, template: Optional[str] = None, *, isolation: Optional[str] = None,
               labels: Optional[Mapping[str, str]] = None, ttl: Optional[Seconds] = None,
               limits: Union[Limits, Mapping[str, Any], None] = None, session: Optional[str] = None,
               run: Optional[str] = None, expiry_policy: Optional[str] = None,
               idle_timeout: Optional[Seconds] = None) -> "Sandbox":
        """Create and start a sandbox.

        Args:
            template: the template ("debian" by default; built on first use, ~1-2 min).
            isolation: "gvisor" or "container" (default: the daemon's).
            labels: key/value labels, filterable in :meth:`list` and :meth:`events`.
            ttl: time to live in seconds (or a timedelta; default: the daemon's --default-ttl).
            limits: :class:`Limits` or a dict with memory_bytes, pids, cpus.
            session: session ID (generated when absent; forks inherit it).
            run: run ID (e.g. an RL run).
            expiry_policy: "destroy" (default) or "pause" when the TTL runs out.
            idle_timeout: pause after this many seconds without API activity (-1: never).
        """
        body: Dict[str, Any] = {}
        if template:
            body["template"] = template
        if isolation:
            body["isolation"] = isolation
        if labels:
            body["labels"] = dict(labels)
        if limits:
            lim = limits if isinstance(limits, Limits) else Limits(**dict(limits))
            if lim.to_json():
                body["limits"] = lim.to_json()
        _lifetime(body, session, run, ttl, expiry_policy, idle_timeout)
        return Sandbox(self, self._t.call("POST", "/v1/sandboxes", json_body=body))

    def get(self, id: str) -> "Sandbox":
        """The sandbox ``id`` (raises :class:`NotFound`)."""
        return Sandbox(self, self._t.call("GET", "/v1/sandboxes/" + quote(id)))

    def sandbox(self, id: str) -> "Sandbox":
        """A Sandbox object for ``id`` without asking the daemon (fields stay empty until
        :meth:`Sandbox.refresh`)."""
        return Sandbox(self, {"id": id})

    def list(self, labels: Optional[Mapping[str, str]] = None, session: Optional[str] = None,
             run: Optional[str] = None, state: Optional[str] = None) -> List["Sandbox"]:
        """The sandboxes matching every given filter, oldest first.

        Args:
            labels: every key=value must match.
            session: session ID.
            run: run ID.
            state: "running", "stopped" or "paused".
        """
        q = {"label": _label_query(labels), "session": session or None, "run": run or None, "state": state or None}
        d = self._t.call("GET", "/v1/sandboxes", query=q)
        return [Sandbox(self, s) for s in (d or {}).get("sandboxes") or []]

    def destroy(self, id: str) -> None:
        """Stop and delete sandbox ``id`` (its checkpoints stay until :meth:`gc`)."""
        self._t.call("DELETE", "/v1/sandboxes/" + quote(id))

    # -- checkpoints ---------------------------------------------------------------

    def tree(self, id: str) -> "Tree":
        """The lineage of sandbox ``id``: its checkpoints, oldest first, with labels,
        sizes and times."""
        return Tree._from_json(self, self._t.call("GET", "/v1/sandboxes/%s/tree" % quote(id)))

    def get_checkpoint(self, id: str) -> "Checkpoint":
        """The checkpoint ``id``."""
        return Checkpoint(self, self._t.call("GET", "/v1/checkpoints/" + quote(id)))

    def fork(self, checkpoint: Union["Checkpoint", str], count: int = 1, *,
             labels: Optional[Mapping[str, str]] = None, ttl: Optional[Seconds] = None,
             session: Optional[str] = None, run: Optional[str] = None, expiry_policy: Optional[str] = None,
             idle_timeout: Optional[Seconds] = None) -> List["Sandbox"]:
        """Make ``count`` new sandboxes (1 to 256, in parallel) from a checkpoint: files and
        processes as they were. Forks inherit the source's labels (``labels`` are added),
        session and run unless given."""
        ck = checkpoint.id if isinstance(checkpoint, Checkpoint) else str(checkpoint)
        if int(count) < 1:
            raise InvalidArgument("count=%r: give 1 to 256" % count, status=None)
        body: Dict[str, Any] = {"count": int(count)}
        if labels:
            body["labels"] = dict(labels)
        _lifetime(body, session, run, ttl, expiry_policy, idle_timeout)
        d = self._t.call("POST", "/v1/checkpoints/%s/fork" % quote(ck), json_body=body)
        return [Sandbox(self, s) for s in (d or {}).get("sandboxes") or []]

    def prewarm(self, checkpoint: Union["Checkpoint", str], count: int = 1) -> int:
        """Make ``count`` standbys of a checkpoint ready (1 to 256; those already ready
        count, so a repeated call prepares nothing more) and return, once they are, how
        many standbys of it are ready.

        A standby is the checkpoint restored ahead of time and kept frozen: the next
        ``count`` rollbacks or forks to it are thaws (2-3 ms) instead of restores
        (~150 ms). Call it before resetting a batch of sandboxes to one checkpoint (RL
        environments) or before a wide fork. Each standby costs a restore now (~0.1-0.5 s,
        one at a time by default; the call waits, so mind the client's ``timeout``) and holds its
        processes' memory until taken or evicted: the daemon's standby budget bounds the
        cache, oldest evicted first, so the count returned may be lower than asked.
        Raises :class:`NotFound` for an unknown checkpoint, :class:`InvalidArgument` for
        a count outside 1 to 256, :class:`FailedPrecondition` for a gvisor checkpoint
        (gvisor has no standbys) or a daemon with standbys turned off.
        """
        ck = checkpoint.id if isinstance(checkpoint, Checkpoint) else str(checkpoint)
        if not 1 <= int(count) <= 256:
            raise InvalidArgument("prewarm count=%r: give 1 to 256" % count, status=None)
        d = self._t.call("POST", "/v1/checkpoints/%s/prewarm" % quote(ck), json_body={"count": int(count)})
        return int((d or {}).get("standbys") or 0)

    def standbys(self, checkpoint: Union["Checkpoint", str]) -> int:
        """How many standbys of a checkpoint are ready (see :meth:`prewarm`)."""
        ck = checkpoint.id if isinstance(checkpoint, Checkpoint) else str(checkpoint)
        d = self._t.call("GET", "/v1/checkpoints/%s/standbys" % quote(ck))
        return int((d or {}).get("standbys") or 0)

    def delete_checkpoint(self, id: Union["Checkpoint", str], cascade: bool = False) -> List[str]:
        """Delete a checkpoint (with ``cascade``, its whole subtree); return the IDs deleted."""
        ck = id.id if isinstance(id, Checkpoint) else str(id)
        d = self._t.call("DELETE", "/v1/checkpoints/" + quote(ck), query={"cascade": bool(cascade)})
        return list((d or {}).get("removed") or [])

    def diff(self, a: Union["Checkpoint", str], b: Union["Checkpoint", str]) -> List[Change]:
        """The paths that differ between two checkpoints' filesystems, sorted by path."""
        ia = a.id if isinstance(a, Checkpoint) else str(a)
        ib = b.id if isinstance(b, Checkpoint) else str(b)
        d = self._t.call("GET", "/v1/checkpoints/%s/diff/%s" % (quote(ia), quote(ib)))
        return [Change(kind=c.get("kind", ""), path=c.get("path", "")) for c in (d or {}).get("changes") or []]

    def gc(self) -> GCReport:
        """Delete checkpoints and files nothing references."""
        d = self._t.call("POST", "/v1/gc") or {}
        return GCReport(checkpoints=list(d.get("checkpoints") or []), volumes=list(d.get("volumes") or []))

    # -- templates -----------------------------------------------------------------

    def templates(self) -> List[Template]:
        """The templates."""
        d = self._t.call("GET", "/v1/templates")
        return [Template.from_json(t) for t in (d or {}).get("templates") or []]

    def build_template(self, name: str, *, dir: Optional[str] = None, oci: Optional[str] = None,
                       debian: Optional[Mapping[str, Any]] = None) -> Template:
        """Build or import a template (synchronous; a debootstrap build takes minutes).

        Give exactly one of ``dir`` (a directory tree on the daemon's host), ``oci`` (an
        OCI layout or ``docker save`` tarball there) or ``debian`` (a dict with suite,
        variant, packages, mirror; ``{}`` for the defaults).
        """
        body: Dict[str, Any] = {"name": name}
        if dir:
            body["dir"] = dir
        if oci:
            body["oci"] = oci
        if debian is not None:
            body["debian"] = dict(debian)
        return Template.from_json(self._t.call("POST", "/v1/templates", json_body=body))

    def remove_template(self, name: str) -> None:
        """Delete a template."""
        self._t.call("DELETE", "/v1/templates/" + quote(name))

    # -- events --------------------------------------------------------------------

    def events(self, sandbox: Union[str, "Sandbox", Sequence[Union[str, "Sandbox"]], None] = None, *,
               labels: Optional[Mapping[str, str]] = None, session: Optional[str] = None,
               types: Optional[Sequence[str]] = None, timeout: Optional[float] = None) -> "EventStream":
        """Subscribe to lifecycle events from now on; iterate the returned
        :class:`EventStream` (a generator-like object; close it, or use ``with``).

        Filters combine with AND: ``sandbox`` (one or several IDs or Sandbox objects: any
        of them), ``labels`` (all must match), ``session``, ``types`` (e.g.
        ``["checkpointed", "rolled_back"]``). ``timeout``: raise :class:`Timeout` if
        nothing (not even the 15 s keepalive) arrives for that long.

        The subscription exists once this returns, so events of calls made after it are
        seen.
        """
        ids: List[str] = []
        if sandbox is not None:
            items = [sandbox] if isinstance(sandbox, (str, Sandbox)) else list(sandbox)
            ids = [s.id if isinstance(s, Sandbox) else str(s) for s in items]
        q = {"sandbox": ids or None, "label": _label_query(labels), "session": session or None,
             "type": list(types) if types else None}
        conn, resp = self._t.open_stream("GET", "/v1/events", query=q, timeout=timeout, accept="text/event-stream")
        return EventStream(conn, resp, str(self._t.endpoint))


class Sandbox:
    """A sandbox: an isolated Linux machine whose files and processes are checkpointed,
    rolled back and forked together.

    Attributes mirror the API's Sandbox object: ``id``, ``template``, ``isolation``,
    ``state`` ("running", "stopped", "paused"), ``hostname``, ``head`` (the checkpoint the
    current state descends from), ``origin`` (the checkpoint a fork started from),
    ``labels``, ``limits``, ``created_at``, ``session_id``, ``run_id``, ``expires_at``,
    ``expiry_policy``, ``idle_timeout_seconds``, ``last_activity_at``, ``paused_reason``,
    ``resident_checkpoints`` and ``resident_memory_bytes`` (how many of its checkpoints
    are held as frozen copies of its processes, and the memory those hold beyond its
    processes', counted against its memory limit; filled by ``refresh``);
    ``raw`` is the JSON object. Methods that return the sandbox update them in place.

    Use it as a context manager to destroy it at the end::

        with c.create() as sb:
            sb.run("make test", check=True)
    """

    def __init__(self, client: Client, data: Dict[str, Any]):
        self.client = client
        self.files = Files(self)
        self._procs: "weakref.WeakSet[Process]" = weakref.WeakSet()
        self._update(data)

    def _update(self, d: Dict[str, Any]) -> "Sandbox":
        self.raw: Dict[str, Any] = d
        self.id: str = d.get("id", "")
        self.template: str = d.get("template", "")
        self.isolation: str = d.get("isolation", "")
        self.state: str = d.get("state", "")
        self.hostname: str = d.get("hostname", "")
        self.head: str = d.get("head") or ""
        self.origin: str = d.get("origin") or ""
        self.labels: Dict[str, str] = dict(d.get("labels") or {})
        self.limits: Limits = Limits.from_json(d.get("limits"))
        self.created_at: Optional[_dt.datetime] = parse_time(d.get("created_at"))
        self.root: str = d.get("root", "")
        self.init: Dict[str, Any] = dict(d.get("init") or {})
        self.session_id: str = d.get("session_id") or ""
        self.run_id: str = d.get("run_id") or ""
        self.expires_at: Optional[_dt.datetime] = parse_time(d.get("expires_at"))
        self.expiry_policy: str = d.get("expiry_policy") or ""
        self.idle_timeout_seconds: int = int(d.get("idle_timeout_seconds") or 0)
        self.last_activity_at: Optional[_dt.datetime] = parse_time(d.get("last_activity_at"))
        self.paused_reason: str = d.get("paused_reason") or ""
        self.resident_memory_bytes: int = int(d.get("resident_memory_bytes") or 0)
        self.resident_checkpoints: int = int(d.get("resident_checkpoints") or 0)
        return self

    def _path(self, *rest: str) -> str:
        return "/v1/sandboxes/" + quote(self.id) + "".join("/" + r for r in rest)

    def __repr__(self) -> str:
        return "<Sandbox %s %s%s>" % (self.id, self.state or "?", (" labels=%r" % self.labels) if self.labels else "")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sandbox) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("sandbox", self.id))

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.destroy()
        except NotFound:
            pass

    # -- lifecycle -----------------------------------------------------------------

    def refresh(self) -> "Sandbox":
        """Re-read the sandbox from the daemon."""
        return self._update(self.client._t.call("GET", self._path()))

    def stop(self) -> "Sandbox":
        """Stop the sandbox's processes, keeping its files and checkpoints."""
        return self._update(self.client._t.call("POST", self._path("stop")))

    def resume(self) -> "Sandbox":
        """Restart a stopped or paused sandbox from its head checkpoint (a running one is
        left as is)."""
        return self._update(self.client._t.call("POST", self._path("resume")))

    def update(self, *, ttl: Optional[Seconds] = None, expiry_policy: Optional[str] = None,
               idle_timeout: Optional[Seconds] = None) -> "Sandbox":
        """Change the TTL (expire ``ttl`` seconds from now), the expiry policy ("destroy"
        or "pause") or the idle timeout (seconds; 0: the daemon's default; -1: never)."""
        body: Dict[str, Any] = {}
        if ttl is not None:
            body["ttl_seconds"] = _seconds(ttl, "ttl")
        if expiry_policy is not None:
            body["expiry_policy"] = expiry_policy
        if idle_timeout is not None:
            body["idle_timeout_seconds"] = _seconds(idle_timeout, "idle_timeout")
        return self._update(self.client._t.call("PATCH", self._path(), json_body=body))

    def destroy(self) -> None:
        """Stop and delete the sandbox (its checkpoints stay until :meth:`Client.gc`)."""
        self.client._t.call("DELETE", self._path())

    # -- processes -----------------------------------------------------------------

    def run(self, cmd: Command, *, timeout: Optional[float] = None,
            env: Union[Mapping[str, str], Sequence[str], None] = None, cwd: Optional[str] = None,
            stdin: Optional[str] = None, tty: bool = False, check: bool = False,
            keep: bool = False,
            on_stdout: Optional[Callable[[str], Any]] = None,
            on_stderr: Optional[Callable[[str], Any]] = None) -> RunResult:
        """Run a command to its end and return its :class:`RunResult` (``exit_code``,
        ``stdout``, ``stderr``).

        ``cmd`` is a shell command (run with ``sh -c``) or an argv list. The output is
        streamed (NDJSON) while the command runs; ``on_stdout``/``on_stderr`` get it as
        text as it arrives.

        Args:
            timeout: seconds; the daemon kills the process (SIGKILL) when it runs longer,
                and :class:`Timeout` is raised with the partial result in ``.result``.
            env: environment additions, a dict or ["KEY=VALUE", ...].
            cwd: working directory (default "/").
            stdin: text written to its standard input, which is then closed (default:
                empty standard input).
            tty: run on a pseudo-terminal (stderr then goes to stdout).
            check: raise :class:`CommandFailed` if the exit status is not 0.
            keep: keep the process's record (output, exit status) in the sandbox after
                its end, for :meth:`process` (by default the daemon removes it).

        Interrupting the call (or losing the connection) kills the process.
        """
        args = _argv(cmd)
        body: Dict[str, Any] = {"args": args}
        if env is not None:
            body["env"] = _env(env)
        if cwd:
            body["cwd"] = cwd
        if tty:
            body["tty"] = True
        if stdin:
            body["stdin"] = stdin
        if keep:
            body["keep"] = True
        if timeout is not None:
            if timeout <= 0:
                raise InvalidArgument("timeout=%r: give a positive number of seconds" % timeout, status=None)
            body["timeout_seconds"] = float(timeout)
        sock_timeout = None if timeout is None else timeout + _GRACE
        res = RunResult(args=args)
        out, err = bytearray(), bytearray()
        decs = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
        start = time.monotonic()
        conn, resp = self.client._t.open_stream("POST", self._path("exec"), json_body=body, timeout=sock_timeout)
        try:
            for ch in parse_ndjson(iter_lines(resp), "cairnd at %s" % self.client.url):
                if ch.type == "started":
                    res.handle = ch.handle
                elif ch.type == "stdout":
                    out += ch.data
                    if on_stdout is not None:
                        on_stdout(decs["stdout"].decode(ch.data))
                elif ch.type == "stderr":
                    err += ch.data
                    if on_stderr is not None:
                        on_stderr(decs["stderr"].decode(ch.data))
                elif ch.type == "end":
                    ex = ExitStatus.from_json(ch.exit)
                    if ex is not None:
                        res.exit_code, res.signal = ex.code, ex.signal
                    res.timed_out = ch.timed_out
        except socket.timeout:
            res.stdout_bytes, res.stderr_bytes = bytes(out), bytes(err)
            res.duration, res.timed_out = time.monotonic() - start, True
            raise Timeout("%s: no answer from cairnd within %.0f s; the process is killed" % (args, sock_timeout),
                          status=None, result=res) from None
        except (OSError, http.client.HTTPException) as e:
            raise self.client._t.unavailable(e, "the output stream broke: ") from None
        finally:
            conn.close()
        res.stdout_bytes, res.stderr_bytes = bytes(out), bytes(err)
        res.duration = time.monotonic() - start
        if res.timed_out and res.handle:
            # cairnd re-sends the output from the start after a timeout kill (api/exec.go follows
            # again with the same writers): take the process's recorded output instead.
            try:
                proc = Process(self, {"handle": res.handle})
                res.stdout_bytes = proc._read_from("stdout", 0)[0]
                res.stderr_bytes = proc._read_from("stderr", 0)[0]
            except CairnError:
                pass
        if res.timed_out:
            raise Timeout("%s ran longer than %g s and was killed" % (args, timeout), status=None, result=res)
        if check:
            res.check()
        return res

    def spawn(self, cmd: Command, *, env: Union[Mapping[str, str], Sequence[str], None] = None,
              cwd: Optional[str] = None, tty: bool = False) -> "Process":
        """Start a long-lived process in the background and return its :class:`Process`.

        Its standard input stays open (:meth:`Process.send`), its output is kept
        (:meth:`Process.read`); process handles survive checkpoint, rollback and fork.
        ``cmd`` is a shell command (``sh -c``) or an argv list, e.g.
        ``["python3", "-i", "-u"]`` for an interactive Python.
        """
        body: Dict[str, Any] = {"args": _argv(cmd)}
        if env is not None:
            body["env"] = _env(env)
        if cwd:
            body["cwd"] = cwd
        if tty:
            body["tty"] = True
        return self._track(Process(self, self.client._t.call("POST", self._path("processes"), json_body=body)))

    def _track(self, p: "Process") -> "Process":
        self._procs.add(p)
        return p

    def processes(self) -> List["Process"]:
        """The processes started in the sandbox, oldest first."""
        d = self.client._t.call("GET", self._path("processes"))
        return [self._track(Process(self, p)) for p in (d or {}).get("processes") or []]

    def process(self, handle: str) -> "Process":
        """The process ``handle`` — e.g. in a fork, the copy of a process of its source:
        ``kid.process(repl.handle)``."""
        return self._track(Process(self, self.client._t.call("GET", self._path("processes", quote(handle)))))

    # -- checkpoints ---------------------------------------------------------------

    def checkpoint(self, label: Optional[str] = None, durable: bool = False) -> "Checkpoint":
        """Take a joint checkpoint (filesystem + every process); it becomes the head.

        A container sandbox of simple processes is checkpointed *resident*: each process
        forks a frozen copy-on-write copy of itself, no memory is copied, and its durable
        copy is written in the background. ``durable=True`` returns only once the
        checkpoint is on disk whole and synced (it then survives a crash of the
        machine)."""
        body = {"label": label} if label else {}
        if durable:
            body["durable"] = True
        ck = Checkpoint(self.client, self.client._t.call("POST", self._path("checkpoints"), json_body=body))
        self.head = ck.id
        return ck

    def rollback(self, checkpoint: Union["Checkpoint", str]) -> "Sandbox":
        """Return the sandbox — files and processes — to a checkpoint of its lineage (a
        :class:`Checkpoint` or its ID). The read positions of the :class:`Process` objects
        of this Sandbox object are moved back if their output was rolled back."""
        ck = checkpoint.id if isinstance(checkpoint, Checkpoint) else str(checkpoint)
        self._update(self.client._t.call("POST", self._path("rollback"), json_body={"checkpoint": ck}))
        for p in list(self._procs):
            try:
                p.resync()
            except NotFound:
                pass  # the process did not exist at the checkpoint
        return self

    def tree(self) -> "Tree":
        """The lineage of this sandbox (see :meth:`Client.tree`)."""
        return self.client.tree(self.id)

    def fork(self, count: int = 1, label: Optional[str] = None, **kw: Any) -> List["Sandbox"]:
        """Checkpoint this sandbox now and fork ``count`` sandboxes from that checkpoint
        (keyword arguments as :meth:`Client.fork`)."""
        return self.checkpoint(label=label).fork(count=count, **kw)


class Files:
    """The files of a sandbox (``sb.files``); they work on stopped sandboxes too. Paths are
    absolute or relative to "/"; ".." is refused."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    def _call(self, method: str, what: str, path: str, **kw: Any) -> Any:
        q = {"path": path}
        q.update(kw.pop("query", {}))
        return self._sb.client._t.call(method, self._sb._path(*what.split("/")) if what else self._sb._path(),
                                       query=q, **kw)

    def read(self, path: str) -> bytes:
        """The bytes of a file (at most 256 MiB)."""
        _, data = self._sb.client._t.request("GET", self._sb._path("files", "content"), query={"path": path},
                                             accept="application/octet-stream")
        return data

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The contents of a text file."""
        return self.read(path).decode(encoding)

    def write(self, path: str, data: Union[bytes, str], mode: Optional[int] = None) -> FileInfo:
        """Write a file atomically, creating parent directories; ``data`` is bytes or text
        (UTF-8); ``mode`` e.g. 0o755 (default 0o644)."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        q: Dict[str, Any] = {}
        if mode is not None:
            q["mode"] = "%o" % mode
        return FileInfo.from_json(self._call("PUT", "files/content", path, raw=raw, query=q))

    def stat(self, path: str) -> FileInfo:
        """Describe a path (a symlink itself, not its target)."""
        return FileInfo.from_json(self._call("GET", "files/stat", path))

    def exists(self, path: str) -> bool:
        """Whether the path exists."""
        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def list(self, path: str = "/") -> List[FileInfo]:
        """The entries of a directory."""
        d = self._call("GET", "files/list", path)
        return [FileInfo.from_json(e) for e in (d or {}).get("entries") or []]

    def remove(self, path: str) -> None:
        """Remove a file or (recursively) a directory."""
        self._call("DELETE", "files", path)


class Process:
    """A process started in a sandbox (see :meth:`Sandbox.spawn`).

    Attributes: ``handle`` (stable across checkpoint, rollback and fork), ``pid`` (inside
    the sandbox), ``args``, ``tty``, ``running``, ``started_at``, ``exit``
    (:class:`ExitStatus` once it exited) — as of the last call that returned them
    (:meth:`refresh`).

    Output: :meth:`read` returns what was written since the previous read;
    :meth:`read_until` waits for a marker; :attr:`output` is all of standard output.
    """

    def __init__(self, sandbox: Sandbox, data: Dict[str, Any]):
        self.sandbox = sandbox
        self._offsets = {"stdout": 0, "stderr": 0}
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in self._offsets}
        self._update(data)

    def _update(self, d: Dict[str, Any]) -> "Process":
        self.raw: Dict[str, Any] = d
        self.handle: str = d.get("handle", "")
        self.pid: int = int(d.get("pid") or 0)
        self.args: List[str] = list(d.get("args") or [])
        self.tty: bool = bool(d.get("tty"))
        self.running: bool = bool(d.get("running"))
        self.started_at: Optional[_dt.datetime] = parse_time(d.get("started_at"))
        self.exit: Optional[ExitStatus] = ExitStatus.from_json(d.get("exit"))
        return self

    def _path(self, *rest: str) -> str:
        return self.sandbox._path("processes", quote(self.handle), *rest)

    @property
    def _t(self) -> Transport:
        return self.sandbox.client._t

    def __repr__(self) -> str:
        st = "running" if self.running else ("exit %d" % self.exit.code if self.exit else "stopped")
        return "<Process %s %s in %s: %s>" % (self.handle, self.args, self.sandbox.id, st)

    def refresh(self) -> "Process":
        """Re-read the process's state (running, exit) from the daemon."""
        return self._update(self._t.call("GET", self._path()))

    @property
    def returncode(self) -> Optional[int]:
        """The exit code once the process exited (as of the last refresh), else None."""
        return self.exit.code if self.exit else None

    def poll(self) -> Optional[int]:
        """Refresh and return the exit code, or None while it runs."""
        return self.refresh().returncode

    # -- input ---------------------------------------------------------------------

    def send(self, data: Union[str, bytes], eof: bool = False) -> None:
        """Write text or bytes to the process's standard input (add the "\\n" yourself);
        with ``eof`` close it after."""
        body: Dict[str, Any] = {}
        if isinstance(data, str):
            if data:
                body["data"] = data
        elif data:
            body["data_base64"] = base64.b64encode(bytes(data)).decode("ascii")
        if eof:
            body["eof"] = True
        self._t.call("POST", self._path("stdin"), json_body=body)

    def close_stdin(self) -> None:
        """Close the process's standard input (it reads end of file)."""
        self.send(b"", eof=True)

    # -- signals and exit ----------------------------------------------------------

    def signal(self, sig: SignalLike) -> None:
        """Send a signal to the process and its process group: a number, a name ("TERM",
        "SIGINT") or a ``signal.Signals``."""
        self._t.call("POST", self._path("signal"), json_body={"signal": _signal_name(sig)})

    def kill(self) -> None:
        """Kill the process (SIGKILL)."""
        self.signal("KILL")

    def terminate(self) -> None:
        """Ask the process to end (SIGTERM)."""
        self.signal("TERM")

    def remove(self) -> None:
        """Remove the record of the exited process (its output and exit status) from the
        sandbox; :class:`FailedPrecondition` while it runs."""
        self._t.call("DELETE", self._path())

    def wait(self, timeout: Optional[float] = None) -> ExitStatus:
        """Wait for the process to exit and return its :class:`ExitStatus`; raise
        :class:`Timeout` if it still runs after ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            q: Dict[str, Any] = {}
            sock_timeout: Optional[float] = None
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Timeout("process %s still runs after %g s" % (self.handle, timeout), status=None)
                q["timeout_seconds"] = "%.3f" % remaining
                sock_timeout = remaining + _GRACE
            conn, resp = self._t.open_stream("POST", self._path("wait"), query=q, timeout=sock_timeout,
                                             accept="application/json")
            try:
                d = json.loads(resp.read().decode("utf-8"))
            except socket.timeout:
                raise Timeout("process %s: no answer from cairnd" % self.handle, status=None) from None
            except (OSError, http.client.HTTPException, ValueError) as e:
                raise self._t.unavailable(e, "waiting for process %s: " % self.handle) from None
            finally:
                conn.close()
            self._update(d)
            if self.exit is not None:
                return self.exit
            if not self.running:
                raise Unavailable("sandbox %s stopped while process %s was running" % (self.sandbox.id, self.handle),
                                  status=None)

    # -- output --------------------------------------------------------------------

    def _output(self, stream: Optional[str], offsets: Tuple[int, int], follow: bool,
                timeout: Optional[float]) -> Tuple[http.client.HTTPConnection, Iterator[Chunk]]:
        q: Dict[str, Any] = {"stdout_offset": offsets[0], "stderr_offset": offsets[1]}
        if stream:
            if stream not in ("stdout", "stderr"):
                raise InvalidArgument("stream=%r: give stdout or stderr" % stream, status=None)
            q["stream"] = stream
        if follow:
            q["follow"] = True
        conn, resp = self._t.open_stream("GET", self._path("output"), query=q, timeout=timeout)
        return conn, parse_ndjson(iter_lines(resp), "cairnd at %s" % self.sandbox.client.url)

    def _read_from(self, stream: str, offset: int) -> Tuple[bytes, int]:
        """The bytes of one stream from offset on, and the offset reached."""
        offs = (offset, 0) if stream == "stdout" else (0, offset)
        conn, chunks = self._output(stream, offs, False, self._t.timeout)
        buf, reached = bytearray(), offset
        try:
            for ch in chunks:
                if ch.type == stream:
                    buf += ch.data
                elif ch.type == "end":
                    reached = ch.stdout_offset if stream == "stdout" else ch.stderr_offset
                    if ch.exit is not None:
                        self.exit, self.running = ExitStatus.from_json(ch.exit), False
        except (OSError, http.client.HTTPException) as e:
            raise self._t.unavailable(e, "reading output: ") from None
        finally:
            conn.close()
        return bytes(buf), max(reached, offset + len(buf))

    def read_bytes(self, stream: str = "stdout") -> bytes:
        """The bytes written to ``stream`` ("stdout" or "stderr") since the previous read
        of it (without waiting)."""
        data, reached = self._read_from(stream, self._offsets[stream])
        self._offsets[stream] = reached
        return data

    def read(self, stream: str = "stdout") -> str:
        """The text written to ``stream`` ("stdout" or "stderr") since the previous read
        of it, without waiting ("" if nothing new). A Python REPL (``python3 -i``) writes
        its prompts to stderr."""
        return self._decoders[stream].decode(self.read_bytes(stream))

    def read_until(self, marker: Union[str, bytes], timeout: float = 60.0, stream: str = "stdout") -> str:
        """Wait until ``marker`` appears in ``stream`` after the read position, and return
        the text up to and including it (the read position moves just past it).

        Raises :class:`Timeout` after ``timeout`` seconds, :class:`FailedPrecondition` if
        the process exits first (the read position then stays).
        """
        m = marker.encode("utf-8") if isinstance(marker, str) else bytes(marker)
        if not m:
            raise InvalidArgument("empty marker", status=None)
        start = self._offsets[stream]
        offs = (start, 0) if stream == "stdout" else (0, start)
        deadline = time.monotonic() + timeout
        buf = bytearray()
        conn, chunks = self._output(stream, offs, True, timeout)
        try:
            for ch in chunks:
                if ch.type == stream:
                    buf += ch.data
                    i = buf.find(m)
                    if i >= 0:
                        got = bytes(buf[: i + len(m)])
                        self._offsets[stream] = start + len(got)
                        return self._decoders[stream].decode(got)
                elif ch.type == "end":
                    if ch.exit is not None:
                        self.exit, self.running = ExitStatus.from_json(ch.exit), False
                    raise FailedPrecondition("process %s ended before %r appeared in its %s (got %r)"
                                             % (self.handle, marker, stream, bytes(buf[-200:])), status=None)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout()
                if conn.sock is not None:
                    conn.sock.settimeout(remaining)
        except socket.timeout:
            raise Timeout("%r did not appear in the %s of process %s within %g s (got %r)"
                          % (marker, stream, self.handle, timeout, bytes(buf[-200:])), status=None) from None
        except (OSError, http.client.HTTPException) as e:
            raise self._t.unavailable(e, "following output: ") from None
        finally:
            conn.close()
        raise AssertionError("unreachable")

    def read_all(self, stream: str = "stdout") -> str:
        """All the text the process wrote to ``stream`` so far (the read position is
        unchanged)."""
        return self._read_from(stream, 0)[0].decode("utf-8", "replace")

    @property
    def output(self) -> str:
        """All the process's standard output so far (text)."""
        return self.read_all("stdout")

    def follow(self, on_stdout: Optional[Callable[[str], Any]] = None,
               on_stderr: Optional[Callable[[str], Any]] = None) -> Optional[ExitStatus]:
        """Stream the output from the read positions on until the process exits, passing
        text to the callbacks; return the exit status. The read positions move to the end."""
        decs = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                "stderr": codecs.getincrementaldecoder("utf-8")("replace")}
        cbs = {"stdout": on_stdout, "stderr": on_stderr}
        conn, chunks = self._output(None, (self._offsets["stdout"], self._offsets["stderr"]), True, None)
        try:
            for ch in chunks:
                if ch.type in cbs:
                    self._offsets[ch.type] += len(ch.data)
                    cb = cbs[ch.type]
                    if cb is not None:
                        cb(decs[ch.type].decode(ch.data))
                elif ch.type == "end":
                    self._offsets["stdout"] = max(self._offsets["stdout"], ch.stdout_offset)
                    self._offsets["stderr"] = max(self._offsets["stderr"], ch.stderr_offset)
                    self.exit = ExitStatus.from_json(ch.exit)
                    self.running = self.exit is None and self.running
                    return self.exit
        except (OSError, http.client.HTTPException) as e:
            raise self._t.unavailable(e, "following output: ") from None
        finally:
            conn.close()
        return None

    def resync(self) -> None:
        """Move the read positions back to the end of the output if the output shrank —
        after a rollback done through another Sandbox object (:meth:`Sandbox.rollback`
        does it for its own processes). Unread output that still exists stays unread."""
        for stream, off in list(self._offsets.items()):
            if off == 0:
                continue
            data, reached = self._read_from(stream, off - 1)
            if data:
                continue  # the output still reaches off: nothing was lost
            _, size = self._read_from(stream, 0)
            self._offsets[stream] = min(off, size)
            self._decoders[stream].reset()


class Checkpoint:
    """A joint checkpoint of a sandbox: its filesystem and every process, at one instant.

    Attributes: ``id``, ``sandbox_id``, ``parent`` (the previous checkpoint of the
    lineage), ``label``, ``created_at``, ``image_bytes`` (the process images' size),
    ``duration_ms``, ``method``, ``phases_ms``, ``fs_volume``, ``images``; ``resident``
    (its processes are held as frozen copies, so a rollback of its sandbox forks them) and
    ``resident_memory_bytes`` (the memory only those copies hold), both filled by
    ``refresh``; ``raw``.
    """

    def __init__(self, client: Client, data: Dict[str, Any]):
        self.client = client
        self._update(data)

    def _update(self, d: Dict[str, Any]) -> "Checkpoint":
        self.raw: Dict[str, Any] = d
        self.id: str = d.get("id", "")
        self.sandbox_id: str = d.get("sandbox_id", "")
        self.parent: str = d.get("parent") or ""
        self.label: str = d.get("label") or ""
        self.created_at: Optional[_dt.datetime] = parse_time(d.get("created_at"))
        self.fs_volume: str = d.get("fs_volume", "")
        self.images: str = d.get("images", "")
        self.image_bytes: int = int(d.get("image_bytes") or 0)
        self.duration_ms: float = float(d.get("duration_ms") or 0)
        self.method: str = d.get("method", "")
        self.phases_ms: Dict[str, float] = dict(d.get("phases_ms") or {})
        self.resident: bool = bool(d.get("resident"))
        self.resident_memory_bytes: int = int(d.get("resident_memory_bytes") or 0)
        return self

    def __repr__(self) -> str:
        return "<Checkpoint %s%s of %s>" % (self.id, (" %r" % self.label) if self.label else "", self.sandbox_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("checkpoint", self.id))

    def refresh(self) -> "Checkpoint":
        """Re-read the checkpoint from the daemon."""
        return self._update(self.client._t.call("GET", "/v1/checkpoints/" + quote(self.id)))

    def fork(self, count: int = 1, **kw: Any) -> List[Sandbox]:
        """Make ``count`` new sandboxes at this checkpoint, in parallel (keyword arguments:
        labels, ttl, session, run, expiry_policy, idle_timeout; see :meth:`Client.fork`)."""
        return self.client.fork(self, count, **kw)

    def prewarm(self, count: int = 1) -> int:
        """Make ``count`` standbys of this checkpoint ready (those already ready count),
        so that the next ``count`` rollbacks or forks to it are thaws; return how many
        are ready (see :meth:`Client.prewarm`)."""
        return self.client.prewarm(self, count)

    def standbys(self) -> int:
        """How many standbys of this checkpoint are ready."""
        return self.client.standbys(self)

    def delete(self, cascade: bool = False) -> List[str]:
        """Delete the checkpoint (with ``cascade``, its subtree); return the IDs deleted."""
        return self.client.delete_checkpoint(self, cascade)

    def diff(self, other: Union["Checkpoint", str]) -> List[Change]:
        """The paths that differ between this checkpoint's filesystem and ``other``'s."""
        return self.client.diff(self, other)


class Tree:
    """The lineage of a sandbox: ``sandbox`` (its ID), ``head`` (the checkpoint its state
    descends from) and ``checkpoints`` (oldest first). Iterable; ``str(tree)`` draws it."""

    def __init__(self, sandbox: str, head: str, checkpoints: List[Checkpoint]):
        self.sandbox = sandbox
        self.head = head
        self.checkpoints = checkpoints

    @classmethod
    def _from_json(cls, client: Client, d: Dict[str, Any]) -> "Tree":
        d = d or {}
        return cls(d.get("sandbox", ""), d.get("head") or "",
                   [Checkpoint(client, c) for c in d.get("checkpoints") or []])

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(self.checkpoints)

    def __len__(self) -> int:
        return len(self.checkpoints)

    def __repr__(self) -> str:
        return "<Tree of %s: %d checkpoints, head %s>" % (self.sandbox, len(self.checkpoints), self.head or "-")

    def get(self, id: str) -> Optional[Checkpoint]:
        """The checkpoint ``id`` of this lineage, or None."""
        return next((c for c in self.checkpoints if c.id == id), None)

    def find(self, label: str) -> List[Checkpoint]:
        """The checkpoints labelled ``label``."""
        return [c for c in self.checkpoints if c.label == label]

    def children(self, id: Optional[str]) -> List[Checkpoint]:
        """The checkpoints whose parent is ``id`` (None: the roots of this lineage)."""
        ids = {c.id for c in self.checkpoints}
        if id is None:
            return [c for c in self.checkpoints if not c.parent or c.parent not in ids]
        return [c for c in self.checkpoints if c.parent == id]

    def render(self) -> str:
        """The lineage drawn as an indented tree with labels, sizes and times."""
        lines = ["sandbox %s (head %s)" % (self.sandbox, self.head or "-")]

        def walk(c: Checkpoint, prefix: str, last: bool) -> None:
            size = "%.1f MB" % (c.image_bytes / 1e6)
            when = c.created_at.strftime("%Y-%m-%d %H:%M:%S") if c.created_at else "?"
            mark = " <- head" if c.id == self.head else ""
            label = (" %r" % c.label) if c.label else ""
            lines.append("%s%s %s%s  %s  %s  %.0f ms%s" % (prefix, "└─" if last else "├─", c.id, label, size, when,
                                                           c.duration_ms, mark))
            kids = self.children(c.id)
            for i, k in enumerate(kids):
                walk(k, prefix + ("   " if last else "│  "), i == len(kids) - 1)

        roots = self.children(None)
        for i, r in enumerate(roots):
            walk(r, "", i == len(roots) - 1)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


class EventStream:
    """An open lifecycle event stream (:meth:`Client.events`): iterate it for
    :class:`Event` objects as they happen. Iteration ends when the daemon ends the
    stream (it shuts down); a client that fell more than 1024 events behind gets
    :class:`Unavailable` (reconnect and re-list). Close it when done (or use ``with``)."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, where: str):
        self._conn = conn
        self._where = where
        self._msgs = parse_sse(iter_lines(resp))
        self.closed = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        if self.closed:
            raise StopIteration
        try:
            msg = next(self._msgs)
        except StopIteration:
            self.close()
            raise
        except socket.timeout:
            self.close()
            raise Timeout("cairnd at %s: no event within the timeout" % self._where, status=None) from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            closed_by_us = self.closed
            self.close()
            if closed_by_us:
                raise StopIteration from None
            raise Unavailable("cairnd at %s: the event stream broke: %s" % (self._where, e), status=None) from None
        if msg.event == "lagged":
            self.close()
            raise Unavailable("event stream dropped: this client fell more than 1024 events behind; reconnect",
                              status=None)
        try:
            return Event.from_json(json.loads(msg.data))
        except ValueError as e:
            raise Unavailable("cairnd at %s: bad event %r: %s" % (self._where, msg.data[:200], e), status=None) from None

    def next(self) -> Event:
        """The next event (blocks; see the class for how it ends)."""
        return next(self)

    def close(self) -> None:
        """End the subscription."""
        self.closed = True
        self._conn.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

