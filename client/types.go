package client

import (
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
)

// The wire types of cairnd's HTTP API (/v1). The server (package api) encodes exactly
// these; api/openapi.yaml describes them and a test holds the two together.

// Sandbox states as the API reports them: the engine's "running" and "stopped", and
// "paused" for a sandbox the daemon checkpointed and stopped itself (idle or expired
// with policy "pause"); a paused sandbox keeps its state in its head checkpoint.
const (
	StateRunning = model.StateRunning
	StateStopped = model.StateStopped
	StatePaused  = "paused"
)

// Expiry policies: what happens to a sandbox when its TTL runs out.
const (
	ExpireDestroy = "destroy"
	ExpirePause   = "pause"
)

// Sandbox is a sandbox with its session: the engine's record plus what the daemon keeps
// about its lifetime (cairnd always fills the session fields; the in-process backend of
// the CLI has none, and leaves them out).
type Sandbox struct {
	model.Sandbox
	// SessionID groups the sandboxes of one agent session (generated when not given);
	// forks inherit it unless told otherwise.
	SessionID string `json:"session_id,omitempty"`
	// RunID is an optional caller-chosen run identifier (e.g. an RL run).
	RunID string `json:"run_id,omitempty"`
	// ExpiresAt is when the TTL runs out; ExpiryPolicy says what happens then.
	ExpiresAt    time.Time `json:"expires_at,omitzero"`
	ExpiryPolicy string    `json:"expiry_policy,omitempty"`
	// IdleTimeoutSeconds is how long the sandbox may go without API activity before the
	// daemon pauses it (0: never).
	IdleTimeoutSeconds int64     `json:"idle_timeout_seconds,omitempty"`
	LastActivityAt     time.Time `json:"last_activity_at,omitzero"`
	// PausedReason is "idle" or "expired" while State is "paused".
	PausedReason string `json:"paused_reason,omitempty"`
}

// CreateRequest is the body of POST /v1/sandboxes.
type CreateRequest struct {
	Template  string            `json:"template,omitempty"`
	Isolation string            `json:"isolation,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
	Limits    isolation.Limits  `json:"limits,omitzero"`
	Lifetime
}

// Lifetime is the session part of a create or fork request. Zero fields take the
// daemon's defaults.
type Lifetime struct {
	SessionID string `json:"session_id,omitempty"`
	RunID     string `json:"run_id,omitempty"`
	// TTLSeconds is the sandbox's time to live (default --default-ttl, at most --max-ttl).
	TTLSeconds int64 `json:"ttl_seconds,omitempty"`
	// ExpiryPolicy is "destroy" (default) or "pause".
	ExpiryPolicy string `json:"expiry_policy,omitempty"`
	// IdleTimeoutSeconds overrides --idle-timeout for this sandbox; -1 disables idle pause.
	IdleTimeoutSeconds int64 `json:"idle_timeout_seconds,omitempty"`
}

// UpdateRequest is the body of PATCH /v1/sandboxes/{id}: absent fields are unchanged.
type UpdateRequest struct {
	// TTLSeconds sets the expiry to now + TTLSeconds (at most --max-ttl from now).
	TTLSeconds         *int64  `json:"ttl_seconds,omitempty"`
	ExpiryPolicy       *string `json:"expiry_policy,omitempty"`
	IdleTimeoutSeconds *int64  `json:"idle_timeout_seconds,omitempty"`
}

// SandboxList is the body of GET /v1/sandboxes.
type SandboxList struct {
	Sandboxes []*Sandbox `json:"sandboxes"`
}

// ListOptions filter GET /v1/sandboxes; every given filter must match.
type ListOptions struct {
	Labels  map[string]string // label=k=v, repeatable
	Session string
	Run     string
	State   string
}

// ExecRequest is the body of POST .../processes (detached) and POST .../exec (streamed).
type ExecRequest struct {
	Args []string `json:"args"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	Tty  bool     `json:"tty,omitempty"`
	// Stdin, for POST .../exec only, is written to the process's standard input, which
	// is then closed (absent: empty standard input).
	Stdin string `json:"stdin,omitempty"`
	// TimeoutSeconds, for POST .../exec only, kills the process (SIGKILL) after this
	// long; the end line then says timed_out.
	TimeoutSeconds float64 `json:"timeout_seconds,omitempty"`
	// Keep, for POST .../exec only, keeps the process's record (output, exit status)
	// after the stream's end, for GET .../processes/{handle}; by default it is removed.
	Keep bool `json:"keep,omitempty"`
}

// Process is a process started in a sandbox.
type Process = model.Process

// ExitStatus is how a process ended.
type ExitStatus = initctl.ExitStatus

// ProcessList is the body of GET .../processes.
type ProcessList struct {
	Processes []*Process `json:"processes"`
}

// StdinRequest is the body of POST .../processes/{handle}/stdin: Data (text) or
// DataBase64 (bytes), then the standard input is closed if EOF.
type StdinRequest struct {
	Data       string `json:"data,omitempty"`
	DataBase64 []byte `json:"data_base64,omitempty"`
	EOF        bool   `json:"eof,omitempty"`
}

// SignalRequest is the body of POST .../processes/{handle}/signal. Signal is a name
// ("TERM", "SIGKILL") or a number ("9").
type SignalRequest struct {
	Signal string `json:"signal"`
}

