package conformance

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// testEscape is the escape smoke test: from inside, a sandbox cannot see the host's
// processes, mount anything, reach a non-loopback address, load a kernel module, or
// write outside its root. Every probe is harmless if the boundary were missing: files
// are opened for writing but never written, module loads are given a file that is no
// module, and connections go to addresses with no route (a working boundary answers
// "network unreachable" at once; no packet ever leaves).
func testEscape(t *testing.T, h Harness) {
	id := sandbox(t, h)
	t.Run("HostProcesses", func(t *testing.T) {
		out := sh(t, h, id, "ps -e -o pid=,comm=")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		host, _ := os.ReadFile("/proc/self/comm")
		for _, l := range lines {
			f := strings.Fields(l)
			if len(f) != 2 {
				continue
			}
			if f[1] == strings.TrimSpace(string(host)) || f[1] == "runsc-sandbox" || f[1] == "runsc-gofer" || f[1] == "criu" {
				t.Fatalf("a host process is visible inside: %q (all: %q)", l, out)
			}
			if f[0] == "1" && f[1] != "init" {
				t.Fatalf("PID 1 inside is %q, not cairn-init (all: %q)", f[1], out)
			}
		}
		// The shell, ps and init, and perhaps a process being reaped: nothing of the host's
		// hundreds.
		if len(lines) > 8 {
			t.Fatalf("%d processes visible inside: %q", len(lines), out)
		}
		want(t, "this test process seen inside", sh(t, h, id, fmt.Sprintf("cat /proc/%d/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c -- '-test\\.' || true", os.Getpid())), "0\n")
	})
	t.Run("Mount", func(t *testing.T) {
		out := sh(t, h, id, `mkdir -p /mnt/probe
for m in "-t tmpfs none" "-t proc proc" "-t sysfs sysfs" "--bind /"; do
  mount $m /mnt/probe 2>/dev/null && echo "mounted: $m"
done
grep -c ' /mnt/probe ' /proc/self/mountinfo || true`)
		want(t, "mounts that succeeded", out, "0\n")
	})
	t.Run("Network", func(t *testing.T) {
		targets := []string{"10.255.255.1"}
		if ip := hostIP(); ip != "" {
			targets = append(targets, ip)
		}
		code := `import socket, errno, sys
for a in sys.argv[1:]:
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect((a, 80)); print(a, "connected")
    except OSError as e:
        # No route, refused before anything is sent (gVisor's netstack says "host").
        unreachable = e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
        print(a, "unreachable" if unreachable else errno.errorcode.get(e.errno, type(e).__name__))`
		_, out, _ := run(t, h, id, append([]string{"python3", "-c", code}, targets...)...)
		var wantOut strings.Builder
		for _, a := range targets {
			fmt.Fprintf(&wantOut, "%s unreachable\n", a)
		}
		want(t, "connections to non-loopback addresses", out, wantOut.String())
	})
	t.Run("KernelModules", func(t *testing.T) {
		// finit_module(2) and init_module(2) on something that is not a module: with the
		// boundary missing they would fail with ENOEXEC, not EPERM or ENOSYS.
		code := `import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open("/etc/hostname", os.O_RDONLY)
r1 = libc.syscall(313, fd, b"", 0); e1 = ctypes.get_errno()
buf = ctypes.create_string_buffer(64)
r2 = libc.syscall(175, buf, 64, b""); e2 = ctypes.get_errno()
ok = lambda r, e: r == -1 and e in (1, 38)
print(ok(r1, e1), ok(r2, e2), e1, e2)`
		_, out, errOut := run(t, h, id, "python3", "-c", code)
		if !strings.HasPrefix(out, "True True") {
			t.Fatalf("module load not refused with EPERM/ENOSYS: %q %q", out, errOut)
		}
	})
	t.Run("IOUring", func(t *testing.T) {
		if h.Isolation == "gvisor" {
			t.Skip("gVisor's sentry implements io_uring itself, on its own kernel")
		}
		// io_uring_setup(2) with one entry: refused with EPERM (the seccomp filter), where
		// the host kernel would make a ring.
		code := `import ctypes
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
r = libc.syscall(425, 1, params); e = ctypes.get_errno()
print(r, e)`
		_, out, errOut := run(t, h, id, "python3", "-c", code)
		if strings.TrimSpace(out) != "-1 1" {
			t.Fatalf("io_uring_setup inside the sandbox: %q %q; want -1 1 (EPERM)", out, errOut)
		}
	})
	t.Run("WriteOutsideRoot", func(t *testing.T) { testWriteOutside(t, h, id) })
	t.Run("Kernel", func(t *testing.T) {
		if h.Isolation != "gvisor" {
			t.Skip("only a gVisor sandbox runs on its own kernel")
		}
		var u unix.Utsname
		unix.Uname(&u)
		hostVersion := unix.ByteSliceToString(u.Version[:])
		inside := strings.TrimSpace(sh(t, h, id, "uname -v"))
		if inside == hostVersion {
			t.Fatalf("uname -v inside is the host's %q", inside)
		}
		if dmesg := sh(t, h, id, "dmesg 2>&1 || true"); !strings.Contains(dmesg, "gVisor") {
			t.Fatalf("dmesg inside does not show gVisor's boot: %q", tail(dmesg, 300))
		}
	})
}

