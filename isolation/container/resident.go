package container

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/internal/phase"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/freezer"
	"github.com/cairn-sandbox/cairn/isolation/container/zygote"
)

// Resident checkpoints (package zygote): the backend's side. Each zygote sits alone in
// a freezer cgroup under freezer/cairn-zygotes/<sandbox cgroup>/<checkpoint dir>/<pid>;
// the sandbox's own freezer cgroup never holds one, so killing "every process of the
// sandbox" for a rollback spares them, and they stay frozen whatever is signalled
// inside. A rollback's new processes are held in the frozen cgroup ".../spawn" until
// init has learnt them again, then moved into the sandbox's.

// residents is the backend's state for zygotes.
type residents struct {
	tracer *ptrace.Tracer
	mu     sync.Mutex
	// busy holds the locks of each checkpoint directory; protected by mu.
	busy map[string]*dirLocks
	// lastPid holds the ns_last_pid helper of each sandbox, by init; protected by mu.
	lastPid map[isolation.Proc]*lastPidHelper
	// watched are the sandboxes with zygotes, by cgroup name, and their inits; watching
	// says whether the watchdog runs. Both protected by mu.
	watched  map[string]isolation.Proc
	watching bool
	// tracks follow the writes of each sandbox's processes for rewinds in place, by
	// init; protected by mu.
	tracks map[isolation.Proc]*zygote.Tracks
	// records are the zygote records last read by readRecord, by their file's device
	// and inode (the same file once its checkpoint's directory is renamed into place);
	// protected by mu.
	records map[recordKey]cachedRecord
}

type recordKey struct{ dev, ino uint64 }

// cachedRecord is a zygote record as read from a file of that change time and size (a
// record is replaced by a rename, never rewritten in place).
type cachedRecord struct {
	ctime unix.Timespec
	size  int64
	rec   *zygote.Record
}

// maxCachedRecords bounds readRecord's cache (it is emptied when full).
const maxCachedRecords = 64

// readRecord is zygote.Read for readers that do not change the record: a record read
// before is returned again while its file is the same. A rollback read it twice
// (IsResident, then RollbackResident), ~0.2 ms each for W1's (registers, extended state,
// descriptors and mappings of each process, in JSON); each checkpoint's is read once
// beside it (cacheRecord), so that its first rollback finds it read.
func (r *residents) readRecord(dir string) (*zygote.Record, bool, error) {
	path := filepath.Join(dir, zygote.RecordFile)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err == nil {
		if rec := r.cached(&st); rec != nil {
			return rec, true, nil
		}
	}
	f, err := os.Open(path)
	if err != nil {
		return zygote.Read(dir) // its error, or its absence, as Read tells them
	}
	defer f.Close()
	rec, err := r.load(f)
	if err != nil {
		return nil, false, fmt.Errorf("zygote record %s: %w", dir, err)
	}
	return rec, true, nil
}

// recordReads counts the records read from their files into the cache (for tests).
var recordReads atomic.Int64

// cached is the record read before from a file of status st, or nil.
func (r *residents) cached(st *unix.Stat_t) *zygote.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.records[recordKey{dev: st.Dev, ino: st.Ino}]
	if !ok || c.ctime != st.Ctim || c.size != st.Size {
		return nil
	}
	return c.rec
}

// load returns the record of the open file f, read and kept in the cache unless it is
// there already.
func (r *residents) load(f *os.File) (*zygote.Record, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, err
	}
	if rec := r.cached(&st); rec != nil {
		return rec, nil
	}
	recordReads.Add(1)
	b, err := io.ReadAll(f)
	if err != nil {
		return nil, err
	}
	rec, err := zygote.Decode(b)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.records == nil || len(r.records) >= maxCachedRecords {
		r.records = map[recordKey]cachedRecord{}
	}
	r.records[recordKey{dev: st.Dev, ino: st.Ino}] = cachedRecord{ctime: st.Ctim, size: st.Size, rec: rec}
	return rec, nil
}

