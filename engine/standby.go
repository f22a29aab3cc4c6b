package engine

import (
	"context"
	"errors"
	"fmt"
	"path"
	"sync"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/store"
)

// Standbys. A standby is a checkpoint restored ahead of time onto its own writable root
// and kept frozen before any instruction of it has run. Rolling back or forking to a
// checkpoint with a standby is then a claim (one SQLite statement), a hostname and a
// thaw: the CRIU restore already happened, off the critical path. The claimed standby
// is replaced in the background. Standbys are a cache bounded by Config.StandbyBudget
// (oldest evicted first); losing them loses nothing.

// standbyDir holds the roots of standbys in the pool.
const standbyDir = "standby"

// Defaults of the standby cache.
const (
	DefaultStandbyBudget = 4 << 30
	DefaultMaxStandbys   = 64
)

// background runs f off the caller's critical path. Close waits for it.
func (e *Engine) background(f func(ctx context.Context)) {
	e.bgWG.Add(1)
	go func() {
		defer e.bgWG.Done()
		start := time.Now()
		f(context.Background())
		e.bgMu.Lock()
		e.bgStats.BackgroundMS += float64(time.Since(start).Microseconds()) / 1000
		e.bgMu.Unlock()
	}()
}

// Stats are cumulative counters of this engine's background work.
type Stats struct {
	StandbysPrepared int     `json:"standbys_prepared"`
	StandbysClaimed  int     `json:"standbys_claimed"`
	StandbysEvicted  int     `json:"standbys_evicted"`
	StandbyMisses    int     `json:"standby_misses"`
	BackgroundMS     float64 `json:"background_ms"`
	// StandbyPrepareMS is the time spent restoring standbys (background or Prewarm).
	StandbyPrepareMS float64 `json:"standby_prepare_ms"`
	// Compactions counts image compactions (incremental.go), CompactionMS their time
	// (also in BackgroundMS) and CompactionSavedBytes the bytes they removed.
	Compactions          int     `json:"compactions"`
	CompactionMS         float64 `json:"compaction_ms"`
	CompactionSavedBytes int64   `json:"compaction_saved_bytes"`
	// ResidentRollbacks counts rollbacks through zygotes (resident.go), InPlaceRestores
	// those that restored images into the sandbox's running init; DurableCopies
	// the durable copies written of resident checkpoints and DurableMS their time (also
	// in BackgroundMS); ResidentsEvicted the resident checkpoints whose zygotes were
	// ended to keep within Config.Residents, ResidentsEvictedForMemory those of them
	// ended to keep within Config.ResidentMemory.
	ResidentRollbacks int     `json:"resident_rollbacks"`
	InPlaceRestores   int     `json:"in_place_restores"`
	DurableCopies     int     `json:"durable_copies"`
	DurableMS         float64 `json:"durable_ms"`
	ResidentsEvicted  int     `json:"residents_evicted"`
	// ResidentsEvictedForMemory: see ResidentsEvicted.
	ResidentsEvictedForMemory int `json:"residents_evicted_for_memory"`
	// Reverts counts the roots brought back in place by rollbacks (storage.Reverter),
	// RevertOps the filesystem operations they applied, and the RevertMS fields the
	// time of their phases: the snapshot of the live root, computing the difference,
	// applying it (all on the rollbacks' critical path).
	Reverts int `json:"reverts"`
	// PlannedReverts counts those computed ahead, from the head checkpoint's
	// filesystem (storage.PlannedReverter), without a snapshot of the root.
	PlannedReverts int `json:"planned_reverts"`
	// TreeReverts counts those whose difference was read from the volumes' changed
	// items (a tree plan), not computed by the kernel's send.
	TreeReverts int `json:"tree_reverts"`
	// RevertCompared counts the inodes their tree plans read from both volumes.
	RevertCompared   int     `json:"revert_compared"`
	RevertOps        int     `json:"revert_ops"`
	RevertSnapshotMS float64 `json:"revert_snapshot_ms"`
	RevertSendMS     float64 `json:"revert_send_ms"`
	RevertApplyMS    float64 `json:"revert_apply_ms"`
}

