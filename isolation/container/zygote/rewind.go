package zygote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/dirty"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
)

// A rewind brings a sandbox's processes back to a resident checkpoint in place: they
// keep running as the same processes, and get back the checkpoint's memory (the pages
// they may have written since, copied from their zygotes), registers, floating-point
// state, program break, mappings, descriptors' offsets, flags and pipe contents. No
// process is killed, forked or reaped, and init is not told anything (its table holds
// the same processes). A rollback that can rewind costs the scan of the pages written
// and the copy of those, instead of a kill, a fork and the fixups of every process.
//
// A rewind needs the same processes as at the checkpoint, each tracked (Tracks) since
// its zygote was made, and nothing that a fork would reset and a rewind cannot: it is
// refused (NotRewound, nothing changed: the caller forks from the zygotes instead) if a
// process started or ended since, has threads, children, POSIX timers or pending
// signals, a descriptor that is not the same open file description as its zygote's
// (kcmp), a lock it did not hold then, or state /proc shows to differ from its
// zygote's: signal mask and dispositions, credentials, capabilities, seccomp, umask,
// limits, name, CPU affinity. Mappings may differ where the writable private memory
// is anonymous: ranges mapped since are unmapped, ranges unmapped since are mapped again
// and filled from the zygote, the heap is set back with brk; any other difference in
// the mappings (a file mapped or unmapped, protections changed) is refused. Interval
// timers are cleared (a process with one is not captured). Not restored, not checked:
// the alternate signal stack, the parent-death signal (not captured when set), and
// memory written behind the page tables' back (by a device, or through pages pinned
// for direct I/O before the checkpoint).

// NotRewound says why a rollback cannot bring the processes back in place. Nothing was
// changed: they run on as before.
type NotRewound struct{ Reason string }

func (e *NotRewound) Error() string { return "not rewound in place: " + e.Reason }

func notRewound(format string, args ...any) error {
	return &NotRewound{Reason: fmt.Sprintf(format, args...)}
}

// maxRewindCopy bounds the pages a rewind brings back. A rewind writes the zygote's
// content into the process's own pages, where a process forked from the zygote shares
// the zygote's: each page of the set is then held twice, once by the zygote and once by
// the process (and by the zygotes made of it later). A W2 search (rollbacks to far
// nodes, sets of up to 17 MB) reached 1.63 GiB in its sandbox with every rollback
// rewound, 0.44 GiB with none; a copy of ~8 MB costs about what the fork does.
const maxRewindCopy = 8 << 20

// RewindFault, if set (by tests), is called by every rewind once it has changed the
// processes' memory: its error makes the rewind fail there.
var RewindFault func() error

// RewindOptions are the options of Rewind.
type RewindOptions struct {
	// Live lists the sandbox's processes but init (and but the zygotes).
	Live func() ([]int, error)
	// Begin is called once every process is stopped and found fit, before anything is
	// changed: the caller starts its revert of the root there (it may run on beside the
	// copy). Its error aborts the rewind.
	Begin func() error
	// Reverted waits for the caller's revert, before the fixups, which need the
	// checkpoint's files. Its error aborts the rewind.
	Reverted func() error
	// Failed, if set, is called when the rewind fails once begun, with the processes
	// still stopped, before Rewind kills them (they are in no known state: none may
	// run an instruction of its own again).
	Failed func()
	// After, if set, is what the scan of the processes once they run again (later)
	// waits for: the caller's call returned. That scan re-protects every page the
	// rewind copied back, and it took a CPU from the rest of the caller's rollback.
	After <-chan struct{}
	// Phase, if set, is told how long each phase took ("lock", "live", "do" (the wait
	// for the tracer's thread), "stop", "check", "scan", "memory" (its steps
	// "memory_calls", "fixups_early", "memory_copy", summed over the processes),
	// "reverted", "fixups", "sets", "detach"; "refused_copy" when the rewind is refused
	// for the pages it would copy back).
	Phase func(name string, d time.Duration)
}

