package fixup

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu"
)

// The process under test is started by re-executing the test binary (childEnv set):
// the child sets up the state a sandbox process has — its own session, a file read
// part way, POSIX locks, pipes and a FIFO with unread bytes, a parent-death signal, the
// child-subreaper flag — and then execs a single-threaded holder (Python: a Go process
// always has threads, and Apply takes single-threaded processes, as a zygote is). The
// holder serves commands read from a control FIFO; "fork" makes it fork a zygote, which
// stops itself (SIGSTOP, as cairn stops a zygote for its dump) and, once restored,
// serves the same commands as the process it copies.

const (
	childEnv = "CAIRN_FIXUP_CHILD" // the directory of the process under test
	modeEnv  = "CAIRN_FIXUP_MODE"  // "holder" or "threads"
)

// Contents of the files and pipes at the checkpoint.
var (
	dataContent   = []byte("checkpoint data: 0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ")
	lockContent   = []byte("lock file, locked in two places..")
	mappedContent = bytes.Repeat([]byte("mapped page "), 8192/12+1)[:8192]
	pipeA         = []byte("pipe-at-checkpoint")
	fifoData      = []byte("fifo-at-checkpoint")
	pipeC         = []byte("c-at-checkpoint")
)

const pdeathSig = unix.SIGUSR2

func TestMain(m *testing.M) {
	if dir := os.Getenv(childEnv); dir != "" {
		var err error
		switch os.Getenv(modeEnv) {
		case "threads":
			err = threads(dir)
		default:
			err = holder(dir)
		}
		fmt.Fprintln(os.Stderr, "child:", err)
		os.Exit(2)
	}
	// Restored processes are orphaned when criu restore -d exits, and zygotes when their
	// process is killed: adopt them, to reap them.
	unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	os.Exit(m.Run())
}

// threads is a multi-threaded process for Apply to refuse.
func threads(dir string) error {
	if _, err := unix.Setsid(); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "ready"), nil, 0o600); err != nil {
		return err
	}
	for {
		unix.Pause()
	}
}

// holder sets up the process's state and execs the Python holder.
func holder(dir string) error {
	// The parent-death signal is an attribute of the thread that sets it, and the exec
	// keeps the calling thread's: both on one thread, or the holder lost it when the
	// goroutine moved between them (TestApply failed ~1 run in 6, "not set up").
	runtime.LockOSThread()
	if _, err := unix.Setsid(); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(pdeathSig), 0, 0, 0); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return err
	}
	if err := os.Chdir(filepath.Join(dir, "work")); err != nil {
		return err
	}
	// Descriptors without O_CLOEXEC, to survive the exec (os.Open would set it).
	data, err := unix.Open(filepath.Join(dir, "data"), unix.O_RDONLY, 0)
	if err != nil {
		return err
	}
	if _, err := unix.Read(data, make([]byte, 10)); err != nil {
		return err
	}
	// The process owns its file (F_SETOWN, for SIGIO): the owner is in the open file
	// description, which its zygote shares.
	if _, err := unix.FcntlInt(uintptr(data), unix.F_SETOWN, os.Getpid()); err != nil {
		return err
	}
	lock, err := unix.Open(filepath.Join(dir, "lock"), unix.O_RDWR, 0)
	if err != nil {
		return err
	}
	for _, l := range []unix.Flock_t{{Type: unix.F_WRLCK, Start: 0, Len: 4}, {Type: unix.F_RDLCK, Start: 10, Len: 0}} {
		if err := unix.FcntlFlock(uintptr(lock), unix.F_SETLK, &l); err != nil {
			return err
		}
	}
	var a, b [2]int
	if err := unix.Pipe2(a[:], 0); err != nil {
		return err
	}
	if err := unix.Pipe2(b[:], 0); err != nil {
		return err
	}
	if _, err := unix.Write(a[1], pipeA); err != nil {
		return err
	}
	fifo, err := unix.Open(filepath.Join(dir, "fifo"), unix.O_RDWR, 0)
	if err != nil {
		return err
	}
	if _, err := unix.Write(fifo, fifoData); err != nil {
		return err
	}
	// fd 3 (ExtraFiles) is the write end of pipe C, whose read end the test holds: the
	// process has no read end of it, so CRIU dumps no data for it.
	if _, err := unix.Write(3, pipeC); err != nil {
		return err
	}
	ctl, err := unix.Open(filepath.Join(dir, "ctl"), unix.O_RDWR, 0)
	if err != nil {
		return err
	}
	args, err := json.Marshal(map[string]any{"dir": dir, "ctl": ctl, "data": data, "lock": lock,
		"a": a, "b": b, "fifo": fifo, "c": 3, "pdeath": int(pdeathSig)})
	if err != nil {
		return err
	}
	py := filepath.Join(dir, "bin", "python")
	return unix.Exec(py, []string{"python", "-c", holderScript, string(args)}, os.Environ())
}

