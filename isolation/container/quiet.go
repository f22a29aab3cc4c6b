package container

import (
	"context"
	"errors"
	"os"
	"slices"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/internal/phase"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
)

// A quiet kill is the kill of a rollback in place whose caller wants to know the root
// as the kill leaves it before it looks (isolation.RollbackHooks.Quiesced): the caller
// may then compute its revert from a snapshot of the root it already has, instead of
// taking a new one.
//
// Every process but init is stopped (SIGSTOP, until each is seen stopped or gone:
// a stopped process runs no instruction, and has no system call in progress), and the
// caller looks. Init is left running: it writes in the root only to answer a request
// (none comes: the caller holds the sandbox) or to record a child's death (cmd/cairn-init
// reap), which it does before it reaps the child: an "exit" file in the process's
// record directory, through a temporary name, and a line of its log if that fails.
// Then every process is sent SIGKILL and reaped, and undoExits removes those records
// again and gives their directories back their times, so that the root holds what the
// caller saw but for those directories' change times (no call sets them). It checks
// what it undoes: a record directory holding anything else than before and the new
// record, or an init log that grew, and the root is not vouched for.
//
// A process that does not stop within stopWait (one in the middle of an uninterruptible
// wait, a vfork parent whose child is stopped) makes the kill an ordinary one. Freezing
// the sandbox's cgroup instead would hold init too, whose Go runtime took up to 19 ms
// to freeze and, thawed, up to 35 ms to reap (W1).

// stopWait bounds how long quietKill waits for the processes to stop.
const stopWait = 20 * time.Millisecond

// quietKill kills every process of sb but init as killAllButInit does, calling
// quiesced (if set) once they are stopped, before the kill. It reports whether sb's
// root holds again what quiesced saw (false when quiesced is nil or was not called).
func quietKill(ctx context.Context, sb *isolation.Sandbox, quiesced func(context.Context)) (bool, error) {
	if quiesced == nil {
		return false, killAllButInit(ctx, sb)
	}
	t := time.Now()
	stopped, ok := stopAllButInit(sb)
	phase.Since(ctx, "stop_all", t)
	var marks *records
	if ok {
		t = time.Now()
		var err error
		if marks, err = markRecords(sb.Root); err == nil {
			quiesced(ctx)
		}
		phase.Since(ctx, "mark_records", t)
	}
	for _, p := range stopped {
		unix.Kill(p, unix.SIGKILL)
	}
	if err := killAllButInit(ctx, sb, stopped...); err != nil {
		if marks != nil {
			marks.close()
		}
		return false, err
	}
	if marks == nil {
		return false, nil
	}
	t = time.Now()
	defer phase.Since(ctx, "undo_exits", t)
	return marks.undo(), nil
}

// stopAllButInit sends SIGSTOP to every process of sb but init, and to those they fork
// meanwhile, and waits until each is stopped or gone; ok is false if one is still
// running after stopWait. It returns the processes it signalled.
func stopAllButInit(sb *isolation.Sandbox) (signalled []int, ok bool) {
	deadline := time.Now().Add(stopWait)
	seen := map[int]bool{}
	for {
		added := false
		for _, p := range cgroupPids(sb.CgroupName()) {
			if p != sb.Init.Pid && !seen[p] {
				unix.Kill(p, unix.SIGSTOP)
				seen[p] = true
				signalled = append(signalled, p)
				added = true
			}
		}
		all := true
		for delay := 10 * time.Microsecond; ; delay = min(2*delay, 200*time.Microsecond) {
			all = true
			for _, p := range signalled {
				if !stoppedOrGone(p) {
					all = false
					break
				}
			}
			if all || time.Now().After(deadline) {
				break
			}
			time.Sleep(delay)
		}
		if !all {
			return signalled, false
		}
		if !added {
			return signalled, true // stopped, and nothing new forked since the last look
		}
	}
}