// cacheRecord reads the record of dir into readRecord's cache on another goroutine, and
// returns a channel closed once it is done. The file is opened now, while dir is still
// the staged directory the checkpoint renames into place as it ends: a read by its path
// from another goroutine (until 2026-12-06) ran after that rename one time in two and
// found nothing, and W1's first rollback to the checkpoint then read and parsed the
// record on its critical path (0.17-0.39 ms).
func (r *residents) cacheRecord(dir string) <-chan struct{} {
	done := make(chan struct{})
	f, err := os.Open(filepath.Join(dir, zygote.RecordFile))
	if err != nil {
		close(done)
		return done
	}
	go func() {
		defer close(done)
		defer f.Close()
		r.load(f)
	}()
	return done
}

// rewinds says whether this kernel can track writes for rewinds in place.
var rewinds = sync.OnceValue(zygote.Supported)

// tracksOf returns the tracks of sb's processes (made if missing and make is set),
// nil if the kernel cannot track writes.
func (r *residents) tracksOf(sb *isolation.Sandbox, make bool) *zygote.Tracks {
	if rewinds() != nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	ts := r.tracks[sb.Init]
	if ts == nil && make {
		if r.tracks == nil {
			r.tracks = map[isolation.Proc]*zygote.Tracks{}
		}
		ts = &zygote.Tracks{}
		r.tracks[sb.Init] = ts
	}
	return ts
}

// tracks is r.tracksOf for the backend: nil if it does not rewind.
func (b *Backend) tracks(sb *isolation.Sandbox, make bool) *zygote.Tracks {
	if b.NoRewinds {
		return nil
	}
	return b.res.tracksOf(sb, make)
}

// untrack stops following the writes of the processes of the sandbox of init: before
// CRIU dumps them (their memory registered with cairn's userfaultfd is not what CRIU
// expects of a process), and once init is gone.
func (r *residents) untrack(init isolation.Proc) {
	r.mu.Lock()
	ts := r.tracks[init]
	delete(r.tracks, init)
	r.mu.Unlock()
	ts.Close()
}

// untrackAll stops following the writes of every sandbox's processes.
func (r *residents) untrackAll() {
	r.mu.Lock()
	all := r.tracks
	r.tracks = nil
	r.mu.Unlock()
	for _, ts := range all {
		ts.Close()
	}
}

// forget drops every sandbox's sets for the zygotes of rec.
func (r *residents) forget(rec *zygote.Record) {
	r.mu.Lock()
	all := make([]*zygote.Tracks, 0, len(r.tracks))
	for _, ts := range r.tracks {
		all = append(all, ts)
	}
	r.mu.Unlock()
	for _, ts := range all {
		ts.Forget(rec)
	}
}

// A dying init waits for every process of its pid namespace to die, frozen zygotes
// too, which cannot die while frozen: a sandbox whose init was killed behind cairn's
// back would hang there. The watchdog ends the zygotes of such a sandbox.
const watchEvery = 250 * time.Millisecond

// watch makes the watchdog look after the zygotes of sb.
func (r *residents) watch(sb *isolation.Sandbox) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.watched == nil {
		r.watched = map[string]isolation.Proc{}
	}
	r.watched[sb.CgroupName()] = sb.Init
	if !r.watching {
		r.watching = true
		go r.watchdog()
	}
}

func (r *residents) watchdog() {
	for {
		time.Sleep(watchEvery)
		r.mu.Lock()
		if len(r.watched) == 0 {
			r.watching = false
			r.mu.Unlock()
			return
		}
		var dead []string
		for cg, init := range r.watched {
			if initDying(init) {
				dead = append(dead, cg)
				delete(r.watched, cg)
			}
		}
		r.mu.Unlock()
		for _, cg := range dead {
			dropAllZygotes(cg)
		}
	}
}

// initDying reports whether init has exited or is exiting (PF_EXITING).
func initDying(init isolation.Proc) bool {
	f, alive := init.Stat()
	return !alive || exiting(f)
}

// exiting reports whether a live process's stat fields (isolation.Proc.Stat) show it
// exiting (PF_EXITING in its flags, field 6).
func exiting(f []string) bool {
	flags, _ := strconv.ParseUint(f[6], 10, 64)
	const pfExiting = 0x4
	return flags&pfExiting != 0
}

