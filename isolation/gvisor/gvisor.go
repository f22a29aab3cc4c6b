// Package gvisor is cairn's gVisor isolation backend: each sandbox runs on gVisor's
// user-space kernel (runsc, systrap platform), so the sandbox's system calls are served
// by the sentry rather than the host kernel. Its network is loopback only
// (--network=none). Checkpoints are runsc's own save/restore of the whole sandbox.
//
// Filesystem. The root is the sandbox's btrfs subvolume itself, served by the gofer with
// --overlay2=none, so that every write reaches the subvolume and the engine's btrfs
// snapshot captures the filesystem half of a checkpoint; --file-access=shared makes the
// sentry revalidate what it caches, so files cairn writes or removes from outside are
// seen inside at once.
//
// Control. cairn-init is PID 1 ("cairn-init boot") and keeps its file-based protocol
// (package initctl) under /.cairn. The sentry implements the FIFOs there, out of the
// host's reach, so cairn drives init with `runsc exec` of cairn-init's client stages;
// outputs and exit files are regular files and are read on the host directly.
//
// Identity of a run. Every Start and Restore is a new runsc container whose ID is
// derived from the base name of sb.Root (cairn gives every start, rollback and fork a
// fresh root volume), so a concurrent fork never collides with its siblings and Stop
// needs no lookup.
//
// Filesystem half, by measurement. gVisor's alternative, its in-sandbox overlay
// (--overlay2=root:memory), keeps written files in the memory image: a sandbox that had
// written 50 MB took 334-1047 ms per checkpoint with 50 MB of image each time (no
// increments), against 183-327 ms and 2 MB here; restore 697 against 558 ms. It also
// requires --file-access=exclusive, which hides the sandbox's files (process output
// included) from the host.
package gvisor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
	"golang.org/x/sys/unix"
)

// DefaultRunsc is where scripts/install-deps.sh installs runsc.
const DefaultRunsc = "/usr/local/bin/runsc"

// Backend is the gVisor backend. The zero value is not usable; use New.
type Backend struct {
	runsc      string
	initBinary string
	// stateDir holds runsc's state (--root), the OCI bundles, and the markers of
	// sandboxes paused by a checkpoint.
	stateDir string
}

// New returns a backend booting sandboxes with the cairn-init binary at initBinary and
// keeping runsc's state under stateDir. It fails when runsc is not installed.
func New(initBinary, stateDir string) (*Backend, error) {
	runsc, err := findRunsc()
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(initBinary); err != nil {
		return nil, errdefs.FailedPrecondition("cairn-init binary %s: %v (build it with `go build ./cmd/cairn-init` next to cairn)", initBinary, err)
	}
	for _, d := range []string{"state", "bundles", "paused"} {
		if err := os.MkdirAll(filepath.Join(stateDir, d), 0o700); err != nil {
			return nil, fmt.Errorf("runsc state directory: %w", err)
		}
	}
	return &Backend{runsc: runsc, initBinary: initBinary, stateDir: stateDir}, nil
}

// findRunsc looks for runsc where the install script puts it, then on PATH.
func findRunsc() (string, error) {
	if _, err := os.Stat(DefaultRunsc); err == nil {
		return DefaultRunsc, nil
	}
	if p, err := exec.LookPath("runsc"); err == nil {
		return p, nil
	}
	return "", errdefs.FailedPrecondition("runsc (gVisor) is not installed: run scripts/install-deps.sh, or create sandboxes with --isolation container")
}

// traceRunsc (CAIRN_TRACE_RUNSC=1) prints every runsc call and its duration to stderr.
var traceRunsc = os.Getenv("CAIRN_TRACE_RUNSC") != ""

// Name implements isolation.Backend.
func (b *Backend) Name() string { return "gvisor" }

// cid is the runsc container ID of the sandbox's current run: the root's base name
// and a "_". runsc resolves an ID given on its command line as a prefix and refuses it
// as ambiguous when it prefixes another container's, even one it equals exactly; root
// names never contain "_", so with it no ID is a prefix of another.
func cid(sb *isolation.Sandbox) string { return filepath.Base(sb.Root) + "_" }

func (b *Backend) bundle(id string) string { return filepath.Join(b.stateDir, "bundles", id) }

