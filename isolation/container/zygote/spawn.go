package zygote

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
)

// SpawnOptions are the options of Spawn.
type SpawnOptions struct {
	// SetLastPid makes nsPid the next PID of the sandbox's pid namespace (it writes
	// nsPid-1 to that namespace's ns_last_pid) and returns the last PID the namespace
	// gave before.
	SetLastPid func(nsPid int) (last int, err error)
	// Reverted, if set, is called once every process is forked and before the first
	// fixup, which needs the root as at the checkpoint: it waits for the caller's revert
	// of the root, run meanwhile. Its error aborts the spawn.
	Reverted func() error
	// Reap, if set, lets the frozen init run until done says so (at most a moment), then
	// freezes it again: a PID to fork is held by a zombie child of init, which only init
	// can reap. Logf, if set, is told of it.
	Reap func(done func() bool) error
	Logf func(format string, args ...any)
	// Phase, if set, is told how long each phase took ("stop", "fork", "reverted",
	// "fixups", "track", "park").
	Phase func(name string, d time.Duration)
	// Tracks, if set, follows the new processes' writes from their birth, so that a
	// later rollback can bring them back in place (Rewind) to this checkpoint or to any
	// other of theirs.
	Tracks *Tracks

	// resume moves the next PID back past every PID given in the namespace (set by
	// Spawn).
	resume func() error
	// proc is the /proc of the sandbox's pid namespace, "" if not found (set by Spawn).
	proc string
}

// Spawn makes every zygote of r fork the process it copies, with that process's PID,
// registers, memory, descriptors (offsets, flags, pipe contents as at the checkpoint),
// locks and inherited settings. A new process is born in its zygote's cgroups: the
// sandbox's, but for the freezer, where it is held, frozen, until the caller moves it
// into the sandbox's freezer cgroup (Release). Moving a task between cgroups is the
// costly part (~0.1 ms each here, and an RCU grace period without favordynmods):
// this way there is one move per process. The zygotes are frozen again afterwards,
// ready for the next rollback.
//
// Preconditions: the sandbox's other processes are gone (their PIDs are free), its root
// holds the checkpoint's files again (reverted in place: the zygotes' descriptors and
// mappings point at its inodes) or will once Reverted returns, and nothing else forks in
// the sandbox meanwhile.
func Spawn(ctx context.Context, tr *ptrace.Tracer, r *Record, o SpawnOptions) ([]int, error) {
	var pids []int
	err := tr.Do(func() error {
		t := time.Now()
		zs, err := wake(r)
		defer park(r, zs, o)
		if err != nil {
			return err
		}
		report(o.Phase, "stop", t)
		o.proc = r.nsProc()
		// Each fork takes the PID it asks for, and the next PID moves at once past those
		// of every process to fork: otherwise the next PID after the first process's
		// would be the second's, and any process starting meanwhile in the namespace
		// (CRIU, dumping a zygote from inside in the background) would take it. It
		// moves past the last PID the namespace gave before the spawn, too: PIDs given
		// since the checkpoint may belong to the processes of other checkpoints, which
		// their rollbacks need free (a zygote forked later would take one and keep it).
		// PIDs in use past that one are skipped.
		last, before := 0, 0
		for _, p := range r.Procs {
			last = max(last, p.NSPid)
		}
		set := o.SetLastPid
		o.SetLastPid = func(nsPid int) (int, error) {
			l, err := set(nsPid)
			if before == 0 {
				before = l // the first setting's: the namespace's before the spawn
			}
			return l, err
		}
		o.resume = func() error {
			_, err := set(max(last, before) + 1)
			return err
		}
		t = time.Now()
		for i := range r.Procs {
			pid, err := spawnOne(zs[i], &r.Procs[i], o)
			if pid > 0 {
				pids = append(pids, pid)
			}
			if err != nil {
				return err
			}
		}
		report(o.Phase, "fork", t)
		crashPoint("zygote-spawn-forked")
		if err := failPoint("zygote-spawn-forked"); err != nil {
			return err
		}
		if o.Reverted != nil {
			t = time.Now()
			if err := o.Reverted(); err != nil {
				return err
			}
			report(o.Phase, "reverted", t)
		}
		t = time.Now()
		for i := range r.Procs {
			p := &r.Procs[i]
			if err := fixup(p.spawned, p); err != nil {
				return fmt.Errorf("process %d: %w", p.NSPid, err)
			}
		}
		report(o.Phase, "fixups", t)
		if o.Tracks != nil {
			t = time.Now()
			for i := range r.Procs {
				o.Tracks.spawned(r.Procs[i].spawned, &r.Procs[i])
			}
			report(o.Phase, "track", t)
		}
		return nil
	})
	if err != nil {
		Discard(pids)
		return nil, err
	}
	return pids, nil
}

