package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/gvisor"
)

// runscRuntime drives gVisor's runsc CLI, with the flags cairn's gVisor backend found
// necessary on these machines: the systrap platform, no network, and the rootfs served
// as is (--overlay2=none: writes reach the btrfs volume, so its snapshot is the
// filesystem half; --file-access=shared: the sentry sees the files the host edits).
type runscRuntime struct {
	path  string
	state string // runsc --root

	mu sync.Mutex
	// deletes are the `runsc delete --force` started by kill; protected by mu.
	deletes []*exec.Cmd
}

// findRunsc looks for runsc where scripts/install-deps.sh puts it, then on PATH.
func findRunsc() (string, error) {
	if _, err := os.Stat(gvisor.DefaultRunsc); err == nil {
		return gvisor.DefaultRunsc, nil
	}
	if p, err := exec.LookPath("runsc"); err == nil {
		return p, nil
	}
	return "", errdefs.FailedPrecondition("runsc (gVisor) is not installed: run scripts/install-deps.sh")
}

// runscBaseline is the runsc baseline: ociBaseline with runsc.
func (b *runner) runscBaseline(ctx context.Context, s *scratch, n int, br *BaselineReport) error {
	br.Method = "runsc " + b.rep.Machine.Runsc + " (--platform=systrap --network=none --overlay2=none --file-access=shared): " +
		"`runsc checkpoint --leave-running` (default compression) + btrfs read-only snapshot of the rootfs; " +
		"rollback: SIGKILL of the sandbox + writable snapshot + `runsc restore --detach` + delete of the old rootfs " +
		"(`runsc delete --force` runs detached: it waits for the host's init to reap the sandbox); " +
		"fork ×16: 16 writable snapshots + `runsc restore --detach` (4 at a time, as cairn's fork)"
	path, err := findRunsc()
	if err != nil {
		return err
	}
	return b.ociBaseline(ctx, s, &runscRuntime{path: path, state: s.path("state")}, n, br)
}

// run runs one runsc command. stdin and stdout (nil: none) become the stdio of a
// container it starts, stdout also its stderr; runsc's own log goes to a file that the
// error quotes.
func (r *runscRuntime) run(ctx context.Context, stdin, stdout *os.File, args ...string) error {
	logf, err := os.CreateTemp("", "bench-runsc-")
	if err != nil {
		return err
	}
	defer os.Remove(logf.Name())
	defer logf.Close()
	global := []string{"--root", r.state, "--log", logf.Name(),
		"--platform=systrap", "--network=none", "--overlay2=none", "--file-access=shared"}
	cmd := exec.CommandContext(ctx, r.path, append(global, args...)...)
	// Files, not pipes to this process: a started sandbox inherits them and outlives
	// runsc, and Run would wait for it to close a pipe.
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stdout
	if stdout == nil {
		cmd.Stdout, cmd.Stderr = logf, logf
	}
	if err := cmd.Run(); err != nil {
		msg, _ := os.ReadFile(logf.Name())
		return fmt.Errorf("runsc %s: %v: %s", args[0], err, tail(msg, 800))
	}
	return nil
}

func (r *runscRuntime) pidFile(k *ociContainer) string { return filepath.Join(k.bundle, "pid") }

func (r *runscRuntime) start(ctx context.Context, k *ociContainer, images string, stdin, stdout *os.File) error {
	if images == "" {
		return r.run(ctx, stdin, stdout, "run", "--detach", "--bundle", k.bundle, "--pid-file", r.pidFile(k), k.id)
	}
	return r.run(ctx, stdin, stdout, "restore", "--detach", "--bundle", k.bundle, "--image-path", images,
		"--pid-file", r.pidFile(k), k.id)
}

// checkpoint saves the sandbox leaving it running, then snapshots the rootfs: gVisor
// flushes what it caches of files as it saves (the order cairn's gVisor backend uses).
// The REPL is idle between steps, so nothing changes the rootfs in between.
func (r *runscRuntime) checkpoint(ctx context.Context, k *ociContainer, images string, snapshot func() error) error {
	if err := r.run(ctx, nil, nil, "checkpoint", "--leave-running", "--image-path", images, k.id); err != nil {
		return err
	}
	return snapshot()
}

// kill kills the sandbox process (the sentry: with it every process of the container,
// and the gofer) and waits for its death, then deletes the container in the
// background: `runsc delete` waits until the dead sentry, an orphan, has been reaped by
// the host's init, which on these machines takes up to ~1.4 s.
func (r *runscRuntime) kill(ctx context.Context, k *ociContainer) error {
	b, err := os.ReadFile(r.pidFile(k))
	if err != nil {
		return fmt.Errorf("runsc pid file: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("runsc pid file %s: %w", r.pidFile(k), err)
	}
	if p, err := isolation.ProcOf(pid); err == nil {
		unix.Kill(pid, unix.SIGKILL)
		for deadline := time.Now().Add(10 * time.Second); p.Alive(); time.Sleep(200 * time.Microsecond) {
			if time.Now().After(deadline) {
				return errdefs.Unavailable("runsc sandbox process %d did not exit after SIGKILL", pid)
			}
		}
	}
	cmd := exec.Command(r.path, "--root", r.state, "delete", "--force", k.id)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("runsc delete: %w", err)
	}
	r.mu.Lock()
	r.deletes = append(r.deletes, cmd)
	r.mu.Unlock()
	return nil
}

func (r *runscRuntime) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, cmd := range r.deletes {
		cmd.Wait()
	}
	r.deletes = nil
}