// dirLocks are the locks of a checkpoint directory. excl: a durable dump of its
// zygotes, their end, and a rollback that forks them take turns (dirLock). use: rewinds
// in place, which only read the zygotes (their memory, their descriptors), share them,
// even with a dump under way (dirUse); their end waits for the rewinds (dirDrop).
type dirLocks struct {
	excl sync.Mutex
	use  sync.RWMutex
}

// locksOf returns dir's locks.
func (r *residents) locksOf(dir string) *dirLocks {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.busy == nil {
		r.busy = map[string]*dirLocks{}
	}
	l := r.busy[dir]
	if l == nil {
		l = &dirLocks{}
		r.busy[dir] = l
	}
	return l
}

// dirLock takes a checkpoint directory's lock: in this process, and across processes
// sharing the data directory (an flock on the directory: a second engine's recovery
// must not dump zygotes this one is dumping).
func (r *residents) dirLock(dir string) func() {
	l := r.locksOf(dir)
	l.excl.Lock()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err == nil {
		for unix.Flock(fd, unix.LOCK_EX) == unix.EINTR {
		}
	}
	return func() {
		if err == nil {
			unix.Close(fd)
		}
		l.excl.Unlock()
	}
}

// dirUse holds a checkpoint directory's zygotes for a rewind in place: they are not
// ended (dirDrop) until it is released. Rewinds are this engine's own (its tracks), so
// the lock is in this process only.
func (r *residents) dirUse(dir string) func() {
	l := r.locksOf(dir)
	l.use.RLock()
	return l.use.RUnlock
}

// dirDrop takes a checkpoint directory's lock (dirLock), and waits for the rewinds
// using its zygotes, to end them.
func (r *residents) dirDrop(dir string) func() {
	unlock := r.dirLock(dir)
	l := r.locksOf(dir)
	l.use.Lock()
	return func() {
		l.use.Unlock()
		unlock()
	}
}

func (r *residents) tr() *ptrace.Tracer {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.tracer == nil {
		r.tracer = ptrace.NewTracer()
	}
	return r.tracer
}

// zygoteRoot is the freezer cgroup directory of a sandbox's zygotes.
func zygoteRoot(cgroup string) string {
	return filepath.Join(cgroupRoot, "freezer", "cairn-zygotes", cgroup)
}

// CheckpointResident implements isolation.Resident.
func (b *Backend) CheckpointResident(ctx context.Context, sb *isolation.Sandbox, dir string, hooks isolation.Hooks) error {
	if !b.Running(sb) {
		return errdefs.FailedPrecondition("sandbox %s is not running", sb.ID)
	}
	if err := criu.InsideAvailable(); err != nil {
		// Without CRIU inside the sandbox, the zygotes could never be made durable.
		return fmt.Errorf("%w: %v", isolation.ErrNotResident, err)
	}
	// A durable copy of an earlier checkpoint (CRIU inside, at nice 19) is held meanwhile:
	// on two cores its CPU and writes stretched the tail of the checkpoints it overlapped
	// (W1, A/B in one build: p99 22.5-26.5 ms running, 15.2-19.4 held).
	// Asked to freeze, not waited for: the capture only needs it off the CPUs.
	t := time.Now()
	release, _ := holdCRIUSoon(sb.CgroupName())
	defer release()
	hooks.Report("hold_criu", t)
	_, err := zygote.Capture(ctx, b.res.tr(), zygote.CaptureOptions{
		Init: sb.Init,
		Procs: func() ([]int, error) {
			return slices.DeleteFunc(cgroupPids(sb.CgroupName()), func(p int) bool { return p == sb.Init.Pid }), nil
		},
		CgroupDir: filepath.Join(zygoteRoot(sb.CgroupName()), filepath.Base(dir)),
		RecordDir: dir,
		Frozen: func() error {
			if hooks.Frozen == nil {
				return nil
			}
			return hooks.Frozen(ctx)
		},
		Phase:  hooks.Phase,
		Tracks: b.tracks(sb, true),
	})
	var in *zygote.Ineligible
	if errors.As(err, &in) {
		return fmt.Errorf("%w: %s", isolation.ErrNotResident, in.Reason)
	}
	if err != nil {
		os.Remove(filepath.Join(dir, zygote.RecordFile))
		return err
	}
	b.res.watch(sb)
	// Read once beside the checkpoint's end, for its first rollback.
	b.res.cacheRecord(dir)
	return nil
}

