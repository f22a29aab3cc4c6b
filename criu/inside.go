package criu

// Inside mode: CRIU run inside every namespace of a running sandbox (mount, pid, network,
// ipc, uts, cgroup), so that it sees them as its own and neither dumps nor restores any
// of them. That is how one process of a sandbox (a child of its init) is dumped alone and
// later restored into a running sandbox, as a child of its init, with its PID, in its
// mount namespace. CRIU is run through its command line: its RPC mode opens the client's
// /proc/<pid>/fd/<n>, and the sandbox's procfs does not show the client.
//
// CRIU runs there as the host's root, with every capability, in a filesystem the
// sandbox's code controls. Nothing it executes or configures itself from may therefore
// be found through a path of the sandbox's tree: a sandbox can rename any directory
// holding a mount point (/.cairn with a mount on /.cairn/criu included) and put its own
// files in its place, or replace /bin/sh. So:
//   - CRIU's prefix (the private one of scripts/install-deps.sh) is not mounted into the
//     sandbox: its directory is an inherited descriptor (prefixFd) and every path of it
//     that CRIU or its loader uses is /proc/self/fd/<n>/..., which the sandbox cannot
//     redirect (without CAP_SYS_ADMIN it cannot unmount or replace the sandbox's /proc,
//     and it cannot read the descriptors of a process holding more capabilities).
//   - No script runs inside: the host-side launcher execs nsenter, which execs CRIU's
//     dynamic loader with a clean environment: no locale, and a PATH inside the prefix,
//     where nothing but CRIU is. CRIU's kernel probe runs iptables, ip6tables and sh
//     through PATH; any other PATH would find the sandbox's.
//   - The loader is a copy of the prefix's whose "/etc/ld.so.preload" is renamed to a
//     path that cannot exist (see loaderPatch): glibc's loader reads that file from the
//     process's root, with no option to skip it, and would load the libraries it names
//     into CRIU. --inhibit-cache keeps it from the sandbox's /etc/ld.so.cache.
//   - CRIU reads no configuration file (--no-default-config: /etc/criu/default.conf
//     could name an action script), looks for plugins only in a directory of the prefix
//     that has none (--libdir; cairn needs none), and gnutls reads no system
//     configuration.
// What remains exposed is documented at DumpInside and RestoreInside; the tests plant
// each of the files above in a sandbox (TestInsideIgnoresSandboxFiles).

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// CRIU's descriptors in inside mode (exec.Cmd.ExtraFiles, in this order).
const (
	prefixFd = 3 // CRIU's prefix directory
	loaderFd = 4 // the loader (a sealed memfd)
	imagesFd = 5 // the images directory
	workFd   = 6 // restore: the work directory; dump: the freezer cgroup (if any)
)

// loaderPatch renames the preload file of glibc's loader to one of the same length that
// no process can create: procfs has no /proc/0.
var loaderPatch = [2]string{"/etc/ld.so.preload\x00", "/proc/0/ld.preload\x00"}

// insideCRIU is what running CRIU inside a sandbox needs, found once per process.
type insideCRIU struct {
	prefix  *os.File // the prefix directory
	loader  *os.File // the patched loader
	libPath string   // --library-path, through prefixFd
	nsenter string
	env     []string // CRIU's whole environment
}

var (
	insideOnce sync.Once
	inside     *insideCRIU
	insideErr  error
)

// InsideAvailable reports why CRIU cannot run inside sandboxes here (nil if it can): it
// needs the private prefix of scripts/install-deps.sh (CRIU with its own loader and
// libraries, >= 4.2), whose loader can be made to ignore /etc/ld.so.preload, and nsenter.
// The host's own CRIU is not used inside: it would load the sandbox's libraries.
func InsideAvailable() error {
	_, err := insideSetup()
	return err
}

func insideSetup() (*insideCRIU, error) {
	insideOnce.Do(func() {
		inside, insideErr = newInside(filepath.Dir(PrivatePrefixCriu))
		if insideErr != nil {
			insideErr = errdefs.FailedPrecondition("CRIU cannot run inside sandboxes: %v: run scripts/install-deps.sh as root", insideErr)
		}
	})
	return inside, insideErr
}