// Rewind brings the processes of a sandbox back to the checkpoint of r, in place. A
// *NotRewound error means that nothing was changed and Begin was not called. Any other
// error with begun set means that the processes were killed (SIGKILL while stopped, so
// that none ran half brought back), after Failed; their tracking is dropped.
func (ts *Tracks) Rewind(ctx context.Context, tr *ptrace.Tracer, r *Record, o RewindOptions) (begun bool, err error) {
	if ts == nil {
		return false, notRewound("the sandbox's writes are not tracked")
	}
	t0 := time.Now()
	ts.mu.Lock()
	defer ts.mu.Unlock()
	report(o.Phase, "lock", t0)
	t0 = time.Now()
	ts.gc()
	ks := make([]*track, len(r.Procs))
	var want []int
	for i, rp := range r.Procs {
		for _, k := range ts.procs {
			if _, ok := k.differ[rp.Zygote]; ok && k.nsPid == rp.NSPid {
				ks[i] = k
			}
		}
		if ks[i] == nil {
			return false, notRewound("process %d was not tracked since the checkpoint", rp.NSPid)
		}
		if rp.Regs == nil || len(rp.Xstate) == 0 || rp.Brk == 0 {
			return false, notRewound("the checkpoint's record predates rewinds")
		}
		want = append(want, ks[i].proc.Pid)
	}
	slices.Sort(want)
	// A rewind copies back at least the pages already known to differ that lie in the
	// zygotes' writable memory (finish): too many, and it is refused before any process
	// is stopped. (W2: a far rollback was refused only after its stop, check and scan.)
	if known := knownCopy(ts, ks, r); known > maxRewindCopy {
		report(o.Phase, "refused_copy", t0)
		return false, notRewound("at least %d MiB of pages to bring back, more than %d: a fork shares them with the zygotes instead", known>>20, maxRewindCopy>>20)
	}
	live, err := o.Live()
	if err != nil {
		return false, err
	}
	live = sorted(live)
	if !slices.Equal(live, want) {
		return false, notRewound("processes started or ended since the checkpoint")
	}
	report(o.Phase, "live", t0)
	t0 = time.Now()
	// ks in the order of live (stopAll's), with their records.
	order := make([]int, len(live))
	for i, pid := range live {
		for j, k := range ks {
			if k.proc.Pid == pid {
				order[i] = j
			}
		}
	}
	defer func() {
		if err != nil && begun {
			for _, k := range ks {
				ts.drop(k.proc.Pid)
			}
		}
	}()
	err = tr.Do(func() (err error) {
		report(o.Phase, "do", t0)
		t := time.Now()
		procs, stopped, err := stopAll(live)
		defer func() {
			t := time.Now()
			defer report(o.Phase, "detach", t)
			if begun && err != nil {
				if o.Failed != nil {
					o.Failed()
				}
				for _, p := range procs[:stopped] {
					p.Kill()
				}
				procs = procs[stopped:]
				stopped = 0
			}
			for i, p := range procs {
				if i >= stopped {
					tr.Forget(p)
					continue
				}
				p.Unpark()
				if err := p.Detach(); err != nil {
					tr.Forget(p)
				}
			}
		}()
		if err != nil {
			var in *Ineligible
			if errors.As(err, &in) {
				return notRewound("%s", in.Reason)
			}
			return err
		}
		if now, err := o.Live(); err != nil || !slices.Equal(sorted(now), live) {
			return notRewound("processes started or ended during the rollback")
		}
		report(o.Phase, "stop", t)
		t = time.Now()
		plans := make([]*plan, len(procs))
		for i, p := range procs {
			j := order[i]
			if plans[i], err = check(p, &r.Procs[j], ts.viewOf(r.Procs[j].Zygote), o.Phase); err != nil {
				return err
			}
			useVDSO(p, plans[i].maps)
		}
		// Parked, a process half brought back waits in pause(2) if cairn dies, instead
		// of running; the recovery's rollback kills it and forks from the zygotes. (The
		// check changes nothing: a crash before this point leaves them as they were.)
		for _, p := range procs {
			if err := p.Park(); err != nil {
				return err
			}
		}
		report(o.Phase, "check", t)
		// What each process wrote since its last scan goes into every set now: the
		// sets stay right whatever follows.
		t = time.Now()
		for i := range procs {
			k := ks[order[i]]
			d, err := k.t.ScanMaps(plans[i].maps)
			if err != nil {
				ts.drop(k.proc.Pid)
				return notRewound("process %d: its writes are no longer tracked: %v", k.nsPid, err)
			}
			k.add(d)
			plans[i].finish(k.differ[r.Procs[order[i]].Zygote])
		}
		report(o.Phase, "scan", t)
		var copying uint64
		for _, pl := range plans {
			copying += pl.copy.Bytes()
		}
		if copying > maxRewindCopy {
			report(o.Phase, "refused_copy", t)
			return notRewound("%d MiB of pages to bring back, more than %d: a fork shares them with the zygotes instead", copying>>20, maxRewindCopy>>20)
		}
		begun = true
		if err := o.Begin(); err != nil {
			return err
		}
		crashPoint("rewind-begun") // the root's revert runs beside
		t = time.Now()
		for i, p := range procs {
			if err := plans[i].apply(p, &r.Procs[order[i]], o.Phase); err != nil {
				return fmt.Errorf("process %d: %w", r.Procs[order[i]].NSPid, err)
			}
		}
		report(o.Phase, "memory", t)
		crashPoint("rewind-copied")
		if RewindFault != nil {
			if err := RewindFault(); err != nil {
				return err
			}
		}
		t = time.Now()
		if err := o.Reverted(); err != nil {
			return err
		}
		report(o.Phase, "reverted", t)
		t = time.Now()
		for i, p := range procs {
			rp := &r.Procs[order[i]]
			if err := fixLate(p, rp, plans[i].held); err != nil {
				return fmt.Errorf("process %d: %w", rp.NSPid, err)
			}
		}
		report(o.Phase, "fixups", t)
		crashPoint("rewind-fixed")
		// The process is its zygote again: that zygote's set starts empty, and what
		// the others' lacked of the pages it may have differed in is added to them.
		// The copies, the mappings made again and the scratch of the fixups are
		// scanned into every set once the processes run again (later).
		t = time.Now()
		for i := range procs {
			k, z := ks[order[i]], r.Procs[order[i]].Zygote
			old := k.differ[z]
			k.add(old)
			k.differ[z] = nil
		}
		report(o.Phase, "sets", t)
		return nil
	})
	if err == nil {
		ts.later(want, o.After)
	}
	return begun, err
}