// stoppedOrGone reports whether the process is stopped (by a signal or a tracer), a
// zombie, or gone.
func stoppedOrGone(pid int) bool {
	switch ptrace.ProcState(pid) {
	case "T", "t", "Z", "X", "gone":
		return true
	}
	return false
}

// records is what markRecords saw of init's records of running processes.
type records struct {
	cairnfd int // /.cairn of the root
	procfd  int // /.cairn/proc
	logSize int64
	running []record
}

// record is the directory of a process with no exit record yet.
type record struct {
	handle       string
	entries      []string
	atime, mtime unix.Timespec
}

// markRecords opens the root's record directory and notes, for each process without
// an exit record, its directory's entries and times, and the size of init's log.
// Paths are resolved below the root without following symlinks: the sandbox owns them.
func markRecords(root string) (*records, error) {
	rootfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(rootfd)
	cairnfd, err := unix.Openat2(rootfd, initctl.Dir, &beneath)
	if err != nil {
		return nil, err
	}
	procfd, err := unix.Openat2(cairnfd, initctl.ProcDir, &beneath)
	if err != nil {
		unix.Close(cairnfd)
		return nil, err
	}
	r := &records{cairnfd: cairnfd, procfd: procfd, logSize: -1}
	var st unix.Stat_t
	if err := unix.Fstatat(cairnfd, initctl.LogFile, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		r.logSize = st.Size
	}
	handles, err := readDir(procfd, ".")
	if err != nil {
		r.close()
		return nil, err
	}
	for _, h := range handles {
		if !initctl.ValidHandle(h) {
			continue
		}
		ents, err := readDir(procfd, h)
		if err != nil || slices.Contains(ents, "exit") {
			continue
		}
		if err := unix.Fstatat(procfd, h, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			continue
		}
		r.running = append(r.running, record{handle: h, entries: ents, atime: st.Atim, mtime: st.Mtim})
	}
	return r, nil
}

// undo removes the exit records written since markRecords and restores their
// directories' times; it reports whether the records are as marked again, and closes r.
func (r *records) undo() bool {
	defer r.close()
	ok := true
	for _, rec := range r.running {
		fd, err := unix.Openat2(r.procfd, rec.handle, &beneath)
		if err != nil {
			ok = false
			continue
		}
		ents, err := readDir(fd, ".")
		switch {
		case err != nil:
			ok = false
		case slices.Equal(ents, rec.entries):
			// init knew no process of this record, or it did not die
		case len(ents) == len(rec.entries)+1 && slices.Contains(ents, "exit") &&
			slices.Equal(slices.DeleteFunc(slices.Clone(ents), func(e string) bool { return e == "exit" }), rec.entries):
			if unix.Unlinkat(fd, "exit", 0) != nil || futimens(fd, rec.atime, rec.mtime) != nil {
				ok = false
			}
		default:
			ok = false
		}
		unix.Close(fd)
	}
	var st unix.Stat_t
	if err := unix.Fstatat(r.cairnfd, initctl.LogFile, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		ok = ok && st.Size == r.logSize
	} else {
		ok = ok && errors.Is(err, os.ErrNotExist) && r.logSize < 0
	}
	return ok
}

func (r *records) close() {
	unix.Close(r.procfd)
	unix.Close(r.cairnfd)
}

// beneath opens a directory below another without following a symlink or leaving the
// filesystem: the sandbox owns every name of its root.
var beneath = unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
	Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}

// readDir lists the directory rel of dirfd, sorted.
func readDir(dirfd int, rel string) ([]string, error) {
	fd, err := unix.Openat2(dirfd, rel, &beneath)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	slices.Sort(names)
	return names, err
}

// futimens sets the access and modification times of the file open as fd
// (utimensat with a NULL path).
func futimens(fd int, atime, mtime unix.Timespec) error {
	ts := [2]unix.Timespec{atime, mtime}
	_, _, e := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}
