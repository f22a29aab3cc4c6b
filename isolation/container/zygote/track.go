package zygote

import (
	"sync"

	"github.com/cairn-sandbox/cairn/internal/dirty"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
)

// Tracks follows the writes of one sandbox's processes (package dirty: userfaultfd
// write-protect and PAGEMAP_SCAN, no soft-dirty needed), so that a rollback to one of
// its resident checkpoints can bring the processes back in place (Rewind) instead of
// killing them and forking new ones from the zygotes.
//
// For each tracked process and each resident checkpoint whose zygote of it was made
// while it was tracked, it keeps the pages in which the process may differ from that
// zygote. Every scan of the process (at each checkpoint, at each rewind) adds the pages
// written since the last scan to every such set; a checkpoint starts its own set empty
// (the process and its new zygote are the same then); a rewind to a checkpoint copies
// that checkpoint's set back from the zygote, adds it to the others and empties it.
// The sets are supersets: a page in one may be equal to the zygote's, none outside it
// differs.
//
// A process forked from a zygote by a rollback (Spawn) is tracked from its birth: it is
// its zygote then, so its set for that zygote starts empty, and its set for any other
// zygote of the same process is the pages in which the two zygotes may differ. Those
// come from the captures: when a zygote is made, the process's set for each older
// zygote is the pages in which the new one may differ from that one (relate). So a
// rollback that forked does not end the rewinds: the next rollback, to any checkpoint
// of the process, can rewind the new process in place.
//
// Tracks live in cairn's memory only: a restarted cairn has none, and its rollbacks
// fork from the zygotes as before. The zero value is ready to use.
type Tracks struct {
	mu sync.Mutex
	// procs are the tracked processes, by host PID; protected by mu.
	procs map[int]*track
	// views are what rewinds read of the zygotes, by zygote; protected by mu.
	views map[isolation.Proc]*zygoteView
	// rel holds, for two zygotes of the same process, the pages in which they may
	// differ (the same set under both): rel[a][b] == rel[b][a]. Protected by mu.
	rel map[isolation.Proc]map[isolation.Proc]dirty.Set
}

// relate records that zygotes a and b may differ in the pages of s. Callers hold mu.
func (ts *Tracks) relate(a, b isolation.Proc, s dirty.Set) {
	if ts.rel == nil {
		ts.rel = map[isolation.Proc]map[isolation.Proc]dirty.Set{}
	}
	for _, x := range [2][2]isolation.Proc{{a, b}, {b, a}} {
		m := ts.rel[x[0]]
		if m == nil {
			m = map[isolation.Proc]dirty.Set{}
			ts.rel[x[0]] = m
		}
		m[x[1]] = s
	}
}

// viewOf returns the view of zygote z (empty until loaded). Callers hold mu.
func (ts *Tracks) viewOf(z isolation.Proc) *zygoteView {
	if ts.views == nil {
		ts.views = map[isolation.Proc]*zygoteView{}
	}
	v := ts.views[z]
	if v == nil {
		v = &zygoteView{}
		ts.views[z] = v
	}
	return v
}

// track is one tracked process.
type track struct {
	proc  isolation.Proc
	nsPid int
	t     *dirty.Tracker
	// differ holds, by zygote (of a checkpoint taken while tracked), the pages in which
	// the process may differ from it; under making, while a capture makes one, the set
	// of the zygote to come.
	differ map[isolation.Proc]dirty.Set
}

// making is the key of the set of the zygote a capture is making (no process is PID
// 0): started empty by before, moved to that zygote's own key by captured. A scan in
// between (a rewind's later scan, once the process runs again) adds to it as to every
// set.
var making = isolation.Proc{}

// Supported says whether this kernel can track writes (dirty.Supported).
func Supported() error { return dirty.Supported() }

