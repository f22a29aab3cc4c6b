package criu_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/netns"
)

// The test binary is re-executed as the mini sandbox's init and as its worker
// (runc's libcontainer/integration/init_test.go pattern).
const (
	roleEnv = "CAIRN_CRIU_TEST_ROLE" // "init" or "worker"
	rootEnv = "CAIRN_CRIU_TEST_ROOT" // init: the host directory it pivots into
	runEnv  = "CAIRN_CRIU_TEST_RUN"  // init: the host directory it binds at /run
	dirEnv  = "CAIRN_CRIU_TEST_DIR"  // worker: its state directory
	// exeInside is where the mini init binds the test binary in its root.
	exeInside = "/cairn-criu.test"
)

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case "init":
		if err := miniInit(); err != nil {
			fmt.Fprintln(os.Stderr, "mini init:", err)
			os.Exit(1)
		}
		os.Exit(0)
	case "worker":
		if err := worker(); err != nil {
			fmt.Fprintln(os.Stderr, "worker:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// requireInside skips (outside CI) or fails (with CI=true) unless these tests can run:
// root and the private CRIU prefix. It does not use testenv.Require, which builds an
// engine this package does not need.
func requireInside(tb testing.TB) {
	tb.Helper()
	missing := ""
	if os.Geteuid() != 0 {
		missing = "these tests need root"
	} else if _, err := os.Stat(criu.PrivatePrefixCriu); err != nil {
		missing = "no CRIU in the private prefix (run scripts/install-deps.sh)"
	} else if _, err := exec.LookPath("nsenter"); err != nil {
		missing = "nsenter not found"
	}
	if missing == "" {
		return
	}
	if os.Getenv("CI") == "true" {
		tb.Fatalf("prerequisite missing in CI: %s", missing)
	}
	tb.Skipf("skipping: %s", missing)
}

// miniInit is PID 1 of a minimal sandbox: new pid, mount, network, ipc, uts and cgroup
// namespaces, a tmpfs root pivoted into (with the host's /usr read-only, /dev and the test
// binary), its own /proc with /proc/sys read-only and loopback up, as cairn-init has. Its
// /run is a host directory, not a tmpfs, as in cairn's sandboxes: CRIU writes no
// kernel-feature cache there. It reaps every
// child and serves one command a line on stdin: "worker NAME" starts a worker with state
// in /tmp/NAME and answers "pid N" (N in the sandbox's pid namespace).
func miniInit() error {
	root := os.Getenv(rootEnv)
	// Descriptors inherited from the host (without close-on-exec) must not reach the
	// workers: CRIU cannot dump a file of another mount namespace.
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount("tmpfs", root, "tmpfs", 0, "mode=755,size=64m"); err != nil {
		return err
	}
	for _, d := range []string{"usr", "dev", "proc", "tmp", "etc", "run", ".old"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	for _, l := range []string{"bin", "lib", "lib64", "sbin"} {
		if err := os.Symlink("usr/"+l, filepath.Join(root, l)); err != nil {
			return err
		}
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(root, exeInside), nil, 0o755); err != nil {
		return err
	}
	for _, b := range []struct {
		src, dst string
		ro       bool
	}{{"/usr", "usr", true}, {"/dev", "dev", false}, {exe, exeInside, true}, {os.Getenv(runEnv), "run", false}} {
		dst := filepath.Join(root, b.dst)
		if err := unix.Mount(b.src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", b.src, err)
		}
		if b.ro {
			if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
				return err
			}
		}
	}
	// The sandbox's own /usr/sbin (writable, as in a real sandbox's tree), where a
	// program found through PATH would be.
	if err := unix.Mount("tmpfs", filepath.Join(root, "usr/sbin"), "tmpfs", 0, "mode=755,size=1m"); err != nil {
		return err
	}
	if err := unix.PivotRoot(root, filepath.Join(root, ".old")); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Unmount("/.old", unix.MNT_DETACH); err != nil {
		return err
	}
	os.Remove("/.old")
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := unix.Mount("/proc/sys", "/proc/sys", "", unix.MS_BIND, ""); err != nil {
		return err
	}
	if err := unix.Mount("", "/proc/sys", "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		return err
	}
	if err := netns.LoopbackUp(); err != nil { // as cairn-init; CRIU probes TCP on it
		return err
	}
	go func() {
		for {
			var ws unix.WaitStatus
			if _, err := unix.Wait4(-1, &ws, 0, nil); errors.Is(err, unix.ECHILD) {
				time.Sleep(10 * time.Millisecond)
			}
		}
	}()
	fmt.Println("ready")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 || f[0] != "worker" {
			fmt.Println("err unknown command")
			continue
		}
		cmd := exec.Command(exeInside)
		cmd.Env = []string{roleEnv + "=worker", dirEnv + "=/tmp/" + f[1]}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := cmd.Start(); err != nil {
			fmt.Println("err", err)
			continue
		}
		fmt.Println("pid", cmd.Process.Pid) // never waited for: the reaper takes it
	}
	return sc.Err()
}

// answer is what a worker reports of its state.
type answer struct {
	Token   string // random, made at start: the same process's memory
	Counter int    // questions answered
	Char    string // the byte read from its data file at its offset
	Offset  int64  // the data file's offset after that read
	Cwd     string
	Pid     int
	PPid    int
}

// worker keeps state in memory (a token, a counter), a descriptor of a data file at an
// offset, and its working directory, and answers questions: a line "ID" written to the
// FIFO DIR/ask gets DIR/answer-ID.json.
func worker() error {
	dir := os.Getenv(dirEnv)
	tok := make([]byte, 8)
	rand.Read(tok)
	if err := os.MkdirAll(filepath.Join(dir, "cwd"), 0o755); err != nil {
		return err
	}
	data, err := unix.Open(filepath.Join(dir, "data"), unix.O_RDWR|unix.O_CREAT|unix.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := unix.Write(data, []byte("abcdefghijklmnopqrstuvwxyz")); err != nil {
		return err
	}
	if _, err := unix.Seek(data, 5, io.SeekStart); err != nil {
		return err
	}
	if err := unix.Mkfifo(filepath.Join(dir, "ask.tmp"), 0o600); err != nil {
		return err
	}
	// Held read-write, so that it never reads EOF and writers never block.
	ask, err := unix.Open(filepath.Join(dir, "ask.tmp"), unix.O_RDWR, 0)
	if err != nil {
		return err
	}
	if err := os.Rename(filepath.Join(dir, "ask.tmp"), filepath.Join(dir, "ask")); err != nil {
		return err
	}
	if err := unix.Chdir(filepath.Join(dir, "cwd")); err != nil {
		return err
	}
	a := answer{Token: hex.EncodeToString(tok)}
	var pending []byte
	buf := make([]byte, 64)
	for {
		n, err := unix.Read(ask, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		pending = append(pending, buf[:n]...)
		for {
			i := strings.IndexByte(string(pending), '\n')
			if i < 0 {
				break
			}
			id := string(pending[:i])
			pending = pending[i+1:]
			a.Counter++
			c := make([]byte, 1)
			if _, err := unix.Read(data, c); err != nil {
				return err
			}
			a.Char = string(c)
			a.Offset, _ = unix.Seek(data, 0, io.SeekCurrent)
			a.Cwd, _ = unix.Getwd()
			a.Pid, a.PPid = unix.Getpid(), unix.Getppid()
			b, _ := json.Marshal(a)
			out := filepath.Join(dir, "answer-"+id+".json")
			if err := os.WriteFile(out+".tmp", b, 0o644); err != nil {
				return err
			}
			if err := os.Rename(out+".tmp", out); err != nil {
				return err
			}
		}
	}
}

// miniSandbox is a running mini init, seen from the host.
type miniSandbox struct {
	cmd *exec.Cmd
	in  io.Writer
	out *bufio.Scanner
	pid int    // host PID of init
	run string // host directory of its /run
}

func startSandbox(tb testing.TB) *miniSandbox {
	tb.Helper()
	cmd := exec.Command("/proc/self/exe")
	run := tb.TempDir()
	cmd.Env = append(os.Environ(), roleEnv+"=init", rootEnv+"="+tb.TempDir(), runEnv+"="+run)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS |
		syscall.CLONE_NEWNET | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS | syscall.CLONE_NEWCGROUP}
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() }) // its pid namespace dies with it
	s := &miniSandbox{cmd: cmd, in: in, out: bufio.NewScanner(out), pid: cmd.Process.Pid, run: run}
	if !s.out.Scan() || s.out.Text() != "ready" {
		tb.Fatalf("mini init did not start: %q %v", s.out.Text(), s.out.Err())
	}
	return s
}