// Release lets the processes Spawn made run: they join the freezer cgroup whose
// cgroup.procs file is given (a thawed one).
func Release(pids []int, procs string) error {
	for _, pid := range pids {
		if err := os.WriteFile(procs, []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("start process %d: %w", pid, err)
		}
	}
	return nil
}

// Discard kills processes Spawn made; they die once out of their zygotes' frozen
// cgroups, in the root freezer cgroup.
func Discard(pids []int) {
	for _, pid := range pids {
		unix.Kill(pid, unix.SIGKILL)
		os.WriteFile(filepath.Join(freezer.Root, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
	}
}

func report(phase func(string, time.Duration), name string, start time.Time) {
	if phase != nil {
		phase(name, time.Since(start))
	}
}

// wake seizes every zygote of r (frozen), thaws its cgroup so that it stops for us
// instead, and waits for the stops. It returns the zygotes it holds, parked
// (ptrace.Park): thawed, a zygote would run as a copy of its process if cairn died now;
// parked, it waits in pause(2) for the next rollback (or Settle) to give it its
// registers back from the record and freeze it again.
func wake(r *Record) ([]*ptrace.Tracee, error) {
	zs := make([]*ptrace.Tracee, len(r.Procs))
	for i, p := range r.Procs {
		if !p.Zygote.Alive() {
			return zs, fmt.Errorf("zygote of process %d is gone", p.NSPid)
		}
		z, err := ptrace.Seize(p.Zygote.Pid)
		if err != nil {
			return zs, err
		}
		zs[i] = z
		if p.VDSO != 0 {
			z.SetVDSO(p.VDSO) // else found by its first call
		}
		if err := z.Interrupt(); err != nil {
			return zs, err
		}
	}
	// Thawed, a zygote stops for us before it runs an instruction of its own; until it
	// is parked, a crash would let it run as a copy of its process: a crash window.
	err := ptrace.Window(func() error {
		thawed := make([]bool, len(zs))
		for i, p := range r.Procs {
			thawed[i] = !freezer.IsFrozen(p.Cgroup)
			if err := freezer.Set(p.Cgroup, freezer.Thawed); err != nil {
				return err
			}
		}
		for i, z := range zs {
			if err := z.Wait(stopTimeout); err != nil {
				return err
			}
			if err := rest(z, &r.Procs[i], thawed[i]); err != nil {
				return err
			}
			if r.Procs[i].Regs != nil {
				if err := z.Park(); err != nil {
					return err
				}
			}
		}
		return nil
	})
	return zs, err
}

// ErrLost says that a zygote ran code of its own since the checkpoint (a crash of cairn
// left it thawed, and not parked): it is no longer a copy of its process at the
// checkpoint, and was killed.
var ErrLost = errors.New("a zygote ran since its checkpoint and was ended")

// rest gives a zygote stopped for us its registers from the record (its own, even if a
// Spawn that died parked it). A zygote found in a thawed cgroup must have been parked:
// otherwise it ran as a copy of its process, and is killed (ErrLost).
func rest(z *ptrace.Tracee, p *Proc, thawed bool) error {
	if thawed && !z.Parked() {
		z.Kill()
		return fmt.Errorf("process %d: %w", p.NSPid, ErrLost)
	}
	if p.Regs != nil {
		z.SetRegs(*p.Regs)
	}
	return nil
}

// park freezes the zygotes (and the processes just forked from them, in the same
// cgroups) again and lets go of them: their registers are restored, and each freezes
// before it runs an instruction.
func park(r *Record, zs []*ptrace.Tracee, o SpawnOptions) {
	t := time.Now()
	for i, z := range zs {
		if z == nil {
			continue
		}
		freezer.Write(r.Procs[i].Cgroup, freezer.Frozen)
		// Stopped by us in a frozen cgroup, each freezes as soon as it is let go: its
		// own registers can go back now. A signal that reached a zygote came after its
		// checkpoint (a fork leaves none pending): it is dropped, not delivered.
		z.Unpark()
		z.DropPending()
		z.Detach()
		if c := r.Procs[i].spawned; c != nil {
			c.Unpark()
			c.Detach()
		}
	}
	for _, p := range r.Procs {
		freezer.Set(p.Cgroup, freezer.Frozen)
	}
	report(o.Phase, "park", t)
}

// spawnOne forks the process of p from its zygote, with its PID, session and registers;
// fixup does the rest. It returns the new process's host PID as soon as it exists.
func spawnOne(z *ptrace.Tracee, p *Proc, o SpawnOptions) (int, error) {
	c, err := forkAs(z, p, o)
	if err != nil {
		return 0, err
	}
	// park detaches it, frozen in the zygote's cgroup; parked until then, like its
	// zygote, it waits in pause(2) if cairn dies first (a stray, which the next rollback
	// kills).
	p.spawned = c
	c.SetRegs(z.Regs())
	if err := c.Park(); err != nil {
		unix.Kill(c.Pid, unix.SIGKILL)
		return c.Pid, err
	}
	// The zygote leads a session of its own; the process led its own (checked at the
	// capture): setsid makes it so again, its PID being that of its session and group.
	if _, err := c.Syscall(unix.SYS_SETSID); err != nil {
		unix.Kill(c.Pid, unix.SIGKILL)
		return c.Pid, fmt.Errorf("setsid: %w", err)
	}
	return c.Pid, nil
}

// pidWait bounds how long forkAs waits for a PID taken by another process; pidPoll is
// how often it looks.
const (
	pidWait = time.Second
	pidPoll = 200 * time.Microsecond
)

// forkAs makes z fork a child with PID nsPid in its namespace. The PID may be taken for
// a moment by a process outside the sandbox's tree (a CRIU dumping a zygote from inside
// the sandbox in the background, an operator's nsenter): forkAs waits until it is free
// before it forks, as a child born with another PID could not be reaped while init is
// frozen, and would hold that PID, maybe the next process's, until the spawn ends.
// Between the look and the fork, another process of the namespace that forks may still
// take it (init and the zygotes are frozen; the holders above may): such a child is
// killed and the fork tried again.
func forkAs(z *ptrace.Tracee, p *Proc, o SpawnOptions) (*ptrace.Tracee, error) {
	nsPid := p.NSPid
	deadline := time.Now().Add(pidWait)
	for {
		reaped := false
		for pidHeld(o.proc, nsPid) {
			// A zombie whose parent is frozen (init, during a spawn) is reaped only if
			// init runs for a moment.
			if zombieOfFrozen(o.proc, nsPid) {
				if reaped || o.Reap == nil {
					return nil, fmt.Errorf("PID %d is taken (%s)", nsPid, holderOf(z.Pid, nsPid))
				}
				if o.Logf != nil {
					o.Logf("PID %d to fork is taken (%s): init runs to reap it", nsPid, holderOf(z.Pid, nsPid))
				}
				reaped = true
				if err := o.Reap(func() bool { return !pidHeld(o.proc, nsPid) }); err != nil {
					return nil, fmt.Errorf("reap the zombie holding PID %d: %w", nsPid, err)
				}
				continue
			}
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("PID %d is taken (%s)", nsPid, holderOf(z.Pid, nsPid))
			}
			time.Sleep(pidPoll)
		}
		// A crash window: a crash between the two settings of the next PID would leave
		// it at nsPid, for the next thread of init to take.
		var c *ptrace.Tracee
		err := ptrace.Window(func() error {
			if _, err := o.SetLastPid(nsPid); err != nil {
				return fmt.Errorf("next PID %d: %w", nsPid, err)
			}
			var err error
			c, err = z.Fork(unix.CLONE_PARENT)
			if rerr := o.resume(); err == nil && rerr != nil {
				c.Kill()
				return fmt.Errorf("next PID: %w", rerr)
			}
			return err
		})
		if err != nil {
			return nil, err
		}
		// The clone returned the new process's PID in the sandbox to the zygote (its
		// sibling: the same pid namespace).
		got := c.ClonedAs
		if got == nsPid {
			return c, nil
		}
		c.Kill()
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("the new process got PID %d, not %d: the PID is taken (%s)", got, nsPid, holderOf(z.Pid, nsPid))
		}
	}
}

