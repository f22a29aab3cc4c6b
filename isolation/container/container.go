// Package container is cairn's own Linux-container isolation backend: each sandbox runs
// in its own pid, mount, network (loopback only), ipc, uts and cgroup namespaces, under
// v1 cgroup limits (memory, pids, cpu), a seccomp filter and a reduced capability set,
// with cairn-init as PID 1. Its process tree is checkpointed and restored by CRIU over
// RPC (package criu).
//
// cairn builds the container itself rather than through runc: a runc checkpoint costs
// ~200 ms here against ~40 ms for the CRIU dump it wraps, and the sandbox's mount tree is
// small enough (root, /proc, a private devpts) that CRIU restores it without help.
package container

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
	"golang.org/x/sys/unix"
)

// Backend is the container backend. The zero value is not usable; use New.
type Backend struct {
	initBinary string
	seccomp    bool
	// workers holds CRIU workers started ahead of the next checkpoint, restorers those
	// started ahead of the next restore (workers.go).
	workers   workerPool
	restorers restorePool
	// res keeps the zygotes' tracer and helpers (resident.go).
	res residents
	// Logf, if set, reports what went wrong in work the caller does not see fail (a
	// rewind that failed, after which the rollback forked instead).
	Logf func(format string, args ...any)
	// NoRewinds turns rewinds in place off: rollbacks fork from the zygotes.
	NoRewinds bool
}

// New returns a backend that boots sandboxes with the cairn-init binary at initBinary.
func New(initBinary string) (*Backend, error) {
	if _, err := os.Stat(initBinary); err != nil {
		return nil, errdefs.FailedPrecondition("cairn-init binary %s: %v (build it with `go build ./cmd/cairn-init` next to cairn)", initBinary, err)
	}
	return &Backend{initBinary: initBinary, seccomp: true}, nil
}

// Name implements isolation.Backend.
func (b *Backend) Name() string { return "container" }

// setupConfig mirrors cmd/cairn-init's SetupConfig.
type setupConfig struct {
	Root     string `json:"root"`
	Hostname string `json:"hostname"`
	Seccomp  bool   `json:"seccomp"`
}

// Start implements isolation.Backend.
func (b *Backend) Start(ctx context.Context, sb *isolation.Sandbox) error {
	return b.start(ctx, sb, true)
}

// start boots init; pidBase: and sets the sandbox's PID base (a restore of processes
// into it sets it after them).
func (b *Backend) start(ctx context.Context, sb *isolation.Sandbox, pidBase bool) error {
	// The first resident checkpoint of a cairn process checks that CRIU runs inside
	// sandboxes (criu --version through its loader copy: ~16 ms here, once): done now,
	// beside the boot, it is not on that checkpoint's critical path.
	go criu.InsideAvailable()
	if err := initctl.Install(b.initBinary, sb.Root); err != nil {
		return err
	}
	if err := criu.InstallKdatInside(sb.Root); err != nil {
		return err
	}
	ctlDir := filepath.Join(sb.Root, initctl.Dir)
	os.Remove(filepath.Join(ctlDir, initctl.ReadyFile))
	if err := createCgroups(sb.CgroupName(), sb.Limits); err != nil {
		return err
	}
	cfg, _ := json.Marshal(setupConfig{Root: sb.Root, Hostname: sb.Hostname, Seccomp: b.seccomp})
	gateR, gateW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer gateR.Close()
	defer gateW.Close()
	var stderr bytes.Buffer
	cmd := exec.Command(b.initBinary, "setup")
	cmd.Env = []string{"CAIRN_SETUP=" + string(cfg)}
	cmd.ExtraFiles = []*os.File{gateR}
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: unix.CLONE_NEWPID | unix.CLONE_NEWNS | unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS,
		Setsid:     true,
	}
	if err := cmd.Start(); err != nil {
		removeCgroups(sb.CgroupName())
		return fmt.Errorf("start sandbox init: %w", err)
	}
	pid := cmd.Process.Pid
	fail := func(err error) error {
		cmd.Process.Kill()
		cmd.Wait()
		removeCgroups(sb.CgroupName())
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			return fmt.Errorf("%w: %s", err, msg)
		}
		return err
	}
	if err := joinCgroups(sb.CgroupName(), pid); err != nil {
		return fail(err)
	}
	gateW.Write([]byte{1})
	gateW.Close()
	if err := initctl.WaitReady(ctx, ctlDir, func() bool { return isolation.ProcAlive(pid) }, 10*time.Second); err != nil {
		return fail(err)
	}
	go cmd.Wait() // reap init if it ever exits while this process lives
	init, err := isolation.ProcOf(pid)
	if err != nil {
		return fail(err)
	}
	sb.Init = init
	// The sandbox's own processes get PIDs from UserPidBase up, above those of init's
	// threads (Go starts them as it likes): a process restored alone into a fresh
	// sandbox (a zygote checkpoint's images) finds its PID free there.
	if !pidBase {
		return nil
	}
	if err := b.res.setPidBase(sb.Init); err != nil {
		b.res.stopped(init)
		return fail(err)
	}
	return nil
}

// UserPidBase is the first PID of a container sandbox's processes.
const UserPidBase = 1000

// Stop implements isolation.Backend.
func (b *Backend) Stop(ctx context.Context, sb *isolation.Sandbox) error {
	b.workers.stopped(sb)
	b.res.stopped(sb.Init)
	// A frozen tree cannot die: thaw after the kill is queued. The zygotes are frozen
	// in cgroups of their own, and the dying pid namespace waits for them too.
	if b.Running(sb) {
		unix.Kill(sb.Init.Pid, unix.SIGKILL)
	}
	dropAllZygotes(sb.CgroupName())
	os.Remove(criuDir(sb.CgroupName()))
	for _, p := range cgroupPids(sb.CgroupName()) {
		unix.Kill(p, unix.SIGKILL)
	}
	thaw(sb.CgroupName())
	deadline := time.Now().Add(10 * time.Second)
	for len(cgroupPids(sb.CgroupName())) > 0 || (sb.Init.Pid != 0 && b.Running(sb)) {
		if time.Now().After(deadline) {
			return fmt.Errorf("sandbox %s: processes did not exit after SIGKILL", sb.ID)
		}
		time.Sleep(time.Millisecond)
	}
	sb.Init = isolation.Proc{}
	return removeCgroups(sb.CgroupName())
}

// Running implements isolation.Backend. An init that is exiting is not running (its
// zygotes, frozen, would keep it from exiting: they are ended).
func (b *Backend) Running(sb *isolation.Sandbox) bool {
	f, alive := sb.Init.Stat()
	if !alive {
		return false
	}
	if exiting(f) {
		dropAllZygotes(sb.CgroupName())
		os.Remove(criuDir(sb.CgroupName()))
		return false
	}
	return true
}
