package dirty

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/internal/seccomp"
	"github.com/cairn-sandbox/cairn/internal/testenv/prereq"
	"golang.org/x/sys/unix"
)

// TestMain lets the test binary start Python under the sandbox's seccomp filter
// (seccompExecEnv).
func TestMain(m *testing.M) {
	if python := os.Getenv(seccompExecEnv); python != "" {
		execFiltered(python)
	}
	os.Exit(m.Run())
}

// seccompExecEnv names the interpreter a re-executed test binary runs (with the test
// binary's arguments) under internal/seccomp's filter.
const seccompExecEnv = "CAIRN_DIRTY_SECCOMP_EXEC"

func execFiltered(python string) {
	// The filter is the calling thread's, and execve keeps it: install it on the thread
	// that runs execve. Without CAP_SYS_ADMIN in the filter's eyes, no_new_privs is what
	// allows installing it; a sandbox's processes have both.
	runtime.LockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		fmt.Fprintln(os.Stderr, "no_new_privs:", err)
		os.Exit(2)
	}
	if err := seccomp.Install(); err != nil {
		fmt.Fprintln(os.Stderr, "seccomp:", err)
		os.Exit(2)
	}
	var env []string
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, seccompExecEnv+"=") {
			env = append(env, e)
		}
	}
	err := syscall.Exec(python, append([]string{python}, os.Args[1:]...), env)
	fmt.Fprintln(os.Stderr, "exec:", err)
	os.Exit(2)
}

// replicaScript is the tracee of these tests: a Python process (standard library only)
// that reads one command a line from fd 3 and answers each with one line on fd 4. It
// works on memory through ctypes at raw addresses, so that nothing but the commands
// touches the test's mappings (the interpreter's own heap and stack change all the time,
// which is why the tests look at their mappings only).
//
// Addresses and sizes are hexadecimal. Each write stores a new value (1 to 255) in the
// first byte of each page given.
const replicaScript = `
import ctypes, mmap, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
libc.read.restype = ctypes.c_ssize_t
libc.syscall.restype = ctypes.c_long
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
MAP_FIXED = 0x10
gen = 0
def reply(*a):
    os.write(4, (" ".join(str(x) for x in a) + "\n").encode())
def failed(what):
    reply("error", what, os.strerror(ctypes.get_errno()).replace(" ", "_"))
def nextgen():
    global gen
    gen = gen % 255 + 1
    return gen
for line in os.fdopen(3):
    f = line.split()
    if not f:
        continue
    op, a = f[0], f[1:]
    h = lambda i: int(a[i], 16)
    if op == "map":  # map SIZE ADDR|0 [PATH]: a private mapping, anonymous or of a file
        flags = mmap.MAP_PRIVATE | (MAP_FIXED if h(1) else 0)
        fd = -1
        if len(a) > 2:
            fd = os.open(a[2], os.O_RDWR)
        else:
            flags |= mmap.MAP_ANONYMOUS
        p = libc.mmap(h(1), h(0), mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if fd >= 0:
            os.close(fd)
        if p is None or p == 2**64 - 1:
            failed("mmap")
        else:
            reply("%x" % p)
    elif op == "mapflags":  # mapflags SIZE FLAGS: mmap(2) with these flags, anonymous
        p = libc.mmap(0, h(0), mmap.PROT_READ | mmap.PROT_WRITE, h(1), -1, 0)
        if p is None or p == 2**64 - 1:
            failed("mmap")
        else:
            reply("%x" % p)
    elif op == "write":  # write ADDR...
        g = nextgen()
        for i in range(len(a)):
            ctypes.memset(h(i), g, 1)
        reply("ok")
    elif op == "fill":  # fill ADDR SIZE: every page
        ctypes.memset(h(0), nextgen(), h(1))
        reply("ok")
    elif op == "touch":  # touch ADDR...: read (populates a page without writing it)
        for i in range(len(a)):
            ctypes.string_at(h(i), 1)
        reply("ok")
    elif op == "get":  # get ADDR: the first byte of the page
        reply(ctypes.string_at(h(0), 1)[0])
    elif op == "sysread":  # sysread ADDR PATH: read(2) a page of the file into memory
        fd = os.open(a[1], os.O_RDONLY)
        n = libc.read(fd, h(0), 4096)
        os.close(fd)
        if n != 4096:
            failed("read")
        else:
            reply("ok")
    elif op == "madvise":  # madvise ADDR SIZE ADVICE
        if libc.madvise(h(0), h(1), h(2)) != 0:
            failed("madvise")
        else:
            reply("ok")
    elif op == "unmap":  # unmap ADDR SIZE
        if libc.munmap(h(0), h(1)) != 0:
            failed("munmap")
        else:
            reply("ok")
    elif op == "fork":  # fork ADDR...: a child writes each page and checks it, then stops
        pid = os.fork()
        if pid == 0:
            ok = 1
            for i in range(len(a)):
                ctypes.memset(h(i), 0x5a, 1)
                ok &= ctypes.string_at(h(i), 1) == b"\x5a"
            os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(0 if ok else 1)
        os.waitpid(pid, os.WUNTRACED)
        reply(pid)
    elif op == "exec":  # exec: run execve, into a Python that names itself "execd" and sleeps
        reply("ok")
        os.execv(sys.executable, [sys.executable, "-c",
            "import ctypes, time; ctypes.CDLL(None).prctl(15, b'execd', 0, 0, 0); time.sleep(1000)"])
    elif op == "reap":  # reap PID: wait for a child, answer its exit status
        _, st = os.waitpid(int(a[0]), 0)
        reply(os.waitstatus_to_exitcode(st))
    elif op == "uffd":  # uffd [ADDR SIZE]: a userfaultfd of our own, registering ADDR
        fd = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK | 1)
        if fd < 0:
            failed("userfaultfd")
            continue
        if len(a) == 2:
            api = (ctypes.c_uint64 * 3)(0xaa, 0, 0)
            reg = (ctypes.c_uint64 * 4)(h(0), h(1), 1, 0)  # UFFDIO_REGISTER_MODE_MISSING
            if libc.ioctl(fd, 0xc018aa3f, api) != 0 or libc.ioctl(fd, 0xc020aa00, reg) != 0:
                failed("ioctl")
                continue
        else:
            os.close(fd)
        reply(fd)
    else:
        reply("error", "unknown_command", op)
`

