package zygote

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/dirty"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
)

// stopTimeout bounds how long a process may take to stop for us.
const stopTimeout = 10 * time.Second

// CaptureOptions are the options of Capture.
type CaptureOptions struct {
	// Init is the sandbox's init.
	Init isolation.Proc
	// Procs lists the sandbox's processes but init (its zygotes, also children of init,
	// are not the sandbox's processes): all are captured, and each must be a child of
	// init.
	Procs func() ([]int, error)
	// CgroupDir is a freezer cgroup directory (host path, created if missing) under
	// which each zygote gets a cgroup of its own, named after its process's PID.
	CgroupDir string
	// RecordDir receives the record (RecordFile): first a provisional one, written
	// before the first zygote is forked and naming the cgroups the zygotes go to, so
	// that Kill can always end what a crash left; the complete one once the processes
	// run again.
	RecordDir string
	// Frozen, if set, is called once every process is stopped, on a goroutine of its
	// own while the zygotes are made: the caller snapshots the filesystem there. Its
	// error aborts the capture; the processes stay stopped until it returns.
	Frozen func() error
	// Phase, if set, is told how long each phase took ("stop", "zygote_scan",
	// "zygote_track", "zygote_wait_prepare", "zygote_fork" and its steps
	// "zygote_fork_clone", "_calls", "_move", "_check" summed over the processes,
	// "zygotes", "fs", "resume", and "stopped": from the stop to the end of the resume;
	// "zygote_prepare" beside it, "zygote_record_final" after it), from three goroutines
	// at once.
	Phase func(name string, d time.Duration)
	// Tracks, if set, follows the processes' writes from here on, so that a rollback to
	// this checkpoint can bring them back in place (Rewind).
	Tracks *Tracks
}

func (o *CaptureOptions) report(name string, start time.Time) {
	if o.Phase != nil {
		o.Phase(name, time.Since(start))
	}
}

// Capture makes a zygote of every child of the sandbox's init and records what fork
// does not copy. The processes are stopped (ptrace) for the duration, and run on
// unchanged afterwards whatever happens. On any failure nothing is left behind: the
// zygotes made so far are killed, and the provisional record removed once they are. An
// *Ineligible error says why the sandbox cannot be captured this way (the caller falls
// back to CRIU).
func Capture(ctx context.Context, tr *ptrace.Tracer, o CaptureOptions) (*Record, error) {
	// A process that has just exited is a zombie until init reaps it, which it does as
	// soon as it runs; one killed with its group may also exit while it is being
	// stopped (conformance ResidentPaths: a shell and its child killed together). A
	// capture a moment later does not see it: it is tried again for a little while,
	// rather than give up the zygotes. (A failed capture leaves nothing behind.)
	for deadline := time.Now().Add(reapWait); ; {
		rec, err := captureOnce(ctx, tr, o)
		var in *Ineligible
		if errors.As(err, &in) && in.ending && time.Now().Before(deadline) {
			time.Sleep(reapWait / 50)
			continue
		}
		return rec, err
	}
}