const holderScript = `
import ctypes, fcntl, json, mmap, os, signal, sys
a = json.loads(sys.argv[1])
d = a["dir"]
libc = ctypes.CDLL(None, use_errno=True)
received = [0]
def on_pdeath(sig, frame):
    received[0] += 1
signal.signal(a["pdeath"], on_pdeath)
with open(d + "/mapped", "r+b") as f:
    mapped = mmap.mmap(f.fileno(), 0)  # MAP_SHARED; mmap keeps a dup of the fd

def prctl_get(op):
    v = ctypes.c_int(0)
    if libc.prctl(op, ctypes.byref(v), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")
    return v.value

def reply(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)

def mutate(what):
    # What the process does after the checkpoint, to the objects it shares with its zygote.
    if what == "moved":
        os.read(a["data"], 20)
        fl = fcntl.fcntl(a["data"], fcntl.F_GETFL)
        fcntl.fcntl(a["data"], fcntl.F_SETFL, fl | os.O_NONBLOCK | os.O_APPEND)
        fcntl.fcntl(a["a"][0], fcntl.F_SETFL, os.O_NONBLOCK)
        os.read(a["a"][0], 4096)
        os.write(a["a"][1], b"pipe-after")
        os.write(a["b"][1], b"b-after")
        os.read(a["fifo"], 4096)
        fcntl.lockf(a["lock"], fcntl.LOCK_UN, 4, 0)
        fcntl.lockf(a["lock"], fcntl.LOCK_EX | fcntl.LOCK_NB, 4, 4)
        with open(d + "/data", "ab") as f:
            f.write(b"appended after the checkpoint")
        os.chmod(d + "/data", 0o600)
    elif what == "renamed":
        for p in ("data", "mapped", "work", "bin/python"):
            os.rename(d + "/" + p, d + "/" + p + ".moved")
    elif what == "deleted":
        fd = os.open(d + "/data", os.O_WRONLY)
        os.pwrite(fd, b"overwritten after the checkpoint", 0)
        os.close(fd)
        os.unlink(d + "/data")
        os.unlink(d + "/mapped")
        os.rmdir(d + "/work")
    elif what == "relinked":
        os.link(d + "/data", d + "/data.link")
        os.unlink(d + "/data")
    elif what != "unchanged":
        raise ValueError(what)

def serve():
    buf = b""
    while True:
        buf += os.read(a["ctl"], 4096)
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "fork":
                pid = os.fork()
                if pid == 0:
                    # The zygote: not dumpable (as cairn makes its zygotes), stopped until
                    # dumped. Restored, it goes on from here and serves as the process it
                    # is a copy of.
                    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
                    os.kill(os.getpid(), signal.SIGSTOP)
                    continue
                reply(cmd["out"], {"child": pid})
            elif op == "report":
                reply(cmd["out"], {"pid": os.getpid(), "pdeath": prctl_get(2),
                                   "dumpable": libc.prctl(3, 0, 0, 0, 0),
                                   "subreaper": prctl_get(37), "pdeath_received": received[0],
                                   "owner": fcntl.fcntl(a["data"], fcntl.F_GETOWN)})
            elif op == "mutate":
                mutate(cmd["what"])
                reply(cmd["out"], {})

serve()
`