func newInside(prefix string) (*insideCRIU, error) {
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		return nil, errors.New("nsenter (util-linux) not found")
	}
	if _, err := os.Stat(filepath.Join(prefix, "usr/sbin/criu")); err != nil {
		return nil, fmt.Errorf("no CRIU in the private prefix %s", prefix)
	}
	var ld []byte
	for _, p := range []string{"usr/lib64/ld-linux-x86-64.so.2", "lib64/ld-linux-x86-64.so.2"} {
		if ld, err = os.ReadFile(filepath.Join(prefix, p)); err == nil {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("no dynamic loader in the private prefix %s", prefix)
	}
	if n := bytes.Count(ld, []byte(loaderPatch[0])); n != 1 {
		return nil, fmt.Errorf("the loader of %s names %q %d times, not once: cannot keep it from the sandbox's preload file", prefix, strings.TrimRight(loaderPatch[0], "\x00"), n)
	}
	ld = bytes.Replace(ld, []byte(loaderPatch[0]), []byte(loaderPatch[1]), 1)
	c := &insideCRIU{nsenter: nsenter}
	if c.loader, err = sealedMemfd("cairn-criu-ld.so", ld); err != nil {
		return nil, fmt.Errorf("loader copy: %w", err)
	}
	if c.prefix, err = os.Open(prefix); err != nil {
		c.loader.Close()
		return nil, err
	}
	var libs []string
	for _, d := range []string{"usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"} {
		if st, err := os.Stat(filepath.Join(prefix, d)); err == nil && st.IsDir() {
			libs = append(libs, fdPath(prefixFd, d))
		}
	}
	c.libPath = strings.Join(libs, ":")
	c.env = []string{"PATH=" + fdPath(prefixFd, "usr/sbin") + ":" + fdPath(prefixFd, "usr/bin"),
		// gnutls (linked by CRIU) reads a system configuration at load otherwise.
		"GNUTLS_SYSTEM_PRIORITY_FILE=" + fdPath(prefixFd, "etc/gnutls/config")}
	// The exact chain DumpInside runs, less nsenter: it proves the copy loads CRIU.
	cmd := exec.Command("env", append(append([]string{"-i"}, c.env...), c.command("--version")...)...)
	cmd.ExtraFiles = c.files(nil, nil)
	out, err := cmd.CombinedOutput()
	if err != nil {
		c.close()
		return nil, fmt.Errorf("CRIU through the loader copy: %v: %s", err, bytes.TrimSpace(out))
	}
	v, err := parseVersion(string(out))
	if err == nil && v < MinVersion {
		err = fmt.Errorf("CRIU %d.%d.%d in %s is older than 4.2", v/10000, v/100%100, v%100, prefix)
	}
	if err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

func (c *insideCRIU) close() {
	c.prefix.Close()
	c.loader.Close()
}

// sealedMemfd returns a read-only descriptor of an executable memory file holding b,
// sealed against any change.
func sealedMemfd(name string, b []byte) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_EXEC)
	if errors.Is(err, unix.EINVAL) { // kernels before 6.3 know no MFD_EXEC
		fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	}
	if err != nil {
		return nil, err
	}
	w := os.NewFile(uintptr(fd), name)
	defer w.Close()
	if _, err := w.Write(b); err != nil {
		return nil, err
	}
	if _, err := unix.FcntlInt(w.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SEAL|unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE); err != nil {
		return nil, err
	}
	// exec refuses a file open for writing (ETXTBSY): keep a read-only descriptor only.
	return os.Open(fmt.Sprintf("/proc/self/fd/%d", w.Fd()))
}

// parseVersion reads CRIU's "Version: 4.2.1" as 40201.
func parseVersion(out string) (int, error) {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == "Version:" {
			var v [3]int
			for i, p := range strings.SplitN(f[1], ".", 3) {
				v[i], _ = strconv.Atoi(p)
			}
			return v[0]*10000 + v[1]*100 + v[2], nil
		}
	}
	return 0, fmt.Errorf("CRIU printed no version: %q", strings.TrimSpace(out))
}

// fdPath is the path of rel under descriptor fd (fd itself if rel is empty).
func fdPath(fd int, rel string) string {
	if rel == "" {
		return fmt.Sprintf("/proc/self/fd/%d", fd)
	}
	return fmt.Sprintf("/proc/self/fd/%d/%s", fd, rel)
}