// captureOnce is one attempt of Capture.
func captureOnce(ctx context.Context, tr *ptrace.Tracer, o CaptureOptions) (*Record, error) {
	t0 := time.Now()
	kids, err := o.list()
	if err != nil {
		return nil, err
	}
	if err := checkAll(kids, o.Init.Pid); err != nil {
		return nil, err
	}
	o.report("check", t0)
	// Prepared beside the stop and the scan, and awaited before the first zygote is
	// forked (prepare): the provisional record and the zygotes' cgroups.
	rec := &Record{Version: Version, Init: o.Init}
	prepared := make(chan error, 1)
	go func() { prepared <- o.prepare(rec, kids) }()
	prepare := sync.OnceValue(func() error { return <-prepared })
	err = tr.Do(func() error {
		t := time.Now()
		procs, stopped, err := stopAll(kids)
		defer func(stop time.Time) {
			t := time.Now()
			for i, p := range procs {
				if i >= stopped {
					tr.Forget(p) // never stopped: detached once it does
				} else if err := p.Detach(); err != nil {
					tr.Forget(p)
				}
			}
			o.report("resume", t)
			o.report("stopped", stop) // how long the processes did not run
		}(t)
		if err != nil {
			return err
		}
		if now, err := o.list(); err != nil || !slices.Equal(now, kids) {
			return &Ineligible{Reason: "processes started or ended during the checkpoint", ending: true}
		}
		o.report("stop", t)
		// Every process is stopped: the filesystem is captured now, on another thread,
		// while the zygotes are made (a btrfs snapshot and the forks each take a few
		// milliseconds, mostly in the kernel, on two cores).
		fs := o.frozen()
		err = o.zygotes(procs, rec, prepare)
		if ferr := fs(); err == nil {
			err = ferr
		}
		return err
	})
	if perr := prepare(); err == nil {
		err = perr // (awaited in any case: Kill must not run before it is done)
	}
	if err == nil {
		// The complete record, once the processes run again: until then the provisional
		// one names the zygotes' cgroups, which is all Kill needs after a crash.
		tw := time.Now()
		err = rec.Write(o.RecordDir)
		o.report("zygote_record_final", tw)
	}
	if err != nil {
		if Kill(rec) == nil {
			// Nothing left for the record to name (kept otherwise, for a later Kill).
			os.Remove(filepath.Join(o.RecordDir, RecordFile))
		}
		return nil, err
	}
	o.Tracks.captured(rec, kids)
	return rec, nil
}

// prepare writes the provisional record, which names the cgroups the zygotes of the
// processes kids will go to (after their PIDs in the sandbox, which never change), then
// makes those cgroups, frozen. It runs while the processes are stopped and scanned.
func (o *CaptureOptions) prepare(rec *Record, kids []int) error {
	t := time.Now()
	for _, k := range kids {
		nsPid, err := NSPid(k)
		if err != nil {
			return err
		}
		rec.Procs = append(rec.Procs, Proc{Cgroup: o.cgroup(nsPid)})
	}
	if err := rec.Write(o.RecordDir); err != nil {
		return err
	}
	for _, p := range rec.Procs {
		if err := os.MkdirAll(p.Cgroup, 0o755); err != nil {
			return fmt.Errorf("zygote cgroup: %w", err)
		}
		if err := freezer.Write(p.Cgroup, freezer.Frozen); err != nil {
			return fmt.Errorf("zygote cgroup: %w", err)
		}
	}
	o.report("zygote_prepare", t)
	return nil
}

// cgroup is the freezer cgroup of the zygote of the process whose PID in the sandbox is
// nsPid.
func (o *CaptureOptions) cgroup(nsPid int) string {
	return filepath.Join(o.CgroupDir, strconv.Itoa(nsPid))
}

// reapWait bounds how long Capture waits for init to reap a process that has exited.
const reapWait = 20 * time.Millisecond

func checkAll(kids []int, init int) error {
	for _, k := range kids {
		if err := checkBefore(k, init); err != nil {
			return err
		}
	}
	return nil
}

// frozen starts o.Frozen on its own goroutine and returns the wait for its result.
func (o *CaptureOptions) frozen() (wait func() error) {
	if o.Frozen == nil {
		return func() error { return nil }
	}
	done := make(chan error, 1)
	go func() {
		t := time.Now()
		err := o.Frozen()
		if err == nil {
			o.report("fs", t)
		}
		done <- err
	}()
	return func() error { return <-done }
}