// nsProc returns the /proc of the sandbox's pid namespace, as its root (seen through
// the zygote of its first process) holds it: its entry of the zygote must be the
// zygote (the same start time), else "". It is found once per record read.
func (r *Record) nsProc() string {
	if r.proc == nil {
		dir := ""
		if len(r.Procs) > 0 {
			p := &r.Procs[0]
			dir = procDir(p.Zygote.Pid) + "/root/proc"
			in, err1 := isolation.StatFields(fmt.Sprintf("%s/%d/stat", dir, p.ZygoteNSPid))
			out, err2 := isolation.StatFields(procDir(p.Zygote.Pid) + "/stat")
			if err1 != nil || err2 != nil || len(in) < 20 || len(out) < 20 || in[19] != out[19] {
				dir = ""
			}
		}
		r.proc = &dir
	}
	return *r.proc
}

// WaitPids waits until the PIDs of r's processes are free in the sandbox's pid
// namespace, at most timeout, and says which are still taken (with their holders)
// if some are. A rollback calls it once the sandbox's processes are killed and before
// init is frozen: a zombie child of init holding one (a process that ended as the
// rollback began, say) is then reaped, which it would not be while init is frozen.
func (r *Record) WaitPids(timeout time.Duration) error {
	proc := r.nsProc()
	deadline := time.Now().Add(timeout)
	for {
		var held []int
		for _, p := range r.Procs {
			if pidHeld(proc, p.NSPid) {
				held = append(held, p.NSPid)
			}
		}
		if len(held) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			var why []string
			for _, n := range held {
				why = append(why, fmt.Sprintf("%d %s", n, holderOf(r.Procs[0].Zygote.Pid, n)))
			}
			return fmt.Errorf("PIDs of the checkpoint's processes still taken: %s", strings.Join(why, "; "))
		}
		time.Sleep(pidPoll)
	}
}