var _ isolation.Resident = (*Backend)(nil)

// residentRecord reads the zygote record in dir (through readRecord if cached: the
// caller does not change it), and checks that its zygotes live and are of sb's
// generation.
func (r *residents) residentRecord(sb *isolation.Sandbox, dir string, cached bool) (*zygote.Record, error) {
	read := zygote.Read
	if cached {
		read = r.readRecord
	}
	rec, ok, err := read(dir)
	if err != nil {
		return nil, err
	}
	if !ok || rec.Init != sb.Init || !rec.Alive() {
		return nil, fmt.Errorf("%w: the checkpoint's zygotes are gone or belong to another generation of %s", isolation.ErrNotResident, sb.ID)
	}
	return rec, nil
}

// IsResident implements isolation.Resident.
func (b *Backend) IsResident(sb *isolation.Sandbox, dir string) bool {
	_, err := b.res.residentRecord(sb, dir, true)
	return err == nil
}

// DropResident implements isolation.Resident.
func (b *Backend) DropResident(dir string) error {
	defer b.res.dirDrop(dir)()
	rec, ok, err := zygote.Read(dir)
	if err != nil || !ok {
		return err
	}
	b.res.forget(rec)
	return zygote.Kill(rec)
}

// RollbackResident implements isolation.Resident.
//
// A rewind in place only reads the zygotes: it shares them (dirUse) with a durable copy
// dumping them, which holds the directory's lock for ~100 ms (W1: 1 rollback in 20
// waited for one, the rollbacks' p99), and asks the background CRIU to freeze without
// waiting for it. The forks take the directory's lock, then hold CRIU until it is
// frozen: they set the namespace's next PID. (CRIU is let go before the lock is waited
// for: it may be the dump that holds it.)
func (b *Backend) RollbackResident(ctx context.Context, sb *isolation.Sandbox, dir string, hooks isolation.RollbackHooks) error {
	t := time.Now()
	unuse := b.res.dirUse(dir)
	rec, err := b.res.residentRecord(sb, dir, true)
	if err != nil {
		unuse()
		return err
	}
	phase.Since(ctx, "record", t)
	adoptStrays(rec, sb)
	t = time.Now()
	release, _ := holdCRIUSoon(sb.CgroupName())
	phase.Since(ctx, "hold_criu", t)
	done, hooks, err := b.rewind(ctx, sb, rec, hooks)
	release()
	unuse()
	if done {
		return err
	}
	t = time.Now()
	defer b.res.dirLock(dir)()
	if rec, err = b.res.residentRecord(sb, dir, false); err != nil {
		return err
	}
	helper, err := b.res.helper(sb.Init)
	if err != nil {
		return fmt.Errorf("%w: %v", isolation.ErrNotResident, err)
	}
	phase.Since(ctx, "fork_lock", t)
	release, err = holdCRIUPhase(ctx, sb)
	if err != nil {
		return err
	}
	defer release()
	asQuiesced, err := killPhase(ctx, sb, hooks.Quiesced)
	if err != nil {
		return err
	}
	// The root is reverted on another thread from here on, the longest part of a
	// rollback: it may begin once the processes are reaped (init has written their exit
	// records) and CRIU is held, as nothing else writes there until the reload, and it
	// goes on while init is frozen and the zygotes fork (a fork copies memory and
	// descriptors, not files; the fixups after it need the checkpoint's files).
	waitRevert := startRevert(ctx, sb, hooks, asQuiesced)
	// Their PIDs must be free before init is frozen: a zombie child of init holding one
	// is reaped only while init runs. A PID still taken is the spawn's to wait for, or
	// to fail on.
	t = time.Now()
	if err := rec.WaitPids(pidsWait); err != nil && b.Logf != nil {
		b.Logf("rollback of sandbox %s: %v", sb.ID, err)
	}
	phase.Since(ctx, "pids_free", t)
	// Init is frozen while the processes are forked: its Go runtime starts threads
	// whenever it likes, and each takes the next PID of the namespace.
	t = time.Now()
	if err := freeze(sb.CgroupName()); err != nil {
		waitRevert() // the caller's fallback reverts again, not beside this one
		return err
	}
	phase.Since(ctx, "freeze_init", t)
	// Once every process is forked, init runs again (its threads may take PIDs now)
	// and learns them, beside the fixups; they are still held frozen in their zygotes'
	// cgroups, and init must know them before they run: one that exited at once would
	// otherwise be reaped unknown, its exit unrecorded.
	var reloaded chan error // init's reload, once started
	forked := func() error {
		if err := waitRevert(); err != nil {
			return err
		}
		t := time.Now()
		if err := thaw(sb.CgroupName()); err != nil {
			return err
		}
		phase.Since(ctx, "thaw_init", t)
		reloaded = make(chan error, 1)
		go func() {
			t := time.Now()
			err := b.reload(ctx, sb)
			phase.Since(ctx, "reload", t)
			reloaded <- err
		}()
		return nil
	}
	t = time.Now()
	reap := func(done func() bool) error {
		if err := thaw(sb.CgroupName()); err != nil {
			return err
		}
		for deadline := time.Now().Add(reapWait); !done() && time.Now().Before(deadline); {
			time.Sleep(100 * time.Microsecond)
		}
		return freeze(sb.CgroupName())
	}
	pids, err := zygote.Spawn(ctx, b.res.tr(), rec, zygote.SpawnOptions{SetLastPid: helper.set, Reverted: forked,
		Reap: reap, Logf: b.Logf, Phase: prefixed(ctx, "spawn_"), Tracks: b.tracks(sb, true)})
	if rerr := waitRevert(); err == nil {
		err = rerr
	}
	if reloaded != nil {
		if rerr := <-reloaded; err == nil {
			err = rerr
		}
	}
	phase.Since(ctx, "spawn", t)
	release()
	if reloaded == nil {
		// The spawn failed before its processes were all forked: init is still frozen.
		if terr := thaw(sb.CgroupName()); err == nil {
			err = terr
		}
	}
	if err != nil {
		zygote.Discard(pids)
		return err
	}
	t = time.Now()
	defer phase.Since(ctx, "release", t)
	return zygote.Release(pids, filepath.Join(ctrlDir("freezer", sb.CgroupName()), "cgroup.procs"))
}

