package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/cairn-sandbox/cairn/internal/initctl"
	"golang.org/x/sys/unix"
)

var base = "/" + initctl.Dir

// proc is a process init started.
type proc struct {
	handle string
	pid    int
	stdin  int      // init's read-write hold on the stdin FIFO; -1 once closed
	master *os.File // pty master (tty mode), else nil
	relay  sync.WaitGroup
}

type server struct {
	mu sync.Mutex
	// procs by pid; protected by mu.
	procs map[int]*proc
	// byHandle; protected by mu.
	byHandle map[string]*proc
}

func serve() error {
	for _, d := range []string{initctl.ReqDir, initctl.RespDir, initctl.ProcDir} {
		if err := os.MkdirAll(filepath.Join(base, d), 0o755); err != nil {
			return err
		}
	}
	ctlPath := filepath.Join(base, initctl.CtlFIFO)
	if err := unix.Mkfifo(ctlPath, 0o600); err != nil && !errors.Is(err, unix.EEXIST) {
		return err
	}
	ctl, err := os.OpenFile(ctlPath, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	s := &server{procs: map[int]*proc{}, byHandle: map[string]*proc{}}
	sigs := make(chan os.Signal, 16)
	// Signals meant to stop init are caught and dropped, not ignored: an ignored
	// disposition would be inherited by every process init starts.
	signal.Notify(sigs, unix.SIGCHLD, unix.SIGHUP, unix.SIGTERM, unix.SIGINT)
	go func() {
		for sig := range sigs {
			if sig == unix.SIGCHLD {
				s.reap()
			}
		}
	}()
	if err := os.WriteFile(filepath.Join(base, initctl.ReadyFile), []byte(fmt.Sprint(os.Getpid())), 0o644); err != nil {
		return err
	}
	sc := bufio.NewScanner(ctl)
	for sc.Scan() {
		rid := strings.TrimSpace(sc.Text())
		if rid == "" || strings.ContainsAny(rid, "/.") {
			continue
		}
		s.handle(rid)
	}
	return fmt.Errorf("control FIFO closed: %v", sc.Err())
}

func (s *server) handle(rid string) {
	var req initctl.Request
	reqPath := filepath.Join(base, initctl.ReqDir, rid+".json")
	resp := initctl.Response{OK: true}
	if err := initctl.ReadJSON(reqPath, &req); err != nil {
		resp = initctl.Response{Error: err.Error()}
	} else {
		pid, err := s.do(&req)
		if err != nil {
			resp = initctl.Response{Error: err.Error()}
		}
		resp.Pid = pid
	}
	os.Remove(reqPath)
	if err := initctl.WriteJSONAtomic(filepath.Join(base, initctl.RespDir, rid+".json"), resp); err != nil {
		fmt.Fprintf(os.Stderr, "write response %s: %v\n", rid, err)
	}
}

func (s *server) do(req *initctl.Request) (int, error) {
	switch req.Op {
	case initctl.OpPing:
		return os.Getpid(), nil
	case initctl.OpSpawn:
		if req.Spec == nil || len(req.Spec.Args) == 0 {
			return 0, errors.New("spawn needs a command")
		}
		return s.spawn(req.Handle, req.Spec)
	case initctl.OpReload:
		return os.Getpid(), s.reload()
	case initctl.OpRemove:
		return 0, s.remove(req.Handle)
	}
	s.mu.Lock()
	p := s.byHandle[req.Handle]
	s.mu.Unlock()
	if p == nil {
		return 0, fmt.Errorf("process %s is not running", req.Handle)
	}
	switch req.Op {
	case initctl.OpSignal:
		// The process leads its own session: signal the whole group it started.
		if err := unix.Kill(-p.pid, unix.Signal(req.Signal)); err != nil {
			return 0, unix.Kill(p.pid, unix.Signal(req.Signal))
		}
		return p.pid, nil
	case initctl.OpCloseStdin:
		s.mu.Lock()
		defer s.mu.Unlock()
		if p.stdin >= 0 {
			unix.Close(p.stdin)
			p.stdin = -1
		}
		// On disk too: a rollback in place (reload) must know the stdin was closed.
		if err := os.WriteFile(initctl.ProcPath(base, p.handle, initctl.StdinClosed), nil, 0o644); err != nil {
			return 0, err
		}
		return p.pid, nil
	case initctl.OpResize:
		if p.master == nil {
			return 0, errors.New("process has no terminal")
		}
		return p.pid, setWinsize(int(p.master.Fd()), req.Rows, req.Cols)
	}
	return 0, fmt.Errorf("unknown op %q", req.Op)
}

// remove deletes the record of a process that is not running.
func (s *server) remove(handle string) error {
	if !initctl.ValidHandle(handle) {
		return fmt.Errorf("bad handle %q", handle)
	}
	s.mu.Lock()
	running := s.byHandle[handle] != nil
	s.mu.Unlock()
	if running {
		return fmt.Errorf("process %s is running", handle)
	}
	return os.RemoveAll(filepath.Join(base, initctl.ProcDir, handle))
}

func (s *server) spawn(handle string, spec *initctl.ProcSpec) (pid int, err error) {
	if !initctl.ValidHandle(handle) {
		return 0, fmt.Errorf("bad handle %q", handle)
	}
	dir := filepath.Join(base, initctl.ProcDir, handle)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return 0, fmt.Errorf("handle %s: %w", handle, err)
	}
	env := spec.Env
	if !hasVar(env, "PATH") {
		env = append(env, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	}
	if !hasVar(env, "HOME") {
		env = append(env, "HOME=/root")
	}
	if spec.Tty && !hasVar(env, "TERM") {
		env = append(env, "TERM=xterm-256color")
	}
	argv0, err := lookPath(spec.Args[0], env)
	if err != nil {
		return 0, err
	}
	cwd := spec.Cwd
	if cwd == "" {
		cwd = "/"
	}
	p := &proc{handle: handle, stdin: -1}
	var closeAfter []int
	defer func() {
		for _, fd := range closeAfter {
			unix.Close(fd)
		}
		if err != nil && p.stdin >= 0 {
			unix.Close(p.stdin)
		}
	}()
	fifo := filepath.Join(dir, "stdin")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		return 0, err
	}
	if p.stdin, err = unix.Open(fifo, unix.O_RDWR|unix.O_CLOEXEC, 0); err != nil {
		return 0, err
	}
	var files []uintptr
	attr := &syscall.SysProcAttr{Setsid: true}
	if spec.Tty {
		master, slave, err := openPty(spec.Rows, spec.Cols)
		if err != nil {
			return 0, err
		}
		p.master = master
		closeAfter = append(closeAfter, slave)
		files = []uintptr{uintptr(slave), uintptr(slave), uintptr(slave)}
		attr.Setctty = true
		attr.Ctty = 0
	} else {
		in := "/dev/null"
		if !spec.NoStdin {
			in = fifo
		}
		inFd, err := unix.Open(in, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return 0, err
		}
		closeAfter = append(closeAfter, inFd)
		files = append(files, uintptr(inFd))
	}
	for _, name := range []string{"stdout", "stderr"} {
		fd, err := unix.Open(filepath.Join(dir, name), unix.O_WRONLY|unix.O_CREAT|unix.O_APPEND|unix.O_CLOEXEC, 0o644)
		if err != nil {
			return 0, err
		}
		closeAfter = append(closeAfter, fd)
		if !spec.Tty {
			files = append(files, uintptr(fd))
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	pid, err = syscall.ForkExec(argv0, spec.Args, &syscall.ProcAttr{Dir: cwd, Env: env, Files: files, Sys: attr})
	if err != nil {
		if p.master != nil {
			p.master.Close()
		}
		return 0, fmt.Errorf("start %s: %w", spec.Args[0], err)
	}
	p.pid = pid
	s.procs[pid] = p
	s.byHandle[handle] = p
	if p.master != nil {
		s.startRelay(p, dir)
	}
	st := initctl.ProcState{Handle: handle, Pid: pid, Spec: *spec, StartedAt: time.Now().UTC()}
	if err := initctl.WriteJSONAtomic(filepath.Join(dir, "spec.json"), st); err != nil {
		fmt.Fprintf(os.Stderr, "spec %s: %v\n", handle, err)
	}
	return pid, nil
}

// startRelay copies between the pty master and the process's files: output to stdout,
// stdin FIFO to the terminal.
func (s *server) startRelay(p *proc, dir string) {
	out, err := os.OpenFile(filepath.Join(dir, "stdout"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay %s: %v\n", p.handle, err)
		return
	}
	p.relay.Add(1)
	go func() {
		defer p.relay.Done()
		defer out.Close()
		io.Copy(out, p.master) // ends with EIO when the last slave closes
	}()
	in, err := unix.Dup(p.stdin)
	if err != nil {
		return
	}
	inFile := os.NewFile(uintptr(in), "stdin")
	go func() {
		defer inFile.Close()
		io.Copy(p.master, inFile)
	}()
}

// reap collects every exited child; the exit status of a started process is recorded
// before the child is reaped (waitid with WNOWAIT, then wait4): once its PID is gone,
// its exit is on disk. A rollback in place relies on it: it kills the sandbox's
// processes, waits for their PIDs to go, and then brings /.cairn back to the
// checkpoint's; a record written after that would belong to no process there.
func (s *server) reap() {
	for {
		pid, st, ok := nextExited()
		if !ok {
			return
		}
		s.mu.Lock()
		p := s.procs[pid]
		delete(s.procs, pid)
		if p != nil {
			delete(s.byHandle, p.handle)
		}
		s.mu.Unlock()
		if p != nil {
			s.finish(p, st)
		}
		var ws unix.WaitStatus
		for {
			if _, err := unix.Wait4(pid, &ws, unix.WNOHANG, nil); err != unix.EINTR {
				break
			}
		}
	}
}

// nextExited returns an exited child and how it ended, leaving it unreaped.
func nextExited() (int, initctl.ExitStatus, bool) {
	var info unix.Siginfo
	for {
		err := unix.Waitid(unix.P_ALL, 0, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, initctl.ExitStatus{}, false
		}
		break
	}
	// The SIGCHLD fields of siginfo_t (si_pid, si_uid, si_status), after signo, errno,
	// code and the union's alignment.
	raw := (*[unsafe.Sizeof(info)]byte)(unsafe.Pointer(&info))
	pid := int(*(*int32)(unsafe.Pointer(&raw[16])))
	status := int(*(*int32)(unsafe.Pointer(&raw[24])))
	if pid == 0 {
		return 0, initctl.ExitStatus{}, false // no child has exited
	}
	st := initctl.ExitStatus{Code: status, ExitedAt: time.Now().UTC()}
	if info.Code != cldExited {
		st.Signal, st.Code = status, 128+status
	}
	return pid, st, true
}

// cldExited is CLD_EXITED: the child called exit (else it was killed, or dumped core).
const cldExited = 1

// finish records how p ended, after the output of its terminal (if any) is written.
func (s *server) finish(p *proc, st initctl.ExitStatus) {
	if p.master != nil {
		p.relay.Wait()
		p.master.Close()
	}
	s.mu.Lock()
	if p.stdin >= 0 {
		unix.Close(p.stdin)
		p.stdin = -1
	}
	s.mu.Unlock()
	if err := initctl.WriteJSONAtomic(initctl.ProcPath(base, p.handle, "exit"), st); err != nil {
		fmt.Fprintf(os.Stderr, "exit %s: %v\n", p.handle, err)
	}
}

func hasVar(env []string, name string) bool {
	for _, e := range env {
		if strings.HasPrefix(e, name+"=") {
			return true
		}
	}
	return false
}

func lookPath(file string, env []string) (string, error) {
	if strings.Contains(file, "/") {
		return file, nil
	}
	path := ""
	for _, e := range env {
		if strings.HasPrefix(e, "PATH=") {
			path = e[5:]
		}
	}
	for _, dir := range filepath.SplitList(path) {
		p := filepath.Join(dir, file)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: command not found in PATH", file)
}

func openPty(rows, cols uint16) (*os.File, int, error) {
	m, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, -1, err
	}
	if err := unix.IoctlSetPointerInt(m, unix.TIOCSPTLCK, 0); err != nil {
		unix.Close(m)
		return nil, -1, err
	}
	n, err := unix.IoctlGetUint32(m, unix.TIOCGPTN)
	if err != nil {
		unix.Close(m)
		return nil, -1, err
	}
	slave, err := unix.Open(fmt.Sprintf("/dev/pts/%d", n), unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(m)
		return nil, -1, err
	}
	if rows == 0 {
		rows, cols = 24, 80
	}
	setWinsize(m, rows, cols)
	return os.NewFile(uintptr(m), "ptmx"), slave, nil
}

func setWinsize(fd int, rows, cols uint16) error {
	ws := unix.Winsize{Row: rows, Col: cols}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCSWINSZ, uintptr(unsafe.Pointer(&ws)))
	if errno != 0 {
		return errno
	}
	return nil
}
