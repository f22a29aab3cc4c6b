package criu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	gocriu "github.com/checkpoint-restore/go-criu/v8"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/netns"
)

// Worker is a CRIU process (`criu swrk`) started before the dump it serves, so that the
// dump does not wait for CRIU to start. Starting it is a chain of programs (the
// launcher script, nsenter, CRIU's dynamic loader and libraries, CRIU's own set-up):
// ~25 ms on an idle machine of this project's kind, where every page fault costs
// ~21 µs, and more under load, all of it inside the sandbox's freeze (or on a
// restore's critical path: StartRestoreWorker). A worker serves one dump or restore,
// then exits; Close stops one that was not used.
type Worker struct {
	c       *gocriu.Criu
	netns   string
	cleanup func()
	once    sync.Once
	// A restore worker (StartRestoreWorker) runs in a network namespace of its own, ns,
	// at nice 19 if background, and writes its PID to pidFile so that Restore can move it
	// into the tree's cgroups.
	restore    bool
	background bool
	ns         *os.File
	pidFile    string
}

// StartWorker launches a worker for a dump of a tree whose network namespace is netns
// (as DumpOptions.NetNS: CRIU joins it at start).
func StartWorker(netns string) (*Worker, error) {
	path, err := Find()
	if err != nil {
		return nil, err
	}
	return startWorker(path, netns)
}

func startWorker(path, netns string) (*Worker, error) {
	w := &Worker{netns: netns}
	if err := w.start(path); err != nil {
		return nil, err
	}
	return w, nil
}

// StartRestoreWorker launches a worker for a restore: in a new network namespace (its
// loopback up), which the restored tree will have, and at nice 19 if background (as
// RestoreOptions.Background). Restore moves it into the tree's cgroups before it asks.
func StartRestoreWorker(background bool) (*Worker, error) {
	path, err := Find()
	if err != nil {
		return nil, err
	}
	return startRestoreWorker(path, background)
}

func startRestoreWorker(path string, background bool) (*Worker, error) {
	ns, err := netns.New()
	if err != nil {
		return nil, fmt.Errorf("network namespace for restore: %w", err)
	}
	w := &Worker{restore: true, background: background, ns: ns,
		netns: fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), ns.Fd())}
	if err := w.start(path); err != nil {
		return nil, err
	}
	return w, nil
}

// start launches the worker's CRIU; on failure it releases everything w holds.
func (w *Worker) start(path string) error {
	// The launcher's log and PID file are memfds, like the launcher itself: a worker
	// left by a killed cairn leaves no files.
	var closers []func() // run by cleanup
	w.cleanup = func() {
		for _, c := range closers {
			c()
		}
		if w.ns != nil {
			w.ns.Close()
		}
	}
	scratch := func(name string) (string, error) {
		fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
		if err != nil {
			return "", err
		}
		f := os.NewFile(uintptr(fd), name)
		closers = append(closers, func() { f.Close() })
		return procPath(f), nil
	}
	log, err := scratch("cairn-criu-launch.log")
	if err == nil && w.restore {
		w.pidFile, err = scratch("cairn-criu-pid")
	}
	var run string
	if err == nil {
		var closeRun func()
		if run, closeRun, err = launcher(path, w.netns, log, nil, w.background, w.pidFile); err == nil {
			closers = append(closers, closeRun)
		}
	}
	if err == nil {
		w.c = gocriu.MakeCriu()
		w.c.SetCriuPath(run)
		err = retryBusy(w.c.Prepare)
	}
	if err != nil {
		w.cleanup()
	}
	return err
}

// join moves a restore worker into the cgroups whose cgroup.procs files are given, so
// that the tree it forks is born there.
func (w *Worker) join(cgroups []string) error {
	var pid []byte
	for i := 0; ; i++ {
		b, err := os.ReadFile(w.pidFile)
		if err != nil {
			return err
		}
		if pid = bytes.TrimSpace(b); len(pid) > 0 {
			break
		}
		if i == 200 { // the launcher writes it first thing; give up after ~1 s
			return fmt.Errorf("CRIU worker wrote no PID to %s", w.pidFile)
		}
		time.Sleep(5 * time.Millisecond)
	}
	for _, cg := range cgroups {
		if err := os.WriteFile(cg, pid, 0); err != nil {
			return err
		}
	}
	return nil
}

// serve runs call on w (nil or not usable: nothing) and closes w. done says the
// operation took place, err being its outcome; otherwise the caller starts a CRIU of
// its own: w was not usable, or had died before the request reached it.
func (w *Worker) serve(usable bool, call func(*gocriu.Criu) error) (done bool, err error) {
	if w == nil {
		return false, nil
	}
	defer w.Close()
	if !usable {
		return false, nil
	}
	err = call(w.c)
	return err == nil || !unsent(err), err
}

// Close stops the worker (if it has not served, CRIU exits when its socket closes) and
// removes its launcher. It is safe to call more than once.
func (w *Worker) Close() {
	w.once.Do(func() {
		w.c.Cleanup()
		w.cleanup()
	})
}

// unsent reports whether err says the request never reached the worker: it had died
// before the dump began, and a new CRIU may be started for the same dump.
func unsent(err error) bool {
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) ||
		strings.Contains(err.Error(), "broken pipe")
}