// pidsWait bounds how long a rollback waits for its processes' PIDs to be free before
// it freezes init; reapWait how long init runs again, in the middle of the spawn, to
// reap a zombie holding one.
const (
	pidsWait = 200 * time.Millisecond
	reapWait = 100 * time.Millisecond
)

// rewind tries to bring sb's processes back to the checkpoint of rec in place
// (zygote.Tracks.Rewind); the caller holds sb's CRIU. done says that it did, or failed with err. Otherwise the
// caller kills and forks as usual, with the hooks returned: hooks itself if the rewind
// changed nothing; if it failed once begun (its processes are then dead, killed before
// they could run), hooks that do not revert the root again when it holds the
// checkpoint's files (the revert ran, and the exit records the kill left were undone).
func (b *Backend) rewind(ctx context.Context, sb *isolation.Sandbox, rec *zygote.Record, hooks isolation.RollbackHooks) (done bool, next isolation.RollbackHooks, err error) {
	ts := b.tracks(sb, false)
	if ts == nil {
		return false, hooks, nil
	}
	t := time.Now()
	var waitRevert func() error // set once the revert started
	var marks *records
	var live []int // the processes last listed: those a failed rewind killed
	begun, err := ts.Rewind(ctx, b.res.tr(), rec, zygote.RewindOptions{
		Live: func() ([]int, error) {
			live = slices.DeleteFunc(cgroupPids(sb.CgroupName()), func(p int) bool { return p == sb.Init.Pid })
			return live, nil
		},
		Begin: func() error {
			// The processes are stopped, init writes nothing (the caller holds the
			// sandbox), CRIU is held: the root is quiesced, and stays so until the
			// revert, as nothing is killed.
			asQuiesced := hooks.Quiesced != nil
			if asQuiesced {
				hooks.Quiesced(ctx)
			}
			waitRevert = startRevert(ctx, sb, hooks, asQuiesced)
			return nil
		},
		Reverted: func() error { return waitRevert() },
		Failed: func() {
			// Once the revert is done, the root's records are noted, so that the exit
			// records of the kill that follows can be undone.
			if waitRevert != nil && waitRevert() == nil {
				marks, _ = markRecords(sb.Root)
			}
		},
		After: hooks.Returned,
		Phase: prefixed(ctx, "rewind_"),
	})
	var rerr error
	if waitRevert != nil {
		rerr = waitRevert()
		if err == nil {
			err = rerr
		}
	}
	if !begun {
		// Nothing was changed (a NotRewound says why; any other error came before a
		// change too): the processes are killed and forked instead.
		phase.Since(ctx, "rewind_refused", t)
		return false, hooks, nil
	}
	if err == nil {
		phase.Since(ctx, "rewound", t)
		return true, hooks, nil
	}
	// Failed once begun: its processes were killed. The rollback forks from the
	// zygotes instead, in the same generation, so that no other checkpoint loses its
	// zygotes.
	phase.Since(ctx, "rewind_failed", t)
	if b.Logf != nil {
		b.Logf("rewind of sandbox %s failed, forking from its zygotes instead: %v", sb.ID, err)
	}
	// Dead, they left the cgroup: their PIDs are free once init has reaped them.
	if kerr := killAllButInit(ctx, sb, live...); kerr != nil {
		if marks != nil {
			marks.close()
		}
		return true, hooks, errors.Join(err, kerr)
	}
	clean := marks != nil && marks.undo() && rerr == nil
	next = isolation.RollbackHooks{Revert: func(ctx context.Context, _ bool) error {
		if clean {
			return nil // the root holds the checkpoint's files already
		}
		return hooks.Revert(ctx, false)
	}}
	return false, next, nil
}

