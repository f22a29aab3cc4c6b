package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/internal/netns"
	"github.com/cairn-sandbox/cairn/internal/seccomp"
	"golang.org/x/sys/unix"
)

// SetupEnv names the environment variable carrying the JSON SetupConfig.
const SetupEnv = "CAIRN_SETUP"

// SetupConfig is what cairn passes to the setup stage.
type SetupConfig struct {
	Root     string `json:"root"`
	Hostname string `json:"hostname"`
	Seccomp  bool   `json:"seccomp"`
}

// keptCaps is the capability set of sandbox processes: Docker's default less NET_RAW.
var keptCaps = []int{
	unix.CAP_CHOWN, unix.CAP_DAC_OVERRIDE, unix.CAP_FSETID, unix.CAP_FOWNER, unix.CAP_MKNOD,
	unix.CAP_SETGID, unix.CAP_SETUID, unix.CAP_SETFCAP, unix.CAP_SETPCAP,
	unix.CAP_NET_BIND_SERVICE, unix.CAP_SYS_CHROOT, unix.CAP_KILL, unix.CAP_AUDIT_WRITE,
}

func init() {
	// Namespace changes (unshare), the seccomp filter and capability drops apply to the
	// calling thread, and execve carries over that thread's state: keep main on one.
	runtime.LockOSThread()
}

func setup() error {
	var cfg SetupConfig
	if err := json.Unmarshal([]byte(os.Getenv(SetupEnv)), &cfg); err != nil {
		return fmt.Errorf("bad %s: %w", SetupEnv, err)
	}
	// Wait for cairn to have put us into the sandbox's cgroups (fd 3 closes or sends a byte).
	gate := os.NewFile(3, "gate")
	var b [1]byte
	if n, _ := gate.Read(b[:]); n != 1 {
		return fmt.Errorf("cairn went away before the sandbox was started")
	}
	gate.Close()
	// Whatever descriptors cairn's own parent leaked to it point outside the sandbox and
	// would make the tree undumpable: close them all.
	if err := unix.CloseRange(3, ^uint(0), 0); err != nil {
		return fmt.Errorf("close inherited descriptors: %w", err)
	}
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("cgroup namespace: %w", err)
	}
	if err := mountAll(cfg.Root); err != nil {
		return err
	}
	if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
		return fmt.Errorf("sethostname: %w", err)
	}
	if err := netns.LoopbackUp(); err != nil {
		return fmt.Errorf("loopback: %w", err)
	}
	if err := redirectStdio(); err != nil {
		return err
	}
	if cfg.Seccomp {
		if err := seccomp.Install(); err != nil {
			return fmt.Errorf("seccomp: %w", err)
		}
	}
	if err := dropCaps(); err != nil {
		return fmt.Errorf("capabilities: %w", err)
	}
	bin := "/" + filepath.Join(initctl.Dir, initctl.InitBin)
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "GOMAXPROCS=1", "GOGC=50"}
	// cairn wrote the binary (initctl.Install) just before starting us. Another of its
	// goroutines may have forked a child meanwhile, which holds every descriptor cairn
	// had open, the binary's write descriptor included, until it execs: the kernel then
	// refuses to execute the file (ETXTBSY, golang/go#22315) for that short while.
	for tries := 0; ; tries++ {
		err := unix.Exec(bin, []string{"cairn-init", "serve"}, env)
		if !errors.Is(err, unix.ETXTBSY) || tries == 200 {
			return err
		}
		time.Sleep(time.Millisecond)
	}
}

