package isolation

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ProcOf identifies the running process pid (its start time tells it from a later
// process that reuses the PID).
func ProcOf(pid int) (Proc, error) {
	f, err := statFields(pid)
	if err != nil {
		return Proc{}, err
	}
	if len(f) < 20 {
		return Proc{}, fmt.Errorf("short /proc/%d/stat", pid)
	}
	st, err := strconv.ParseUint(f[19], 10, 64)
	return Proc{Pid: pid, StartTime: st}, err
}

// Alive reports whether p still runs: the same process (PID and start time), and not a
// zombie.
func (p Proc) Alive() bool {
	_, ok := p.Stat()
	return ok
}

// Stat returns the fields of p's stat file (as StatFields) if p still runs (Alive), in
// one read.
func (p Proc) Stat() ([]string, bool) {
	if p.Pid == 0 {
		return nil, false
	}
	f, err := statFields(p.Pid)
	if err != nil || len(f) < 20 {
		return nil, false
	}
	return f, f[0] != "Z" && f[0] != "X" && f[19] == strconv.FormatUint(p.StartTime, 10)
}

// statFields returns the fields of /proc/pid/stat after the command name, starting with
// the state.
func statFields(pid int) ([]string, error) {
	return StatFields(fmt.Sprintf("/proc/%d/stat", pid))
}

// StatFields returns the fields of the stat file of a task (file: /proc/<pid>/stat of
// any procfs) after the command name: the state is field 0, the parent's PID 1, the
// session 3, the start time 19. It is read into a buffer on the stack: engines ask it
// of every zygote and init often (Alive), and os.ReadFile's buffers were a sixth of
// what cairn allocated in W1 (see package memtune).
func StatFields(file string) ([]string, error) {
	fd, err := unix.Open(file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: file, Err: err}
	}
	defer unix.Close(fd)
	// A stat line: 52 numbers of at most 20 digits, and a name of at most 64 bytes.
	var buf [2048]byte
	n := 0
	for {
		m, err := unix.Read(fd, buf[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: file, Err: err}
		}
		if m == 0 {
			break
		}
		if n += m; n == len(buf) {
			return nil, fmt.Errorf("%s holds more than %d bytes", file, len(buf))
		}
	}
	i := bytes.LastIndexByte(buf[:n], ')')
	if i < 0 {
		return nil, fmt.Errorf("malformed %s", file)
	}
	return strings.Fields(string(buf[i+1 : n])), nil
}

// ProcAlive reports whether pid exists and is not a zombie (whatever process it is).
func ProcAlive(pid int) bool {
	f, err := statFields(pid)
	return err == nil && len(f) > 0 && f[0] != "Z" && f[0] != "X"
}