// Since returns the counters accumulated since before was read.
func (s Stats) Since(before Stats) Stats {
	return Stats{StandbysPrepared: s.StandbysPrepared - before.StandbysPrepared,
		StandbysClaimed: s.StandbysClaimed - before.StandbysClaimed, StandbysEvicted: s.StandbysEvicted - before.StandbysEvicted,
		StandbyMisses: s.StandbyMisses - before.StandbyMisses, BackgroundMS: s.BackgroundMS - before.BackgroundMS,
		StandbyPrepareMS: s.StandbyPrepareMS - before.StandbyPrepareMS, Compactions: s.Compactions - before.Compactions,
		CompactionMS: s.CompactionMS - before.CompactionMS, CompactionSavedBytes: s.CompactionSavedBytes - before.CompactionSavedBytes,
		ResidentRollbacks: s.ResidentRollbacks - before.ResidentRollbacks, InPlaceRestores: s.InPlaceRestores - before.InPlaceRestores,
		DurableCopies: s.DurableCopies - before.DurableCopies,
		DurableMS:     s.DurableMS - before.DurableMS, ResidentsEvicted: s.ResidentsEvicted - before.ResidentsEvicted,
		ResidentsEvictedForMemory: s.ResidentsEvictedForMemory - before.ResidentsEvictedForMemory,
		Reverts:                   s.Reverts - before.Reverts, PlannedReverts: s.PlannedReverts - before.PlannedReverts, TreeReverts: s.TreeReverts - before.TreeReverts, RevertCompared: s.RevertCompared - before.RevertCompared, RevertOps: s.RevertOps - before.RevertOps,
		RevertSnapshotMS: s.RevertSnapshotMS - before.RevertSnapshotMS, RevertSendMS: s.RevertSendMS - before.RevertSendMS,
		RevertApplyMS: s.RevertApplyMS - before.RevertApplyMS}
}

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	e.bgMu.Lock()
	defer e.bgMu.Unlock()
	return e.bgStats
}

func (e *Engine) count(f func(*Stats)) {
	e.bgMu.Lock()
	f(&e.bgStats)
	e.bgMu.Unlock()
}

// Prewarm makes n standbys of a checkpoint ready now, counting those already ready (in
// parallel, bounded), so that the next n rollbacks or forks to it are thaws. Typical
// use: before resetting a batch of RL sandboxes to one warm checkpoint. Calling it again
// with the same n prepares nothing more. The cache's bounds still apply: more than it
// holds evicts the oldest standbys, these included.
func (e *Engine) Prewarm(ctx context.Context, checkpointID string, n int) error {
	if n < 1 || n > MaxFork {
		return errdefs.InvalidArgument("prewarm count %d: give 1 to %d", n, MaxFork)
	}
	ck, err := e.checkpoint(ctx, checkpointID)
	if err != nil {
		return err
	}
	if e.cfg.Standbys < 0 {
		return errdefs.FailedPrecondition("standbys are turned off in this engine: rollbacks and forks of %s restore it with CRIU", ck.ID)
	}
	iso, _ := e.sourceOf(ctx, ck)
	b, err := e.backend(iso)
	if err != nil {
		return err
	}
	if _, ok := b.(isolation.FrozenRestorer); !ok {
		return errdefs.FailedPrecondition("%s checkpoints have no standbys: rollbacks and forks of %s restore it (container isolation has thaw-speed standbys)", iso, ck.ID)
	}
	// Standbys restore images: a resident checkpoint's durable copy must be written.
	if err := e.ensureDurable(ctx, ck); err != nil {
		return err
	}
	ready, err := e.db.StandbysOf(ctx, ck.ID)
	if err != nil {
		return err
	}
	todo := n - len(ready)
	if todo <= 0 {
		return nil
	}
	// prepareStandby bounds the restores running at once (Config.StandbyRestores).
	errs := make([]error, todo)
	var wg sync.WaitGroup
	for i := 0; i < todo; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			errs[i] = e.prepareStandby(ctx, ck)
		}(i)
	}
	wg.Wait()
	return errors.Join(errs...)
}

// sourceOf returns the isolation and limits a checkpoint's copies run with.
func (e *Engine) sourceOf(ctx context.Context, ck *model.Checkpoint) (string, isolation.Limits) {
	if sb, err := e.db.Sandbox(ctx, ck.SandboxID); err == nil {
		return sb.Isolation, sb.Limits
	}
	if ck.Isolation != "" {
		return ck.Isolation, isolation.Limits{}
	}
	return "container", isolation.Limits{}
}