// startRevert starts hooks.Revert on another goroutine and returns what waits for its
// end (as often as called).
func startRevert(ctx context.Context, sb *isolation.Sandbox, hooks isolation.RollbackHooks, asQuiesced bool) func() error {
	reverted := make(chan error, 1)
	go func() {
		err := hooks.Revert(ctx, asQuiesced)
		if err != nil {
			err = fmt.Errorf("revert the root of %s: %w", sb.ID, err)
		}
		reverted <- err
	}()
	return sync.OnceValue(func() error { return <-reverted })
}

// reload makes sb's init learn its processes again from its root (/.cairn/proc).
func (b *Backend) reload(ctx context.Context, sb *isolation.Sandbox) error {
	resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpReload})
	if err != nil {
		return err
	}
	return resp.Err(sb.ID, "reload processes")
}

// killAndRevert begins a rollback in place by images: holdAndKill, then the revert of
// its root.
func killAndRevert(ctx context.Context, sb *isolation.Sandbox, hooks isolation.RollbackHooks) (release func(), err error) {
	release, asQuiesced, err := holdAndKill(ctx, sb, hooks.Quiesced)
	if err != nil {
		return nil, err
	}
	if err := hooks.Revert(ctx, asQuiesced); err != nil {
		release()
		return nil, fmt.Errorf("revert the root of %s: %w", sb.ID, err)
	}
	return release, nil
}

// holdAndKill begins a rollback in place: it holds the sandbox's background CRIU (a
// durable copy, dumping a zygote from inside, writes in the root and starts processes
// in the namespace, which could take a PID to give back) until release, so that what
// quiesced sees of the root stays, then kills every process of sb but init (quietKill:
// init records each death before it reaps the process, and once their PIDs are gone
// nothing more is written for them). asQuiesced is quietKill's.
func holdAndKill(ctx context.Context, sb *isolation.Sandbox, quiesced func(context.Context)) (release func(), asQuiesced bool, err error) {
	if release, err = holdCRIUPhase(ctx, sb); err != nil {
		return nil, false, err
	}
	if asQuiesced, err = killPhase(ctx, sb, quiesced); err != nil {
		release()
		return nil, false, err
	}
	return release, asQuiesced, nil
}

