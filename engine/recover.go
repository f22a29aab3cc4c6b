package engine

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container"
	"github.com/cairn-sandbox/cairn/isolation/gvisor"
	"github.com/cairn-sandbox/cairn/storage/btrfs"
	"github.com/cairn-sandbox/cairn/store"
)

// recover brings the data directory back to a consistent state after a crash: it has
// the backends undo what a dead checkpoint left in running sandboxes (Recoverer: a
// frozen sandbox thawed), and removes staging directories, unrecorded
// checkpoint directories and unreferenced roots of sandboxes nobody is working on.
func (e *Engine) recover(ctx context.Context) error {
	if err := e.btrfs.Recover(ctx); err != nil {
		return err
	}
	sbs, err := e.db.Sandboxes(ctx)
	if err != nil {
		return err
	}
	for _, sb := range sbs {
		r, ok := e.backends[sb.Isolation].(Recoverer)
		if sb.State != model.StateRunning || !ok {
			continue
		}
		if unlock, ok := e.tryLock(sb.ID); ok {
			// One sandbox left stuck does not keep the engine from starting: the next
			// start tries again.
			if err := r.Recover(ctx, e.isb(sb)); err != nil {
				e.cfg.Logf("recover sandbox %s: %v", sb.ID, err)
			}
			unlock()
		} else {
			e.recoverLater(r, sb.ID)
		}
	}
	e.recoverStandbys(ctx)
	if e.alone {
		e.recoverLost(ctx)
	}
	_, err = e.sweep(ctx, false)
	e.recoverImages(ctx)
	e.recoverResidents(ctx)
	return err
}

// recoverLockWait bounds how long recoverLater waits for a sandbox's lock.
const recoverLockWait = time.Minute

// recoverLater recovers sandbox id, whose lock was taken when the engine started, once
// it is free. Another engine working on it holds it, and undoes its own freeze; but so
// may, for a moment, a process a dead engine started (between its fork and its exec, a
// child holds every descriptor of its parent, the lock's included) while the sandbox
// that engine froze waits for a recovery. Skipping it left it frozen until the next
// start (conformance: CrashMidCheckpoint/checkpoint-stopped, 2 runs in 18).
func (e *Engine) recoverLater(r Recoverer, id string) {
	e.background(func(ctx context.Context) {
		ctx, cancel := context.WithTimeout(ctx, recoverLockWait)
		defer cancel()
		go func() {
			select {
			case <-e.closing:
				cancel()
			case <-ctx.Done():
			}
		}()
		unlock, err := e.lock(ctx, id, true)
		if err != nil {
			if !errors.Is(err, context.Canceled) {
				e.cfg.Logf("recover sandbox %s: its lock stayed taken: %v", id, err)
			}
			return
		}
		defer unlock()
		sb, err := e.Get(ctx, id)
		if err != nil || sb.State != model.StateRunning {
			return
		}
		if err := r.Recover(ctx, e.isb(sb)); err != nil {
			e.cfg.Logf("recover sandbox %s: %v", id, err)
		}
	})
}

// recoverLost deletes the checkpoints whose filesystem is gone: a crash of the machine
// took it (a checkpoint's snapshot is published lazily, durable only once the pool is
// synced: Durable checkpoints are, and the others within btrfs's commit interval) while
// its row survived. Its children, if any survived, are re-parented onto its parent, and a
// sandbox whose head it was gets that parent as head. Only an engine alone on the data
// directory runs it (after a crash of the machine, the first to start is): another
// engine's checkpoint has its row before its split snapshot is done (publishLater), and
// was deleted as lost by an engine opened in those milliseconds.
func (e *Engine) recoverLost(ctx context.Context) {
	cks, err := e.db.Checkpoints(ctx)
	if err != nil {
		return
	}
	if _, err := os.Stat(e.pool.Path(checkpointsDir)); err != nil {
		return // no checkpoint directory at all: nothing to judge by
	}
	var lost []string
	for _, ck := range cks {
		// Only a name that is certainly gone (not an unreadable one) counts as lost.
		if _, err := os.Lstat(e.pool.Path(ck.FSVolume)); ck.FSVolume != "" && errors.Is(err, fs.ErrNotExist) {
			e.cfg.Logf("checkpoint %s of sandbox %s lost its filesystem (%s) in a crash of the machine; deleting it", ck.ID, ck.SandboxID, ck.FSVolume)
			lost = append(lost, ck.ID)
		}
	}
	if len(lost) > 0 {
		if err := e.deleteCheckpoints(ctx, lost); err != nil {
			e.cfg.Logf("delete lost checkpoints: %v", err)
		}
	}
}