// command is CRIU's command line through the loader copy, paths through descriptors.
func (c *insideCRIU) command(args ...string) []string {
	return append([]string{fdPath(loaderFd, ""), "--inhibit-cache",
		"--library-path", c.libPath, fdPath(prefixFd, "usr/sbin/criu")}, args...)
}

// files are CRIU's inherited descriptors, from prefixFd on.
func (c *insideCRIU) files(images, work *os.File) []*os.File {
	fs := []*os.File{c.prefix, c.loader}
	if images != nil {
		fs = append(fs, images)
	}
	if work != nil {
		fs = append(fs, work)
	}
	return fs
}

// argv is the launcher's command: nsenter joins every namespace and the root of the
// sandbox's init, with a clean environment, and starts CRIU with args.
func (c *insideCRIU) argv(initPid int, op string, args ...string) []string {
	argv := append(append([]string{"env", "-i"}, c.env...), c.nsenter, "--target", strconv.Itoa(initPid),
		"--mount", "--pid", "--net", "--ipc", "--uts", "--cgroup", "--root", "--")
	return append(argv, c.command(append([]string{"--no-default-config", op,
		"--libdir", fdPath(prefixFd, "usr/sbin"), fmt.Sprintf("-v%d", *logLevel()),
		"--manage-cgroups=ignore", "--network-lock", "skip", "--tcp-established", "--file-locks"}, args...)...)...)
}

// InsideDumpOptions are the options of DumpInside.
type InsideDumpOptions struct {
	// InitPid is the host PID of the sandbox's init: CRIU joins its mount, pid, network,
	// ipc, uts and cgroup namespaces and its root.
	InitPid int
	// Pid is the process to dump, as a PID of the sandbox's pid namespace (the last field
	// of NSpid in its /proc status). Its whole tree is dumped: it should have no children.
	// It must lead its session (setsid), as CRIU dumps no shell job.
	Pid int
	// ImagesDir exists and is empty; CRIU's log is dump.log there, the launcher's
	// launch.log.
	ImagesDir string
	// FreezeCgroup, if set, is the host path of a freezer cgroup holding exactly the tree
	// (already frozen or not): CRIU freezes the tree through it and leaves it as it was.
	// CRIU reaches it through a descriptor (the sandbox has no /sys/fs/cgroup).
	FreezeCgroup string
	// Cgroups are cgroup.procs files CRIU (and what it starts) joins first: the caller
	// can then freeze CRIU for a moment, say while no other process of the sandbox's pid
	// namespace may fork.
	Cgroups []string
	// Background runs CRIU at nice 19.
	Background bool
}