// zombieOfFrozen says whether nsPid is held by a zombie whose parent is frozen.
func zombieOfFrozen(proc string, nsPid int) bool {
	if proc == "" {
		return false
	}
	f, err := isolation.StatFields(fmt.Sprintf("%s/%d/stat", proc, nsPid))
	if err != nil || len(f) < 2 || f[0] != "Z" {
		return false
	}
	// f[1] is the parent's PID in the namespace; its freezer state is read through the
	// same /proc.
	st, _ := os.ReadFile(fmt.Sprintf("%s/%s/cgroup", proc, f[1]))
	for _, l := range strings.Split(string(st), "\n") {
		if _, rel, ok := strings.Cut(l, ":freezer:"); ok {
			return freezer.IsFrozen(filepath.Join(freezer.Root, rel))
		}
	}
	return false
}

// pidHeld says whether a task holds nsPid in the sandbox's pid namespace, whose /proc
// is proc (a zombie holds its PID too). Without that view (proc "") it says no, and
// forkAs learns of a held PID from the fork.
func pidHeld(proc string, nsPid int) bool {
	if proc == "" {
		return false
	}
	_, err := os.Lstat(proc + "/" + strconv.Itoa(nsPid))
	return err == nil
}

// fixup puts back in the new process c what its zygote shares with the processes
// forked from it before (offsets, flags, pipe contents) or what fork does not inherit
// (locks, parent-death signal, subreaper flag): fixEarly, then fixLate.
func fixup(c *ptrace.Tracee, p *Proc) error {
	if err := fixEarly(c, p, nil); err != nil {
		return err
	}
	return fixLate(c, p, nil)
}