// path is the host path of p in the sandbox.
func (s *miniSandbox) path(p string) string { return fmt.Sprintf("/proc/%d/root%s", s.pid, p) }

// startWorker starts a worker with state in /tmp/name and returns its PID in the
// sandbox and on the host, once it answers.
func (s *miniSandbox) startWorker(tb testing.TB, name string) (nspid, host int) {
	tb.Helper()
	fmt.Fprintf(s.in, "worker %s\n", name)
	if !s.out.Scan() {
		tb.Fatalf("mini init: %v", s.out.Err())
	}
	f := strings.Fields(s.out.Text())
	if len(f) != 2 || f[0] != "pid" {
		tb.Fatalf("mini init: %q", s.out.Text())
	}
	nspid, _ = strconv.Atoi(f[1])
	host = hostPid(tb, s.pid, nspid)
	s.ask(tb, name, "start")
	return nspid, host
}

// ask asks the worker of /tmp/name a question and returns its answer.
func (s *miniSandbox) ask(tb testing.TB, name, id string) answer {
	tb.Helper()
	dir := s.path("/tmp/" + name)
	deadline := time.Now().Add(20 * time.Second)
	for {
		fd, err := unix.Open(filepath.Join(dir, "ask"), unix.O_WRONLY|unix.O_NONBLOCK, 0)
		if err == nil {
			_, err = unix.Write(fd, []byte(id+"\n"))
			unix.Close(fd)
			if err != nil {
				tb.Fatal(err)
			}
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("worker %s does not listen: %v", name, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "answer-"+id+".json"))
		if err == nil {
			var a answer
			if err := json.Unmarshal(b, &a); err != nil {
				tb.Fatal(err)
			}
			return a
		}
		if time.Now().After(deadline) {
			tb.Fatalf("worker %s gave no answer to %s", name, id)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// hostPid finds the host PID of the child of initPid whose PID in the sandbox is nspid,
// independently of criu's own lookup.
func hostPid(tb testing.TB, initPid, nspid int) int {
	tb.Helper()
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st := procStatus(p)
		if st["PPid"] == strconv.Itoa(initPid) && strings.HasSuffix(st["NSpid"], "\t"+strconv.Itoa(nspid)) {
			return p
		}
	}
	tb.Fatalf("init %d has no child %d", initPid, nspid)
	return 0
}

func procStatus(pid int) map[string]string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	m := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// procStat returns pid's state letter and nice value.
func procStat(tb testing.TB, pid int) (string, int) {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		tb.Fatal(err)
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	nice, _ := strconv.Atoi(f[16])
	return f[0], nice
}

// kill kills a process of the sandbox and waits for init to reap it.
func kill(tb testing.TB, host int) {
	tb.Helper()
	syscall.Kill(host, syscall.SIGKILL)
	waitFor(tb, "process to be reaped", func() bool {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", host))
		return err != nil
	})
}

func waitFor(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out waiting for %s", what)
		}
	}
}