// Recoverer is an optional ability of an isolation backend: undoing what a checkpoint
// that died halfway left behind in a running sandbox (container: a frozen cgroup, and a
// CRIU still dumping; gVisor: a paused sandbox). Recover is called under the sandbox's
// lock at engine start (or once the lock is free, if another held it then), so it must
// cost nothing when there is nothing to undo.
type Recoverer interface {
	Recover(ctx context.Context, sb *isolation.Sandbox) error
}

var (
	_ Recoverer = (*container.Backend)(nil)
	_ Recoverer = (*gvisor.Backend)(nil)
)

// sweep removes leftovers: staging entries, checkpoint directories without a row, and
// roots no sandbox points at — each only when the owning sandbox's lock is free.
// It returns the pool names it removed.
//
// Other engines may work on the data directory meanwhile, and each thing swept is
// made before its row is written, under a lock, which is released after: so the
// directories are listed first and the rows read after (and the locks looked at in
// between). A thing listed, whose lock was free after the listing, has its row by the
// time the rows are read, or never will. Reading the rows first instead swept things
// recorded in between (conformance ResidentPaths, beside the engine package's tests: a
// checkpoint's volume went while its row stayed).
func (e *Engine) sweep(ctx context.Context, dryRun bool) ([]string, error) {
	var removed []string
	owner := func(name string) string { return strings.SplitN(name, "-", 2)[0] }
	// Staged filesystems (pool staging/<sandbox>-<checkpoint>) and staged images
	// (images/staging-<sandbox>-<checkpoint>) of sandboxes nobody is working on.
	// A staged thing listed while its checkpoint ran is renamed into place before the
	// lock is let go: one gone once the lock is ours was not swept.
	gone := func(path string) bool {
		_, err := os.Lstat(path)
		return os.IsNotExist(err)
	}
	entries, _ := os.ReadDir(e.pool.Path(stagingDir))
	for _, d := range entries {
		if unlock, ok := e.tryLock(owner(d.Name())); ok {
			name := filepath.Join(stagingDir, d.Name())
			if !gone(e.pool.Path(name)) {
				if !dryRun {
					e.removeStaged(ctx, name)
				}
				removed = append(removed, name)
			}
			unlock()
		}
	}
	// Checkpoints' images and volumes, listed before their rows are read.
	type unrecorded struct{ id, name string }
	var listed []unrecorded
	for _, root := range imageRoots {
		for _, id := range e.imageEntries(root) {
			name := filepath.Join(root, id)
			if rest, ok := strings.CutPrefix(id, stagingDir+"-"); ok {
				if unlock, ok := e.tryLock(owner(rest)); ok {
					if !gone(e.imagesPath(name)) {
						if !dryRun {
							e.dropZygotes(e.imagesPath(name))
							os.RemoveAll(e.imagesPath(name))
						}
						removed = append(removed, name)
					}
					unlock()
				}
				continue
			}
			listed = append(listed, unrecorded{id, name})
		}
	}
	entries, _ = os.ReadDir(e.pool.Path(checkpointsDir))
	for _, d := range entries {
		if !btrfs.IsTemporary(d.Name()) {
			listed = append(listed, unrecorded{d.Name(), filepath.Join(checkpointsDir, d.Name())})
		}
	}
	sbs, err := e.db.Sandboxes(ctx)
	if err != nil {
		return nil, err
	}
	roots, ids := map[string]bool{}, map[string]bool{}
	for _, sb := range sbs {
		roots[sb.Root] = true
		ids[sb.ID] = true
	}
	// A checkpoint is renamed into place and then recorded under its sandbox's lock;
	// the row may be about to be written by a running checkpoint.
	if len(listed) > 0 && !e.checkpointInFlight(ids) {
		cks, err := e.db.Checkpoints(ctx)
		if err != nil {
			return nil, err
		}
		known := map[string]bool{}
		for _, c := range cks {
			known[c.ID] = true
		}
		for _, u := range listed {
			if known[u.id] {
				continue
			}
			if !dryRun {
				e.removeCheckpointFiles(ctx, u.id)
			}
			removed = append(removed, u.name)
		}
	}
	// Standbys' roots: one is recorded under its own lock, so it is looked for again
	// once the lock is ours (a claimed standby's root is its sandbox's).
	entries, _ = os.ReadDir(e.pool.Path(standbyDir))
	for _, d := range entries {
		name := filepath.Join(standbyDir, d.Name())
		if roots[name] || btrfs.IsTemporary(d.Name()) {
			continue
		}
		if unlock, ok := e.tryLock(d.Name()); ok {
			if !e.standbyRootUsed(ctx, name) {
				if !dryRun {
					e.stopOrphan(ctx, d.Name(), name)
					e.pool.Delete(ctx, name)
				}
				removed = append(removed, name)
			}
			unlock()
		}
	}
	entries, _ = os.ReadDir(e.pool.Path("roots"))
	for _, d := range entries {
		name := filepath.Join("roots", d.Name())
		if roots[name] || btrfs.IsTemporary(d.Name()) {
			continue
		}
		if unlock, ok := e.tryLock(owner(d.Name())); ok {
			// Re-check under the lock: a rollback may have just switched to it.
			if sb, err := e.db.Sandbox(ctx, owner(d.Name())); err != nil || sb.Root != name {
				if !dryRun {
					e.stopOrphan(ctx, owner(d.Name()), name)
					e.pool.Delete(ctx, name)
				}
				removed = append(removed, name)
			}
			unlock()
		}
	}
	return removed, nil
}