// DumpInside checkpoints o.Pid's tree from inside the sandbox, leaving it as it was
// (running, or stopped if it was stopped). The images hold no namespace and no mount:
// they can only be restored by RestoreInside into a sandbox with the same files at the
// same paths and the PID free.
//
// The process must not be ptraced (CRIU seizes it) and must hold no descriptor of a
// file outside the sandbox's mounts. ctx is checked before CRIU starts; a running CRIU is
// not interrupted (killed mid-dump, it could leave its parasite in the process).
//
// Exposure: CRIU runs in the sandbox's pid namespace as root with more capabilities than
// the sandbox's processes, so they cannot trace it or read its descriptors, but they can
// signal it (same uid): a sandbox can make its own dump fail. CRIU trusts the sandbox's
// /run/criu.kdat (its kernel-feature cache) if there is one, and without it probes the
// kernel (~25 ms), mounting a tmpfs on a fresh directory of the sandbox's /tmp for a
// moment.
func DumpInside(ctx context.Context, o InsideDumpOptions) error {
	c, err := insideSetup()
	if err != nil {
		return err
	}
	if err := checkInit(o.InitPid); err != nil {
		return err
	}
	if o.Pid == 1 {
		return errdefs.InvalidArgument("pid 1 is the sandbox's init: dump the whole sandbox with Dump")
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/root/proc/%d", o.InitPid, o.Pid)); o.Pid <= 0 || err != nil {
		return errdefs.NotFound("no process %d in the sandbox of init %d: give the PID the process has in the sandbox's pid namespace (the last field of NSpid in its /proc status), not its host PID", o.Pid, o.InitPid)
	}
	dir, err := os.Open(o.ImagesDir)
	if err != nil {
		return err
	}
	defer dir.Close()
	args := []string{"--tree", strconv.Itoa(o.Pid), "--images-dir", fdPath(imagesFd, ""),
		"--leave-running", "--skip-in-flight", "--log-file", "dump.log"}
	var freezer *os.File
	if o.FreezeCgroup != "" {
		if freezer, err = os.Open(o.FreezeCgroup); err != nil {
			return errdefs.NotFound("freezer cgroup of the dump: %v", err)
		}
		defer freezer.Close()
		args = append(args, "--freeze-cgroup", fdPath(workFd, ""))
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	log := filepath.Join(o.ImagesDir, "dump.log")
	launch := filepath.Join(o.ImagesDir, "launch.log")
	if err := c.run(o.InitPid, "dump", args, c.files(dir, freezer), launch, o.Cgroups, o.Background); err != nil {
		return explainInside("dump", err, log, launch)
	}
	return nil
}

// InsideRestoreOptions are the options of RestoreInside.
type InsideRestoreOptions struct {
	// InitPid is the host PID of the running sandbox's init: the process is restored as
	// its child, in its namespaces.
	InitPid   int
	ImagesDir string // images of DumpInside
	// WorkDir is per-restore scratch: CRIU's log (restore.log), the launcher's
	// (launch.log), the restored PID (restore.pid).
	WorkDir string
	// KeepLog is where to keep the logs if the restore fails (if the caller removes
	// WorkDir).
	KeepLog string
	// Cgroups are the cgroup.procs files CRIU joins before it starts (as
	// RestoreOptions.Cgroups), so that the process is born in the sandbox's cgroups.
	Cgroups []string
	// LeaveStopped leaves the restored process stopped (SIGSTOP).
	LeaveStopped bool
	// Background runs CRIU at nice 19; the process gets back the priority it was dumped
	// with.
	Background bool
}

// RestoreInside restores the process dumped by DumpInside in o.ImagesDir into the
// running sandbox of o.InitPid, with its PID (which must be free there), as a child of
// init (CRIU detaches; init reaps it), and returns its host PID.
//
// Exposure: CRIU opens the process's files by path in the sandbox's tree as it is now,
// following symbolic links. A sandbox that replaced such a path by a link to
// /proc/self/fd/<n> could hand the restored process one of CRIU's own descriptors (its
// images directory, a host directory) if its type and mode match the dumped file's:
// restore only into a tree whose files the sandbox's code has not changed since the
// dump (a snapshot taken with it), or whose code is trusted.
func RestoreInside(ctx context.Context, o InsideRestoreOptions) (int, error) {
	c, err := insideSetup()
	if err != nil {
		return 0, err
	}
	if err := checkInit(o.InitPid); err != nil {
		return 0, err
	}
	dir, err := os.Open(o.ImagesDir)
	if err != nil {
		return 0, err
	}
	defer dir.Close()
	work, err := os.Open(o.WorkDir)
	if err != nil {
		return 0, err
	}
	defer work.Close()
	pidFile := filepath.Join(o.WorkDir, "restore.pid")
	os.Remove(pidFile) // CRIU creates it exclusively
	args := []string{"--images-dir", fdPath(imagesFd, ""), "--work-dir", fdPath(workFd, ""),
		"--restore-detached", "--log-file", "restore.log", "--pidfile", "restore.pid"}
	if o.LeaveStopped {
		args = append(args, "--leave-stopped")
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	launch := filepath.Join(o.WorkDir, "launch.log")
	if err := c.run(o.InitPid, "restore", args, c.files(dir, work), launch, o.Cgroups, o.Background); err != nil {
		log := keepLog(RestoreOptions{WorkDir: o.WorkDir, KeepLog: o.KeepLog})
		if log == o.KeepLog {
			return 0, explainInside("restore", err, log, log)
		}
		return 0, explainInside("restore", err, log, launch)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return 0, fmt.Errorf("criu restore wrote no PID: %w", err)
	}
	nspid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("criu restore wrote PID %q: %w", b, err)
	}
	return hostChild(o.InitPid, nspid, o.Cgroups)
}

// checkInit says what to do if the sandbox's init is gone.
func checkInit(initPid int) error {
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/ns/mnt", initPid)); initPid <= 0 || err != nil {
		return errdefs.NotFound("sandbox init %d is not running: start or resume the sandbox first", initPid)
	}
	return nil
}