// fixEarly sets back what depends neither on the process's memory nor on the root's
// files: the offsets and status flags of its descriptors' open file descriptions, and
// the settings fork resets. known is what was read of the descriptors' fdinfo (nil: it
// is read here). A rewind calls it before
// it copies the pages back: every call injected after the copy cost ~0.2-0.8 ms more
// (the first run of a process whose page tables the copy changed), and in the common
// case none is left for fixLate.
func fixEarly(c *ptrace.Tracee, p *Proc, known map[int]fdinfo) error {
	for _, fd := range p.Fds {
		if fd.Kind != KindFile && fd.Kind != KindDir && fd.Kind != KindFIFO {
			continue
		}
		cur, ok := known[fd.Fd]
		if !ok {
			var err error
			if cur, err = readFdinfo(c.Pid, fd.Fd); err != nil {
				return fmt.Errorf("descriptor %d (%s): %w", fd.Fd, fd.Path, err)
			}
		}
		if err := fixDescription(c, fd, &cur); err != nil {
			return fmt.Errorf("descriptor %d (%s): %w", fd.Fd, fd.Path, err)
		}
	}
	if p.PdeathSig != 0 {
		if _, err := c.Syscall(unix.SYS_PRCTL, unix.PR_SET_PDEATHSIG, uintptr(p.PdeathSig)); err != nil {
			return fmt.Errorf("parent-death signal: %w", err)
		}
	}
	if p.Dumpable != nil && *p.Dumpable != 0 {
		// The zygote is not dumpable; its copy is the process again.
		if _, err := c.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, uintptr(*p.Dumpable)); err != nil {
			return fmt.Errorf("dumpable: %w", err)
		}
	}
	if p.ChildSubreaper {
		if _, err := c.Syscall(unix.SYS_PRCTL, unix.PR_SET_CHILD_SUBREAPER, 1); err != nil {
			return fmt.Errorf("child subreaper: %w", err)
		}
	}
	return nil
}

// fixDescription gives the open file description of fd the recorded status flags and
// offset, where cur (its fdinfo) differs; cur is updated.
func fixDescription(c *ptrace.Tracee, fd Fd, cur *fdinfo) error {
	if cur.flags&settableFlags != fd.Flags&settableFlags {
		if _, err := c.Syscall(unix.SYS_FCNTL, uintptr(fd.Fd), unix.F_SETFL, uintptr(fd.Flags&settableFlags)); err != nil {
			return fmt.Errorf("fcntl F_SETFL: %w", err)
		}
		cur.flags = cur.flags&^settableFlags | fd.Flags&settableFlags
	}
	if (fd.Kind == KindFile || fd.Kind == KindDir) && cur.pos != fd.Pos {
		if _, err := c.Syscall(unix.SYS_LSEEK, uintptr(fd.Fd), uintptr(fd.Pos), unix.SEEK_SET); err != nil {
			return fmt.Errorf("lseek to %d: %w", fd.Pos, err)
		}
		cur.pos = fd.Pos
	}
	return nil
}

