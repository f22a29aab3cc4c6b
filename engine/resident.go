package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/phase"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/storage"
)

// Resident checkpoints. Where the backend can (isolation.Resident: the container
// backend's zygotes) and the sandbox's processes allow it, a checkpoint keeps the
// processes in memory, as frozen copy-on-write forks, instead of dumping them: its
// critical path is a freeze by ptrace, a fork per process and the filesystem snapshot.
// A rollback of the same sandbox to it forks the processes again and brings the root's
// files back in place (storage.Reverter), without a new root, a CRIU restore or a copy
// of memory.
//
// Durability follows off the critical path: one background worker writes, in commit
// order, process images of each resident checkpoint from its zygotes (MakeDurable), and
// the row then says methodZygoteImages. Until then the checkpoint lives only in memory,
// which its row says (methodZygote). From then on the zygotes are a cache:
//   - a rollback that would give the sandbox a new generation (a standby, a CRIU
//     restore), a stop or a CRIU checkpoint of the sandbox first waits for the pending
//     durable copies of the sandbox and ends its zygotes (settleResidents);
//   - each sandbox keeps Config.Residents checkpoints resident, the newest, and those
//     whose copy is pending (the worker evicts the oldest durable ones after each copy);
//   - a fork, a standby or a resume restores the images, as for any checkpoint; no
//     standby is prepared ahead for a resident checkpoint (a fork leaves one behind,
//     Prewarm makes a batch).
//
// Invariant: a zygote checkpoint whose zygotes are gone has images (methodZygoteImages),
// except after a machine crash before its durable copy, which recovery reports and
// deletes (the window is the background copy's, ~100 ms a process).

// Checkpoint methods of resident checkpoints.
const (
	methodZygote       = "zygote"
	methodZygoteImages = "zygote-criu"
)

// DefaultResidents is how many checkpoints of a sandbox stay resident by default.
const DefaultResidents = 32

// whyFile holds, in a checkpoint's images directory, why it was not kept resident.
const whyFile = "method-reason"

// residentOf returns the backend's resident ability, if enabled and present.
func (e *Engine) residentOf(b isolation.Backend) (isolation.Resident, bool) {
	if e.cfg.Residents < 0 {
		return nil, false
	}
	r, ok := b.(isolation.Resident)
	return r, ok
}

// durableState is the queue of checkpoints whose durable copy is pending.
type durableState struct {
	mu sync.Mutex
	// queue is in commit order; queued holds its IDs and the one being copied; running
	// says whether the worker runs; busy is when each sandbox last had a checkpoint or
	// rollback. All protected by mu.
	queue   []string
	queued  map[string]bool
	running bool
	busy    map[string]time.Time
}

// A durable copy (a CRIU dump of each zygote, its rewrite, its compaction: ~0.2 s of
// CPU and tens of MB written per W1 checkpoint) waits until its sandbox has had no
// checkpoint or rollback for durableQuiet, at most durableDelay: on a small machine it
// would otherwise slow the critical path of the checkpoints and rollbacks of a burst
// (their btrfs commits wait for the same disk). An agent thinking between steps leaves
// it the time; a fork needing the images writes them at once (ensureDurable).
const (
	durableQuiet = 150 * time.Millisecond
	durableDelay = 2 * time.Second
)

// touch notes a checkpoint or rollback of sandbox id.
func (e *Engine) touch(id string) {
	d := &e.durable
	d.mu.Lock()
	if d.busy == nil {
		d.busy = map[string]time.Time{}
	}
	d.busy[id] = time.Now()
	d.mu.Unlock()
}

// quiet waits until sandbox id has been quiet for durableQuiet, or since durableDelay.
func (e *Engine) quiet(id string) {
	start := time.Now()
	for {
		e.durable.mu.Lock()
		last := e.durable.busy[id]
		e.durable.mu.Unlock()
		wait := durableQuiet - time.Since(last)
		if wait <= 0 || time.Since(start) >= durableDelay {
			return
		}
		time.Sleep(min(wait, durableDelay-time.Since(start)))
	}
}

// checkpointResident takes the checkpoint with zygotes when it can. It returns false
// (and why, for the row) when the sandbox's processes are not eligible; the caller then
// dumps them with CRIU, after settleResidents.
func (e *Engine) checkpointResident(ctx context.Context, r isolation.Resident, isb *isolation.Sandbox, dir string, hooks isolation.Hooks) (bool, string, error) {
	err := r.CheckpointResident(ctx, isb, dir, hooks)
	if errors.Is(err, isolation.ErrNotResident) {
		return false, err.Error(), nil
	}
	return err == nil, "", err
}