// zygotes scans the stopped processes, records them and forks their zygotes, once
// prepare says their record and cgroups are ready.
func (o *CaptureOptions) zygotes(procs []*ptrace.Tracee, rec *Record, prepare func() error) error {
	t := time.Now()
	var zps []*Proc
	var inside time.Duration // of the scan, in calls injected into the processes
	for _, p := range procs {
		zp, in, err := o.scan(p)
		if err != nil {
			return err
		}
		inside += in
		zps = append(zps, zp)
	}
	o.report("zygote_scan", t)
	if o.Phase != nil {
		o.Phase("zygote_scan_inside", inside)
	}
	// What each process wrote since it was last scanned is found now, while it is
	// stopped and before its zygote exists: its new zygote's set starts empty.
	tt := time.Now()
	o.Tracks.before(procs, zps)
	o.report("zygote_track", tt)
	tp := time.Now()
	if err := prepare(); err != nil {
		return err
	}
	o.report("zygote_wait_prepare", tp)
	t1 := time.Now()
	var steps forkSteps
	for i, p := range procs {
		if zps[i].Cgroup != rec.Procs[i].Cgroup {
			// Not the process the provisional record was written for (Capture checks the
			// list did not change): never fork a zygote Kill would not find.
			return fmt.Errorf("process %d: its zygote's cgroup %s is not the recorded %s", p.Pid, zps[i].Cgroup, rec.Procs[i].Cgroup)
		}
		if err := capture(p, zps[i], o.Tracks != nil, &steps); err != nil {
			return err
		}
		rec.Procs[i] = *zps[i]
	}
	o.report("zygote_fork", t1)
	if o.Phase != nil {
		for i, d := range steps {
			o.Phase(forkStepNames[i], d)
		}
	}
	o.report("zygotes", t)
	return nil
}

// list returns the sandbox's processes, sorted.
func (o *CaptureOptions) list() ([]int, error) {
	pids, err := o.Procs()
	if err != nil {
		return nil, fmt.Errorf("processes of the sandbox: %w", err)
	}
	pids = slices.Clone(pids)
	slices.Sort(pids)
	return pids, nil
}

// stopAll seizes and stops every process. It returns those it holds (the caller
// detaches them, whatever happened) and how many of them, first, are stopped.
//
// A process that cannot be seized (gone since it was listed) ends the attempt, but the
// processes seized before it were interrupted: they are waited for, so that the caller
// detaches them now. Handed to the tracer to detach once they stop (Forget), they sat
// in a ptrace stop until its next tick, and Capture's next attempt found one stopped.
func stopAll(pids []int) ([]*ptrace.Tracee, int, error) {
	var procs []*ptrace.Tracee
	var failed error
	interrupted := 0
	for _, pid := range pids {
		p, err := ptrace.Seize(pid)
		if err != nil {
			// ESRCH: gone since it was listed.
			failed = &Ineligible{Reason: fmt.Sprintf("process %d: %v", pid, err), ending: errors.Is(err, unix.ESRCH)}
			break
		}
		procs = append(procs, p)
		if failed = p.Interrupt(); failed != nil {
			break // seized, not interrupted: last, and never waited for (Forget)
		}
		interrupted++
	}
	for i, p := range procs[:interrupted] {
		if err := p.Wait(stopTimeout); err != nil {
			if errors.Is(err, ptrace.ErrExited) {
				err = &Ineligible{Reason: fmt.Sprintf("process %d exited during the checkpoint", p.Pid), ending: true}
			}
			return procs, i, err
		}
	}
	return procs, interrupted, failed
}

// scan records a stopped process (what /proc shows, and what only the process can tell
// about itself) and names its zygote's cgroup; inside is the time the latter took.
func (o *CaptureOptions) scan(p *ptrace.Tracee) (zp *Proc, inside time.Duration, err error) {
	root, err := rootMount(p.Pid)
	if err != nil {
		return nil, 0, err
	}
	if zp, err = scan(p.Pid, root); err != nil {
		return nil, 0, err
	}
	zp.VDSO = useVDSO(p, zp.maps)
	t := time.Now()
	if err := inherited(p, zp, o.Tracks != nil); err != nil {
		return nil, 0, err
	}
	inside = time.Since(t)
	zp.Cgroup = o.cgroup(zp.NSPid)
	return zp, inside, nil
}

// forkSteps adds up the time capture spends in each of its steps, over the processes.
type forkSteps [4]time.Duration

// The phases forkSteps reports, in its order.
var forkStepNames = [...]string{"zygote_fork_clone", "zygote_fork_calls", "zygote_fork_move", "zygote_fork_check"}

// step adds the time since *t to step i and restarts *t.
func (s *forkSteps) step(i int, t *time.Time) {
	now := time.Now()
	s[i] += now.Sub(*t)
	*t = now
}

