package criu

import (
	"errors"
	"os"
	"strings"
	"sync"
	"syscall"

	gocriu "github.com/checkpoint-restore/go-criu/v8"
)

// Worker is a CRIU process (`criu swrk`) started before the dump it serves, so that the
// dump does not wait for CRIU to start. Starting it is a chain of programs (the
// launcher script, nsenter, CRIU's dynamic loader and libraries, CRIU's own set-up):
// ~25 ms on an idle machine of this project's kind, where every page fault costs
// ~21 µs, and more under load, all of it inside the sandbox's freeze. A worker serves
// one dump, then exits; Close stops one that was not used.
type Worker struct {
	c       *gocriu.Criu
	netns   string
	cleanup func()
	once    sync.Once
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
	log, err := os.CreateTemp("", "cairn-criu-launch-*.log")
	if err != nil {
		return nil, err
	}
	log.Close()
	run, cleanup, err := launcher(path, netns, log.Name(), nil, false)
	if err != nil {
		os.Remove(log.Name())
		return nil, err
	}
	w := &Worker{c: gocriu.MakeCriu(), netns: netns, cleanup: func() { cleanup(); os.Remove(log.Name()) }}
	w.c.SetCriuPath(run)
	if err := retryBusy(w.c.Prepare); err != nil {
		w.cleanup()
		return nil, err
	}
	return w, nil
}

// Close stops the worker (if it has not served a dump, CRIU exits when its socket
// closes) and removes its launcher. It is safe to call more than once.
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
