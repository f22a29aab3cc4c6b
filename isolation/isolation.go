// Package isolation defines the boundary a sandbox's processes run inside, and how their
// state is captured and brought back.
//
// Vocabulary and lifecycle. A Sandbox is described to a Backend by its ID, hostname,
// limits and Root: the host path of the writable filesystem the sandbox sees as "/".
// Start boots the sandbox's init on Root; processes are then started with Exec and
// addressed by handle. Checkpoint captures the process tree into an image directory
// while the sandbox keeps running; inside it, the backend calls back into the caller
// while the tree is frozen, so the caller can snapshot the filesystem at the same
// instant. Restore boots a sandbox from an image directory onto a Root holding the
// filesystem captured with it. Stop ends every process of the sandbox. A stopped
// sandbox can be Restored again; a running one is Stopped before its Root changes.
//
// Process handles, the exit status and the output of each process live in the sandbox's
// own filesystem (see package initctl), so they are captured, rolled back and forked
// with the rest of the state.
package isolation

import (
	"context"
	"errors"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/internal/initctl"
)

// DefaultMemoryBytes is the memory limit of a sandbox created without one, on every
// backend.
const DefaultMemoryBytes = 2 << 30

// Limits caps a sandbox's resources; zero means the backend's default.
type Limits struct {
	MemoryBytes int64   `json:"memory_bytes,omitempty"`
	Pids        int64   `json:"pids,omitempty"`
	CPUs        float64 `json:"cpus,omitempty"`
}

// Sandbox is a backend's view of one sandbox.
type Sandbox struct {
	ID       string
	Hostname string
	Root     string
	Limits   Limits
	// Cgroup names the sandbox's cgroups (default: ID). A sandbox restored onto a new
	// root gets new cgroups while the old tree may still be exiting from its own.
	Cgroup string
	// Init identifies the running init, set by Start and Restore; zero when stopped.
	Init Proc
}

// CgroupName is the name of the sandbox's cgroups.
func (sb *Sandbox) CgroupName() string {
	if sb.Cgroup != "" {
		return sb.Cgroup
	}
	return sb.ID
}

// FrozenRestorer is implemented by backends that can restore a tree without letting
// any of its instructions run, for standby copies that a rollback or fork activates.
type FrozenRestorer interface {
	// RestoreFrozen is Restore, but the tree stays frozen until Activate.
	RestoreFrozen(ctx context.Context, sb *Sandbox, dir string) error
}

// Activator is implemented by backends with FrozenRestorer.
type Activator interface {
	// Activate gives a tree restored by RestoreFrozen the identity in sb (hostname)
	// and lets it run.
	Activate(ctx context.Context, sb *Sandbox) error
}

// MemoryReporter is implemented by backends that can tell how much memory a sandbox's
// processes hold; the engine sizes its standby cache with it.
type MemoryReporter interface {
	// MemoryBytes is the anonymous memory resident for the sandbox's processes.
	MemoryBytes(sb *Sandbox) (int64, error)
}

// Resident is implemented by backends that can keep a checkpoint in memory, as zygotes:
// frozen copy-on-write copies of the sandbox's processes, which a rollback of the same
// sandbox forks again. Neither path copies memory. A resident checkpoint's directory
// holds a record of its zygotes at first; MakeDurable adds process images (off the
// critical path), after which Restore and RestoreFrozen accept the directory like any
// other and the zygotes are a cache that DropResident may end.
type Resident interface {
	// CheckpointResident is Checkpoint keeping the processes as zygotes: hooks.Frozen
	// runs while they are stopped and their zygotes exist. If the sandbox's processes
	// cannot be kept so, it returns an error wrapping ErrNotResident with the reason, and
	// the sandbox runs on unchanged.
	CheckpointResident(ctx context.Context, sb *Sandbox, dir string, hooks Hooks) error
	// RollbackResident brings sb's processes back to the resident checkpoint in dir: it
	// kills them, calls hooks.Revert, which must bring sb.Root's files back to the
	// checkpoint's in place (the zygotes' descriptors point at its inodes), and forks the
	// checkpoint's processes from the zygotes (Revert may run on a goroutine of its own,
	// beside the forks). ErrNotResident if the zygotes are gone or
	// belong to another generation of the sandbox (nothing was done then); any other
	// error leaves sb without its processes, to be restored from images.
	RollbackResident(ctx context.Context, sb *Sandbox, dir string, hooks RollbackHooks) error
	// RollbackDurable is RollbackResident for a checkpoint of sb made durable whose
	// zygotes are gone: the processes are restored from its images into sb's running
	// init, so that sb keeps its generation and its other checkpoints' zygotes stay
	// usable. ErrNotResident if the images cannot be restored so (nothing was done).
	RollbackDurable(ctx context.Context, sb *Sandbox, dir string, hooks RollbackHooks) error
	// MakeDurable writes process images of the resident checkpoint in dir, from its
	// zygotes, so that it outlives them. sb is the sandbox they belong to.
	MakeDurable(ctx context.Context, sb *Sandbox, dir string) error
	// IsResident reports whether dir's zygotes are alive and belong to sb as it runs.
	IsResident(sb *Sandbox, dir string) bool
	// DropResident kills dir's zygotes (if any).
	DropResident(dir string) error
	// ResidentMemory is the memory the zygotes of sb hold and its processes do not (the
	// old versions of the pages they wrote since): what ending every zygote of sb would
	// free, each page counted once. It counts against sb's memory limit.
	ResidentMemory(sb *Sandbox) (int64, error)
	// CheckpointMemory is the memory only dir's zygotes map, which DropResident(dir)
	// frees (0 without zygotes).
	CheckpointMemory(dir string) (int64, error)
}

