// Package initctl is the protocol between cairn on the host and cairn-init, the PID 1 of
// every container sandbox.
//
// Everything the two sides exchange lives inside the sandbox's own root filesystem, under
// Dir ("/.cairn"). No descriptor of the sandbox points outside it, so CRIU can dump and
// restore the whole process tree, stdio included, and the exchange itself rolls back and
// forks together with the processes:
//
//	/.cairn/init                 the cairn-init binary (copied in at create)
//	/.cairn/ctl                  FIFO; init holds it open read-write. The host writes one
//	                             request ID per line (atomic: lines are < PIPE_BUF).
//	/.cairn/req/<rid>.json       a Request, written by the host (temp name + rename)
//	/.cairn/resp/<rid>.json      its Response, written by init (temp name + rename)
//	/.cairn/proc/<handle>/spec.json  the process spec (written by init)
//	/.cairn/proc/<handle>/stdin  FIFO; init holds it open read-write until CloseStdin
//	/.cairn/proc/<handle>/stdout, stderr   append-only output files (pty mode: stdout only)
//	/.cairn/proc/<handle>/exit   ExitStatus JSON, written once by init when reaped
//	/.cairn/proc/<handle>/stdin.closed  present once the host closed the process's stdin
//	/.cairn/ready                written by init when it serves requests
//
// Process handles are chosen by the host ("p" + lowercase alphanumerics) and stay valid
// across checkpoint, rollback and fork because they live in the sandbox's state.
package initctl

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// Dir is the control directory, relative to the sandbox root.
const Dir = ".cairn"

// Paths inside Dir.
const (
	CtlFIFO   = "ctl"
	ReqDir    = "req"
	RespDir   = "resp"
	ProcDir   = "proc"
	ReadyFile = "ready"
	InitBin   = "init"
	LogFile   = "init.log"
)

// Ops.
const (
	OpSpawn      = "spawn"
	OpSignal     = "signal"
	OpCloseStdin = "close-stdin"
	OpResize     = "resize"
	OpPing       = "ping"
	// OpReload makes init learn its processes again from the files under ProcDir: every
	// process with a spec and no exit record that is alive and init's child. A rollback
	// in place sends it once the checkpoint's processes are forked again.
	OpReload = "reload"
	// OpRemove deletes the record (the directory under ProcDir) of a process that is
	// not running. Done by init, inside the sandbox: under gVisor the sentry caches what
	// it has seen of the root, and a checkpoint of it refers to files removed behind its
	// back, which its restore then cannot find.
	OpRemove = "remove"
)

// StdinClosed is the marker file of a process whose stdin the host closed.
const StdinClosed = "stdin.closed"

// Request is one command to init.
type Request struct {
	Op     string    `json:"op"`
	Handle string    `json:"handle,omitempty"`
	Spec   *ProcSpec `json:"spec,omitempty"`
	Signal int       `json:"signal,omitempty"`
	Rows   uint16    `json:"rows,omitempty"`
	Cols   uint16    `json:"cols,omitempty"`
}

// Response answers a Request.
type Response struct {
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
	Pid   int    `json:"pid,omitempty"`
}

// ProcSpec describes a process to start.
type ProcSpec struct {
	Args []string `json:"args"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	Tty  bool     `json:"tty,omitempty"`
	Rows uint16   `json:"rows,omitempty"`
	Cols uint16   `json:"cols,omitempty"`
	// NoStdin starts the process with stdin at end-of-file (/dev/null).
	NoStdin bool `json:"no_stdin,omitempty"`
}

// ExitStatus is how a process ended.
type ExitStatus struct {
	Code     int       `json:"code"`
	Signal   int       `json:"signal,omitempty"`
	ExitedAt time.Time `json:"exited_at"`
}

// ProcState is what init records about a process in spec.json.
type ProcState struct {
	Handle    string    `json:"handle"`
	Pid       int       `json:"pid"`
	Spec      ProcSpec  `json:"spec"`
	StartedAt time.Time `json:"started_at"`
}

var handleRE = regexp.MustCompile(`^[a-z0-9]{1,32}$`)

// ValidHandle reports whether h is a well-formed process handle.
func ValidHandle(h string) bool { return handleRE.MatchString(h) }

// ProcPath returns the path of a file of process handle under the control dir base.
func ProcPath(base, handle, name string) string {
	return filepath.Join(base, ProcDir, handle, name)
}

// WriteJSONAtomic writes v to path through a temporary name and a rename, so a reader
// sees either nothing or the whole document.
func WriteJSONAtomic(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := fmt.Sprintf("%s.tmp%d", path, os.Getpid())
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// ReadJSON reads a document written by WriteJSONAtomic.
func ReadJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// Install copies the cairn-init binary at src into the sandbox root (a reflink where the
// filesystem can): init runs from inside the root, so every file the process tree maps
// is inside the sandbox, and a restored image finds it.
func Install(src, root string) error {
	dir := filepath.Join(root, Dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	dst := filepath.Join(dir, InitBin)
	tmp := dst + ".tmp"
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		if _, err := out.ReadFrom(in); err != nil {
			out.Close()
			return err
		}
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

// WaitReady waits until init under the control directory dir has written its ready
// file, the process that should become init has died (alive returns false: the error
// carries the end of init's log), the timeout passes or ctx ends.
func WaitReady(ctx context.Context, dir string, alive func() bool, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for delay := 100 * time.Microsecond; ; delay = min(delay*2, 5*time.Millisecond) {
		if _, err := os.Stat(filepath.Join(dir, ReadyFile)); err == nil {
			return nil
		}
		if !alive() {
			log, _ := os.ReadFile(filepath.Join(dir, LogFile))
			lines := strings.Split(strings.TrimSpace(string(log)), "\n")
			return fmt.Errorf("sandbox init exited during start: %s", strings.Join(lines[max(0, len(lines)-5):], " | "))
		}
		if time.Now().After(deadline) {
			return errdefs.Unavailable("sandbox init did not become ready in %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
	}
}

// Err is nil for a successful response, else the error init reported for what, in
// sandbox id.
func (r Response) Err(id, what string) error {
	if r.OK {
		return nil
	}
	return errdefs.FailedPrecondition("sandbox %s: %s: %s", id, what, r.Error)
}