// capture forks the zygote of a stopped process into its frozen cgroup (made by
// prepare), and records the process's extended processor state for a rewind (xstate).
func capture(p *ptrace.Tracee, zp *Proc, xstate bool, steps *forkSteps) error {
	t := time.Now()
	z, err := p.Fork(unix.CLONE_PARENT)
	if err != nil {
		return err
	}
	steps.step(0, &t)
	// Out of the process's session and group: as their member the zygote would keep
	// the process's PID allocated (a session ID), and a rollback could not give it back.
	// Until Detach the zygote's registers are those of the injected clone's return: if
	// cairn died now the zygote would crash in the vDSO, not run as a copy.
	if _, err := z.Syscall(unix.SYS_SETSID); err != nil {
		unix.Kill(z.Pid, unix.SIGKILL)
		z.Detach()
		return fmt.Errorf("setsid in the zygote of %d: %w", p.Pid, err)
	}
	// Not dumpable: the sandbox's processes can then neither read its memory nor open
	// its /proc entries (they lack CAP_SYS_PTRACE), nor ptrace it.
	if _, err := z.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, 0); err != nil {
		unix.Kill(z.Pid, unix.SIGKILL)
		z.Detach()
		return fmt.Errorf("prctl in the zygote of %d: %w", p.Pid, err)
	}
	// A signal that reached it since the clone (sent to the process's group by another
	// process, say) came after the checkpoint: the zygote, which is the process at the
	// checkpoint, drops it.
	z.DropPending()
	steps.step(1, &t)
	// Into the frozen cgroup before it gets the process's registers: from Detach on, it
	// freezes before it runs an instruction (and if cairn dies, the kernel detaches it
	// into the freezer too).
	if err := os.WriteFile(filepath.Join(zp.Cgroup, "cgroup.procs"), []byte(strconv.Itoa(z.Pid)), 0); err != nil {
		unix.Kill(z.Pid, unix.SIGKILL)
		z.Detach()
		return fmt.Errorf("freeze zygote: %w", err)
	}
	steps.step(2, &t)
	// Its PID in the sandbox is what the clone returned in the process (CLONE_PARENT: a
	// sibling, in the same pid namespace).
	zp.Zygote, err = isolation.ProcOf(z.Pid)
	zp.ZygoteNSPid = z.ClonedAs
	if err == nil {
		zp.zygoteMaps, err = sameMappings(p.Pid, zp.maps, z.Pid)
	}
	regs := p.Regs()
	zp.Regs = &regs
	z.SetRegs(regs)
	if err == nil && xstate {
		zp.Xstate, err = p.Xstate()
	}
	if derr := z.Detach(); err == nil {
		err = derr
	}
	steps.step(3, &t)
	if err != nil {
		unix.Kill(z.Pid, unix.SIGKILL)
		return err
	}
	return nil
}

// sameMappings rejects a process with mappings that fork left out of its copy
// (MADV_DONTFORK), and returns the zygote's. a are the process's mappings (scanMaps),
// unchanged since: it is stopped, and the scratch page of inherited is unmapped again.
func sameMappings(pid int, a []mapping, zygote int) ([]mapping, error) {
	b, err := readMaps(zygote)
	if err != nil {
		return nil, err
	}
	if !slices.EqualFunc(a, b, func(x, y mapping) bool { return x.Range == y.Range }) {
		return nil, ineligible("process %d has memory that is not inherited by fork (MADV_DONTFORK)", pid)
	}
	return b, nil
}

// inherited reads, from inside the process, the state that fork resets and /proc does
// not show: interval timers (a zygote would lose them: not eligible), the parent-death
// signal and the child-subreaper flag (recorded, set again by Spawn); and, for a rewind
// (brk), the program break.
func inherited(p *ptrace.Tracee, zp *Proc, brk bool) error {
	// The calls' results, 32 bytes at most, one at a time.
	s, err := p.Scratch(32)
	if err != nil {
		return err
	}
	err = readInherited(p, zp, brk, s)
	// A failure to give the scratch memory back wins: the process must not run on with
	// its changes.
	if ferr := s.Free(); ferr != nil {
		return fmt.Errorf("give back the scratch memory of %d: %v", p.Pid, ferr)
	}
	return err
}