// knownCopy is how much a rewind to r would copy back at least: the pages of each
// process's set for its zygote (as last scanned) in that zygote's writable private
// memory, for the zygotes whose view is read (ahead: preload). Callers hold ts.mu.
func knownCopy(ts *Tracks, ks []*track, r *Record) uint64 {
	var n uint64
	for i, rp := range r.Procs {
		if zv := ts.views[rp.Zygote]; zv != nil && zv.status != nil {
			n += ks[i].differ[rp.Zygote].Intersect(zv.writable).Bytes()
		}
	}
	return n
}

func sorted(pids []int) []int {
	pids = slices.Clone(pids)
	slices.Sort(pids)
	return pids
}

// plan is what a rewind does to one process.
type plan struct {
	zygote int
	// unmap are the process's writable private ranges mapped since the checkpoint
	// (its heap aside: brk sets it back); mmap the anonymous ones its zygote has and it
	// lacks, with their protections.
	unmap dirty.Set
	mmap  []protRange
	// writable are the zygote's writable private ranges, same those the process maps
	// identically, grown the heap pages the brk gives back.
	writable, same, grown dirty.Set
	// copy are the pages copied from the zygote (finish); scratch is one of them, mapped
	// in the process before the copy, for the arguments of injected calls.
	copy    dirty.Set
	scratch uint64
	// maps are the process's mappings as check read them (it is stopped), fdinfo its
	// descriptors' (fixEarly sets their offsets and flags back from them; a descriptor
	// the late fixups open again is read again).
	maps   []mapping
	fdinfo map[int]fdinfo
	// held are the POSIX locks the process holds (all of them held at the checkpoint:
	// check refuses one taken since); the fixups take again only the others.
	held []Lock
}

type protRange struct {
	dirty.Range
	prot int
}

// The status fields a fork copies and a rewind cannot set: they must be the zygote's.
var sameStatus = []string{"Umask", "SigBlk", "SigIgn", "SigCgt", "NoNewPrivs", "Seccomp",
	"Seccomp_filters", "Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd",
	"CapAmb", "Mems_allowed_list", "Speculation_Store_Bypass"}

// kcmpFile is KCMP_FILE (include/uapi/linux/kcmp.h).
const kcmpFile = 0