// replica is a running replicaScript.
type replica struct {
	cmd  *exec.Cmd
	pid  int
	in   *os.File
	out  *bufio.Reader
	outf *os.File
}

var pythonPath = sync.OnceValues(func() (string, error) {
	// The interpreter itself, not a wrapper (pyenv's shims are shell scripts): the
	// process the tests trace is then Python from its first instruction.
	out, err := exec.Command("python3", "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		return "", fmt.Errorf("python3: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
})

// startReplica starts the replica, under the sandbox's seccomp filter if filtered.
func startReplica(t *testing.T, filtered bool) *replica {
	t.Helper()
	requireRoot(t)
	python, err := pythonPath()
	if err != nil {
		prereq.Missing(t, err.Error())
	}
	cr, cw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	rr, rw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(python, "-c", replicaScript)
	if filtered {
		cmd = exec.Command(os.Args[0], "-c", replicaScript)
		cmd.Env = append(os.Environ(), seccompExecEnv+"="+python)
	}
	cmd.ExtraFiles = []*os.File{cr, rw}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cr.Close()
	rw.Close()
	r := &replica{cmd: cmd, pid: cmd.Process.Pid, in: cw, out: bufio.NewReader(rr), outf: rr}
	t.Cleanup(func() {
		cw.Close()
		rr.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	r.do(t, "touch") // Python runs and answers
	return r
}

// do sends one command and returns its answer's fields; an error answer fails the test.
func (r *replica) do(t *testing.T, format string, a ...any) []string {
	t.Helper()
	f := r.try(t, format, a...)
	if len(f) > 0 && f[0] == "error" {
		t.Fatalf("replica: %q: %v", fmt.Sprintf(format, a...), f)
	}
	return f
}

// try is do that returns error answers.
func (r *replica) try(t *testing.T, format string, a ...any) []string {
	t.Helper()
	cmd := fmt.Sprintf(format, a...)
	if _, err := r.in.WriteString(cmd + "\n"); err != nil {
		t.Fatalf("replica: send %q: %v", cmd, err)
	}
	r.outf.SetReadDeadline(time.Now().Add(20 * time.Second))
	line, err := r.out.ReadString('\n')
	if err != nil {
		t.Fatalf("replica: no answer to %q: %v", cmd, err)
	}
	return strings.Fields(line)
}

// addr parses an address answered by the replica.
func addr(t *testing.T, f []string) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(f[0], 16, 64)
	if err != nil {
		t.Fatalf("replica answered %v, not an address", f)
	}
	return v
}

// stopped runs f with pid seized and stopped on tr's thread, then lets it go.
func stopped(t *testing.T, tr *ptrace.Tracer, pid int, f func(p *ptrace.Tracee) error) {
	t.Helper()
	err := tr.Do(func() error {
		p, err := ptrace.Seize(pid)
		if err != nil {
			return err
		}
		if err := p.Interrupt(); err != nil {
			return err
		}
		if err := p.Wait(10 * time.Second); err != nil {
			return err
		}
		return errors.Join(f(p), p.Detach())
	})
	if err != nil {
		t.Fatal(err)
	}
}

func requireRoot(t *testing.T) {
	t.Helper()
	prereq.Root(t, "tracing another process's memory needs root")
}