// readInherited makes the calls of inherited, their results in s.
func readInherited(p *ptrace.Tracee, zp *Proc, brk bool, s *ptrace.Scratch) error {
	for _, which := range []int{unix.ITIMER_REAL, unix.ITIMER_VIRTUAL, unix.ITIMER_PROF} {
		if _, err := p.Syscall(unix.SYS_GETITIMER, uintptr(which), uintptr(s.Addr)); err != nil {
			return fmt.Errorf("getitimer in %d: %w", p.Pid, err)
		}
		var it [4]int64
		if err := s.Get(0, ptrace.Bytes(&it)); err != nil {
			return err
		}
		if it != [4]int64{} {
			return ineligible("process %d has an interval timer set (setitimer/alarm)", p.Pid)
		}
	}
	var v [2]int32
	if _, err := p.Syscall(unix.SYS_PRCTL, unix.PR_GET_PDEATHSIG, uintptr(s.Addr)); err != nil {
		return fmt.Errorf("prctl in %d: %w", p.Pid, err)
	}
	if _, err := p.Syscall(unix.SYS_PRCTL, unix.PR_GET_CHILD_SUBREAPER, uintptr(s.Addr)+4); err != nil {
		return fmt.Errorf("prctl in %d: %w", p.Pid, err)
	}
	if err := s.Get(0, ptrace.Bytes(&v)); err != nil {
		return err
	}
	zp.PdeathSig, zp.ChildSubreaper = int(v[0]), v[1] != 0
	d, err := p.Syscall(unix.SYS_PRCTL, unix.PR_GET_DUMPABLE)
	if err != nil {
		return fmt.Errorf("prctl in %d: %w", p.Pid, err)
	}
	if d > 1 {
		// SUID_DUMP_ROOT, which prctl cannot set again.
		return ineligible("process %d is dumpable by root only (suid_dumpable)", p.Pid)
	}
	dumpable := int(d)
	zp.Dumpable = &dumpable
	if brk {
		// The program break, which a rewind sets again (brk(0) returns it).
		b, err := p.Syscall(unix.SYS_BRK, 0)
		if err != nil {
			return fmt.Errorf("brk in %d: %w", p.Pid, err)
		}
		zp.Brk = uint64(b)
	}
	if zp.PdeathSig != 0 {
		// CRIU restores it while CRIU is the parent, which then exits: the signal would
		// be delivered at once to the process restored from the durable copy.
		return ineligible("process %d has a parent-death signal set (prctl PR_SET_PDEATHSIG)", p.Pid)
	}
	return nil
}

// Kill ends the zygotes of r and removes their cgroups: every task in them dies (a
// provisional record names the cgroups only). Zygotes already gone are fine.
func Kill(r *Record) error {
	var errs []error
	for _, p := range r.Procs {
		if p.Cgroup == "" {
			continue
		}
		if err := KillCgroup(p.Cgroup); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// KillCgroup kills every task of a zygote's freezer cgroup and removes it.
func KillCgroup(dir string) error {
	if _, err := os.Stat(dir); os.IsNotExist(err) {
		return nil
	}
	for _, pid := range freezer.Procs(dir) {
		unix.Kill(pid, unix.SIGKILL)
	}
	// A frozen task dies only once thawed.
	freezer.Write(dir, freezer.Thawed)
	return removeCgroup(dir)
}

// removeCgroup removes an empty cgroup, waiting for a killed task to leave it.
func removeCgroup(dir string) error {
	var err error
	for i := 0; i < 400; i++ {
		if err = os.Remove(dir); err == nil || os.IsNotExist(err) {
			return nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("remove zygote cgroup %s: %w", dir, err)
}

// useVDSO tells a stopped tracee where its vDSO starts, found in the maps just read of
// it (ptrace.Tracee.SetVDSO), and returns that address; 0 if it is not there, when the
// tracee looks for it itself.
func useVDSO(p *ptrace.Tracee, ms []dirty.Mapping) uint64 {
	for _, m := range ms {
		if m.Path == "[vdso]" {
			if p.SetVDSO(m.Start) != nil {
				return 0
			}
			return m.Start
		}
	}
	return 0
}