// prepareStandby restores one frozen copy of ck and records it.
func (e *Engine) prepareStandby(ctx context.Context, ck *model.Checkpoint) error {
	iso, limits := e.sourceOf(ctx, ck)
	b, err := e.backend(iso)
	if err != nil {
		return err
	}
	fr, ok := b.(isolation.FrozenRestorer)
	if !ok {
		return nil
	}
	// A bounded number at a time (Config.StandbyRestores, default 1): sandboxes and
	// their checkpoints run meanwhile.
	e.prepSem <- struct{}{}
	defer func() { <-e.prepSem }()
	// Queued refills outlive checkpoints deleted while they waited: nothing to do.
	if _, err := e.db.Checkpoint(ctx, ck.ID); errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	start := time.Now()
	sid := newID("s", 11)
	unlock, err := e.lock(ctx, sid, true)
	if err != nil {
		return err
	}
	defer unlock()
	root := path.Join(standbyDir, sid)
	if err := e.snapshotLazy(ctx, ck.FSVolume, root, false); err != nil {
		if _, err2 := e.db.Checkpoint(ctx, ck.ID); errors.Is(err2, errdefs.ErrNotFound) {
			return nil // deleted since the check above
		}
		return err
	}
	isb := &isolation.Sandbox{ID: sid, Hostname: sid, Root: e.pool.Path(root), Limits: limits, Cgroup: sid}
	if err := fr.RestoreFrozen(ctx, isb, e.imagesPath(ck.Images)); err != nil {
		e.pool.Delete(context.WithoutCancel(ctx), root)
		if _, err2 := e.db.Checkpoint(ctx, ck.ID); errors.Is(err2, errdefs.ErrNotFound) {
			return nil // its images went with it
		}
		return fmt.Errorf("standby of %s: %w", ck.ID, err)
	}
	crashPoint("standby-restored")
	// The cache is bounded by the memory standbys hold; the images' size on disk says
	// little about it once they are incremental.
	bytes := ck.ImageBytes
	if mr, ok := b.(isolation.MemoryReporter); ok {
		if n, err := mr.MemoryBytes(isb); err == nil && n > 0 {
			bytes = n
		}
	}
	s := &store.Standby{ID: sid, Checkpoint: ck.ID, Isolation: iso, Root: root, Init: isb.Init,
		Bytes: bytes, CreatedAt: time.Now().UTC().Format(time.RFC3339Nano)}
	if err := e.db.AddStandby(ctx, s); err != nil {
		e.discard(context.WithoutCancel(ctx), s)
		return err
	}
	// The checkpoint may have been deleted while its copy was restored: its deletion
	// removes the row before it drops standbys, so one of the two sees the other.
	if _, err := e.db.Checkpoint(ctx, ck.ID); errors.Is(err, errdefs.ErrNotFound) {
		if ok, _ := e.db.DeleteStandby(ctx, s.ID); ok {
			e.discard(context.WithoutCancel(ctx), s)
		}
		return nil
	}
	e.count(func(st *Stats) {
		st.StandbysPrepared++
		st.StandbyPrepareMS += float64(time.Since(start).Microseconds()) / 1000
	})
	e.evictStandbys(ctx)
	return nil
}

// standbyISB is the backend's view of a standby.
func (e *Engine) standbyISB(s *store.Standby) *isolation.Sandbox {
	return &isolation.Sandbox{ID: s.ID, Hostname: s.ID, Root: e.pool.Path(s.Root), Cgroup: path.Base(s.Root), Init: s.Init}
}