// runsc runs one runsc command with cairn's global flags, stdin from in (nil: none),
// and returns its stdout. Every call costs a runsc start-up (~25-40 ms here).
func (b *Backend) run(ctx context.Context, in []byte, args ...string) ([]byte, error) {
	global := []string{
		"--root", filepath.Join(b.stateDir, "state"),
		"--platform=systrap", "--network=none", "--overlay2=none", "--file-access=shared",
	}
	cmd := exec.CommandContext(ctx, b.runsc, append(global, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	var outFile *os.File
	if args[0] == "run" || args[0] == "restore" {
		// The sandbox these start inherits runsc's stdio and outlives it: pipes would keep
		// Run waiting for its end. Output goes to an unlinked file instead.
		f, err := os.CreateTemp("", "cairn-runsc-")
		if err != nil {
			return nil, err
		}
		os.Remove(f.Name())
		defer f.Close()
		cmd.Stdout, cmd.Stderr, outFile = f, f, f
	}
	if in != nil {
		cmd.Stdin = bytes.NewReader(in)
	}
	start := time.Now()
	err := cmd.Run()
	if outFile != nil {
		outFile.Seek(0, 0)
		stderr.ReadFrom(outFile)
	}
	if traceRunsc {
		fmt.Fprintf(os.Stderr, "cairn: runsc %s: %.1f ms (%v)\n", strings.Join(args, " "), float64(time.Since(start).Microseconds())/1000, err)
	}
	if err != nil {
		return stdout.Bytes(), &runscError{args: args, err: err, stderr: lastLines(stderr.String(), 8)}
	}
	return stdout.Bytes(), nil
}

// runscError is a failed runsc command, with its exit code for classification.
type runscError struct {
	args   []string
	err    error
	stderr string
}

func (e *runscError) Error() string {
	return fmt.Sprintf("runsc %s: %v: %s", strings.Join(e.args, " "), e.err, e.stderr)
}

// exitCode is the exit code of a failed command, or -1.
func exitCode(err error) int {
	var re *runscError
	var ee *exec.ExitError
	if errors.As(err, &re) && errors.As(re.err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// Start implements isolation.Backend.
func (b *Backend) Start(ctx context.Context, sb *isolation.Sandbox) error {
	if err := initctl.Install(b.initBinary, sb.Root); err != nil {
		return err
	}
	ctlDir := filepath.Join(sb.Root, initctl.Dir)
	os.Remove(filepath.Join(ctlDir, initctl.ReadyFile))
	if err := os.MkdirAll(filepath.Join(sb.Root, "tmp"), 0o1777); err != nil {
		return err
	}
	id := cid(sb)
	if err := writeBundle(b.bundle(id), spec(sb, id)); err != nil {
		return err
	}
	pidFile := filepath.Join(b.bundle(id), "pid")
	// run -detach is create and start in one runsc start-up.
	if _, err := b.run(ctx, nil, "run", "--detach", "--bundle", b.bundle(id), "--pid-file", pidFile, id); err != nil {
		b.destroy(id, isolation.Proc{})
		return fmt.Errorf("start gVisor sandbox %s: %w", sb.ID, err)
	}
	p, err := readPid(pidFile)
	if err == nil {
		err = initctl.WaitReady(ctx, ctlDir, func() bool { return isolation.ProcAlive(p.Pid) }, 10*time.Second)
	}
	if err != nil {
		b.destroy(id, isolation.Proc{})
		return err
	}
	sb.Init = p
	return nil
}

// readPid reads the sandbox (sentry) process runsc wrote to pidFile: it is what
// Running watches, and its death is the sandbox's.
func readPid(pidFile string) (isolation.Proc, error) {
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return isolation.Proc{}, fmt.Errorf("runsc pid file: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return isolation.Proc{}, fmt.Errorf("runsc pid file %s: %w", pidFile, err)
	}
	p, err := isolation.ProcOf(pid)
	if err != nil {
		return isolation.Proc{}, fmt.Errorf("gVisor sandbox process %d: %w", pid, err)
	}
	return p, nil
}

// Stop implements isolation.Backend.
func (b *Backend) Stop(ctx context.Context, sb *isolation.Sandbox) error {
	if err := b.destroy(cid(sb), sb.Init); err != nil {
		return err
	}
	sb.Init = isolation.Proc{}
	return nil
}

// destroy ends a run: it kills its sentry (with it every process of the sandbox, and
// the gofer, which exits when the sentry's end of its channel closes), then leaves the
// removal of runsc's state and cgroups to a detached `runsc delete --force`.
//
// `runsc delete` itself waits until the dead sentry has been reaped, and the sentry is
// an orphan reaped by the host's PID 1: on these VMs PID 1 reaps about every 1.4 s, so a
// waited delete made every rollback 1.4 s longer. Nothing cairn does next depends on
// the deletion: the next run of the sandbox has another container ID and cgroup.
func (b *Backend) destroy(id string, p isolation.Proc) error {
	if p.Pid == 0 {
		p, _ = readPid(filepath.Join(b.bundle(id), "pid"))
	}
	if p.Pid != 0 {
		if p.Alive() {
			unix.Kill(p.Pid, unix.SIGKILL)
			deadline := time.Now().Add(10 * time.Second)
			for p.Alive() {
				if time.Now().After(deadline) {
					return errdefs.Unavailable("gVisor sandbox process %d did not exit after SIGKILL", p.Pid)
				}
				time.Sleep(200 * time.Microsecond)
			}
		}
	}
	if err := b.deleteDetached(id); err != nil {
		return err
	}
	os.RemoveAll(b.bundle(id))
	os.Remove(b.pausedMarker(id))
	return nil
}

// deleteDetached starts `runsc delete --force id` in its own session and reaps it in
// the background. It is started with ForkExec rather than os/exec: an exec.Cmd holds a
// pidfd until waited for, and a long-lived engine would count those as leaked.
func (b *Backend) deleteDetached(id string) error {
	null, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer null.Close()
	argv := []string{b.runsc, "--root", filepath.Join(b.stateDir, "state"), "delete", "--force", id}
	fd := null.Fd()
	pid, err := syscall.ForkExec(b.runsc, argv, &syscall.ProcAttr{
		Files: []uintptr{fd, fd, fd},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		return fmt.Errorf("runsc delete: %w", err)
	}
	go func() {
		var ws syscall.WaitStatus
		for {
			if _, err := syscall.Wait4(pid, &ws, 0, nil); err != syscall.EINTR {
				return
			}
		}
	}()
	return nil
}

// Running implements isolation.Backend without calling runsc: the sandbox lives as long
// as its sentry process does.
func (b *Backend) Running(sb *isolation.Sandbox) bool {
	if sb.Init.Pid == 0 {
		return false
	}
	return sb.Init.Alive()
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, " | ")
}

// signalName is used in error messages.
func signalName(sig syscall.Signal) string { return unix.SignalName(sig) }