// fixLate sets back what needs the root as at the checkpoint (its revert done): a
// descriptor on a file the revert recreated is opened again (the inherited one names
// the old, deleted inode), pipes and FIFOs hold the recorded bytes, the working
// directory, and the POSIX locks. held are the locks the process holds (a rewind's;
// nil for a new process, which holds none): one held on a file not opened again is not
// taken again.
func fixLate(c *ptrace.Tracee, p *Proc, held []Lock) error {
	var s *ptrace.Scratch
	scratch := func() (*ptrace.Scratch, error) {
		if s != nil {
			return s, nil
		}
		var err error
		s, err = c.Scratch(8192)
		return s, err
	}
	defer func() {
		if s != nil {
			s.Free()
		}
	}()
	root := fmt.Sprintf("/proc/%d/root", c.Pid)
	reopened := map[int]bool{}
	for _, fd := range p.Fds {
		link := fmt.Sprintf("/proc/%d/fd/%d", c.Pid, fd.Fd)
		if fd.Kind == KindFile || fd.Kind == KindDir || fd.Kind == KindFIFO {
			if !sameInode(filepath.Join(root, fd.Path), link) {
				if err := reopen(c, fd, scratch); err != nil {
					return fmt.Errorf("descriptor %d (%s): %w", fd.Fd, fd.Path, err)
				}
				reopened[fd.Fd] = true
				cur, err := readFdinfo(c.Pid, fd.Fd) // a new open file description
				if err == nil {
					err = fixDescription(c, fd, &cur)
				}
				if err != nil {
					return fmt.Errorf("descriptor %d (%s): %w", fd.Fd, fd.Path, err)
				}
			}
		}
		if fd.Kind == KindPipe || fd.Kind == KindFIFO {
			if err := refill(link, fd.Data); err != nil {
				return fmt.Errorf("descriptor %d (%s): %w", fd.Fd, fd.Path, err)
			}
		}
	}
	if !sameInode(filepath.Join(root, p.Cwd.Path), fmt.Sprintf("/proc/%d/cwd", c.Pid)) {
		s, err := scratch()
		if err != nil {
			return err
		}
		addr, err := s.Put(0, ptrace.CString(p.Cwd.Path))
		if err != nil {
			return err
		}
		if _, err := c.Syscall(unix.SYS_CHDIR, addr); err != nil {
			return fmt.Errorf("chdir %s: %w", p.Cwd.Path, err)
		}
	}
	ino := map[int]uint64{}
	for _, fd := range p.Fds {
		ino[fd.Fd] = fd.Ino
	}
	for _, l := range p.Locks {
		if !reopened[l.Fd] && slices.ContainsFunc(held, func(h Lock) bool { return sameLock(h, l, ino) }) {
			continue
		}
		if err := relock(c, l, scratch); err != nil {
			return err
		}
	}
	return nil
}

// sameLock reports whether a and b are the same lock (on the same file: ino gives the
// inode of each descriptor).
func sameLock(a, b Lock, ino map[int]uint64) bool {
	return ino[a.Fd] == ino[b.Fd] && a.Write == b.Write && a.Start == b.Start && a.Len == b.Len
}