// cgroup makes a throwaway v1 cgroup of controller and returns its directory; it is
// removed at the end of the test (after the sandboxes started later are gone).
func cgroup(tb testing.TB, controller string) string {
	tb.Helper()
	dir := filepath.Join("/sys/fs/cgroup", controller, fmt.Sprintf("cairn-test-%d-%s", os.Getpid(), strings.ReplaceAll(tb.Name(), "/", "-")))
	if err := os.Mkdir(dir, 0o755); err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("prerequisite missing in CI: a v1 %s cgroup: %v", controller, err)
		}
		tb.Skipf("skipping: no v1 %s cgroup: %v", controller, err)
	}
	tb.Cleanup(func() {
		if controller == "freezer" {
			os.WriteFile(filepath.Join(dir, "freezer.state"), []byte("THAWED"), 0)
		}
		for i := 0; os.Remove(dir) != nil && i < 500; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	return dir
}

func nsOf(tb testing.TB, pid int, ns string) string {
	tb.Helper()
	l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
	if err != nil {
		tb.Fatal(err)
	}
	return l
}

func TestInsideAvailable(t *testing.T) {
	requireInside(t)
	if err := criu.InsideAvailable(); err != nil {
		t.Fatalf("InsideAvailable with the private prefix installed: %v", err)
	}
}

// TestInsideDumpRestore dumps one worker of a mini sandbox from inside, checks that it
// runs on (images without namespaces or mounts), kills it, restores it into the same
// running sandbox in a given cgroup, and checks that it is the dumped process again: its
// PID, parent (init), namespaces, memory, file offset and working directory, and the
// priority it was dumped with despite a background restore.
func TestInsideDumpRestore(t *testing.T) {
	requireInside(t)
	cg := cgroup(t, "pids")
	s := startSandbox(t)
	nspid, host := s.startWorker(t, "w")
	before := s.ask(t, "w", "1")
	if want := (answer{Token: before.Token, Counter: 2, Char: "g", Offset: 7, Cwd: "/tmp/w/cwd", Pid: nspid, PPid: 1}); before != want {
		t.Fatalf("worker before the dump: %+v", cmp.Diff(want, before))
	}

	images := t.TempDir()
	if err := criu.DumpInside(context.Background(), criu.InsideDumpOptions{InitPid: s.pid, Pid: nspid, ImagesDir: images}); err != nil {
		t.Fatalf("dump: %v", err)
	}
	if _, err := os.Stat(filepath.Join(images, fmt.Sprintf("core-%d.img", nspid))); err != nil {
		t.Fatalf("no core image of the worker: %v", err)
	}
	for _, pat := range []string{"mountpoints-*.img", "netns-*.img", "utsns-*.img", "ipcns-*.img"} {
		if m, _ := filepath.Glob(filepath.Join(images, pat)); len(m) > 0 {
			t.Errorf("the dump holds a namespace: %s", m)
		}
	}
	if a := s.ask(t, "w", "after-dump"); a.Counter != 3 || a.Char != "h" {
		t.Fatalf("worker after the dump: %+v, want it running on with counter 3", a)
	}

	kill(t, host)
	got, err := criu.RestoreInside(context.Background(), criu.InsideRestoreOptions{InitPid: s.pid, ImagesDir: images,
		WorkDir: t.TempDir(), Cgroups: []string{filepath.Join(cg, "cgroup.procs")}, Background: true})
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	if want := hostPid(t, s.pid, nspid); got != want {
		t.Fatalf("RestoreInside returned host PID %d; init's child %d is %d", got, nspid, want)
	}
	for _, ns := range []string{"mnt", "pid", "net", "ipc", "uts", "cgroup"} {
		if g, w := nsOf(t, got, ns), nsOf(t, s.pid, ns); g != w {
			t.Errorf("restored in %s, init's is %s", g, w)
		}
	}
	if cgs, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", got)); !strings.Contains(string(cgs), ":pids:/"+filepath.Base(cg)+"\n") {
		t.Errorf("restored process not in %s: %s", cg, cgs)
	}
	if _, nice := procStat(t, got); nice != 0 {
		t.Errorf("restored with nice %d, dumped with 0", nice)
	}
	// The state at the dump, not at the kill: the counter and offset go on from there.
	after := s.ask(t, "w", "2")
	if want := (answer{Token: before.Token, Counter: 3, Char: "h", Offset: 8, Cwd: "/tmp/w/cwd", Pid: nspid, PPid: 1}); after != want {
		t.Errorf("restored worker: %s", cmp.Diff(want, after))
	}
}

