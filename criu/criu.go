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
	// NetNS is the inode of the tree's network namespace, declared external: CRIU then
	// does not dump the namespace itself (links, routes, iptables and sysctls cost ~45 ms
	// of external tools per dump), only the sockets in it; Restore is given a new one.
	NetNS uint64
}

// netKey names the external network namespace in images.
const netKey = "cairn-net"

// RestoreOptions are the options of a restore.
type RestoreOptions struct {
	ImagesDir string
	WorkDir   string // per-restore scratch (logs); images may be shared by concurrent restores
	KeepLog   string // where to keep CRIU's log if the restore fails (the work dir is removed)
	// LeaveStopped leaves every restored task stopped (SIGSTOP) instead of running.
	LeaveStopped bool
	Root         string // mount point of the new root filesystem
	// NetNS is the network namespace to restore the tree into (see DumpOptions.NetNS).
	NetNS *os.File
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
		// A connection the server has not accepted yet cannot be dumped; it is dropped
		// (its client sees a reset) rather than failing the checkpoint.
		TcpSkipInFlight: b(true),
		FileLocks:       b(true),
		ManageCgroups:   b(true),
		LogLevel:        i32(2),
		LogFile:         str("dump.log"),
		NetworkLock:     rpc.CriuNetworkLockMethod_SKIP.Enum(),
	}
	if opts.FreezeCgroup != "" {
		ro.FreezeCgroup = str(opts.FreezeCgroup)
	}
	if opts.NetNS != 0 {
		ro.External = []string{fmt.Sprintf("net[%d]:%s", opts.NetNS, netKey)}
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
	if opts.LeaveStopped {
		ro.LeaveStopped = b(true)
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
	if opts.NetNS != nil {
		c.AddInheritFd(netKey, opts.NetNS)
	}
	n := &restoreNotify{}
	if err := c.Restore(ro, n); err != nil {
		log := filepath.Join(opts.WorkDir, "restore.log")
		if opts.KeepLog != "" {
			if b, rerr := os.ReadFile(log); rerr == nil && os.WriteFile(opts.KeepLog, b, 0o600) == nil {
				log = opts.KeepLog
			}
		}
		return 0, explain("restore", err, log)
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
		// CRIU cannot raise its own RLIMIT_NOFILE here and says so as an error on every
		// run; it is harmless and hides the real cause.
		if strings.Contains(l, "RLIMIT_NOFILE") {
			continue
		}
		if strings.Contains(l, "Error") || strings.Contains(l, "error") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	if len(errs) > 4 {
		errs = errs[len(errs)-4:]
	}
	return errdefs.FailedPrecondition("criu %s failed: %s (full log: %s)", op, strings.Join(errs, " | "), log)
}

// Version returns the version number of the CRIU in use (e.g. 40101).
func Version() (int, error) {
	p, err := Find()
	if err != nil {
		return 0, err
	}
	return version(p)
}

// UseKdatCache installs CRIU's kernel-feature cache (/run/criu.kdat) for the current
// boot, keeping a copy in dir.
//
// CRIU writes that cache only when /run is a tmpfs, so that a reboot drops it; /run is a
// plain directory on this machine kind, so every CRIU start would probe the kernel
// again (~30 ms). CRIU reads the cache from any filesystem, though. So cairn generates
// it once per boot (running CRIU with a private tmpfs /run) into dir/kdat-<boot id>, and
// installs it as /run/criu.kdat whenever the boot id differs from the one it was made
// for — which also replaces a stale cache from before a reboot.
func UseKdatCache(dir string) error {
	real, err := Find()
	if err != nil {
		return nil // no CRIU: operations that need it say so
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		return nil // util-linux missing: run without the cache
	}
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	kdat := filepath.Join(dir, "kdat-"+strings.TrimSpace(string(boot)))
	want, err := os.ReadFile(kdat)
	if err != nil {
		tmp := kdat + ".tmp"
		script := fmt.Sprintf(`mount -t tmpfs -o size=4m tmpfs /run && %q check >/dev/null 2>&1; cp /run/criu.kdat %q`, real, tmp)
		if out, err := exec.Command("unshare", "-m", "sh", "-c", script).CombinedOutput(); err != nil {
			return fmt.Errorf("generate CRIU kdat cache: %v: %s", err, out)
		}
		if err := os.Rename(tmp, kdat); err != nil {
			return err
		}
		if want, err = os.ReadFile(kdat); err != nil {
			return err
		}
	}
	const installed = "/run/criu.kdat"
	if have, err := os.ReadFile(installed); err == nil && string(have) == string(want) {
		return nil
	}
	tmp := installed + ".cairn-tmp"
	if err := os.WriteFile(tmp, want, 0o600); err != nil {
		return nil // /run not writable: run without the cache
	}
	return os.Rename(tmp, installed)
}