// sameInode reports whether two paths name the same inode.
func sameInode(a, b string) bool {
	var sa, sb unix.Stat_t
	return unix.Stat(a, &sa) == nil && unix.Stat(b, &sb) == nil && sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// settableFlags are the status flags fcntl(F_SETFL) changes (the access mode cannot).
const settableFlags = unix.O_APPEND | unix.O_NONBLOCK | unix.O_ASYNC | unix.O_DIRECT | unix.O_NOATIME

// reopen opens fd.Path in c onto descriptor fd.Fd, with its flags and offset.
func reopen(c *ptrace.Tracee, fd Fd, scratch func() (*ptrace.Scratch, error)) error {
	s, err := scratch()
	if err != nil {
		return err
	}
	addr, err := s.Put(0, ptrace.CString(fd.Path))
	if err != nil {
		return err
	}
	flags := fd.Flags&^(unix.O_CREAT|unix.O_EXCL|unix.O_TRUNC|unix.O_CLOEXEC) | unix.O_NOCTTY
	if fd.Kind == KindFIFO {
		flags |= unix.O_NONBLOCK // a FIFO's open waits for the other end; F_SETFL puts it back
	}
	cwd := unix.AT_FDCWD
	nfd, err := c.Syscall(unix.SYS_OPENAT, uintptr(cwd), addr, uintptr(flags), 0)
	if err != nil {
		return fmt.Errorf("open %s again: %w", fd.Path, err)
	}
	dflags := uintptr(0)
	if fd.Flags&unix.O_CLOEXEC != 0 {
		dflags = unix.O_CLOEXEC
	}
	if int(nfd) != fd.Fd {
		if _, err := c.Syscall(unix.SYS_DUP3, nfd, uintptr(fd.Fd), dflags); err != nil {
			return fmt.Errorf("dup3: %w", err)
		}
		if _, err := c.Syscall(unix.SYS_CLOSE, nfd); err != nil {
			return fmt.Errorf("close: %w", err)
		}
	}
	return nil
}

// refill makes a pipe or FIFO hold exactly data: what is in it is drained (it was
// written after the checkpoint) and data written back.
func refill(link string, data []byte) error {
	f, err := unix.Open(link, unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open pipe: %w", err)
	}
	defer unix.Close(f)
	buf := make([]byte, 64<<10)
	for {
		n, err := unix.Read(f, buf)
		if errors.Is(err, unix.EAGAIN) || n == 0 {
			break
		}
		if err != nil {
			return fmt.Errorf("drain pipe: %w", err)
		}
	}
	for len(data) > 0 {
		n, err := unix.Write(f, data)
		if err != nil {
			return fmt.Errorf("refill pipe: %w", err)
		}
		data = data[n:]
	}
	return nil
}

// relock takes again a POSIX lock the process held.
func relock(c *ptrace.Tracee, l Lock, scratch func() (*ptrace.Scratch, error)) error {
	s, err := scratch()
	if err != nil {
		return err
	}
	fl := unix.Flock_t{Type: unix.F_RDLCK, Whence: 0, Start: l.Start, Len: l.Len}
	if l.Write {
		fl.Type = unix.F_WRLCK
	}
	addr, err := s.Put(4096, ptrace.Bytes(&fl))
	if err != nil {
		return err
	}
	if _, err := c.Syscall(unix.SYS_FCNTL, uintptr(l.Fd), unix.F_SETLK, addr); err != nil {
		return fmt.Errorf("lock %d+%d on descriptor %d again: %w", l.Start, l.Len, l.Fd, err)
	}
	return nil
}

// Zygotes lists the zygotes of r as host processes.
func (r *Record) Zygotes() []isolation.Proc {
	var out []isolation.Proc
	for _, p := range r.Procs {
		out = append(out, p.Zygote)
	}
	return out
}

// Settle brings the zygotes of r back to rest after a crash in the middle of a Spawn:
// its strays are killed, and a zygote whose cgroup is thawed, parked in pause(2), gets
// its registers back from the record and is frozen again (as a Spawn's wake and park
// do). It does nothing to zygotes at rest, and must not run beside a Spawn of the same
// record (the caller's lock).
func Settle(tr *ptrace.Tracer, r *Record) error {
	Discard(r.Strays())
	thawed := &Record{}
	for _, p := range r.Procs {
		if freezer.IsFrozen(p.Cgroup) || !p.Zygote.Alive() {
			continue
		}
		if p.Regs == nil {
			return fmt.Errorf("zygote of process %d is thawed and its record has no registers to give it back", p.NSPid)
		}
		thawed.Procs = append(thawed.Procs, p)
	}
	if len(thawed.Procs) == 0 {
		return nil
	}
	err := tr.Do(func() error {
		zs, err := wake(thawed)
		park(thawed, zs, SpawnOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("settle the zygotes: %w", err)
	}
	return nil
}

// Strays are the processes in r's zygotes' cgroups other than the zygotes: processes a
// Spawn forked and never released, because cairn died in the middle of it.
func (r *Record) Strays() []int {
	var out []int
	for _, p := range r.Procs {
		for _, pid := range freezer.Procs(p.Cgroup) {
			if pid != p.Zygote.Pid {
				out = append(out, pid)
			}
		}
	}
	return out
}

// crashPoint kills the process when CAIRN_TEST_CRASH_AT names this point, so that tests
// can prove a crash there recoverable: after the forks of a Spawn, the zygotes and their
// new copies parked (the engine's points name the rest).
func crashPoint(name string) {
	if os.Getenv("CAIRN_TEST_CRASH_AT") == name {
		unix.Kill(os.Getpid(), unix.SIGKILL)
		select {}
	}
}

// failPoint fails the operation when CAIRN_TEST_FAIL_AT names this point, so that tests
// can prove a failure there survivable (the spawn's, after its forks: the rollback falls
// back to the checkpoint's images).
func failPoint(name string) error {
	if os.Getenv("CAIRN_TEST_FAIL_AT") == name {
		return fmt.Errorf("test failure at %s (CAIRN_TEST_FAIL_AT)", name)
	}
	return nil
}

// holderOf describes the task holding PID nsPid in the pid namespace of pid, for the
// error of a fork that could not get it: its host PID, command, and whether it is a
// thread, a zygote (not dumpable, frozen) or of another cgroup (a background CRIU).
func holderOf(pid, nsPid int) string {
	ns, err := os.Readlink(procDir(pid) + "/ns/pid")
	if err != nil {
		return "holder unknown"
	}
	procs, _ := os.ReadDir("/proc")
	for _, d := range procs {
		tgid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if n, _ := os.Readlink(procDir(tgid) + "/ns/pid"); n != ns {
			continue
		}
		tasks, _ := os.ReadDir(procDir(tgid) + "/task")
		for _, t := range tasks {
			tid, _ := strconv.Atoi(t.Name())
			st, err := readStatus(tid)
			if err != nil || st.nsPid != nsPid {
				continue
			}
			comm, _ := os.ReadFile(procDir(tgid) + "/comm")
			what := "process"
			if tid != tgid {
				what = fmt.Sprintf("thread of process %d", tgid)
			}
			pcomm, _ := os.ReadFile(procDir(st.ppid) + "/comm")
			return fmt.Sprintf("held by %s %d (%s), state %s, %s old, parent %d (%s, freezer cgroup %s), freezer cgroup %s", what, tid, strings.TrimSpace(string(comm)),
				ptrace.ProcState(tid), age(tid), st.ppid, strings.TrimSpace(string(pcomm)), freezer.Of(st.ppid), freezer.Of(tid))
		}
	}
	return "holder not found: it has exited since"
}

// age is how long ago task pid started, from its start time in /proc/<pid>/stat (clock
// ticks since boot, 100 a second here) and the system's uptime.
func age(pid int) string {
	st, err := isolation.StatFields(procDir(pid) + "/stat")
	if err != nil || len(st) < 20 {
		return "?"
	}
	start, err := strconv.ParseFloat(st[19], 64)
	up, uerr := os.ReadFile("/proc/uptime")
	f := strings.Fields(string(up))
	if err != nil || uerr != nil || len(f) == 0 {
		return "?"
	}
	now, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return "?"
	}
	return (time.Duration((now - start/100) * float64(time.Second))).Round(10 * time.Millisecond).String()
}