// require skips the test (outside CI) or fails it (CI=true) unless root, CRIU and
// Python are there, and returns CRIU's path.
func require(t *testing.T) string {
	t.Helper()
	skip := t.Skipf
	if os.Getenv("CI") == "true" {
		skip = t.Fatalf
	}
	if os.Geteuid() != 0 {
		skip("needs root (CRIU)")
	}
	p, err := criu.Find()
	if err != nil {
		skip("%v", err)
	}
	if _, err := python(); err != nil {
		skip("needs python3 for the single-threaded process under test: %v", err)
	}
	return p
}

// python returns the real Python binary (not a wrapper script: it is copied).
func python() (string, error) {
	p, err := exec.LookPath("python3")
	if _, serr := os.Stat("/usr/bin/python3"); serr == nil {
		p, err = "/usr/bin/python3", nil
	}
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(p)
}

// proc is the process under test: the holder, its zygote, or a restored process.
type proc struct {
	t    *testing.T
	dir  string
	pid  int
	cmd  *exec.Cmd // the holder started by the test
	pipe *os.File  // the test's read end of pipe C
}

// start sets up dir and starts the holder (or, in mode "threads", a Go process).
func start(t *testing.T, mode string) *proc {
	t.Helper()
	dir := t.TempDir()
	for _, d := range []string{"work", "bin", "out"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, c := range map[string][]byte{"data": dataContent, "lock": lockContent, "mapped": mappedContent} {
		if err := os.WriteFile(filepath.Join(dir, name), c, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"fifo", "ctl"} {
		if err := unix.Mkfifo(filepath.Join(dir, f), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	py, err := python()
	if err != nil {
		t.Fatal(err)
	}
	// A copy, so that the test can rename the executable.
	if b, err := os.ReadFile(py); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(filepath.Join(dir, "bin", "python"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "out", "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	defer w.Close()
	// stdin and stdout are /dev/null, stderr a file: nothing shared with the test's
	// terminal, and everything inside mounts CRIU can reach.
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+dir, modeEnv+"="+mode)
	cmd.Stderr = log
	cmd.ExtraFiles = []*os.File{w}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, dir: dir, pid: cmd.Process.Pid, cmd: cmd, pipe: r}
	t.Cleanup(p.kill)
	if mode == "threads" {
		p.waitFile(filepath.Join(dir, "ready"))
	} else {
		p.report() // it serves
	}
	return p
}

// kill kills the holder (and reaps it) and closes the test's end of pipe C.
func (p *proc) kill() {
	if p.cmd != nil {
		p.cmd.Process.Kill()
		p.cmd.Wait()
		p.cmd = nil
	}
	if p.pipe != nil {
		p.pipe.Close()
		p.pipe = nil
	}
}

// killPid kills an adopted process (a zygote, a restored process) and reaps it.
func killPid(pid int) {
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return
	}
	var ws unix.WaitStatus
	unix.Wait4(pid, &ws, 0, nil)
}

func (p *proc) waitFile(path string) []byte {
	p.t.Helper()
	for i := 0; i < 2000; i++ {
		if b, err := os.ReadFile(path); err == nil {
			return b
		}
		time.Sleep(10 * time.Millisecond)
	}
	log, _ := os.ReadFile(filepath.Join(p.dir, "out", "log"))
	p.t.Fatalf("%s did not appear; the process's log:\n%s", path, log)
	return nil
}

var seq int

// do sends a command to whichever process reads the control FIFO and returns its reply.
func (p *proc) do(cmd map[string]any, reply any) {
	p.t.Helper()
	seq++
	out := filepath.Join(p.dir, "out", fmt.Sprintf("reply-%d", seq))
	cmd["out"] = out
	line, _ := json.Marshal(cmd)
	f, err := os.OpenFile(filepath.Join(p.dir, "ctl"), os.O_WRONLY, 0)
	if err != nil {
		p.t.Fatal(err)
	}
	_, err = f.Write(append(line, '\n'))
	f.Close()
	if err != nil {
		p.t.Fatal(err)
	}
	if err := json.Unmarshal(p.waitFile(out), reply); err != nil {
		p.t.Fatal(err)
	}
}

type report struct {
	Pid            int `json:"pid"`
	Pdeath         int `json:"pdeath"`
	Subreaper      int `json:"subreaper"`
	Dumpable       int `json:"dumpable"`
	PdeathReceived int `json:"pdeath_received"`
	Owner          int `json:"owner"` // F_GETOWN of the data file's descriptor
}

func (p *proc) report() report {
	p.t.Helper()
	var r report
	p.do(map[string]any{"op": "report"}, &r)
	return r
}

// fork makes the holder fork its zygote, and returns it once stopped.
func (p *proc) fork() int {
	p.t.Helper()
	var r struct{ Child int }
	p.do(map[string]any{"op": "fork"}, &r)
	for i := 0; i < 2000 && state(r.Child) != 'T'; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if s := state(r.Child); s != 'T' {
		p.t.Fatalf("zygote %d is in state %c, not stopped", r.Child, s)
	}
	return r.Child
}

func (p *proc) mutate(what string) {
	p.t.Helper()
	var r struct{}
	p.do(map[string]any{"op": "mutate", "what": what}, &r)
}

// stat returns fields of /proc/pid/stat after the command name: state, ppid, pgrp,
// session...
func stat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	s := string(b)
	return strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
}

func state(pid int) byte {
	if f := stat(pid); len(f) > 0 {
		return f[0][0]
	}
	return 0
}

// record reads a process's Spec from /proc, as cairn does at a checkpoint (without the
// parent-death signal and the subreaper flag, which only the process itself can read),
// and the unread content of its pipes and FIFOs by descriptor.
func record(t *testing.T, pid int) (Spec, map[int][]byte) {
	t.Helper()
	s := Spec{Pid: pid}
	base := fmt.Sprintf("/proc/%d", pid)
	ents, err := os.ReadDir(base + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	byFd := map[int][]byte{}
	seen := map[uint64]bool{}
	for _, e := range ents {
		fd, _ := strconv.Atoi(e.Name())
		link, err := os.Readlink(fmt.Sprintf("%s/fd/%d", base, fd))
		if err != nil {
			t.Fatal(err)
		}
		info, err := os.ReadFile(fmt.Sprintf("%s/fdinfo/%d", base, fd))
		if err != nil {
			t.Fatal(err)
		}
		f := File{Fd: fd, Path: link}
		for _, l := range strings.Split(string(info), "\n") {
			k, v, _ := strings.Cut(l, ":")
			v = strings.TrimSpace(v)
			switch k {
			case "pos":
				f.Pos, _ = strconv.ParseInt(v, 10, 64)
			case "flags":
				fl, _ := strconv.ParseInt(v, 8, 64)
				f.Flags = int(fl)
			case "lock":
				if l, ok := parseLock(fd, v); ok {
					s.Locks = append(s.Locks, l)
				}
			}
		}
		if strings.HasPrefix(link, "/") || strings.HasPrefix(link, "pipe:[") {
			s.Files = append(s.Files, f)
		}
		var st unix.Stat_t
		if err := unix.Stat(fmt.Sprintf("%s/fd/%d", base, fd), &st); err != nil {
			t.Fatal(err)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFIFO {
			data := peek(t, fmt.Sprintf("%s/fd/%d", base, fd))
			byFd[fd] = data
			if !seen[st.Ino] {
				s.Pipes = append(s.Pipes, Pipe{Ino: st.Ino, Data: data})
				seen[st.Ino] = true
			}
		}
	}
	if s.Cwd, err = os.Readlink(base + "/cwd"); err != nil {
		t.Fatal(err)
	}
	if s.Exe, err = os.Readlink(base + "/exe"); err != nil {
		t.Fatal(err)
	}
	s.Maps = maps(t, pid)
	sort.Slice(s.Locks, func(i, j int) bool { return s.Locks[i].Start < s.Locks[j].Start })
	return s, byFd
}

// parseLock parses a "lock:" line of fdinfo ("1: POSIX  ADVISORY  WRITE 42 fe:00:1 0 9").
func parseLock(fd int, v string) (Lock, bool) {
	f := strings.Fields(v)
	if len(f) < 8 || f[1] != "POSIX" {
		return Lock{}, false
	}
	l := Lock{Fd: fd, Write: f[3] == "WRITE"}
	l.Start, _ = strconv.ParseInt(f[6], 10, 64)
	if f[7] != "EOF" {
		end, _ := strconv.ParseInt(f[7], 10, 64)
		l.Len = end - l.Start + 1
	}
	return l, true
}

// peek returns the unread bytes of the pipe or FIFO at path without consuming them.
func peek(t *testing.T, path string) []byte {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	n, err := unix.Tee(fd, p[1], 1<<16, unix.SPLICE_F_NONBLOCK)
	if errors.Is(err, unix.EAGAIN) || n == 0 {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, n)
	if m, err := unix.Read(p[0], b); err != nil || int64(m) != n {
		t.Fatalf("read %d teed bytes of %s: %d, %v", n, path, m, err)
	}
	return b
}

// maps returns the file-backed mappings of /proc/pid/maps.
func maps(t *testing.T, pid int) []Map {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []Map
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || !strings.HasPrefix(fields[5], "/") {
			continue
		}
		lo, _, _ := strings.Cut(fields[0], "-")
		start, _ := strconv.ParseUint(lo, 16, 64)
		_, path, _ := strings.Cut(sc.Text(), " /")
		out = append(out, Map{Start: start, Path: "/" + path})
	}
	return out
}

// pathAt returns the path of the file mapped at addr in pid.
func pathAt(t *testing.T, pid int, addr uint64) string {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		lo, hi, _ := strings.Cut(fields[0], "-")
		a, _ := strconv.ParseUint(lo, 16, 64)
		b, _ := strconv.ParseUint(hi, 16, 64)
		if a <= addr && addr < b {
			if _, path, ok := strings.Cut(sc.Text(), " /"); ok {
				return "/" + path
			}
			return ""
		}
	}
	return ""
}

// criuDump dumps the single task pid with the CRIU CLI into a new directory, leaving it
// as it is. --shell-job: a zygote is not the leader of the session it is in.
func criuDump(t *testing.T, criuPath string, pid int, extra ...string) string {
	t.Helper()
	dir := t.TempDir()
	args := append([]string{"dump", "-t", strconv.Itoa(pid), "-D", dir, "--leave-running",
		"--shell-job", "--file-locks", "-o", "dump.log", "-v4"}, extra...)
	out, err := exec.Command(criuPath, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("criu dump -t %d: %v: %s\n%s", pid, err, out, logErrors(filepath.Join(dir, "dump.log")))
	}
	return dir
}

// criuRestore restores dir with the CRIU CLI, detached; the restored process is adopted by
// the test (a subreaper) when criu exits. It is killed at the end of the test.
func criuRestore(t *testing.T, criuPath, dir string, pid int, extra ...string) {
	t.Helper()
	args := append([]string{"restore", "-D", dir, "--restore-detached", "--file-locks",
		"-o", "restore.log", "-v4"}, extra...)
	out, err := exec.Command(criuPath, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("criu restore: %v: %s\n%s", err, out, logErrors(filepath.Join(dir, "restore.log")))
	}
	t.Cleanup(func() { killPid(pid) })
}

// logErrors returns the error lines of a CRIU log.
func logErrors(path string) string {
	b, _ := os.ReadFile(path)
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") && !strings.Contains(l, "RLIMIT_NOFILE") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