// TestInsideStopped checks the states a zygote may be kept in: a stopped process stays
// stopped through its dump and is restored stopped; a frozen one (FreezeCgroup) stays
// frozen through its dump and is restored running (outside the freezer); LeaveStopped
// restores a running one stopped. Each then runs on from its dump.
func TestInsideStopped(t *testing.T) {
	requireInside(t)
	s := startSandbox(t)
	check := func(t *testing.T, name string, host int, images string, leaveStopped, wantStopped bool) {
		t.Helper()
		kill(t, host)
		got, err := criu.RestoreInside(context.Background(), criu.InsideRestoreOptions{InitPid: s.pid, ImagesDir: images, WorkDir: t.TempDir(), LeaveStopped: leaveStopped})
		if err != nil {
			t.Fatalf("restore: %v", err)
		}
		if st, _ := procStat(t, got); (st == "T") != wantStopped {
			t.Errorf("restored in state %s, want stopped (T): %v", st, wantStopped)
		}
		syscall.Kill(got, syscall.SIGCONT)
		if a := s.ask(t, name, "restored"); a.Counter != 2 {
			t.Errorf("restored worker answered %+v, want counter 2 (1 at the dump)", a)
		}
	}
	t.Run("Stopped", func(t *testing.T) {
		nspid, host := s.startWorker(t, "stopped")
		syscall.Kill(host, syscall.SIGSTOP)
		waitFor(t, "the worker to stop", func() bool { st, _ := procStat(t, host); return st == "T" })
		images := t.TempDir()
		if err := criu.DumpInside(context.Background(), criu.InsideDumpOptions{InitPid: s.pid, Pid: nspid, ImagesDir: images}); err != nil {
			t.Fatalf("dump: %v", err)
		}
		if st, _ := procStat(t, host); st != "T" {
			t.Fatalf("after the dump the worker is in state %s, want still stopped (T)", st)
		}
		check(t, "stopped", host, images, false, true)
	})
	t.Run("Frozen", func(t *testing.T) {
		fz := cgroup(t, "freezer")
		nspid, host := s.startWorker(t, "frozen")
		if err := os.WriteFile(filepath.Join(fz, "cgroup.procs"), []byte(strconv.Itoa(host)), 0); err != nil {
			t.Fatal(err)
		}
		state := func() string {
			b, _ := os.ReadFile(filepath.Join(fz, "freezer.state"))
			return strings.TrimSpace(string(b))
		}
		os.WriteFile(filepath.Join(fz, "freezer.state"), []byte("FROZEN"), 0)
		waitFor(t, "the worker to freeze", func() bool { return state() == "FROZEN" })
		images := t.TempDir()
		if err := criu.DumpInside(context.Background(), criu.InsideDumpOptions{InitPid: s.pid, Pid: nspid, ImagesDir: images, FreezeCgroup: fz, Background: true}); err != nil {
			t.Fatalf("dump: %v", err)
		}
		if st := state(); st != "FROZEN" {
			t.Fatalf("after the dump the freezer is %s, want still FROZEN", st)
		}
		os.WriteFile(filepath.Join(fz, "freezer.state"), []byte("THAWED"), 0)
		if a := s.ask(t, "frozen", "thawed"); a.Counter != 2 {
			t.Fatalf("thawed worker answered %+v, want counter 2", a)
		}
		check(t, "frozen", host, images, false, false)
	})
	t.Run("LeaveStopped", func(t *testing.T) {
		nspid, host := s.startWorker(t, "running")
		images := t.TempDir()
		if err := criu.DumpInside(context.Background(), criu.InsideDumpOptions{InitPid: s.pid, Pid: nspid, ImagesDir: images}); err != nil {
			t.Fatalf("dump: %v", err)
		}
		check(t, "running", host, images, true, true)
	})
}