// standbyRootUsed reports whether a standby's row or a sandbox's names root (true, too,
// when the rows cannot be read: nothing is removed on a guess). The standbys are read
// first: a claim moves the root from a standby's row to a sandbox's in one transaction.
func (e *Engine) standbyRootUsed(ctx context.Context, root string) bool {
	standbys, err := e.db.Standbys(ctx)
	if err != nil || slices.ContainsFunc(standbys, func(s *store.Standby) bool { return s.Root == root }) {
		return true
	}
	sbs, err := e.db.Sandboxes(ctx)
	return err != nil || slices.ContainsFunc(sbs, func(sb *model.Sandbox) bool { return sb.Root == root })
}

// stopOrphan ends the tree, if any, that runs on root, a root no record names: a
// standby or a fork whose preparation died after its restore and before its row (each
// tree's cgroups are named after its root). Left alone, it ran (a fork) or stayed
// frozen (a standby) for good, holding its memory. Preconditions: the caller holds the
// lock of id, the root's owner.
func (e *Engine) stopOrphan(ctx context.Context, id, root string) {
	for _, b := range e.backends {
		b.Stop(ctx, &isolation.Sandbox{ID: id, Root: e.pool.Path(root), Cgroup: path.Base(root)})
	}
}

// checkpointInFlight reports whether the lock of any of sandboxes is held: then an
// unrecorded checkpoint may be about to be recorded (a checkpoint is taken and recorded
// under its sandbox's lock), and is left for a later sweep. Other locks (standbys being
// prepared, forks being made) say nothing about checkpoints.
func (e *Engine) checkpointInFlight(sandboxes map[string]bool) bool {
	locks, _ := os.ReadDir(filepath.Join(e.cfg.DataDir, "locks"))
	for _, l := range locks {
		if !sandboxes[l.Name()] {
			continue
		}
		if unlock, ok := e.tryLock(l.Name()); ok {
			unlock()
		} else {
			return true
		}
	}
	return false
}

// GC deletes what nothing references: checkpoints of removed sandboxes that are not in
// the lineage (ancestors of a checkpoint or origin) of any existing sandbox, and
// leftover files.
//
// The checkpoints are read before the sandboxes: a checkpoint read then belongs to a
// sandbox the second read sees, unless it was removed. (In the other order, another
// engine's sandbox created between the reads had its first checkpoints collected.)
func (e *Engine) GC(ctx context.Context) (*model.GCReport, error) {
	cks, err := e.db.Checkpoints(ctx)
	if err != nil {
		return nil, err
	}
	sbs, err := e.db.Sandboxes(ctx)
	if err != nil {
		return nil, err
	}
	byID := map[string]*model.Checkpoint{}
	for _, c := range cks {
		byID[c.ID] = c
	}
	live := map[string]bool{}
	for _, sb := range sbs {
		live[sb.ID] = true
	}
	keep := map[string]bool{}
	mark := func(id string) {
		for c := byID[id]; c != nil && !keep[c.ID]; c = byID[c.Parent] {
			keep[c.ID] = true
		}
	}
	for _, c := range cks {
		if live[c.SandboxID] {
			mark(c.ID)
		}
	}
	for _, sb := range sbs {
		mark(sb.Origin)
		mark(sb.Head)
	}
	rep := &model.GCReport{}
	var victims []string
	for _, c := range cks {
		if !keep[c.ID] {
			victims = append(victims, c.ID)
		}
	}
	if err := e.deleteCheckpoints(ctx, victims); err != nil {
		return nil, err
	}
	rep.Checkpoints = victims
	rep.Volumes, err = e.sweep(ctx, false)
	return rep, err
}

// Leftovers lists what recovery would remove now (staging directories, unrecorded
// checkpoints, unreferenced roots, files of interrupted image rewrites); empty in a
// consistent data directory.
func (e *Engine) Leftovers() []string {
	l, _ := e.sweep(context.Background(), true)
	return append(l, e.imageLeftovers()...)
}