// check says whether the stopped process p can be brought back in place to rp, and
// how (its memory aside: finish completes the plan once the process is scanned).
func check(p *ptrace.Tracee, rp *Proc, zv *zygoteView, phase func(string, time.Duration)) (*plan, error) {
	t := time.Now()
	if !rp.Zygote.Alive() {
		return nil, notRewound("the zygote of process %d is gone", rp.NSPid)
	}
	ps, err := statusFields(p.Pid)
	if err != nil {
		return nil, err
	}
	switch {
	case ps["Threads"] != "1":
		return nil, notRewound("process %d has %s threads", rp.NSPid, ps["Threads"])
	case strings.Trim(ps["SigPnd"], "0") != "" || strings.Trim(ps["ShdPnd"], "0") != "":
		return nil, notRewound("process %d has pending signals", rp.NSPid)
	}
	if err := zv.load(rp.Zygote.Pid); err != nil {
		return nil, err
	}
	for _, f := range sameStatus {
		if ps[f] != zv.status[f] {
			return nil, notRewound("process %d: %s changed since the checkpoint (%s, was %s)", rp.NSPid, f, ps[f], zv.status[f])
		}
	}
	// The CPU affinity too, but the process's own: while traced it runs on the
	// tracer's CPU (ptrace's colocate), which /proc shows.
	if cpus, err := p.Affinity(); err != nil {
		return nil, err
	} else if cpus != zv.cpus {
		return nil, notRewound("process %d: its CPU affinity changed since the checkpoint", rp.NSPid)
	}
	for i, f := range viewFiles {
		a, err := procFile(p.Pid, f)
		if err != nil {
			return nil, err
		}
		if a != zv.files[i] {
			return nil, notRewound("process %d: its %s changed since the checkpoint", rp.NSPid, f)
		}
	}
	if kids, err := Children(p.Pid); err != nil {
		return nil, err
	} else if len(kids) > 0 {
		return nil, notRewound("process %d has child processes", rp.NSPid)
	}
	if b, err := os.ReadFile(procDir(p.Pid) + "/timers"); err == nil && len(strings.TrimSpace(string(b))) > 0 {
		return nil, notRewound("process %d has POSIX timers", rp.NSPid)
	}
	report(phase, "check_proc", t)
	t = time.Now()
	infos, held, err := sameFds(p.Pid, rp.Zygote.Pid, rp)
	if err != nil {
		return nil, err
	}
	report(phase, "check_fds", t)
	t = time.Now()
	defer report(phase, "check_maps", t)
	pl, err := planMaps(p.Pid, rp.Zygote.Pid, zv, rp)
	if pl != nil {
		pl.fdinfo, pl.held = infos, held
	}
	return pl, err
}

// zygoteView is what a rewind reads of a zygote: it never changes (the zygote is
// frozen), so it is read once.
type zygoteView struct {
	status map[string]string
	cpus   unix.CPUSet // its CPU affinity
	files  []string    // viewFiles
	maps   []mapping
	// writable is the zygote's writable private memory (what a rewind may copy back
	// into), of maps.
	writable dirty.Set
}

// viewFiles are the /proc files of a process a rewind compares with its zygote's.
var viewFiles = []string{"limits", "comm", "personality", "root"}

// load reads the zygote z's view, unless it has (its mappings, unless given).
func (zv *zygoteView) load(z int) error {
	if zv.status != nil {
		return nil
	}
	st, err := statusFields(z)
	if err != nil {
		return err
	}
	if err := unix.SchedGetaffinity(z, &zv.cpus); err != nil {
		return fmt.Errorf("CPU affinity of zygote %d: %w", z, err)
	}
	var files []string
	for _, f := range viewFiles {
		b, err := procFile(z, f)
		if err != nil {
			return err
		}
		files = append(files, b)
	}
	if zv.maps == nil {
		if zv.maps, err = readMaps(z); err != nil {
			return err
		}
	}
	zv.status, zv.files = st, files
	zv.writable = cover(zv.maps, mapping.WritablePrivate)
	return nil
}

// statusKeys are the fields of /proc/<pid>/status a rewind reads: sameStatus, and those
// check tests.
var statusKeys = func() map[string]bool {
	m := map[string]bool{"Threads": true, "SigPnd": true, "ShdPnd": true}
	for _, k := range sameStatus {
		m[k] = true
	}
	return m
}()