// Chunk is one line of an NDJSON output stream (POST .../exec, GET .../output).
//
// Type "started" (exec only) names the handle; "stdout" and "stderr" carry output, as
// Data when the bytes are UTF-8 (a chunk never splits a UTF-8 sequence) and as
// DataBase64 otherwise; "end" is always the last line and carries the exit status when
// the process has exited, plus the offsets to resume from; "error" replaces "end" when
// the stream fails after it started.
type Chunk struct {
	Type         string      `json:"type"`
	Handle       string      `json:"handle,omitempty"`
	Data         string      `json:"data,omitempty"`
	DataBase64   []byte      `json:"data_base64,omitempty"`
	Exit         *ExitStatus `json:"exit,omitempty"`
	TimedOut     bool        `json:"timed_out,omitempty"`
	StdoutOffset int64       `json:"stdout_offset,omitempty"`
	StderrOffset int64       `json:"stderr_offset,omitempty"`
	Code         string      `json:"code,omitempty"`
	Detail       string      `json:"detail,omitempty"`
}

// Chunk types.
const (
	ChunkStarted = "started"
	ChunkStdout  = "stdout"
	ChunkStderr  = "stderr"
	ChunkEnd     = "end"
	ChunkError   = "error"
)

// CheckpointRequest is the body of POST /v1/sandboxes/{id}/checkpoints.
type CheckpointRequest struct {
	Label string `json:"label,omitempty"`
	// Durable waits until the checkpoint is on disk whole before answering: a resident
	// checkpoint (method "zygote", held in memory by frozen copies of the processes)
	// otherwise gets its durable copy a fraction of a second later, in the background.
	Durable bool `json:"durable,omitempty"`
}

// Checkpoint is a joint (filesystem, process tree) checkpoint.
type Checkpoint = model.Checkpoint

// RollbackRequest is the body of POST /v1/sandboxes/{id}/rollback.
type RollbackRequest struct {
	Checkpoint string `json:"checkpoint"`
}

// ForkRequest is the body of POST /v1/checkpoints/{id}/fork. Forks inherit the source
// sandbox's labels (Labels are added on top), session and run unless given.
type ForkRequest struct {
	Count  int               `json:"count,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
	Lifetime
}

// PrewarmRequest is the body of POST /v1/checkpoints/{id}/prewarm. Count (1 to 256) is
// how many standbys to prepare; absent, 1. A pointer, so that an explicit 0 is refused
// rather than taken for the default.
type PrewarmRequest struct {
	Count *int `json:"count,omitempty"`
}

// Standbys is the body of POST /v1/checkpoints/{id}/prewarm and GET
// /v1/checkpoints/{id}/standbys: how many standbys of the checkpoint are ready. A
// standby is the checkpoint restored ahead of time and kept frozen, so that a rollback
// or fork to it is a thaw (milliseconds) instead of a restore.
type Standbys struct {
	Checkpoint string `json:"checkpoint"`
	Standbys   int    `json:"standbys"`
}

// Tree is the body of GET /v1/sandboxes/{id}/tree: the checkpoints of a sandbox's
// lineage, oldest first.
type Tree struct {
	Sandbox     string        `json:"sandbox"`
	Head        string        `json:"head"`
	Checkpoints []*Checkpoint `json:"checkpoints"`
}

// Removed lists what a delete removed.
type Removed struct {
	Removed []string `json:"removed"`
}

// ChangeList is the body of GET /v1/checkpoints/{from}/diff/{to}.
type ChangeList struct {
	Changes []model.Change `json:"changes"`
}

// FileInfo describes a path inside a sandbox.
type FileInfo = model.FileInfo

// FileList is the body of GET .../files/list.
type FileList struct {
	Entries []*FileInfo `json:"entries"`
}

// Template is a read-only root filesystem sandboxes are created from.
type Template = model.Template

// TemplateList is the body of GET /v1/templates.
type TemplateList struct {
	Templates []*Template `json:"templates"`
}

// TemplateRequest is the body of POST /v1/templates: exactly one of Debian, Dir, OCI.
type TemplateRequest struct {
	Name   string        `json:"name"`
	Debian *DebianSource `json:"debian,omitempty"`
	Dir    string        `json:"dir,omitempty"`
	OCI    string        `json:"oci,omitempty"`
}

// DebianSource configures a debootstrap build; zero fields take the defaults.
type DebianSource struct {
	Suite    string   `json:"suite,omitempty"`
	Variant  string   `json:"variant,omitempty"`
	Packages []string `json:"packages,omitempty"`
	Mirror   string   `json:"mirror,omitempty"`
}

// GCReport says what GC removed.
type GCReport = model.GCReport

// Health is the body of GET /v1/health.
type Health struct {
	Status        string  `json:"status"`
	Version       string  `json:"version"`
	UptimeSeconds float64 `json:"uptime_seconds"`
	DataDir       string  `json:"data_dir"`
	Sandboxes     int     `json:"sandboxes"`
}

// Event is one lifecycle event of GET /v1/events (server-sent events: "id" is Seq,
// "event" is Type, "data" this object as JSON).
type Event struct {
	Seq        uint64            `json:"seq"`
	Type       string            `json:"type"`
	Time       time.Time         `json:"time"`
	SandboxID  string            `json:"sandbox_id"`
	Checkpoint string            `json:"checkpoint,omitempty"`
	SessionID  string            `json:"session_id,omitempty"`
	RunID      string            `json:"run_id,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
	// Reason says why, for paused ("idle", "expired", "shutdown"), destroyed
	// ("expired", "api") and resumed ("api", "activity").
	Reason string `json:"reason,omitempty"`
}

// Event types.
const (
	EventCreated      = "created"
	EventCheckpointed = "checkpointed"
	EventRolledBack   = "rolled_back"
	EventForked       = "forked"
	EventPaused       = "paused"
	EventResumed      = "resumed"
	EventStopped      = "stopped"
	EventExpired      = "expired"
	EventDestroyed    = "destroyed"
)

// Problem is the body of every error response (RFC 9457), with Code the stable
// errdefs code ("not_found", "invalid_argument", ...).
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Code   string `json:"code"`
	Detail string `json:"detail"`
}
