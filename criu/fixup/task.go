package fixup

import (
	"encoding/binary"

	"github.com/checkpoint-restore/go-criu/v8/crit"
	criu_core "github.com/checkpoint-restore/go-criu/v8/crit/images/criu-core"
	file_lock "github.com/checkpoint-restore/go-criu/v8/crit/images/file-lock"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/mm"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/pstree"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/siginfo"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/tty"
	"golang.org/x/sys/unix"
)

// Task states of core.tc.task_state (compel/include/uapi/task-state.h).
const (
	taskAlive   = 0x1
	taskStopped = 0x3
)

// Lock kinds of file_lock_entry.flag (criu/include/file-lock.h).
const (
	flPosix = 1
)

// fixTask renames the task in pstree.img and makes its core the recorded process's:
// running, with its parent-death signal, child-subreaper flag and dumpable setting.
func (d *dump) fixTask(s Spec) error {
	pid := d.newPid
	t := d.pstree.entries[0].Message.(*pstree.PstreeEntry)
	t.Pid, t.Pgid, t.Sid, t.Threads = &pid, &pid, &pid, []uint32{pid}
	d.pstree.changed = true

	core := d.core.entries[0].Message.(*criu_core.CoreEntry)
	tc, th := core.GetTc(), core.GetThreadCore()
	if tc == nil || th == nil {
		return unexpected(d.dir, "%s has no task or thread core", d.core.name)
	}
	switch st := tc.GetTaskState(); st {
	case taskAlive, taskStopped:
	default:
		return unexpected(d.dir, "task %d was dumped in state %#x, not alive or stopped", d.pid, st)
	}
	alive, pdeath, subreaper := uint32(taskAlive), uint32(s.PdeathSig), s.ChildSubreaper
	tc.TaskState, tc.StopSigno = &alive, nil
	th.PdeathSig = &pdeath
	tc.ChildSubreaper = &subreaper
	if s.Dumpable != nil {
		v := int32(*s.Dumpable)
		d.mm.entries[0].Message.(*mm.MmEntry).Dumpable = &v
		d.mm.changed = true
	}
	// A SIGSTOP still pending when CRIU seized the task (sent to stop it for the dump)
	// would stop it again once restored. Fork clears pending signals: the dump's were
	// sent to the zygote, so dropping one loses nothing of the recorded process.
	dropStops(tc.GetSignalsS())
	dropStops(th.GetSignalsP())
	for _, pt := range tc.GetTimers().GetPosix() {
		if pt.NotifyThreadId != nil && uint32(*pt.NotifyThreadId) == d.pid {
			v := int32(pid)
			pt.NotifyThreadId = &v
		}
	}
	d.core.changed = true

	for _, e := range d.ttyInfo.entries {
		ti := e.Message.(*tty.TtyInfoEntry)
		if ti.GetSid() == d.pid {
			ti.Sid = &pid
			d.ttyInfo.changed = true
		}
		if ti.GetPgrp() == d.pid {
			ti.Pgrp = &pid
			d.ttyInfo.changed = true
		}
	}
	return nil
}

// dropStops removes pending SIGSTOPs from q (each entry is a raw siginfo_t, si_signo
// first).
func dropStops(q *siginfo.SignalQueueEntry) {
	if q == nil {
		return
	}
	keep := q.Signals[:0]
	for _, si := range q.Signals {
		if b := si.GetSiginfo(); len(b) >= 4 && binary.LittleEndian.Uint32(b) == uint32(unix.SIGSTOP) {
			continue
		}
		keep = append(keep, si)
	}
	q.Signals = keep
}

// fixLocks replaces the task's POSIX locks with s.Locks; its other locks (flock, OFD:
// held by the shared open file description, which fork shares) stay, renamed.
func (d *dump) fixLocks(s Spec) error {
	pid := d.newPid
	fds := d.fdIndex()
	var out []*file_lock.FileLockEntry
	for _, e := range d.locks.entries {
		l := e.Message.(*file_lock.FileLockEntry)
		owner := uint32(l.GetPid())
		if owner != d.pid && owner != pid {
			return unexpected(d.dir, "filelocks.img has a lock of task %d, which the dump does not hold", owner)
		}
		if l.GetFlag()&flPosix != 0 {
			continue
		}
		v := int32(pid)
		l.Pid = &v
		out = append(out, l)
	}
	for _, l := range s.Locks {
		fe, ok := fds[l.Fd]
		if !ok {
			return invalid("Spec.Locks: fd %d is not open in the dump (%s)", l.Fd, d.fdList())
		}
		f := d.fileByID(fe.GetId())
		reg := d.pathEntry(f)
		if reg == nil {
			return invalid("Spec.Locks: fd %d is a %s in the dump, not a file", l.Fd, f.GetType())
		}
		acc := reg.GetFlags() & unix.O_ACCMODE
		if l.Write && acc == unix.O_RDONLY || !l.Write && acc == unix.O_WRONLY {
			return invalid("Spec.Locks: fd %d (%s) is open with access mode %d: it cannot hold a %s lock", l.Fd, reg.GetName(), acc, map[bool]string{true: "write", false: "read"}[l.Write])
		}
		flag, typ := uint32(flPosix), uint32(unix.F_RDLCK)
		if l.Write {
			typ = unix.F_WRLCK
		}
		owner, fd, start, n := int32(pid), int32(l.Fd), l.Start, l.Len
		out = append(out, &file_lock.FileLockEntry{Flag: &flag, Type: &typ, Pid: &owner, Fd: &fd, Start: &start, Len: &n})
	}
	d.locks.entries = d.locks.entries[:0]
	for _, l := range out {
		d.locks.entries = append(d.locks.entries, &crit.CriuEntry{Message: l})
	}
	d.locks.changed = true
	return nil
}