// statusFields reads the statusKeys of /proc/<pid>/status into a map.
func statusFields(pid int) (m map[string]string, err error) {
	m = make(map[string]string, len(statusKeys))
	err = readProc(procDir(pid)+"/status", func(b []byte) error {
		for len(b) > 0 {
			var l []byte
			l, b, _ = bytes.Cut(b, []byte{'\n'})
			if k, v, ok := bytes.Cut(l, []byte{':'}); ok && statusKeys[string(k)] {
				m[string(k)] = string(bytes.TrimSpace(v))
			}
		}
		return nil
	})
	return m, err
}

// procFile reads /proc/<pid>/<name> (a symbolic link's target for "root").
func procFile(pid int, name string) (s string, err error) {
	if name == "root" {
		return os.Readlink(procDir(pid) + "/root")
	}
	err = readProc(procDir(pid)+"/"+name, func(b []byte) error {
		s = string(b)
		return nil
	})
	return s, err
}

// sameFds checks that the process holds the descriptors it held at the checkpoint, each
// the same open file description as its zygote's (which shares them), and no lock it
// did not hold then. It returns what it read of each descriptor's fdinfo, and the locks
// the process holds.
func sameFds(pid, z int, rp *Proc) (map[int]fdinfo, []Lock, error) {
	ents, err := os.ReadDir(procDir(pid) + "/fd")
	if err != nil {
		return nil, nil, err
	}
	var have []int
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			have = append(have, n)
		}
	}
	slices.Sort(have)
	var had []int
	inoOf := map[int]uint64{}
	for _, fd := range rp.Fds {
		had = append(had, fd.Fd)
		inoOf[fd.Fd] = fd.Ino
	}
	if !slices.Equal(have, had) {
		return nil, nil, notRewound("process %d opened or closed descriptors since the checkpoint", rp.NSPid)
	}
	var fds []Fd
	infos := make(map[int]fdinfo, len(rp.Fds))
	for _, fd := range rp.Fds {
		r, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(pid), uintptr(z), kcmpFile, uintptr(fd.Fd), uintptr(fd.Fd), 0)
		if errno != 0 {
			return nil, nil, fmt.Errorf("kcmp descriptor %d of %d: %w", fd.Fd, pid, errno)
		}
		if r != 0 {
			return nil, nil, notRewound("process %d: descriptor %d was opened again since the checkpoint", rp.NSPid, fd.Fd)
		}
		fi, err := readFdinfo(pid, fd.Fd)
		if err != nil {
			return nil, nil, err
		}
		fds = append(fds, Fd{Fd: fd.Fd, locks: fi.locks})
		infos[fd.Fd] = fi
	}
	locks, err := locksOf(pid, fds)
	if err != nil {
		var in *Ineligible
		if errors.As(err, &in) {
			return nil, nil, notRewound("%s", in.Reason)
		}
		return nil, nil, err
	}
	key := func(l Lock) string { return fmt.Sprint(inoOf[l.Fd], l.Write, l.Start, l.Len) }
	held := map[string]bool{}
	for _, l := range rp.Locks {
		held[key(l)] = true
	}
	for _, l := range locks {
		if !held[key(l)] {
			return nil, nil, notRewound("process %d took a lock since the checkpoint", rp.NSPid)
		}
	}
	return infos, locks, nil
}

// mapping is one line of a maps file.
type mapping = dirty.Mapping

// key is what two mappings of an address must share to map it the same way: the
// protections, the file and the file's offset of the address (for a file).
func key(m mapping) string {
	k := m.Perms + " " + m.Dev + " " + strconv.FormatUint(m.Inode, 10) + " " + m.Path
	if m.Inode != 0 {
		k += " " + strconv.FormatInt(int64(m.Offset)-int64(m.Start), 10)
	}
	return k
}

// prot is a mapping's protection, as mmap takes it.
func prot(m mapping) int {
	p := 0
	if m.Perms[0] == 'r' {
		p |= unix.PROT_READ
	}
	if m.Perms[1] == 'w' {
		p |= unix.PROT_WRITE
	}
	if m.Perms[2] == 'x' {
		p |= unix.PROT_EXEC
	}
	return p
}

// readMaps parses /proc/<pid>/maps.
func readMaps(pid int) ([]mapping, error) {
	var ms []mapping
	err := readProc(procDir(pid)+"/maps", func(b []byte) (err error) {
		if ms, err = dirty.ParseMaps(b); err != nil {
			return fmt.Errorf("maps of %d: %w", pid, err)
		}
		return nil
	})
	return ms, err
}