// durableLater queues the durable copy of a just-committed resident checkpoint.
func (e *Engine) durableLater(id string) {
	d := &e.durable
	d.mu.Lock()
	if d.queued == nil {
		d.queued = map[string]bool{}
	}
	if d.queued[id] {
		d.mu.Unlock()
		return
	}
	d.queued[id] = true
	d.queue = append(d.queue, id)
	start := !d.running
	d.running = true
	d.mu.Unlock()
	if start {
		e.background(func(ctx context.Context) {
			lowPriorityThread()
			for {
				d.mu.Lock()
				if len(d.queue) == 0 {
					d.running = false
					d.mu.Unlock()
					return
				}
				id := d.queue[0]
				d.queue = d.queue[1:]
				d.mu.Unlock()
				ck, err := e.db.Checkpoint(ctx, id)
				if err == nil {
					e.quiet(ck.SandboxID)
				}
				if err := e.makeDurable(ctx, id); err != nil {
					e.cfg.Logf("durable copy of checkpoint %s: %v", id, err)
				}
				if ck != nil {
					e.evictResidents(ctx, ck.SandboxID)
				}
				d.mu.Lock()
				delete(d.queued, id)
				d.mu.Unlock()
			}
		})
	}
}

// makeDurable writes the images of resident checkpoint id from its zygotes.
func (e *Engine) makeDurable(ctx context.Context, id string) error {
	ck, err := e.db.Checkpoint(ctx, id)
	if err != nil || ck.Method != methodZygote {
		return nil // deleted meanwhile, or already durable
	}
	sb, err := e.db.Sandbox(ctx, ck.SandboxID)
	if err != nil {
		return err
	}
	b, err := e.backend(ck.Isolation)
	if err != nil {
		return err
	}
	r, ok := b.(isolation.Resident)
	if !ok {
		return fmt.Errorf("backend %s keeps no zygotes", ck.Isolation)
	}
	start := time.Now()
	dir := e.imagesPath(ck.Images)
	if err := r.MakeDurable(ctx, e.isb(sb), dir); err != nil {
		return err
	}
	if cur, err := e.db.Checkpoint(ctx, id); err != nil || cur.Method != methodZygote {
		return nil // recorded meanwhile by another caller (the worker, or a fork)
	}
	crashPoint("durable-written")
	n := DirBytes(dir)
	if err := e.db.SetCheckpointImages(ctx, id, methodZygoteImages, n); err != nil {
		return err
	}
	e.count(func(st *Stats) {
		st.DurableCopies++
		st.DurableMS += float64(time.Since(start).Microseconds()) / 1000
	})
	ck.Method, ck.ImageBytes = methodZygoteImages, n
	// No standby is prepared ahead: rollbacks of the sandbox go through the zygotes, and
	// a standby of each checkpoint (a snapshot, a restore, ~0.5 s of CPU and a root to
	// delete later) would slow the critical path of the next ones on a small machine.
	// A fork restores the images and leaves one behind; Prewarm makes a batch.
	e.compactLater(ck)
	return nil
}

// ensureDurable returns once checkpoint ck (updated in place) has images: a resident
// checkpoint's durable copy is written now, unless it is already (the backend's
// per-directory lock makes this and the worker's copy of it one).
func (e *Engine) ensureDurable(ctx context.Context, ck *model.Checkpoint) error {
	if ck.Method != methodZygote {
		return nil
	}
	if err := e.makeDurable(ctx, ck.ID); err != nil {
		return fmt.Errorf("durable copy of checkpoint %s: %w", ck.ID, err)
	}
	cur, err := e.db.Checkpoint(ctx, ck.ID)
	if err != nil {
		return err
	}
	*ck = *cur
	return nil
}

// residentsOf lists the checkpoints of sb that have zygotes belonging to sb as it runs,
// oldest first.
func (e *Engine) residentsOf(ctx context.Context, sb *model.Sandbox, r isolation.Resident) ([]*model.Checkpoint, error) {
	cks, err := e.db.CheckpointsOf(ctx, sb.ID)
	if err != nil {
		return nil, err
	}
	return e.residentAmong(sb, r, cks), nil
}