// testWriteOutside checks that the host's kernel knobs cannot be opened for writing
// and that a path written inside is the sandbox's own, not the host's.
func testWriteOutside(t *testing.T, h Harness, id string) {
	code := `import os, sys
for p in sys.argv[1:]:
    try:
        os.close(os.open(p, os.O_WRONLY)); print(p, "writable")
    except OSError as e:
        print(p, "refused")`
	knobs := []string{"/proc/sysrq-trigger", "/proc/sys/vm/drop_caches", "/proc/sys/kernel/core_pattern",
		"/proc/sys/kernel/panic", "/sys/kernel/mm/transparent_hugepage/enabled", "/sys/power/state"}
	if !sharesHostKernel(t, h, id) {
		// Its /proc and /sys are its own kernel's (gVisor's sentry answers a write to
		// its /proc/sysrq-trigger and ignores it); the host's knobs are out of reach.
		knobs = nil
	}
	var wantOut strings.Builder
	for _, k := range knobs {
		fmt.Fprintf(&wantOut, "%s refused\n", k)
	}
	if rc, out, errOut := run(t, h, id, append([]string{"python3", "-c", code}, knobs...)...); out != wantOut.String() {
		t.Fatalf("host kernel knobs opened for writing from inside (exit %d): %q %q", rc, out, errOut)
	}
	// A host file at a path the sandbox also has: the sandbox neither sees nor changes
	// the host's.
	dir, err := os.MkdirTemp("/var/tmp", "cairn-escape-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	host := filepath.Join(dir, "host-file")
	if err := os.WriteFile(host, []byte("host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	want(t, "host file seen inside", sh(t, h, id, "test -e "+host+" && echo seen || echo unseen"), "unseen\n")
	sh(t, h, id, fmt.Sprintf("mkdir -p %s && echo sandbox > %s", dir, host))
	if b, _ := os.ReadFile(host); string(b) != "host\n" {
		t.Fatalf("host file changed from inside: %q", b)
	}
}

// sharesHostKernel reports whether the sandbox runs on the host's kernel (same release
// and build), as a container does.
func sharesHostKernel(t *testing.T, h Harness, id string) bool {
	var u unix.Utsname
	unix.Uname(&u)
	host := unix.ByteSliceToString(u.Release[:]) + " " + unix.ByteSliceToString(u.Version[:])
	return strings.TrimSpace(sh(t, h, id, "echo $(uname -r) $(uname -v)")) == host
}

// hostIP is one of the host's own non-loopback IPv4 addresses, or "".
func hostIP() string {
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
			return n.IP.String()
		}
	}
	return ""
}