// before is called during a capture with the processes stopped, before their zygotes
// are forked (zps, as scanned: their mappings read then still hold): it starts tracking
// each process, or scans what it wrote since its last scan into every set (now, while
// it is stopped, so that the new zygote's set starts empty: a scan after the checkpoint
// would put the pages written before it in the new set too, and a rewind there would
// copy them all again). A process that cannot be tracked is not (its rollbacks fork),
// and the capture goes on.
func (ts *Tracks) before(procs []*ptrace.Tracee, zps []*Proc) {
	if ts == nil {
		return
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.gc()
	for i, p := range procs {
		if k := ts.procs[p.Pid]; k != nil {
			d, err := k.t.ScanMaps(zps[i].maps)
			if err == nil {
				k.add(d)
				k.differ[making] = nil
				continue
			}
			ts.drop(p.Pid)
		}
		ts.register(p, zps[i].NSPid, map[isolation.Proc]dirty.Set{making: nil})
	}
}

// register starts tracking the stopped process p (nsPid in the sandbox) with the sets
// differ, unless it cannot be tracked. Callers hold mu, on the tracer's thread.
func (ts *Tracks) register(p *ptrace.Tracee, nsPid int, differ map[isolation.Proc]dirty.Set) {
	proc, err := isolation.ProcOf(p.Pid)
	if err != nil {
		return
	}
	t, err := dirty.Register(p)
	if err != nil {
		return
	}
	if ts.procs == nil {
		ts.procs = map[int]*track{}
	}
	ts.procs[p.Pid] = &track{proc: proc, nsPid: nsPid, t: t, differ: differ}
}

// captured gives the zygotes just made (those of rec, of the processes pids: host
// PIDs, in the order of rec.Procs) the sets before started: what the processes wrote
// since they were scanned, stopped, before the zygotes were forked.
func (ts *Tracks) captured(rec *Record, pids []int) {
	if ts == nil {
		return
	}
	warmCopyBuffer()
	ts.mu.Lock()
	defer ts.mu.Unlock()
	var zs []Proc
	for i, pid := range pids {
		if k := ts.procs[pid]; k != nil && i < len(rec.Procs) {
			next, ok := k.differ[making]
			if !ok {
				continue
			}
			// The new zygote is the process as before scanned it: it may differ from
			// each older zygote where the process did then (or since: a superset).
			z := rec.Procs[i].Zygote
			for old, s := range k.differ {
				if old != making {
					ts.relate(z, old, s)
				}
			}
			k.differ[z] = next
			delete(k.differ, making)
			zs = append(zs, rec.Procs[i])
		}
	}
	go ts.preload(zs)
}

// preload makes the views of the zygotes of ps (they never change) off the critical
// path of a later rewind to them, which would otherwise read them first (~1 ms for a
// Python REPL's status and mappings; W1 rewinds to a zygote once or twice, most of them
// to one not seen before). Their mappings are those the capture read.
func (ts *Tracks) preload(ps []Proc) {
	for _, p := range ps {
		z := p.Zygote
		zv := zygoteView{maps: p.zygoteMaps}
		if err := zv.load(z.Pid); err != nil || !z.Alive() {
			continue // a rewind reads it (and finds what is wrong) itself
		}
		ts.mu.Lock()
		if v := ts.views[z]; v == nil || v.status == nil {
			if ts.views == nil {
				ts.views = map[isolation.Proc]*zygoteView{}
			}
			ts.views[z] = &zv
		}
		ts.mu.Unlock()
	}
}

// spawned starts tracking c, a process just forked by Spawn from the zygote of p (c is
// stopped, and has not run an instruction of its own: its memory is the zygote's). Its
// set for that zygote starts empty; for every other zygote of the process, it is the
// pages in which the two zygotes may differ. A process that cannot be tracked is not
// (its rollbacks fork), and the spawn goes on.
//
// Preconditions: called on the tracer's thread.
func (ts *Tracks) spawned(c *ptrace.Tracee, p *Proc) {
	if ts == nil {
		return
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.drop(c.Pid) // a process of that PID before, gone
	differ := map[isolation.Proc]dirty.Set{p.Zygote: nil}
	for z, s := range ts.rel[p.Zygote] {
		differ[z] = s
	}
	ts.register(c, p.NSPid, differ)
}

// later scans the processes pids into every set, on a goroutine of its own (a scan
// needs no process stopped: a page written while it runs is found by it or by the next),
// once after is closed (if not nil). A rewind or a checkpoint that takes the lock first
// scans them itself. Callers hold mu.
func (ts *Tracks) later(pids []int, after <-chan struct{}) {
	go func() {
		if after != nil {
			<-after
		}
		ts.mu.Lock()
		defer ts.mu.Unlock()
		if laterScans != nil {
			laterScans(pids)
		}
		for _, pid := range pids {
			if k := ts.procs[pid]; k != nil {
				if err := k.scan(); err != nil {
					ts.drop(pid)
				}
			}
		}
	}()
}

// laterScans, if set (by tests), is told of each later scan as it begins.
var laterScans func(pids []int)

// scan adds what the process wrote since the last scan to every set.
func (k *track) scan() error {
	d, err := k.t.Scan()
	if err != nil {
		return err
	}
	k.add(d)
	return nil
}

// add adds d to every set.
func (k *track) add(d dirty.Set) {
	if len(d) == 0 {
		return
	}
	for z, s := range k.differ {
		k.differ[z] = s.Union(d)
	}
}

// Forget drops the sets of the zygotes of rec (they are ending), and of any other
// zygote gone.
func (ts *Tracks) Forget(rec *Record) {
	if ts == nil {
		return
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	gone := map[isolation.Proc]bool{}
	for _, p := range rec.Procs {
		if p.Zygote != making { // a provisional record names none
			gone[p.Zygote] = true
		}
	}
	for z := range ts.views {
		if gone[z] || !z.Alive() {
			gone[z] = true
			delete(ts.views, z)
		}
	}
	for z := range ts.rel {
		if gone[z] || !z.Alive() {
			gone[z] = true
		}
	}
	for z, m := range ts.rel {
		if gone[z] {
			delete(ts.rel, z)
			continue
		}
		for o := range m {
			if gone[o] {
				delete(m, o)
			}
		}
	}
	for _, k := range ts.procs {
		for z := range k.differ {
			if gone[z] {
				delete(k.differ, z)
			}
		}
	}
}

// Close stops tracking every process (the sandbox is ending).
func (ts *Tracks) Close() {
	if ts == nil {
		return
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for pid := range ts.procs {
		ts.drop(pid)
	}
}

// gc stops tracking processes that are gone (the sets of zygotes gone are dropped by
// Forget: checking each zygote here would cost a /proc read apiece). Callers hold mu.
func (ts *Tracks) gc() {
	for pid, k := range ts.procs {
		if !k.proc.Alive() {
			ts.drop(pid)
		}
	}
}

// drop stops tracking pid. Callers hold mu.
func (ts *Tracks) drop(pid int) {
	if k := ts.procs[pid]; k != nil {
		k.t.Close()
		delete(ts.procs, pid)
	}
}