// residentAmong returns those of cks (checkpoints of sb) that are resident, in order.
func (e *Engine) residentAmong(sb *model.Sandbox, r isolation.Resident, cks []*model.Checkpoint) []*model.Checkpoint {
	isb := e.isb(sb)
	var out []*model.Checkpoint
	for _, ck := range cks {
		if (ck.Method == methodZygote || ck.Method == methodZygoteImages) && r.IsResident(isb, e.imagesPath(ck.Images)) {
			out = append(out, ck)
		}
	}
	return out
}

// settleResidents makes every resident checkpoint of sb durable and ends its zygotes:
// before sb's processes are replaced by another generation, stopped, or dumped by CRIU
// (whose dump of the tree would take the zygotes, children of init, in). A checkpoint
// whose durable copy failed is lost with its zygotes; that is reported.
//
// Preconditions: the caller holds sb's lock.
func (e *Engine) settleResidents(ctx context.Context, sb *model.Sandbox) error {
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return nil
	}
	r, ok := b.(isolation.Resident)
	if !ok {
		return nil
	}
	cks, err := e.db.CheckpointsOf(ctx, sb.ID)
	if err != nil {
		return err
	}
	var ids []string
	for _, ck := range cks {
		if ck.Method == methodZygote || ck.Method == methodZygoteImages {
			ids = append(ids, ck.ID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	var errs []error
	for _, ck := range cks {
		if !slices.Contains(ids, ck.ID) {
			continue
		}
		if err := e.ensureDurable(ctx, ck); err != nil {
			e.cfg.Logf("%v", err)
		}
		if err := r.DropResident(e.imagesPath(ck.Images)); err != nil {
			errs = append(errs, err)
		}
		if ck.Method == methodZygote {
			if cur, err := e.db.Checkpoint(ctx, ck.ID); err == nil && cur.Method == methodZygote {
				e.cfg.Logf("checkpoint %s of %s had no durable copy when its zygotes ended; deleting it", ck.ID, sb.ID)
				e.deleteLost(ctx, ck.ID)
			}
		}
	}
	return errors.Join(errs...)
}

// Settle makes the resident checkpoints of sandbox id durable and ends their zygotes,
// as before a program other than cairn dumps the sandbox's process tree with CRIU
// (the zygotes are children of its init, and would be dumped with it).
func (e *Engine) Settle(ctx context.Context, id string) error {
	unlock, err := e.lock(ctx, id, true)
	if err != nil {
		return err
	}
	defer unlock()
	sb, err := e.Get(ctx, id)
	if err != nil {
		return err
	}
	return e.settleResidents(ctx, sb)
}

// deleteLost deletes a checkpoint that can no longer be restored (its zygotes are gone
// and it has no images). Its children stand alone (filesystems are independent copies,
// images never depend on a checkpoint without images) and are re-parented.
func (e *Engine) deleteLost(ctx context.Context, id string) {
	if err := e.deleteCheckpoints(ctx, []string{id}); err != nil {
		e.cfg.Logf("delete lost checkpoint %s: %v", id, err)
	}
}

// evictResidents ends the zygotes of sandbox id's resident checkpoints beyond
// Config.Residents, then while they hold more memory than residentMemoryBound, least
// likely to be rolled back to first (evictionOrder), and only those already durable.
// The durable worker calls it after each copy, so it never dumps anything itself: a
// checkpoint whose copy is pending stays resident beyond both bounds until its copy is
// written (a burst of checkpoints holds more for a moment instead of paying CRIU dumps
// on its critical path).
func (e *Engine) evictResidents(ctx context.Context, id string) {
	sb, err := e.db.Sandbox(ctx, id)
	if err != nil {
		return
	}
	r, ok := e.residentFor(sb)
	if !ok {
		return
	}
	all, err := e.db.CheckpointsOf(ctx, sb.ID)
	if err != nil {
		return
	}
	res := e.residentAmong(sb, r, all)
	if len(res) == 0 {
		return
	}
	drop := func(ck *model.Checkpoint, forMemory bool) {
		if ck.Method != methodZygoteImages {
			return // its copy is pending: the worker evicts it after writing it
		}
		if err := r.DropResident(e.imagesPath(ck.Images)); err != nil {
			e.cfg.Logf("evict zygotes of checkpoint %s: %v", ck.ID, err)
			return
		}
		e.count(func(st *Stats) {
			st.ResidentsEvicted++
			if forMemory {
				st.ResidentsEvictedForMemory++
			}
		})
	}
	order := evictionOrder(res, all, sb.Head)
	excess := len(order) - e.cfg.Residents
	for _, ck := range order[:max(excess, 0)] {
		drop(ck, false)
	}
	bound := e.residentMemoryBound(sb)
	if bound < 0 {
		return
	}
	isb := e.isb(sb)
	for _, ck := range order[max(excess, 0):] {
		held, err := r.ResidentMemory(isb)
		if err != nil {
			e.cfg.Logf("memory held by the zygotes of %s: %v", sb.ID, err)
			return
		}
		if held <= bound {
			return
		}
		drop(ck, true)
	}
}

// residentMemoryBound is Config.ResidentMemory for sb: by default a quarter of its
// memory limit; -1 for none.
func (e *Engine) residentMemoryBound(sb *model.Sandbox) int64 {
	if e.cfg.ResidentMemory != 0 {
		return e.cfg.ResidentMemory
	}
	limit := sb.Limits.MemoryBytes
	if limit <= 0 {
		limit = isolation.DefaultMemoryBytes
	}
	return limit / 4
}

// evictionOrder returns the resident checkpoints res (oldest first) in the order to
// evict them: first those off the lineage of head (its ancestors and itself, through
// all, the sandbox's checkpoints), oldest first, then those on it, farthest from head
// first. An agent backtracks along the path it is on (a retry, a tree search's return
// to a node of its branch) more than it jumps to a branch it left; evicting by age
// alone dropped, in W1 (rollbacks to one of the head's 20 nearest ancestors, 41
// checkpoints, 32 resident), ancestors still in use while abandoned branches stayed,
// and 2-3 rollbacks in 20 restored images (~200 ms) instead of forking (~20 ms).
func evictionOrder(res, all []*model.Checkpoint, head string) []*model.Checkpoint {
	parent := make(map[string]string, len(all))
	for _, ck := range all {
		parent[ck.ID] = ck.Parent
	}
	depth := map[string]int{} // distance from head along the lineage
	for c, d := head, 0; c != "" && d <= len(all); c, d = parent[c], d+1 {
		if _, seen := depth[c]; seen {
			break
		}
		depth[c] = d
	}
	out := make([]*model.Checkpoint, 0, len(res))
	var lineage []*model.Checkpoint
	for _, ck := range res {
		if _, on := depth[ck.ID]; on {
			lineage = append(lineage, ck)
		} else {
			out = append(out, ck)
		}
	}
	slices.SortStableFunc(lineage, func(a, b *model.Checkpoint) int { return depth[b.ID] - depth[a.ID] })
	return append(out, lineage...)
}

// rollbackResident rolls sb back to ck through ck's zygotes, if it has some for sb as
// it runs. It returns false, with nothing done, when it has not; on any other failure
// sb has lost its processes (and possibly part of its root's revert), and the caller
// restores ck's images instead (after its durable copy).
//
// Preconditions: the caller holds sb's lock.
func (e *Engine) rollbackResident(ctx context.Context, r isolation.Resident, sb *model.Sandbox, ck *model.Checkpoint) (bool, error) {
	if ck.Method != methodZygote && ck.Method != methodZygoteImages {
		return false, nil
	}
	isb := e.isb(sb)
	dir := e.imagesPath(ck.Images)
	t := time.Now()
	if !r.IsResident(isb, dir) {
		return false, nil
	}
	phase.Since(ctx, "is_resident", t)
	return e.rollbackInPlace(ctx, sb, ck, "resident-rollback-killed", func(st *Stats) { st.ResidentRollbacks++ },
		func(hooks isolation.RollbackHooks) error {
			if err := r.RollbackResident(ctx, isb, dir, hooks); err != nil {
				return err
			}
			crashPoint("resident-rollback-spawned")
			return nil
		})
}

// rollbackDurable rolls sb back in place to ck, a resident checkpoint made durable whose
// zygotes are gone (evicted), by restoring its images into sb's running init: sb keeps
// its generation, so its other resident checkpoints stay so; a rollback by a new init
// would first have to write the durable copy of each (~0.1 s of CRIU apiece). It returns
// false, with nothing done, unless ck has such images and sb resident checkpoints to
// keep; failures are as for rollbackResident.
//
// Preconditions: the caller holds sb's lock.
func (e *Engine) rollbackDurable(ctx context.Context, r isolation.Resident, sb *model.Sandbox, ck *model.Checkpoint) (bool, error) {
	if ck.Method != methodZygoteImages {
		return false, nil
	}
	if res, err := e.residentsOf(ctx, sb, r); err != nil || len(res) == 0 {
		return false, err
	}
	return e.rollbackInPlace(ctx, sb, ck, "durable-rollback-killed", func(st *Stats) { st.InPlaceRestores++ },
		func(hooks isolation.RollbackHooks) error {
			return r.RollbackDurable(ctx, e.isb(sb), e.imagesPath(ck.Images), hooks)
		})
}

// rollbackInPlace is what the two rollbacks in place share: the mark a crash leaves
// (recovered below), the revert of the root that run's hooks call once sb's processes
// are killed (killed names its crash point), and sb's new head. It returns false, with
// nothing done, when run says isolation.ErrNotResident.
//
// The revert is planned when it can be (storage.PlannedReverter): the difference from
// the head checkpoint's filesystem to ck's, both read-only, is computed from the start,
// beside the kill, and applied if the root still held the head's content when the
// sandbox was quiet (Unchanged, asked in hooks.Quiesced), which a rollback right after
// a checkpoint finds (a search that checkpoints every node, then jumps). Otherwise the
// revert compares the root itself (Revert: a snapshot of it first).
func (e *Engine) rollbackInPlace(ctx context.Context, sb *model.Sandbox, ck *model.Checkpoint, killed string,
	counted func(*Stats), run func(isolation.RollbackHooks) error) (bool, error) {
	rv, ok := e.pool.(storage.Reverter)
	if !ok {
		return false, nil
	}
	t := time.Now()
	if err := markRollback(e.cfg.DataDir, sb.ID, ck.ID); err != nil {
		return false, err
	}
	phase.Since(ctx, "mark", t)
	// The backend's work left for after the call (a rewind's scan) waits for this.
	returned := make(chan struct{})
	defer close(returned)
	hooks := isolation.RollbackHooks{Returned: returned}
	pl := e.planRevert(ctx, sb, ck)
	if pl != nil {
		hooks.Quiesced = pl.quiesced
	}
	hooks.Revert = func(ctx context.Context, asQuiesced bool) error {
		crashPoint(killed)
		var st storage.RevertStats
		var planned bool
		var err error
		if pl != nil {
			st, planned = pl.revert(ctx, asQuiesced)
		}
		if !planned {
			st, err = rv.Revert(ctx, sb.Root, ck.FSVolume)
		}
		if f := phase.Of(ctx); f != nil {
			f("revert_snapshot", msDuration(st.SnapshotMS))
			f("revert_send", msDuration(st.SendMS))
			f("revert_apply", msDuration(st.ApplyMS))
		}
		e.count(func(s *Stats) {
			s.Reverts++
			if planned {
				s.PlannedReverts++
			}
			if st.Diff == "tree" {
				s.TreeReverts++
				s.RevertCompared += st.Compared
			}
			s.RevertOps += st.Ops
			s.RevertSnapshotMS += st.SnapshotMS
			s.RevertSendMS += st.SendMS
			s.RevertApplyMS += st.ApplyMS
		})
		return err
	}
	err := run(hooks)
	if errors.Is(err, isolation.ErrNotResident) {
		e.cfg.Logf("rollback of %s to %s not in place: %v", sb.ID, ck.ID, err)
		clearRollback(e.cfg.DataDir, sb.ID)
		return false, nil
	}
	if err != nil {
		return false, err
	}
	t = time.Now()
	sb.Head = ck.ID
	if err := e.db.PutSandbox(ctx, sb); err != nil {
		return false, err
	}
	clearRollback(e.cfg.DataDir, sb.ID)
	phase.Since(ctx, "commit", t)
	e.count(counted)
	return true, nil
}

// revertPlan is a rollback's planned revert from its sandbox's head (see
// rollbackInPlace).
type revertPlan struct {
	pr         storage.PlannedReverter
	root, head string // the sandbox's root, and its head checkpoint's filesystem
	plan       chan plannedRevert
	unchanged  bool // the root held head's content when the sandbox was quiet
	logf       func(string, ...any)
}

type plannedRevert struct {
	plan storage.RevertPlan // nil: the head is the target
	err  error
}

// planRevert (nil if it does not) starts computing the difference from sb's head
// checkpoint's filesystem to ck's, if the pool can plan reverts, the head has a
// filesystem of its own and the root still holds it as the sandbox runs (Unchanged,
// asked again once it is quiet: when the root has changed already, which a rollback
// after work since the last checkpoint finds, nothing is done beyond that question).
// A head whose split snapshot is still committing (a rollback right after its
// checkpoint) is read by the pool from its fixed tree, without waiting for the commit.
func (e *Engine) planRevert(ctx context.Context, sb *model.Sandbox, ck *model.Checkpoint) *revertPlan {
	pr, ok := e.pool.(storage.PlannedReverter)
	if !ok || sb.Head == "" {
		return nil
	}
	t := time.Now()
	head, err := e.db.Checkpoint(ctx, sb.Head)
	phase.Since(ctx, "plan_head", t)
	if err != nil || head.FSVolume == "" {
		return nil
	}
	t = time.Now()
	ok, err = pr.Unchanged(sb.Root, head.FSVolume)
	phase.Since(ctx, "plan_unchanged", t)
	if err != nil || !ok {
		return nil
	}
	p := &revertPlan{pr: pr, root: sb.Root, head: head.FSVolume, plan: make(chan plannedRevert, 1), logf: e.cfg.Logf}
	if head.FSVolume == ck.FSVolume {
		p.plan <- plannedRevert{}
		return p
	}
	go func() {
		pl, err := pr.PlanRevert(ctx, head.FSVolume, ck.FSVolume)
		p.plan <- plannedRevert{pl, err}
	}()
	return p
}

// quiesced is the rollback's RollbackHooks.Quiesced: it asks whether the root still
// holds the head's content.
func (p *revertPlan) quiesced(ctx context.Context) {
	crashPoint("rollback-quiesced")
	t := time.Now()
	ok, err := p.pr.Unchanged(p.root, p.head)
	p.unchanged = ok && err == nil
	phase.Since(ctx, "unchanged", t)
}

// revert applies the plan if the root held the head's content (asQuiesced: and holds
// it again after the kill), and says whether it did; a failed apply is reported as
// not planned, for the caller's Revert, which converges from where it stopped.
func (p *revertPlan) revert(ctx context.Context, asQuiesced bool) (storage.RevertStats, bool) {
	if !p.unchanged || !asQuiesced {
		return storage.RevertStats{}, false
	}
	t := time.Now()
	r := <-p.plan
	phase.Since(ctx, "revert_wait_plan", t)
	if r.err != nil {
		p.logf("revert of %s: plan from %s: %v; comparing the root itself", p.root, p.head, r.err)
		return storage.RevertStats{}, false
	}
	if r.plan == nil {
		return storage.RevertStats{}, true // the root is the target's already
	}
	st, err := p.pr.RevertPlanned(ctx, p.root, r.plan)
	if err != nil {
		p.logf("revert of %s: planned from %s: %v; comparing the root itself", p.root, p.head, err)
		return st, false
	}
	return st, true
}

// msDuration converts milliseconds as RevertStats holds them.
func msDuration(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

// A rollback in place is not atomic: killing the processes, reverting the root and
// forking from the zygotes. locks/<sandbox>.rollback names the checkpoint while one
// runs; recovery finds a sandbox that died in the middle by it and rolls it back again
// (by images: its processes are gone, its root half reverted).
func rollbackMark(dataDir, id string) string {
	return filepath.Join(dataDir, "locks", id+".rollback")
}

func markRollback(dataDir, id, ck string) error {
	return os.WriteFile(rollbackMark(dataDir, id), []byte(ck), 0o600)
}

func clearRollback(dataDir, id string) { os.Remove(rollbackMark(dataDir, id)) }

// recoverResidents, at engine start: sandboxes whose rollback in place died halfway are
// rolled back again (the mark names the checkpoint), roots left read-only by a revert
// that died are made writable, and, if no other engine is alive on the data directory
// (e.alone), resident checkpoints still waiting for their durable copy are queued again
// (their zygotes survive a crash of cairn, frozen), and those whose zygotes are gone
// without a copy (a machine crash) are deleted. A live engine's resident checkpoints
// are its own: a second engine's durable copy of the same zygotes would race with its
// copies and rollbacks (both seize the zygotes; one fails, and the checkpoint is lost).
func (e *Engine) recoverResidents(ctx context.Context) {
	sbs, err := e.db.Sandboxes(ctx)
	if err != nil {
		return
	}
	for _, sb := range sbs {
		if sb.State != model.StateRunning {
			continue
		}
		// Only sandboxes nobody is working on: another engine may be mid-rollback.
		unlock, ok := e.tryLock(sb.ID)
		if !ok {
			continue
		}
		e.pool.SetReadOnly(ctx, sb.Root, false)
		ck, err := os.ReadFile(rollbackMark(e.cfg.DataDir, sb.ID))
		unlock()
		if err == nil {
			e.cfg.Logf("sandbox %s: a rollback to %s died halfway; rolling back again", sb.ID, ck)
			if err := e.Rollback(ctx, sb.ID, strings.TrimSpace(string(ck))); err != nil {
				e.cfg.Logf("sandbox %s: rollback again: %v", sb.ID, err)
			}
		}
	}
	if !e.alone {
		return
	}
	cks, err := e.db.Checkpoints(ctx)
	if err != nil {
		return
	}
	for _, ck := range cks {
		if ck.Method != methodZygote {
			continue
		}
		sb, err := e.db.Sandbox(ctx, ck.SandboxID)
		b, berr := e.backend(ck.Isolation)
		r, ok := b.(isolation.Resident)
		if err == nil && berr == nil && ok && sb.State == model.StateRunning && r.IsResident(e.isb(sb), e.imagesPath(ck.Images)) {
			e.durableLater(ck.ID)
			continue
		}
		e.cfg.Logf("checkpoint %s was resident only and its zygotes are gone (the machine restarted?); deleting it", ck.ID)
		e.deleteLost(ctx, ck.ID)
	}
}

// isResident reports whether ck's zygotes are alive and belong to its sandbox as it runs.
func (e *Engine) isResident(ck *model.Checkpoint) bool {
	sb, err := e.db.Sandbox(context.Background(), ck.SandboxID)
	if err != nil || sb.State != model.StateRunning {
		return false
	}
	r, ok := e.residentFor(sb)
	return ok && r.IsResident(e.isb(sb), e.imagesPath(ck.Images))
}

// checkpointMemory is Checkpoint.ResidentMemoryBytes of a resident checkpoint (0 if
// it cannot be read).
func (e *Engine) checkpointMemory(ck *model.Checkpoint) int64 {
	sb, err := e.db.Sandbox(context.Background(), ck.SandboxID)
	if err != nil {
		return 0
	}
	r, ok := e.residentFor(sb)
	if !ok {
		return 0
	}
	n, _ := r.CheckpointMemory(e.imagesPath(ck.Images))
	return n
}

// residentFor returns the resident ability of sb's backend, if enabled and present.
func (e *Engine) residentFor(sb *model.Sandbox) (isolation.Resident, bool) {
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return nil, false
	}
	return e.residentOf(b)
}

// residentMemory is Sandbox.ResidentMemoryBytes of a running sandbox (0 if it cannot
// be read, or the backend keeps no zygotes).
func (e *Engine) residentMemory(sb *model.Sandbox) int64 {
	r, ok := e.residentFor(sb)
	if !ok || sb.State != model.StateRunning {
		return 0
	}
	n, _ := r.ResidentMemory(e.isb(sb))
	return n
}

// ResidentMemory returns the memory the zygotes of every running sandbox hold beyond
// their processes' (the sum of what Inspect reports as Sandbox.ResidentMemoryBytes).
func (e *Engine) ResidentMemory(ctx context.Context) (int64, error) {
	sbs, err := e.List(ctx)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, sb := range sbs {
		n += e.residentMemory(sb)
	}
	return n, nil
}

// residentReason is MethodReason for a checkpoint taken with zygotes.
func residentReason(ck *model.Checkpoint) string {
	s := "taken with zygotes: each process of the sandbox forked a frozen copy-on-write copy of itself (no memory copied)"
	if ck.Method == methodZygote {
		s += "; its durable copy (CRIU images written from the zygotes in the background) is not written yet"
	} else {
		s += "; durable: CRIU images of each process were written from the zygotes in the background"
	}
	if ck.Resident {
		return s + "; resident: a rollback of its sandbox forks the processes again from the zygotes"
	}
	return s + "; not resident any more (evicted, or its sandbox runs another generation): rollbacks and forks restore its images"
}