// takeStandby moves sb onto a live standby of ck, if there is one: sb's record is
// rewritten (root, init, head) in the same transaction that removes the standby, the
// standby is given sb's identity and thawed. It returns false, with sb unchanged, when
// there is no usable standby. On success the caller owns the tree sb ran before.
//
// Preconditions: the caller holds sb's lock; writeIdentity, if needed, was done by
// prepare (called with the standby's root path before the swap).
func (e *Engine) takeStandby(ctx context.Context, sb *model.Sandbox, ck *model.Checkpoint, prepare func(root string) error) (bool, error) {
	if e.cfg.Standbys < 0 {
		return false, nil
	}
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return false, nil
	}
	act, ok := b.(isolation.Activator)
	if !ok {
		return false, nil
	}
	cands, err := e.db.StandbysOf(ctx, ck.ID)
	if err != nil {
		return false, err
	}
	for _, s := range cands {
		if s.Isolation != sb.Isolation || !b.Running(e.standbyISB(s)) {
			continue
		}
		if prepare != nil {
			if err := prepare(e.pool.Path(s.Root)); err != nil {
				return false, err
			}
		}
		next := *sb
		next.Root, next.Init, next.Head, next.State = s.Root, s.Init, ck.ID, model.StateRunning
		ok, err := e.db.SwapStandby(ctx, s.ID, &next)
		if err != nil {
			return false, err
		}
		if !ok {
			continue // claimed by someone else
		}
		if err := act.Activate(ctx, e.isb(&next)); err != nil {
			// The old tree is untouched: point the record back at it.
			e.db.PutSandbox(context.WithoutCancel(ctx), sb)
			e.discard(context.WithoutCancel(ctx), s)
			return false, fmt.Errorf("activate standby of %s: %w", ck.ID, err)
		}
		e.count(func(st *Stats) { st.StandbysClaimed++ })
		*sb = next
		return true, nil
	}
	e.count(func(st *Stats) { st.StandbyMisses++ })
	return false, nil
}

// forkWarm makes up to count forks of ck from its ready standbys: one transaction
// claims them all (each standby's row becomes a sandbox's), then each gets its identity
// and is thawed, in parallel. It returns the forks made, none if ck has no standby. On
// error the returned forks exist and the caller removes them. The caller refills.
func (e *Engine) forkWarm(ctx context.Context, b isolation.Backend, src *model.Sandbox, ck *model.Checkpoint, count int) ([]*model.Sandbox, error) {
	act, ok := b.(isolation.Activator)
	if e.cfg.Standbys < 0 || !ok {
		return nil, nil
	}
	cands, err := e.db.StandbysOf(ctx, ck.ID)
	if err != nil {
		return nil, err
	}
	var ids []string
	var sbs []*model.Sandbox
	for _, s := range cands {
		if len(sbs) == count {
			break
		}
		if s.Isolation != b.Name() || !b.Running(e.standbyISB(s)) {
			continue
		}
		sb := forkRecord(b, src, ck)
		sb.Root, sb.Init = s.Root, s.Init
		ids, sbs = append(ids, s.ID), append(sbs, sb)
	}
	if len(sbs) == 0 {
		return nil, nil // forkOne counts the misses
	}
	// Nobody can know the new IDs before the claim commits, but locks keep everyone out
	// until each fork runs.
	for _, sb := range sbs {
		unlock, err := e.lock(ctx, sb.ID, true)
		if err != nil {
			return nil, err
		}
		defer unlock()
	}
	claimed, err := e.db.ClaimStandbys(ctx, ids, sbs)
	if err != nil {
		return nil, err
	}
	out := make([]*model.Sandbox, len(claimed))
	errs := make([]error, len(claimed))
	var wg sync.WaitGroup
	for j, i := range claimed {
		out[j] = sbs[i]
		wg.Add(1)
		go func(sb *model.Sandbox) {
			defer wg.Done()
			// Still frozen: no instruction of the copy has run yet.
			if err := writeIdentity(e.pool.Path(sb.Root), sb.ID); err != nil {
				errs[j] = err
				return
			}
			errs[j] = act.Activate(ctx, e.isb(sb))
		}(sbs[i])
	}
	wg.Wait()
	e.count(func(st *Stats) { st.StandbysClaimed += len(out) })
	if err := errors.Join(errs...); err != nil {
		return out, fmt.Errorf("activate standbys of %s: %w", ck.ID, err)
	}
	return out, nil
}

// discard stops a standby (already removed from the table) and deletes its root.
func (e *Engine) discard(ctx context.Context, s *store.Standby) {
	if b, err := e.backend(s.Isolation); err == nil {
		b.Stop(ctx, e.standbyISB(s))
	}
	e.pool.Delete(ctx, s.Root)
}