// TestInsideIgnoresSandboxFiles plants what would redirect a CRIU that trusted the
// sandbox's tree — a preload file for the loader, a CRIU configuration, a fake CRIU
// prefix at /.cairn/criu, and the programs CRIU's kernel probe runs through PATH
// (iptables, ip6tables, sh) — and checks that a dump and a restore use none of them.
func TestInsideIgnoresSandboxFiles(t *testing.T) {
	requireInside(t)
	s := startSandbox(t)
	nspid, host := s.startWorker(t, "w")
	plant := map[string]string{
		"/etc/ld.so.preload":                          "/nonexistent-cairn-planted-preload.so\n",
		"/etc/criu/default.conf":                      "no-such-option-cairn-planted\n",
		"/.cairn/criu/usr/lib64/ld-linux-x86-64.so.2": "#!/bin/sh\ntouch /tmp/pwned\n",
		"/.cairn/criu/usr/sbin/criu":                  "#!/bin/sh\ntouch /tmp/pwned\n",
	}
	for _, prog := range []string{"iptables", "ip6tables", "sh"} {
		plant["/usr/sbin/"+prog] = "#!/usr/bin/sh\ntouch /tmp/pwned\n"
	}
	for p, content := range plant {
		if err := os.MkdirAll(filepath.Dir(s.path(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(s.path(p), []byte(content), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	images, work := t.TempDir(), t.TempDir()
	if err := criu.DumpInside(context.Background(), criu.InsideDumpOptions{InitPid: s.pid, Pid: nspid, ImagesDir: images}); err != nil {
		t.Fatalf("dump: %v", err)
	}
	kill(t, host)
	if _, err := criu.RestoreInside(context.Background(), criu.InsideRestoreOptions{InitPid: s.pid, ImagesDir: images, WorkDir: work}); err != nil {
		t.Fatalf("restore: %v", err)
	}
	for _, log := range []string{filepath.Join(images, "launch.log"), filepath.Join(images, "dump.log"), filepath.Join(work, "launch.log"), filepath.Join(work, "restore.log")} {
		if b, _ := os.ReadFile(log); strings.Contains(string(b), "cairn-planted") {
			t.Errorf("%s shows a planted file was read:\n%s", log, b)
		}
	}
	if _, err := os.Stat(s.path("/tmp/pwned")); err == nil {
		t.Error("a planted program ran")
	}
}

// TestInsideErrors checks the errors that say what to do: a PID that is not in the
// sandbox, an init that is gone, images that are not there.
func TestInsideErrors(t *testing.T) {
	requireInside(t)
	s := startSandbox(t)
	ctx := context.Background()
	err := criu.DumpInside(ctx, criu.InsideDumpOptions{InitPid: s.pid, Pid: 4242, ImagesDir: t.TempDir()})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "no process 4242") || !strings.Contains(err.Error(), "NSpid") {
		t.Errorf("dump of a PID not in the sandbox: %v, want not found naming the PID and where to find the right one", err)
	}
	err = criu.DumpInside(ctx, criu.InsideDumpOptions{InitPid: 1 << 30, Pid: 2, ImagesDir: t.TempDir()})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "start or resume") {
		t.Errorf("dump in a sandbox whose init is gone: %v, want not found saying to start it", err)
	}
	work := t.TempDir()
	_, err = criu.RestoreInside(ctx, criu.InsideRestoreOptions{InitPid: s.pid, ImagesDir: t.TempDir(), WorkDir: work})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "full log: "+filepath.Join(work, "restore.log")) {
		t.Errorf("restore of no images: %v, want failed precondition quoting the log", err)
	}
}

// BenchmarkDumpInside measures a dump of a small process (a worker: this test binary,
// a few MB resident, 5 threads) from inside a mini sandbox, as cairn's sandboxes are
// (no CRIU kernel-feature cache in the sandbox: CRIU probes the kernel each run) and with
// the host's cache copied into the sandbox's /run/criu.kdat; and, for comparison, the
// host-side Dump of the same kind of process running on the host (with the host's
// cache).
//
//	go test ./criu -run '^$' -bench Inside -benchtime 20x
func BenchmarkDumpInside(b *testing.B) {
	requireInside(b)
	for _, kdat := range []bool{false, true} {
		b.Run(map[bool]string{false: "Inside", true: "InsideKdat"}[kdat], func(b *testing.B) {
			s := startSandbox(b)
			if kdat {
				s.kdat(b)
			}
			nspid, _ := s.startWorker(b, "w")
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				dir := b.TempDir()
				b.StartTimer()
				if err := criu.DumpInside(context.Background(), criu.InsideDumpOptions{InitPid: s.pid, Pid: nspid, ImagesDir: dir}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("Host", func(b *testing.B) {
		host := hostWorker(b)
		for i := 0; i < b.N; i++ {
			b.StopTimer()
			dir := b.TempDir()
			b.StartTimer()
			if err := criu.Dump(context.Background(), criu.DumpOptions{Pid: host, ImagesDir: dir, NetNS: fmt.Sprintf("/proc/%d/ns/net", host)}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// kdat copies the host's CRIU kernel-feature cache into the sandbox's /run.
func (s *miniSandbox) kdat(tb testing.TB) {
	tb.Helper()
	k, err := os.ReadFile("/run/criu.kdat")
	if err != nil {
		tb.Skipf("no kernel-feature cache on the host: %v", err)
	}
	if err := os.WriteFile(filepath.Join(s.run, "criu.kdat"), k, 0o600); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkRestoreInside measures the restore of that process into a running mini
// sandbox (the kill of the previous copy untimed), without and with the cache as
// BenchmarkDumpInside, and the host-side Restore of the host worker (into a new network
// namespace, as Restore does).
func BenchmarkRestoreInside(b *testing.B) {
	requireInside(b)
	for _, kdat := range []bool{false, true} {
		b.Run(map[bool]string{false: "Inside", true: "InsideKdat"}[kdat], func(b *testing.B) {
			s := startSandbox(b)
			if kdat {
				s.kdat(b)
			}
			nspid, host := s.startWorker(b, "w")
			images := b.TempDir()
			if err := criu.DumpInside(context.Background(), criu.InsideDumpOptions{InitPid: s.pid, Pid: nspid, ImagesDir: images}); err != nil {
				b.Fatal(err)
			}
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				kill(b, host)
				work := b.TempDir()
				b.StartTimer()
				var err error
				if host, err = criu.RestoreInside(context.Background(), criu.InsideRestoreOptions{InitPid: s.pid, ImagesDir: images, WorkDir: work}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("Host", func(b *testing.B) {
		host := hostWorker(b)
		images := b.TempDir()
		if err := criu.Dump(context.Background(), criu.DumpOptions{Pid: host, ImagesDir: images, NetNS: fmt.Sprintf("/proc/%d/ns/net", host)}); err != nil {
			b.Fatal(err)
		}
		for i := 0; i < b.N; i++ {
			b.StopTimer()
			syscall.Kill(host, syscall.SIGKILL)
			waitFor(b, "the host worker to be reaped", func() bool {
				var ws syscall.WaitStatus
				syscall.Wait4(host, &ws, syscall.WNOHANG, nil)
				_, err := os.Stat(fmt.Sprintf("/proc/%d", host))
				return err != nil
			})
			work := b.TempDir()
			b.StartTimer()
			var err error
			if host, err = criu.Restore(context.Background(), criu.RestoreOptions{ImagesDir: images, WorkDir: work, Root: "/"}); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		syscall.Kill(host, syscall.SIGKILL)
	})
}

// hostWorker starts a worker on the host (its own session, state in a temporary
// directory) and returns its PID once it listens.
func hostWorker(tb testing.TB) int {
	tb.Helper()
	dir := filepath.Join(tb.TempDir(), "w")
	cmd := exec.Command("/proc/self/exe")
	cmd.Env = []string{roleEnv + "=worker", dirEnv + "=" + dir}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	pid := cmd.Process.Pid
	tb.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL); cmd.Wait() })
	waitFor(tb, "the host worker to listen", func() bool { _, err := os.Stat(filepath.Join(dir, "ask")); return err == nil })
	return pid
}