// RollbackHooks are called by a rollback in place (Resident).
type RollbackHooks struct {
	// Quiesced, if set, is called before the sandbox's processes are killed, while they
	// are stopped and nothing writes in sb.Root: neither they nor anything the backend
	// runs there (its init, its CRIU). A backend that cannot bring the sandbox to that
	// state does not call it.
	Quiesced func(ctx context.Context)
	// Revert must bring sb.Root's files back to the checkpoint's in place; it is called
	// once the processes are gone, and nothing writes in sb.Root until it returns.
	// asQuiesced says that the root holds again exactly what it held when Quiesced was
	// called, but for the change times of the directories of the killed processes'
	// records (the backend removed the exit records their deaths left); false when the
	// backend cannot vouch for that, or Quiesced was not set.
	Revert func(ctx context.Context, asQuiesced bool) error
	// Returned, if set, is closed once the caller is done with the rollback (its new
	// head recorded), as its call returns. What the backend leaves for afterwards (a
	// rewind's scan of the pages it copied back) waits for it, instead of taking a CPU
	// from the end of the call.
	Returned <-chan struct{}
}

// ErrNotResident says that a sandbox cannot be kept, or is not kept, as zygotes.
var ErrNotResident = errors.New("not resident")

// Proc identifies a host process across PID reuse.
type Proc struct {
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
}

// ProcSpec describes a process to start.
type ProcSpec = initctl.ProcSpec

// Hooks are called by Checkpoint while the sandbox's processes are frozen.
type Hooks struct {
	// Frozen captures the filesystem; an error aborts the checkpoint and thaws. It may
	// run on a goroutine of its own while the backend works on the stopped processes
	// (resident checkpoints: beside the forks of the zygotes).
	Frozen func(ctx context.Context) error
	// Dumped, if set, is called when the process state is written but the backend still
	// holds the processes (CRIU's post-dump; container only). Crash tests die there.
	Dumped func()
	// Phase, if set, is told how long each phase took ("freeze", "dump", "thaw"); it
	// may be called from two goroutines at once.
	Phase func(name string, d time.Duration)
}

// Report calls h.Phase if set.
func (h Hooks) Report(name string, start time.Time) {
	if h.Phase != nil {
		h.Phase(name, time.Since(start))
	}
}

// Backend runs sandboxes. Implementations are safe for concurrent use on distinct
// sandboxes; calls on one sandbox are serialized by the caller.
type Backend interface {
	// Name is the isolation kind: "container", "gvisor".
	Name() string
	// Start boots the sandbox's init on sb.Root and sets sb.Init.
	Start(ctx context.Context, sb *Sandbox) error
	// Exec starts a process under handle.
	Exec(ctx context.Context, sb *Sandbox, handle string, spec ProcSpec) error
	// Signal sends sig to the process (and its process group).
	Signal(ctx context.Context, sb *Sandbox, handle string, sig syscall.Signal) error
	// WriteStdin writes data to the process's stdin, then closes it if eof.
	WriteStdin(ctx context.Context, sb *Sandbox, handle string, data []byte, eof bool) error
	// RemoveRecord deletes the record of a process that has exited (its directory under
	// /.cairn/proc), from inside the running sandbox.
	RemoveRecord(ctx context.Context, sb *Sandbox, handle string) error
	// Checkpoint freezes the sandbox, calls hooks.Frozen, dumps the process tree into
	// dir (which exists and is empty) and thaws. On error the sandbox runs on unchanged.
	Checkpoint(ctx context.Context, sb *Sandbox, dir string, hooks Hooks) error
	// Restore starts the process tree dumped in dir on sb.Root and sets sb.Init.
	Restore(ctx context.Context, sb *Sandbox, dir string) error
	// Stop kills every process of the sandbox and releases its host resources.
	Stop(ctx context.Context, sb *Sandbox) error
	// Running reports whether sb.Init is alive.
	Running(sb *Sandbox) bool
}

// CostlyCalls is implemented by backends whose every call into a sandbox starts a
// program on the host (gVisor: a runsc exec, ~30-100 ms): the engine takes the calls it
// can off the caller's path (the removal of a process record after a foreground exec).
type CostlyCalls interface {
	CostlyCalls() bool
}