// refill prepares n standbys of ck in the background.
func (e *Engine) refill(ck *model.Checkpoint, n int) {
	if e.cfg.Standbys <= 0 || n <= 0 {
		return
	}
	e.bgMu.Lock()
	e.pending[ck.ID] += n
	e.bgMu.Unlock()
	e.background(func(ctx context.Context) {
		defer func() {
			e.bgMu.Lock()
			if e.pending[ck.ID] -= n; e.pending[ck.ID] <= 0 {
				delete(e.pending, ck.ID)
			}
			e.bgMu.Unlock()
		}()
		for i := 0; i < n; i++ {
			if err := e.prepareStandby(ctx, ck); err != nil {
				e.cfg.Logf("standby of checkpoint %s: %v", ck.ID, err)
				return
			}
		}
	})
}

// refillIfNone prepares a standby of ck in the background unless one exists: after a
// rollback or fork that found none, the next one to the same checkpoint is likely.
func (e *Engine) refillIfNone(ctx context.Context, ck *model.Checkpoint) {
	e.bgMu.Lock()
	pending := e.pending[ck.ID]
	e.bgMu.Unlock()
	if l, err := e.db.StandbysOf(ctx, ck.ID); err == nil && len(l)+pending == 0 {
		e.refill(ck, 1)
	}
}

// evictStandbys keeps the cache within its bounds, oldest first.
func (e *Engine) evictStandbys(ctx context.Context) {
	all, err := e.db.Standbys(ctx)
	if err != nil {
		return
	}
	var total int64
	for _, s := range all {
		total += s.Bytes
	}
	for len(all) > 0 && (total > e.cfg.StandbyBudget || len(all) > e.cfg.MaxStandbys) {
		s := all[0]
		all = all[1:]
		total -= s.Bytes
		if ok, _ := e.db.DeleteStandby(ctx, s.ID); ok {
			e.discard(ctx, s)
			e.count(func(st *Stats) { st.StandbysEvicted++ })
		}
	}
}

// dropStandbys discards every standby of the given checkpoints (they are being deleted).
func (e *Engine) dropStandbys(ctx context.Context, checkpoints []string) {
	dead := map[string]bool{}
	for _, c := range checkpoints {
		dead[c] = true
	}
	all, _ := e.db.Standbys(ctx)
	for _, s := range all {
		if dead[s.Checkpoint] {
			if ok, _ := e.db.DeleteStandby(ctx, s.ID); ok {
				e.discard(ctx, s)
			}
		}
	}
}

// recoverStandbys drops standbys whose processes are gone (after a reboot), and those
// of checkpoints deleted while they were prepared by an engine that then stopped.
func (e *Engine) recoverStandbys(ctx context.Context) {
	all, _ := e.db.Standbys(ctx)
	for _, s := range all {
		b, err := e.backend(s.Isolation)
		running := err == nil && b.Running(e.standbyISB(s))
		if _, err := e.db.Checkpoint(ctx, s.Checkpoint); running && !errors.Is(err, errdefs.ErrNotFound) {
			continue
		}
		if ok, _ := e.db.DeleteStandby(ctx, s.ID); ok {
			if running {
				e.discard(ctx, s)
			} else {
				e.pool.Delete(ctx, s.Root)
			}
		}
	}
}

// Quiesce waits until the background work started so far (standby preparation, cleanup
// of replaced trees) is done. Benchmarks and tests use it to measure or exercise the
// warm path; nothing else needs it.
func (e *Engine) Quiesce() { e.bgWG.Wait() }

// StandbyMemory returns how many standbys are ready and the memory they hold, in bytes
// (bounded by Config.StandbyBudget and Config.MaxStandbys).
func (e *Engine) StandbyMemory(ctx context.Context) (int, int64, error) {
	all, err := e.db.Standbys(ctx)
	if err != nil {
		return 0, 0, err
	}
	var n int64
	for _, s := range all {
		n += s.Bytes
	}
	return len(all), n, nil
}

// StandbyCount returns how many standbys of a checkpoint are ready (not_found for an
// unknown checkpoint).
func (e *Engine) StandbyCount(ctx context.Context, checkpointID string) (int, error) {
	if _, err := e.checkpoint(ctx, checkpointID); err != nil {
		return 0, err
	}
	l, err := e.db.StandbysOf(ctx, checkpointID)
	return len(l), err
}