// mountAll builds the sandbox's mount tree: the root (a bind of itself, so that it is a
// mount point to pivot into), /proc and a private devpts. /dev itself is a directory of
// the root filesystem, not a tmpfs: CRIU then has no tmpfs to archive on every dump.
func mountAll(root string) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount(root, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind root: %w", err)
	}
	if err := makeDevices(filepath.Join(root, "dev")); err != nil {
		return err
	}
	mounts := []struct {
		src, dst, fstype string
		flags            uintptr
		data             string
	}{
		{"proc", "proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
		{"devpts", "dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5"},
	}
	for _, m := range mounts {
		dst := filepath.Join(root, m.dst)
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, dst, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s on /%s: %w", m.fstype, m.dst, err)
		}
	}
	if err := readonlyProc(filepath.Join(root, "proc")); err != nil {
		return err
	}
	if err := unix.Chdir(root); err != nil {
		return err
	}
	// pivot_root(".", ".") stacks the old root under the new one; detaching it leaves
	// the sandbox with nothing of the host's mount tree.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	return unix.Chdir("/")
}

// readonlyProcPaths are the parts of /proc that reach the host kernel as a whole rather
// than the sandbox's namespaces: the sandbox shares the host's kernel and runs as its
// uid 0, so without this it could write host-wide sysctls (kernel.core_pattern names a
// program the host runs as root; vm.drop_caches, kernel.panic). runc's readonlyPaths.
var readonlyProcPaths = []string{"sys", "sysrq-trigger", "irq", "bus", "fs"}

// readonlyProc bind-mounts each of readonlyProcPaths onto itself read-only.
func readonlyProc(proc string) error {
	for _, p := range readonlyProcPaths {
		dst := filepath.Join(proc, p)
		if _, err := os.Lstat(dst); err != nil {
			continue
		}
		if err := unix.Mount(dst, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind /proc/%s: %w", p, err)
		}
		flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
		if err := unix.Mount("", dst, "", flags, ""); err != nil {
			return fmt.Errorf("make /proc/%s read-only: %w", p, err)
		}
	}
	return nil
}

// makeDevices makes sure the root's /dev has the usual nodes and links (imported trees
// may lack them); existing ones are kept.
func makeDevices(dev string) error {
	if err := os.MkdirAll(filepath.Join(dev, "shm"), 0o1777); err != nil {
		return err
	}
	nodes := []struct {
		name         string
		major, minor uint32
	}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}}
	old := unix.Umask(0)
	defer unix.Umask(old)
	for _, n := range nodes {
		err := unix.Mknod(filepath.Join(dev, n.name), unix.S_IFCHR|0o666, int(unix.Mkdev(n.major, n.minor)))
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("mknod /dev/%s: %w", n.name, err)
		}
	}
	// The private devpts instance serves /dev/ptmx only through this link.
	if fi, err := os.Lstat(filepath.Join(dev, "ptmx")); err == nil && fi.Mode()&os.ModeSymlink == 0 {
		os.Remove(filepath.Join(dev, "ptmx"))
	}
	links := map[string]string{"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(dev, name)); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
	}
	return nil
}

// redirectStdio points fds 0-2 inside the sandbox: /dev/null in, the init log out.
func redirectStdio() error {
	null, err := unix.Open("/dev/null", unix.O_RDWR, 0)
	if err != nil {
		return err
	}
	log, err := unix.Open("/"+filepath.Join(initctl.Dir, initctl.LogFile), unix.O_WRONLY|unix.O_CREAT|unix.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	for fd, src := range []int{null, log, log} {
		if err := unix.Dup2(src, fd); err != nil {
			return err
		}
	}
	unix.Close(null)
	unix.Close(log)
	return nil
}

func dropCaps() error {
	keep := map[int]bool{}
	var mask uint64
	for _, c := range keptCaps {
		keep[c] = true
		mask |= 1 << uint(c)
	}
	for c := 0; c <= unix.CAP_LAST_CAP; c++ {
		if !keep[c] {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return fmt.Errorf("drop cap %d: %w", c, err)
			}
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: uint32(mask), Permitted: uint32(mask), Inheritable: uint32(mask)},
		{Effective: uint32(mask >> 32), Permitted: uint32(mask >> 32), Inheritable: uint32(mask >> 32)},
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return err
	}
	return nil
}