// byKey groups mappings by key, as sets of addresses.
func byKey(ms []mapping) map[string]dirty.Set {
	out := map[string]dirty.Set{}
	for _, m := range ms {
		out[key(m)] = out[key(m)].Union(dirty.Set{m.Range})
	}
	return out
}

func cover(ms []mapping, f func(mapping) bool) dirty.Set {
	var s dirty.Set
	for _, m := range ms {
		if f(m) {
			s = s.Union(dirty.Set{m.Range})
		}
	}
	return s
}

// planMaps compares the process's mappings with its zygote's. What the process mapped
// since the checkpoint (a library loaded, memory allocated) is unmapped: the memory
// copied back no longer refers to it. What it unmapped since must be anonymous private
// memory, mapped again and filled from the zygote; the heap is set back with brk.
// Anything mapped differently at the same address (a protection changed, another file)
// is refused.
func planMaps(pid, z int, zv *zygoteView, rp *Proc) (*plan, error) {
	zm := zv.maps
	pm, err := readMaps(pid)
	if err != nil {
		return nil, err
	}
	all := func(mapping) bool { return true }
	pk, zk := byKey(pm), byKey(zm)
	var same dirty.Set
	for k, s := range zk {
		same = same.Union(s.Intersect(pk[k]))
	}
	heap := func(m mapping) bool { return m.Path == "[heap]" }
	pHeap, zHeap := cover(pm, heap), cover(zm, heap)
	if len(pHeap.Intersect(zHeap).Subtract(same)) > 0 {
		return nil, notRewound("process %d changed the protection of its heap", rp.NSPid)
	}
	pl := &plan{zygote: z, writable: zv.writable, maps: pm}
	pl.same = same.Intersect(pl.writable)
	pl.unmap = cover(pm, all).Subtract(same).Subtract(pHeap)
	pl.grown = zHeap.Subtract(pHeap)
	missing := cover(zm, all).Subtract(same).Subtract(zHeap)
	for _, m := range zm {
		for _, r := range missing.Intersect(dirty.Set{m.Range}) {
			if !m.WritablePrivate() || m.Inode != 0 || m.Path != "" {
				return nil, notRewound("process %d unmapped or changed %s since the checkpoint (%s %#x-%#x)",
					rp.NSPid, orAnon(m.Path), m.Perms, r.Start, r.End)
			}
			pl.mmap = append(pl.mmap, protRange{Range: r, prot: prot(m)})
		}
	}
	if len(pl.same) == 0 {
		return nil, notRewound("process %d has no writable memory in common with its zygote", rp.NSPid)
	}
	return pl, nil
}

// finish completes the plan with the pages that may differ (the process's set for the
// checkpoint, its last scan included): those of the zygote's writable memory, and
// every page of the ranges mapped again or grown.
func (pl *plan) finish(differ dirty.Set) {
	var again dirty.Set
	for _, m := range pl.mmap {
		again = again.Union(dirty.Set{m.Range})
	}
	pl.copy = differ.Union(again).Union(pl.grown).Intersect(pl.writable)
	// A page mapped the same way in both, written over by the copy: the scratch of the
	// injected calls before it.
	if in := pl.copy.Intersect(pl.same); len(in) > 0 {
		pl.scratch = in[0].Start
	} else {
		pl.scratch = pl.same[0].Start
		pl.copy = pl.copy.Union(dirty.Set{{Start: pl.scratch, End: pl.scratch + pageSize}})
	}
}

const pageSize = 4096

