package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/initctl"
)

// A rollback in place (zygotes) replaces init's children under it: the host kills them
// (init records their exits, before reaping them: see reap), brings the root's files
// back to the checkpoint's, which removes those records, and forks the checkpoint's
// processes from their zygotes, with their PIDs, as init's children; then init reloads.
// Its table is rebuilt from the files it keeps under /.cairn/proc, which are the
// checkpoint's again.

// reload learns init's processes from /.cairn/proc: each handle with a spec and no exit
// record whose PID is alive and a child of init, and holds their stdin FIFOs (unless
// closed).
func (s *server) reload() error {
	ents, err := os.ReadDir(filepath.Join(base, initctl.ProcDir))
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for _, e := range ents {
		h := e.Name()
		if !initctl.ValidHandle(h) || s.byHandle[h] != nil {
			continue
		}
		if _, err := os.Stat(initctl.ProcPath(base, h, "exit")); err == nil {
			continue
		}
		var st initctl.ProcState
		if err := initctl.ReadJSON(initctl.ProcPath(base, h, "spec.json"), &st); err != nil {
			continue // a spawn that never completed
		}
		if !isChild(st.Pid) {
			continue
		}
		p := &proc{handle: h, pid: st.Pid, stdin: -1}
		if err := holdStdin(p); err != nil {
			errs = append(errs, fmt.Errorf("stdin of %s: %w", h, err))
		}
		s.procs[p.pid] = p
		s.byHandle[h] = p
	}
	return errors.Join(errs...)
}

// holdStdin gives p init's read-write hold on its stdin FIFO (unless closed).
func holdStdin(p *proc) error {
	if _, err := os.Stat(initctl.ProcPath(base, p.handle, initctl.StdinClosed)); err == nil {
		return nil
	}
	fd, err := unix.Open(initctl.ProcPath(base, p.handle, "stdin"), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	p.stdin = fd
	return nil
}

// isChild reports whether pid is alive and a child of init.
func isChild(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return false
	}
	f := strings.Fields(s[i+1:])
	return len(f) > 1 && f[0] != "Z" && f[0] != "X" && f[1] == strconv.Itoa(os.Getpid())
}
