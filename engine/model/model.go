// Package model holds the records the engine keeps and returns: sandboxes, checkpoints,
// templates, processes.
package model

import (
	"time"

	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
)

// Sandbox states.
const (
	StateRunning = "running"
	StateStopped = "stopped"
)

// Sandbox is the engine's record of a sandbox.
type Sandbox struct {
	ID        string `json:"id"`
	Template  string `json:"template"`
	Isolation string `json:"isolation"`
	State     string `json:"state"`
	Hostname  string `json:"hostname"`
	// Head is the checkpoint the sandbox's current state descends from: the last one
	// taken, or the one rolled back to or forked from ("" before the first).
	Head string `json:"head,omitempty"`
	// Origin is the checkpoint a fork started from ("" for a created sandbox).
	Origin    string            `json:"origin,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
	Limits    isolation.Limits  `json:"limits"`
	CreatedAt time.Time         `json:"created_at"`
	// Root is the pool volume the sandbox runs on.
	Root string         `json:"root"`
	Init isolation.Proc `json:"init"`
	// ResidentMemoryBytes is the memory the zygotes of the sandbox's resident
	// checkpoints hold beyond what its processes map: the old versions of the pages
	// written since, which count against its memory limit (filled by Inspect; bounded
	// by the engine's ResidentMemory).
	ResidentMemoryBytes int64 `json:"resident_memory_bytes,omitempty"`
	// ResidentCheckpoints is how many of its checkpoints are resident (filled by
	// Inspect; bounded by the engine's Residents).
	ResidentCheckpoints int `json:"resident_checkpoints,omitempty"`
}

// Checkpoint is a joint (filesystem, process tree) checkpoint.
type Checkpoint struct {
	ID        string    `json:"id"`
	SandboxID string    `json:"sandbox_id"`
	Parent    string    `json:"parent,omitempty"`
	Label     string    `json:"label,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	// FSVolume is the read-only pool volume of the filesystem half.
	FSVolume string `json:"fs_volume"`
	// Images is the pool-relative directory of the process images.
	Images     string  `json:"images"`
	ImageBytes int64   `json:"image_bytes"`
	DurationMS float64 `json:"duration_ms"`
	// Method says how the process half was captured: "criu-full" (a full CRIU dump),
	// "criu-incremental" (the dump rewritten in the background to hold only the pages
	// that differ from its parent's images), "criu-shared" (the dump rewritten in the
	// background so that its pages equal to its parent's share that data on disk: full
	// images, on the image pool), "runsc-save" (gVisor), "zygote" (frozen
	// copy-on-write forks of the processes, their durable copy pending) and "zygote-criu"
	// (the same, with CRIU images of each process written from them).
	Method string `json:"method"`
	// ImagesDepth is, for criu-incremental, how many parent image directories a restore
	// reads through (1: the parent's images are full).
	ImagesDepth int `json:"images_depth,omitempty"`
	// MethodReason says, in a sentence, why the checkpoint is stored as Method (filled
	// when one checkpoint is read, e.g. by `cairn inspect`).
	MethodReason string `json:"method_reason,omitempty"`
	// Resident says that the checkpoint's processes are held in memory by zygotes (method
	// "zygote" or "zygote-criu"): a rollback of its sandbox forks them again, without a
	// restore (filled when one checkpoint is read).
	Resident bool `json:"resident,omitempty"`
	// ResidentMemoryBytes is the memory only this checkpoint's zygotes map, which ending
	// them would free (filled when one checkpoint is read, if resident).
	ResidentMemoryBytes int64 `json:"resident_memory_bytes,omitempty"`
	// Isolation is the backend the checkpoint was taken with (its copies run on it).
	Isolation string `json:"isolation,omitempty"`
	// PhasesMS is where the critical path's time went, in milliseconds.
	PhasesMS map[string]float64 `json:"phases_ms,omitempty"`
}

// Template is a read-only root filesystem sandboxes are created from.
type Template struct {
	Name      string    `json:"name"`
	Volume    string    `json:"volume"`
	Source    string    `json:"source"`
	Bytes     int64     `json:"bytes"`
	CreatedAt time.Time `json:"created_at"`
}

// CreateOptions are the options of Create.
type CreateOptions struct {
	Template  string // default "debian"
	Isolation string // default: "gvisor" where runsc is installed, else "container"
	Labels    map[string]string
	Limits    isolation.Limits
}

// Process describes a process started with Exec.
type Process struct {
	Handle    string              `json:"handle"`
	Pid       int                 `json:"pid"`
	Args      []string            `json:"args"`
	Tty       bool                `json:"tty,omitempty"`
	Running   bool                `json:"running"`
	StartedAt time.Time           `json:"started_at"`
	Exit      *initctl.ExitStatus `json:"exit,omitempty"`
}

// ExecOptions describe a process to start.
type ExecOptions struct {
	Args []string
	Env  []string
	Cwd  string
	Tty  bool
	// NoStdin gives the process an empty stdin (foreground commands that must not wait).
	NoStdin bool
}

// Change is one path that differs between two checkpoints' filesystems.
type Change struct {
	Kind string `json:"kind"` // "added", "changed", "deleted"
	Path string `json:"path"`
}

// FileInfo describes a path inside a sandbox.
type FileInfo struct {
	Name    string    `json:"name"`
	Path    string    `json:"path"`
	Size    int64     `json:"size"`
	Mode    string    `json:"mode"`
	IsDir   bool      `json:"is_dir"`
	Link    string    `json:"link,omitempty"`
	ModTime time.Time `json:"mod_time"`
}

// GCReport says what GC removed.
type GCReport struct {
	Checkpoints []string `json:"checkpoints"`
	Volumes     []string `json:"volumes"`
}