// apply carries the plan out in the stopped process p.
func (pl *plan) apply(p *ptrace.Tracee, rp *Proc, phase func(string, time.Duration)) error {
	t := time.Now()
	// Interval timers: none at the checkpoint (a process with one is not captured).
	var zero [32]byte
	if err := p.WriteMem(pl.scratch, zero[:]); err != nil {
		return err
	}
	for _, which := range []int{unix.ITIMER_REAL, unix.ITIMER_VIRTUAL, unix.ITIMER_PROF} {
		if _, err := p.Syscall(unix.SYS_SETITIMER, uintptr(which), uintptr(pl.scratch), 0); err != nil {
			return fmt.Errorf("setitimer: %w", err)
		}
	}
	for _, r := range pl.unmap {
		if _, err := p.Syscall(unix.SYS_MUNMAP, uintptr(r.Start), uintptr(r.End-r.Start)); err != nil {
			return fmt.Errorf("munmap %#x-%#x: %w", r.Start, r.End, err)
		}
	}
	if brk, err := p.Syscall(unix.SYS_BRK, uintptr(rp.Brk)); err != nil || uint64(brk) != rp.Brk {
		return fmt.Errorf("brk back to %#x: got %#x (%v)", rp.Brk, brk, err)
	}
	for _, r := range pl.mmap {
		addr, err := p.Syscall(unix.SYS_MMAP, uintptr(r.Start), uintptr(r.End-r.Start), uintptr(r.prot),
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED_NOREPLACE, ^uintptr(0), 0)
		if err != nil || uint64(addr) != r.Start {
			return fmt.Errorf("mmap %#x-%#x again: got %#x (%v)", r.Start, r.End, addr, err)
		}
	}
	report(phase, "memory_calls", t)
	// Before the copy: a call injected after it costs more (fixEarly).
	t = time.Now()
	if err := fixEarly(p, rp, pl.fdinfo); err != nil {
		return err
	}
	report(phase, "fixups_early", t)
	t = time.Now()
	read, err := copyPages(pl.zygote, p.Pid, pl.copy)
	if err != nil {
		return err
	}
	report(phase, "memory_copy", t)
	if phase != nil {
		phase("memory_copy_read", read)
	}
	p.SetRegs(*rp.Regs)
	if err := p.SetXstate(rp.Xstate); err != nil {
		return err
	}
	p.DropSignals()
	return nil
}

// copyBatch bounds the bytes and ranges copied per round of calls.
const (
	copyBatch  = 4 << 20
	copyRanges = 1024 // IOV_MAX
)

// copyPages makes the pages of s in process to hold what they hold in process from.
// The pages a process wrote since the checkpoint are its own copies already (a write to
// one costs no fault); those it did not write, but which the set holds (a superset), are
// shared with a zygote, and get a copy of their own.
//
// Reads go through /proc/<pid>/mem, not process_vm_readv: that one pins the pages it
// reads, and a pin of an anonymous page shared by a fork makes the kernel unshare it
// first (copy it into the process read), so that every page read from a zygote became
// a private copy of it. Comparing the process's pages with the zygote's before writing
// (to write only those that differ) cost more reading than the writes it saved. It
// returns the time spent reading.
func copyPages(from, to int, s dirty.Set) (read time.Duration, err error) {
	if len(s) == 0 {
		return 0, nil
	}
	mem, err := os.Open(procDir(from) + "/mem")
	if err != nil {
		return 0, fmt.Errorf("read the zygote's memory: %w", err)
	}
	defer mem.Close()
	buf, err := getCopyBuffer()
	if err != nil {
		return 0, fmt.Errorf("map a buffer for the copy: %w", err)
	}
	defer putCopyBuffer(buf)
	buf = buf[:min(int(s.Bytes()), copyBatch)]
	var local []unix.Iovec
	var remote []unix.RemoteIovec
	used := 0
	flush := func() error {
		if err := write(to, local, remote); err != nil {
			return err
		}
		local, remote, used = local[:0], remote[:0], 0
		return nil
	}
	for _, r := range s {
		for a := r.Start; a < r.End; {
			n := min(int(r.End-a), len(buf)-used)
			b := buf[used : used+n]
			t := time.Now()
			if _, err := mem.ReadAt(b, int64(a)); err != nil {
				return read, fmt.Errorf("read the zygote's memory at %#x: %w", a, err)
			}
			read += time.Since(t)
			local = append(local, unix.Iovec{Base: &b[0], Len: uint64(n)})
			remote = append(remote, unix.RemoteIovec{Base: uintptr(a), Len: n})
			used += n
			a += uint64(n)
			if used == len(buf) || len(remote) == copyRanges {
				if err := flush(); err != nil {
					return read, err
				}
			}
		}
	}
	return read, flush()
}

// write writes local's bytes to the ranges remote of process pid.
func write(pid int, local []unix.Iovec, remote []unix.RemoteIovec) error {
	if len(remote) == 0 {
		return nil
	}
	want := 0
	for _, r := range remote {
		want += r.Len
	}
	n, err := unix.ProcessVMWritev(pid, local, remote, 0)
	if err == nil && n != want {
		err = fmt.Errorf("short write (%d of %d bytes)", n, want)
	}
	if err != nil {
		return fmt.Errorf("write the process's memory: %w", err)
	}
	return nil
}
