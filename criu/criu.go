// Package criu drives CRIU (>= 4.2) over its RPC interface through go-criu, with the
// options cairn's sandboxes need, and finds a CRIU that works on this machine.
package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	gocriu "github.com/checkpoint-restore/go-criu/v8"
	"github.com/checkpoint-restore/go-criu/v8/rpc"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// MinVersion is the oldest CRIU cairn accepts (4.2.0): on kernels >= 6.16 inet sockets
// refuse SO_PASSCRED/SO_PASSSEC, which CRIU 4.1 reads and then fails the dump on.
const MinVersion = 40200

// PrivatePrefixCriu is where scripts/install-deps.sh installs CRIU when the host's own
// does not pass `criu check`.
const PrivatePrefixCriu = "/opt/cairn/criu/criu"

var (
	findOnce sync.Once
	found    string
	findErr  error
)

// Find returns the path of a usable criu: $CAIRN_CRIU, the private prefix, or the host's
// criu when it is recent enough.
func Find() (string, error) {
	findOnce.Do(func() {
		var cands []string
		if p := os.Getenv("CAIRN_CRIU"); p != "" {
			cands = append(cands, p)
		}
		cands = append(cands, PrivatePrefixCriu)
		if p, err := exec.LookPath("criu"); err == nil {
			cands = append(cands, p)
		}
		for _, c := range cands {
			if v, err := version(c); err == nil && v >= MinVersion {
				found = c
				return
			}
		}
		findErr = errdefs.FailedPrecondition("no CRIU >= 4.2 found (tried %s): run scripts/install-deps.sh as root", strings.Join(cands, ", "))
	})
	return found, findErr
}

func version(path string) (int, error) {
	if _, err := os.Stat(path); err != nil {
		return 0, err
	}
	c := gocriu.MakeCriu()
	c.SetCriuPath(path)
	return c.GetCriuVersion()
}

// DumpOptions are the options of a leave-running dump of a sandbox's process tree.
type DumpOptions struct {
	Pid          int    // host PID of the tree's root
	ImagesDir    string // exists, empty
	FreezeCgroup string // freezer cgroup path of the tree (already frozen or not)
}

// RestoreOptions are the options of a restore.
type RestoreOptions struct {
	ImagesDir string
	WorkDir   string // per-restore scratch (logs); images may be shared by concurrent restores
	Root      string // mount point of the new root filesystem
	// CgroupRoot maps the tree's cgroups to this path in each of Controllers.
	CgroupRoot  string
	Controllers []string
}

func b(v bool) *bool       { return &v }
func i32(v int32) *int32   { return &v }
func str(v string) *string { return &v }

// Dump checkpoints the tree rooted at opts.Pid, leaving it running.
func Dump(ctx context.Context, opts DumpOptions) error {
	path, err := Find()
	if err != nil {
		return err
	}
	dir, err := os.Open(opts.ImagesDir)
	if err != nil {
		return err
	}
	defer dir.Close()
	ro := &rpc.CriuOpts{
		ImagesDirFd:    i32(int32(dir.Fd())),
		Pid:            i32(int32(opts.Pid)),
		LeaveRunning:   b(true),
		TcpEstablished: b(true),
		FileLocks:      b(true),
		ManageCgroups:  b(true),
		LogLevel:       i32(2),
		LogFile:        str("dump.log"),
		NetworkLock:    rpc.CriuNetworkLockMethod_SKIP.Enum(),
	}
	if opts.FreezeCgroup != "" {
		ro.FreezeCgroup = str(opts.FreezeCgroup)
	}
	c := gocriu.MakeCriu()
	c.SetCriuPath(path)
	if err := c.Dump(ro, gocriu.NoNotify{}); err != nil {
		return explain("dump", err, filepath.Join(opts.ImagesDir, "dump.log"))
	}
	return nil
}

type restoreNotify struct {
	gocriu.NoNotify
	pid int32
}

func (n *restoreNotify) PostRestore(pid int32) error { n.pid = pid; return nil }

// Restore restores the tree dumped in opts.ImagesDir and returns the host PID of its root.
func Restore(ctx context.Context, opts RestoreOptions) (int, error) {
	path, err := Find()
	if err != nil {
		return 0, err
	}
	dir, err := os.Open(opts.ImagesDir)
	if err != nil {
		return 0, err
	}
	defer dir.Close()
	work, err := os.Open(opts.WorkDir)
	if err != nil {
		return 0, err
	}
	defer work.Close()
	ro := &rpc.CriuOpts{
		ImagesDirFd:    i32(int32(dir.Fd())),
		WorkDirFd:      i32(int32(work.Fd())),
		Root:           str(opts.Root),
		TcpEstablished: b(true),
		FileLocks:      b(true),
		ManageCgroups:  b(true),
		LogLevel:       i32(2),
		LogFile:        str("restore.log"),
		NetworkLock:    rpc.CriuNetworkLockMethod_SKIP.Enum(),
	}
	mode := rpc.CriuCgMode_SOFT
	ro.ManageCgroupsMode = &mode
	if opts.CgroupRoot != "" {
		for _, c := range opts.Controllers {
			ro.CgRoot = append(ro.CgRoot, &rpc.CgroupRoot{Ctrl: str(c), Path: str(opts.CgroupRoot)})
		}
	}
	c := gocriu.MakeCriu()
	c.SetCriuPath(path)
	n := &restoreNotify{}
	if err := c.Restore(ro, n); err != nil {
		return 0, explain("restore", err, filepath.Join(opts.WorkDir, "restore.log"))
	}
	if n.pid == 0 {
		return 0, errors.New("criu restore reported no pid")
	}
	return int(n.pid), nil
}

// explain turns a CRIU failure into an error naming the cause from CRIU's log.
func explain(op string, err error, log string) error {
	b, _ := os.ReadFile(log)
	var errs []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") || strings.Contains(l, "error") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	if len(errs) > 4 {
		errs = errs[len(errs)-4:]
	}
	return errdefs.FailedPrecondition("criu %s failed: %v: %s (full log: %s)", op, err, strings.Join(errs, " | "), log)
}

// Version returns the version number of the CRIU in use (e.g. 40101).
func Version() (int, error) {
	p, err := Find()
	if err != nil {
		return 0, err
	}
	return version(p)
}

var _ = fmt.Sprint
