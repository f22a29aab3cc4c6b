"""Record types of the cairn SDK (plain dataclasses built from cairnd's JSON)."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import CommandFailed

__all__ = ["parse_time", "Limits", "ExitStatus", "RunResult", "FileInfo", "Template", "Change",
           "Event", "Health", "GCReport"]

_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$")


def parse_time(s: Optional[str]) -> Optional[_dt.datetime]:
    """Parse an RFC 3339 time as cairnd writes it (nanoseconds, "Z") into an aware
    datetime (fraction truncated to microseconds). None or "" gives None."""
    if not s:
        return None
    m = _TIME.match(s)
    if not m:
        return _dt.datetime.fromisoformat(s)
    base, frac, tz = m.groups()
    t = _dt.datetime.strptime(base, "%Y-%m-%dT%H:%M:%S")
    if frac:
        t = t.replace(microsecond=int((frac + "000000")[:6]))
    if not tz or tz == "Z":
        return t.replace(tzinfo=_dt.timezone.utc)
    sign = 1 if tz[0] == "+" else -1
    off = _dt.timedelta(hours=int(tz[1:3]), minutes=int(tz[4:6]))
    return t.replace(tzinfo=_dt.timezone(sign * off))


@dataclass
class Limits:
    """Resource limits of a sandbox (0: unlimited)."""

    memory_bytes: int = 0
    pids: int = 0
    cpus: float = 0.0

    @classmethod
    def from_json(cls, d: Optional[Dict[str, Any]]) -> "Limits":
        """Build from the API's JSON object."""
        d = d or {}
        return cls(memory_bytes=int(d.get("memory_bytes") or 0), pids=int(d.get("pids") or 0),
                   cpus=float(d.get("cpus") or 0))

    def to_json(self) -> Dict[str, Any]:
        """The API's JSON object (zero fields left out)."""
        out: Dict[str, Any] = {}
        if self.memory_bytes:
            out["memory_bytes"] = int(self.memory_bytes)
        if self.pids:
            out["pids"] = int(self.pids)
        if self.cpus:
            out["cpus"] = float(self.cpus)
        return out


@dataclass
class ExitStatus:
    """How a process ended: ``code`` (128+N if killed by signal N), ``signal`` (0 if it
    exited by itself) and when."""

    code: int
    signal: int = 0
    exited_at: Optional[_dt.datetime] = None

    @classmethod
    def from_json(cls, d: Optional[Dict[str, Any]]) -> Optional["ExitStatus"]:
        """Build from the API's JSON object (None stays None)."""
        if not d:
            return None
        return cls(code=int(d.get("code", 0)), signal=int(d.get("signal") or 0), exited_at=parse_time(d.get("exited_at")))


@dataclass
class RunResult:
    """The outcome of :meth:`Sandbox.run`: the exit status and the whole output.

    ``stdout``/``stderr`` are text (UTF-8, undecodable bytes replaced); the exact bytes
    are in ``stdout_bytes``/``stderr_bytes``.
    """

    args: List[str]
    exit_code: int = -1
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    handle: str = ""
    signal: int = 0
    timed_out: bool = False
    duration: float = 0.0

    @property
    def stdout(self) -> str:
        """Standard output as text."""
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        """Standard error as text."""
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """True if the command exited with status 0."""
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> "RunResult":
        """Return self if the command succeeded, else raise :class:`CommandFailed`."""
        if not self.ok:
            tail = (self.stderr or self.stdout).strip()[-500:]
            raise CommandFailed("%s exited with status %d%s" % (self.args, self.exit_code,
                                                                 (": " + tail) if tail else ""), result=self)
        return self


@dataclass
class FileInfo:
    """A path inside a sandbox. ``mode`` is as ls shows it ("-rw-r--r--")."""

    name: str
    path: str
    size: int
    mode: str
    is_dir: bool
    mod_time: Optional[_dt.datetime] = None
    link: str = ""

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "FileInfo":
        """Build from the API's JSON object."""
        return cls(name=d.get("name", ""), path=d.get("path", ""), size=int(d.get("size") or 0),
                   mode=d.get("mode", ""), is_dir=bool(d.get("is_dir")), mod_time=parse_time(d.get("mod_time")),
                   link=d.get("link") or "")


@dataclass
class Template:
    """A read-only root filesystem sandboxes are created from."""

    name: str
    volume: str = ""
    source: str = ""
    bytes: int = 0
    created_at: Optional[_dt.datetime] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Template":
        """Build from the API's JSON object."""
        return cls(name=d.get("name", ""), volume=d.get("volume", ""), source=d.get("source", ""),
                   bytes=int(d.get("bytes") or 0), created_at=parse_time(d.get("created_at")))


@dataclass
class Change:
    """A path that differs between two checkpoints: ``kind`` is added, changed or deleted."""

    kind: str
    path: str


@dataclass
class Event:
    """A lifecycle event (``type``: created, checkpointed, rolled_back, forked, paused,
    resumed, stopped, expired, destroyed). ``checkpoint`` is the new checkpoint
    (checkpointed), the target (rolled_back), the source (forked) or the pause checkpoint
    (paused); ``reason`` says why for paused, destroyed and resumed."""

    seq: int
    type: str
    time: Optional[_dt.datetime]
    sandbox_id: str
    checkpoint: str = ""
    session_id: str = ""
    run_id: str = ""
    labels: Dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Event":
        """Build from the API's JSON object."""
        return cls(seq=int(d.get("seq") or 0), type=d.get("type", ""), time=parse_time(d.get("time")),
                   sandbox_id=d.get("sandbox_id", ""), checkpoint=d.get("checkpoint") or "",
                   session_id=d.get("session_id") or "", run_id=d.get("run_id") or "",
                   labels=dict(d.get("labels") or {}), reason=d.get("reason") or "")


@dataclass
class Health:
    """The daemon's health (GET /v1/health)."""

    status: str
    version: str
    uptime_seconds: float
    data_dir: str
    sandboxes: int

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Health":
        """Build from the API's JSON object."""
        return cls(status=d.get("status", ""), version=d.get("version", ""),
                   uptime_seconds=float(d.get("uptime_seconds") or 0), data_dir=d.get("data_dir", ""),
                   sandboxes=int(d.get("sandboxes") or 0))


@dataclass
class GCReport:
    """What garbage collection removed: checkpoint IDs and pool volumes."""

    checkpoints: List[str]
    volumes: List[str]
