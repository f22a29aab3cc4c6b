package container

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/isolation"
)

// lastPidHelper is a shell living in one sandbox's pid namespace (and in the host's
// other namespaces) that writes the namespace's ns_last_pid on request: ns_last_pid acts
// on the pid namespace of its writer, and no process inside the sandbox has the
// capability to write it. It must not take a PID itself once it runs, or the next
// process would not get the one asked for: a Go program would (its runtime starts
// threads when it likes), a shell loop of builtins does not (no fork, one thread). It is
// not a descendant of the sandbox's init, so a CRIU dump of the tree does not see it,
// and it dies with the namespace.
type lastPidHelper struct {
	mu  sync.Mutex
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

// lastPidScript answers each number N read on stdin by making N the next PID, and says
// which PID was the last before ("ok LAST"). Bash, not dash: a sysctl file reads as
// end-of-file at any offset but 0, and dash reads a byte at a time (bash reads a
// seekable file in one go).
const lastPidScript = `while read -r n; do
  read -r last < /proc/sys/kernel/ns_last_pid
  if echo $((n - 1)) > /proc/sys/kernel/ns_last_pid; then echo "ok $last"; else echo error; fi
done`

// helper returns the sandbox's helper, starting it when there is none (or it died).
func (r *residents) helper(init isolation.Proc) (*lastPidHelper, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.lastPid[init]
	if h != nil && isolation.ProcAlive(h.cmd.Process.Pid) {
		return h, nil
	}
	h, err := startLastPid(init.Pid)
	if err != nil {
		return nil, err
	}
	if r.lastPid == nil {
		r.lastPid = map[isolation.Proc]*lastPidHelper{}
	}
	r.lastPid[init] = h
	return h, nil
}

// stopped forgets (and ends) the helper of a sandbox that stops, and stops tracking its
// processes.
func (r *residents) stopped(init isolation.Proc) {
	r.mu.Lock()
	h := r.lastPid[init]
	delete(r.lastPid, init)
	r.mu.Unlock()
	r.untrack(init)
	if h != nil {
		h.in.Close()
		h.cmd.Process.Kill()
	}
}

func startLastPid(initPid int) (*lastPidHelper, error) {
	type result struct {
		h   *lastPidHelper
		err error
	}
	res := make(chan result, 1)
	go func() {
		// The thread joins the sandbox's pid namespace for its children; it is never
		// handed back to the scheduler (the goroutine exits locked and the thread ends).
		runtime.LockOSThread()
		fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/pid", initPid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			res <- result{err: err}
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWPID); err != nil {
			res <- result{err: fmt.Errorf("join pid namespace of %d: %w", initPid, err)}
			return
		}
		cmd := exec.Command("/bin/bash", "-c", lastPidScript)
		in, err := cmd.StdinPipe()
		if err != nil {
			res <- result{err: err}
			return
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			res <- result{err: err}
			return
		}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			res <- result{err: fmt.Errorf("start the PID helper: %w", err)}
			return
		}
		// Reaped as soon as it ends (the sandbox's pid namespace dies, or it is killed
		// from inside): until then its PID is the namespace's, and a dying init waits for
		// every PID of its namespace to be released.
		go cmd.Wait()
		res <- result{h: &lastPidHelper{cmd: cmd, in: in, out: bufio.NewReader(out)}}
	}()
	r := <-res
	return r.h, r.err
}

// setPidBase makes the next processes of init's sandbox get PIDs from UserPidBase up
// (PIDs in use are skipped).
func (r *residents) setPidBase(init isolation.Proc) error {
	h, err := r.helper(init)
	if err == nil {
		_, err = h.set(UserPidBase)
	}
	if err != nil {
		return fmt.Errorf("PID base of the sandbox: %w", err)
	}
	return nil
}

// set makes nsPid the next PID of the helper's namespace and returns the last PID the
// namespace gave before.
func (h *lastPidHelper) set(nsPid int) (last int, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, err := fmt.Fprintln(h.in, strconv.Itoa(nsPid)); err != nil {
		return 0, fmt.Errorf("PID helper: %w", err)
	}
	line, err := h.out.ReadString('\n')
	if err != nil {
		return 0, fmt.Errorf("PID helper: %w", err)
	}
	ok, n, found := strings.Cut(strings.TrimSpace(line), " ")
	if ok != "ok" || !found {
		return 0, fmt.Errorf("PID helper could not write ns_last_pid (%s)", strings.TrimSpace(line))
	}
	if last, err = strconv.Atoi(n); err != nil {
		return 0, fmt.Errorf("PID helper: last PID %q: %w", n, err)
	}
	return last, nil
}