// holdCRIUPhase is holdCRIU, reported as the phase "hold_criu".
func holdCRIUPhase(ctx context.Context, sb *isolation.Sandbox) (release func(), err error) {
	defer phase.Since(ctx, "hold_criu", time.Now())
	return holdCRIU(sb.CgroupName())
}

// killPhase is quietKill, reported as the phase "kill".
func killPhase(ctx context.Context, sb *isolation.Sandbox, quiesced func(context.Context)) (asQuiesced bool, err error) {
	defer phase.Since(ctx, "kill", time.Now())
	return quietKill(ctx, sb, quiesced)
}

// adoptStrays moves into the sandbox's freezer cgroup the strays of rec's zygotes
// (processes a rollback forked and never released, because cairn died in the middle of
// it). There they are the sandbox's processes, which the rollback kills.
func adoptStrays(rec *zygote.Record, sb *isolation.Sandbox) {
	procs := filepath.Join(ctrlDir("freezer", sb.CgroupName()), "cgroup.procs")
	for _, pid := range rec.Strays() {
		os.WriteFile(procs, []byte(strconv.Itoa(pid)), 0)
	}
}

// killAllButInit kills every process of the sandbox but init (its zygotes are not in its
// freezer cgroup) and waits until init has reaped them, so that their PIDs are free.
// Phases: kill_exit until the last has left the cgroup (exited: its memory unmapped, its
// files closed), kill_reap until init has recorded and reaped the last. Processes the
// caller killed already (and which may have left the cgroup) are in killed.
func killAllButInit(ctx context.Context, sb *isolation.Sandbox, killed ...int) error {
	start := time.Now()
	deadline := start.Add(10 * time.Second)
	waitFor := map[int]bool{}
	for _, p := range killed {
		waitFor[p] = true
	}
	for {
		n := 0
		for _, p := range cgroupPids(sb.CgroupName()) {
			if p != sb.Init.Pid {
				unix.Kill(p, unix.SIGKILL)
				waitFor[p] = true
				n++
			}
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sandbox %s: processes did not exit after SIGKILL", sb.ID)
		}
		time.Sleep(100 * time.Microsecond)
	}
	phase.Since(ctx, "kill_exit", start)
	// A process leaves its cgroup when it exits, its PID when its parent reaps it.
	t := time.Now()
	defer phase.Since(ctx, "kill_reap", t)
	for p := range waitFor {
		for {
			if _, err := os.Stat("/proc/" + strconv.Itoa(p)); err != nil {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("sandbox %s: init did not reap process %d", sb.ID, p)
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
	return nil
}

// dropAllZygotes kills every zygote of a sandbox and removes their cgroups (Stop): a
// frozen zygote would otherwise keep the dying pid namespace's init from exiting.
func dropAllZygotes(cgroup string) {
	root := zygoteRoot(cgroup)
	var dirs []string
	filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		for _, p := range freezer.Procs(d) {
			unix.Kill(p, unix.SIGKILL)
		}
		freezer.Write(d, freezer.Thawed)
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		for j := 0; j < 400; j++ {
			if err := os.Remove(dirs[i]); err == nil || os.IsNotExist(err) {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// hasZygotes reports whether the sandbox has any zygote (a tree dump would take them in).
func hasZygotes(cgroup string) bool {
	found := false
	filepath.WalkDir(zygoteRoot(cgroup), func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && len(freezer.Procs(path)) > 0 {
			found = true
			return filepath.SkipAll
		}
		return nil
	})
	return found
}

// prefixed returns a phase recorder reporting to ctx's under prefix+name, nil if ctx
// has none.
func prefixed(ctx context.Context, prefix string) func(string, time.Duration) {
	f := phase.Of(ctx)
	if f == nil {
		return nil
	}
	return func(name string, d time.Duration) { f(prefix+name, d) }
}