// run starts CRIU op inside the sandbox of initPid through a launcher (which joins
// cgroups and renices first) and waits for it.
func (c *insideCRIU) run(initPid int, op string, args []string, files []*os.File, launchLog string, cgroups []string, background bool) error {
	script, cleanup, err := launchScript(c.argv(initPid, op, args...), launchLog, cgroups, background, "")
	if err != nil {
		return err
	}
	defer cleanup()
	return retryBusy(func() error {
		cmd := exec.Command(script)
		cmd.ExtraFiles = files
		return cmd.Run()
	})
}

// explainInside is explain on CRIU's log and the launcher's (nsenter, the loader), with
// CRIU's harmless complaints inside a sandbox left out.
func explainInside(op string, err error, log, launch string) error {
	var text strings.Builder
	for _, p := range []string{launch, log} {
		b, _ := os.ReadFile(p)
		for _, l := range strings.SplitAfter(string(b), "\n") {
			switch {
			case strings.Contains(l, "Unable to create tun"):
				// The sandbox's network namespace has no /dev/net/tun for CRIU's probe.
			case p == launch && launch != log && strings.TrimSpace(l) != "":
				// Everything there is a failure to start (nsenter, the loader, CRIU's
				// options), whatever its wording.
				text.WriteString("launcher error: " + l)
			default:
				text.WriteString(l)
			}
		}
		if launch == log {
			break
		}
	}
	path := log
	if _, serr := os.Stat(log); serr != nil {
		path = launch // CRIU never started
	}
	return explainLog(op, err, text.String(), path, insideHint(text.String()))
}

// insideHint says what to do about the failures of inside mode that have a known cause.
func insideHint(log string) string {
	switch {
	case strings.Contains(log, "Can't lookup mount"):
		return "the process holds a file outside the sandbox's mounts (opened before it entered the sandbox?): give it only descriptors opened inside"
	case strings.Contains(log, "session leader") || strings.Contains(log, "shell job"):
		return "the process does not lead its session: start it with setsid"
	case strings.Contains(log, "ptrace") && strings.Contains(log, "seize"):
		return "the process is traced or gone: detach its tracer first"
	case strings.Contains(log, "File exists") || strings.Contains(log, "EEXIST"):
		return "the process's PID (or a file it recreates) is taken in the sandbox: restore into a sandbox where it is free"
	case strings.Contains(log, "Can't open file") || strings.Contains(log, "bad size") || strings.Contains(log, "bad mode"):
		return "a file the process had open is missing or changed in the sandbox's tree: restore into the filesystem it was dumped with"
	}
	return "run it again with CAIRN_CRIU_LOG_LEVEL=4 for CRIU's full trace"
}

// hostChild returns the host PID of the child of initPid whose PID in the sandbox is
// nspid, looking first among the members of cgroups (cgroup.procs files).
func hostChild(initPid, nspid int, cgroups []string) (int, error) {
	var cands []int
	if len(cgroups) > 0 {
		b, _ := os.ReadFile(cgroups[0])
		for _, f := range strings.Fields(string(b)) {
			if p, err := strconv.Atoi(f); err == nil {
				cands = append(cands, p)
			}
		}
	}
	match := func(pids []int) int {
		for _, p := range pids {
			if pp, ns, err := procParent(p); err == nil && pp == initPid && ns == nspid {
				return p
			}
		}
		return 0
	}
	if p := match(cands); p != 0 {
		return p, nil
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	cands = cands[:0]
	for _, e := range ents {
		if p, err := strconv.Atoi(e.Name()); err == nil {
			cands = append(cands, p)
		}
	}
	if p := match(cands); p != 0 {
		return p, nil
	}
	return 0, errdefs.NotFound("criu restored PID %d, but init %d has no such child (did it exit at once? see its output)", nspid, initPid)
}

// procParent returns pid's parent (host PID) and its PID in its own pid namespace.
func procParent(pid int) (ppid, nspid int, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(l, ":")
		f := strings.Fields(v)
		switch {
		case k == "PPid" && len(f) == 1:
			ppid, _ = strconv.Atoi(f[0])
		case k == "NSpid" && len(f) > 0:
			nspid, _ = strconv.Atoi(f[len(f)-1])
		}
	}
	return ppid, nspid, nil
}
