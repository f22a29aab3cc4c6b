package client

import (
	"context"
	"io"
	"io/fs"
	"syscall"

	"github.com/cairn-sandbox/cairn/engine/model"
)

// Backend is cairn as the CLI uses it, so that one code path serves users whether
// cairnd runs or not: *Client implements it over the API, and the CLI's in-process
// adapter over the engine. It is the engine's method set in the API's types; a
// sandbox from the in-process backend has no session fields.
type Backend interface {
	Create(ctx context.Context, req CreateRequest) (*Sandbox, error)
	Get(ctx context.Context, id string) (*Sandbox, error)
	List(ctx context.Context, opts ListOptions) ([]*Sandbox, error)
	Remove(ctx context.Context, id string) error
	Stop(ctx context.Context, id string) (*Sandbox, error)
	Resume(ctx context.Context, id string) (*Sandbox, error)

	// Spawn starts a process whose standard input stays open until Stdin with eof.
	Spawn(ctx context.Context, id string, req ExecRequest) (*Process, error)
	Stdin(ctx context.Context, id, handle string, data []byte, eof bool) error
	Signal(ctx context.Context, id, handle string, sig syscall.Signal) error
	Processes(ctx context.Context, id string) ([]*Process, error)
	Process(ctx context.Context, id, handle string) (*Process, error)
	Output(ctx context.Context, id, handle, stream string, offset int64) ([]byte, int64, error)
	Follow(ctx context.Context, id, handle string, stdout, stderr io.Writer) (*ExitStatus, error)
	Wait(ctx context.Context, id, handle string) (*ExitStatus, error)
	// RemoveProcess deletes the record of an exited process.
	RemoveProcess(ctx context.Context, id, handle string) error

	Checkpoint(ctx context.Context, id string, req CheckpointRequest) (*Checkpoint, error)
	Rollback(ctx context.Context, id, checkpoint string) (*Sandbox, error)
	Fork(ctx context.Context, checkpoint string, req ForkRequest) ([]*Sandbox, error)
	// Prewarm prepares count standbys of a checkpoint and returns how many are ready;
	// Standbys only counts them.
	Prewarm(ctx context.Context, checkpoint string, count int) (int, error)
	Standbys(ctx context.Context, checkpoint string) (int, error)
	Tree(ctx context.Context, id string) (*Tree, error)
	GetCheckpoint(ctx context.Context, id string) (*Checkpoint, error)
	DeleteCheckpoint(ctx context.Context, id string, cascade bool) ([]string, error)
	Diff(ctx context.Context, from, to string) ([]model.Change, error)
	GC(ctx context.Context) (*GCReport, error)

	ReadFile(ctx context.Context, id, path string) ([]byte, error)
	WriteFile(ctx context.Context, id, path string, data []byte, mode fs.FileMode) (*FileInfo, error)
	Stat(ctx context.Context, id, path string) (*FileInfo, error)
	ListDir(ctx context.Context, id, path string) ([]*FileInfo, error)
	RemovePath(ctx context.Context, id, path string) error

	BuildTemplate(ctx context.Context, req TemplateRequest) (*Template, error)
	Templates(ctx context.Context) ([]*Template, error)
	RemoveTemplate(ctx context.Context, name string) error
}

var _ Backend = (*Client)(nil)
