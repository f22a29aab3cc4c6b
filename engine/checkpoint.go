package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sync"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/phase"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/storage"
)

// Where checkpoints live: the filesystem half is the pool volume checkpoints/<id>, the
// process images the directory imgs/<id> of the data directory, on the image pool (a
// btrfs filesystem of its own, so that images share their parent's pages on disk and
// the pool's usage stays the filesystems'), or images/<id> on the data directory's own
// filesystem (Config.ImagePool "none", or checkpoints taken before the image pool).
// Both halves are built under staging names first.
const (
	stagingDir      = "staging"
	checkpointsDir  = "checkpoints"
	imagesDir       = "images"
	sharedImagesDir = "imgs"
)

// imageRoots are the data directory's roots of image directories, legacy first.
var imageRoots = []string{imagesDir, sharedImagesDir}

// imagesPath is the host path of a data-directory-relative images path.
func (e *Engine) imagesPath(rel string) string { return filepath.Join(e.cfg.DataDir, rel) }

// MaxFork bounds one Fork call.
const MaxFork = 256

// CheckpointOptions are the options of Checkpoint.
type CheckpointOptions struct {
	Label string
	// Durable makes Checkpoint return only once the checkpoint is on disk whole and
	// survives a crash of the machine: a resident checkpoint (zygotes) is otherwise held
	// in memory until its durable copy is written in the background, a fraction of a
	// second later, and the filesystem's commit and the metadata's sync come later still
	// (btrfs commits every 30 s); a crash of the machine in between loses it, which
	// recovery reports and deletes (a crash of cairn loses nothing).
	Durable bool
}

// Checkpoint takes a joint checkpoint of a running sandbox: the sandbox is frozen, its
// root is snapshotted read-only, its process tree is dumped, and it is thawed. On any
// failure the sandbox keeps running unchanged and nothing is recorded.
func (e *Engine) Checkpoint(ctx context.Context, id string, opts CheckpointOptions) (*model.Checkpoint, error) {
	if len(opts.Label) > 256 {
		return nil, errdefs.InvalidArgument("label is %d bytes long; keep it under 256", len(opts.Label))
	}
	phases := map[string]float64{}
	var phasesMu sync.Mutex
	trace := phase.Of(ctx)
	record := func(name string, d time.Duration) {
		phasesMu.Lock()
		phases[name] = float64(d.Microseconds()) / 1000
		phasesMu.Unlock()
		if trace != nil {
			trace(name, d)
		}
	}
	start := time.Now()
	unlock, err := e.lock(ctx, id, true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	record("lock", time.Since(start))
	t := time.Now()
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if sb.State != model.StateRunning {
		return nil, errdefs.FailedPrecondition("sandbox %s is stopped; resume it first with `cairn resume %s`", id, id)
	}
	e.touch(id)
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return nil, err
	}
	ck := &model.Checkpoint{ID: newID("", 12), SandboxID: id, Parent: sb.Head, Label: opts.Label,
		Isolation: sb.Isolation, Method: method(b)}
	final := filepath.Join(checkpointsDir, ck.ID)
	// Where the pool splits a snapshot (storage.SplitSnapshotter), it is made under its
	// final name, the processes run again once its content is fixed, and the rest of its
	// commit goes on after the call returns (publish, below; the pool's operations on it
	// wait for it meanwhile). Otherwise the read-only snapshot is staged inside a plain
	// directory (a read-only subvolume cannot be renamed itself, its directory can) and
	// renamed into place.
	sp, split := e.pool.(storage.SplitSnapshotter)
	split = split && !e.cfg.NoSplitSnapshots
	staged := filepath.Join(stagingDir, id+"-"+ck.ID)
	fsAt := filepath.Join(staged, "fs")
	if split {
		fsAt = filepath.Join(final, "fs")
	}
	stagedImages := e.imagesPath(filepath.Join(e.imgRoot, stagingDir+"-"+id+"-"+ck.ID))
	if err := os.MkdirAll(stagedImages, 0o700); err != nil {
		return nil, err
	}
	var published func() error // the split snapshot's end, until waited for
	waitFS := func() error {
		if published == nil {
			return nil
		}
		err := published()
		published = nil
		return err
	}
	cleanup := func() {
		waitFS()
		e.pool.Delete(context.WithoutCancel(ctx), fsAt)
		os.RemoveAll(e.pool.Path(staged))
		if split {
			os.Remove(e.pool.Path(final))
		}
		os.RemoveAll(stagedImages)
	}
	record("prepare", time.Since(t))
	hooks := isolation.Hooks{Phase: record, Frozen: func(ctx context.Context) error {
		crashPoint("checkpoint-stopped")
		t := time.Now()
		// Not durable across a crash of the machine at once: the row written next is not
		// either (synchronous=NORMAL), and Durable syncs both (syncCheckpoint).
		var err error
		if split {
			published, err = sp.SnapshotSplit(ctx, sb.Root, fsAt, true)
		} else {
			err = e.snapshotLazy(ctx, sb.Root, fsAt, true)
		}
		record("fs_snapshot", time.Since(t))
		if err == nil {
			crashPoint("checkpoint-frozen")
		}
		return err
	}, Dumped: func() { crashPoint("checkpoint-dumped") }}
	// Resident (zygotes) where the backend and the sandbox's processes allow it, else a
	// CRIU dump, with the reason recorded next to its images.
	resident, why := false, ""
	if r, ok := e.residentOf(b); ok {
		resident, why, err = e.checkpointResident(ctx, r, e.isb(sb), stagedImages, hooks)
		if err != nil {
			cleanup()
			return nil, err
		}
		if !resident {
			// Found ineligible once the snapshot was under way (it runs beside the
			// forks): the CRIU path takes its own.
			waitFS()
			if e.pool.Exists(fsAt) {
				if err := e.pool.Delete(ctx, fsAt); err != nil {
					cleanup()
					return nil, err
				}
			}
		}
	}
	if resident {
		ck.Method = methodZygote
	} else {
		// A CRIU dump of the tree would take zygotes (children of init) in.
		if err := e.settleResidents(ctx, sb); err != nil {
			cleanup()
			return nil, err
		}
		// Flush the root's dirty data before the freeze, so that the snapshot inside it
		// has little left to write (after 200 MB of fresh writes it took 540 ms). The
		// resident path does without: its processes stop for the snapshot as well, but a
		// flush of its own is one btrfs commit more on the critical path (~7-12 ms under
		// W1), and the snapshot flushes the root anyway.
		t := time.Now()
		e.pool.Sync(ctx, sb.Root)
		record("sync", time.Since(t))
		if err := b.Checkpoint(ctx, e.isb(sb), stagedImages, hooks); err != nil {
			cleanup()
			return nil, err
		}
		if why != "" {
			os.WriteFile(filepath.Join(stagedImages, whyFile), []byte(why), 0o600)
		}
	}
	crashPoint("checkpoint-staged")
	// Publish both halves under their final names; the metadata row written next is what
	// makes the checkpoint exist.
	t = time.Now()
	ck.FSVolume = filepath.Join(final, "fs")
	ck.Images = filepath.Join(e.imgRoot, ck.ID)
	if !split {
		os.MkdirAll(e.pool.Path(checkpointsDir), 0o755)
		if err := os.Rename(e.pool.Path(staged), e.pool.Path(final)); err != nil {
			cleanup()
			return nil, fmt.Errorf("publish checkpoint: %w", err)
		}
	}
	if err := os.Rename(stagedImages, e.imagesPath(ck.Images)); err != nil {
		e.removeCheckpointFiles(context.WithoutCancel(ctx), ck.ID)
		cleanup()
		return nil, fmt.Errorf("publish checkpoint images: %w", err)
	}
	crashPoint("checkpoint-published")
	ck.ImageBytes = DirBytes(e.imagesPath(ck.Images))
	ck.CreatedAt = time.Now().UTC()
	sb.Head = ck.ID
	record("publish", time.Since(t))
	t = time.Now()
	ck.PhasesMS = phases // the backend's phases, some reported from another goroutine, are all in
	ck.DurationMS = float64(time.Since(start).Microseconds()) / 1000
	if err := e.db.AddCheckpoint(ctx, ck, sb); err != nil {
		waitFS()
		e.removeCheckpointFiles(context.WithoutCancel(ctx), ck.ID)
		return nil, err
	}
	phase.Since(ctx, "row", t)
	if published != nil {
		e.publishLater(ck, published)
	}
	if resident {
		// Images, compaction and the eviction of the oldest resident checkpoints follow
		// the durable copy.
		e.durableLater(ck.ID)
		if opts.Durable {
			if err := e.ensureDurable(ctx, ck); err != nil {
				return nil, err
			}
			return ck, e.syncCheckpoint(ctx, ck)
		}
		return ck, nil
	}
	e.refill(ck, e.cfg.Standbys)
	e.compactLater(ck)
	if opts.Durable {
		return ck, e.syncCheckpoint(ctx, ck)
	}
	return ck, nil
}

// snapshotLazy is the pool's SnapshotLazy where it has one, else its Snapshot. What it
// makes need not survive a crash of the machine on its own: a checkpoint's filesystem is
// recorded by a row that is not synced either (Durable syncs both, recoverLost deletes a
// row whose filesystem a crash took), and a sandbox's root is replaced on resume (the
// crash ended its processes).
func (e *Engine) snapshotLazy(ctx context.Context, src, dst string, readonly bool) error {
	if l, ok := e.pool.(storage.LazySnapshotter); ok {
		return l.SnapshotLazy(ctx, src, dst, readonly)
	}
	return e.pool.Snapshot(ctx, src, dst, readonly)
}

// syncCheckpoint makes a checkpoint durable across a crash of the machine: its
// filesystem's name (published by a lazy snapshot and a rename), its row, and its images
// (synced when written). Without it a machine crash may lose the latest checkpoints,
// which recovery then deletes (recoverLost).
func (e *Engine) syncCheckpoint(ctx context.Context, ck *model.Checkpoint) error {
	if err := e.pool.Sync(ctx, ck.FSVolume); err != nil {
		return fmt.Errorf("checkpoint %s: sync its filesystem: %w", ck.ID, err)
	}
	if err := e.db.Sync(ctx); err != nil {
		return fmt.Errorf("checkpoint %s: sync its record: %w", ck.ID, err)
	}
	return nil
}

// crashPoint kills the process when CAIRN_TEST_CRASH_AT names this point, so tests can
// prove that a SIGKILL at that line leaves no half-written state (the points of
// criu/incremental's rewrites are named there, with the same variable). Some points run
// while the container backend injects system calls into stopped processes on another
// thread (the snapshot of a resident checkpoint, beside the forks): the kill waits
// until no process is inside an injected call (ptrace.Between), where a real crash
// leaves every process whole, so that each point tests one state.
func crashPoint(name string) {
	if os.Getenv("CAIRN_TEST_CRASH_AT") == name {
		ptrace.Between(func() {
			p, _ := os.FindProcess(os.Getpid())
			p.Kill()
			select {}
		})
	}
}

// DirBytes is the total size of the files under dir: a checkpoint's ImageBytes.
func DirBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// GetCheckpoint returns one checkpoint, with how its images are stored and why
// (ImagesDepth, MethodReason).
func (e *Engine) GetCheckpoint(ctx context.Context, id string) (*model.Checkpoint, error) {
	return e.withDepth(e.checkpoint(ctx, id))
}

// checkpoint returns one checkpoint's row: what rollback, fork and the other operations
// need, without GetCheckpoint's look at the images.
func (e *Engine) checkpoint(ctx context.Context, id string) (*model.Checkpoint, error) {
	if !validID(id) {
		return nil, errdefs.InvalidArgument("%q is not a checkpoint ID (IDs are lowercase letters and digits)", id)
	}
	return e.db.Checkpoint(ctx, id)
}

// inLineage reports whether checkpoint ck may be a rollback target of sb: one of sb's own
// checkpoints, or an ancestor of its head or origin.
func (e *Engine) inLineage(ctx context.Context, sb *model.Sandbox, ck *model.Checkpoint) (bool, error) {
	if ck.SandboxID == sb.ID {
		return true, nil
	}
	all, err := e.db.Checkpoints(ctx)
	if err != nil {
		return false, err
	}
	byID := map[string]*model.Checkpoint{}
	for _, c := range all {
		byID[c.ID] = c
	}
	for _, start := range []string{sb.Head, sb.Origin} {
		for c := byID[start]; c != nil; c = byID[c.Parent] {
			if c.ID == ck.ID {
				return true, nil
			}
		}
	}
	return false, nil
}

// Rollback returns a sandbox, files and processes, to a checkpoint in its lineage. The
// sandbox keeps its ID; the checkpoint becomes its head, so the next checkpoint branches
// from it.
func (e *Engine) Rollback(ctx context.Context, id, checkpointID string) error {
	t := time.Now()
	unlock, err := e.lock(ctx, id, true)
	if err != nil {
		return err
	}
	defer unlock()
	phase.Since(ctx, "lock", t)
	t = time.Now()
	sb, err := e.Get(ctx, id)
	if err != nil {
		return err
	}
	ck, err := e.checkpoint(ctx, checkpointID)
	if err != nil {
		return err
	}
	ok, err := e.inLineage(ctx, sb, ck)
	if err != nil {
		return err
	}
	if !ok {
		return errdefs.InvalidArgument("checkpoint %s belongs to sandbox %s, not to the lineage of %s; fork it instead: `cairn fork %s`", ck.ID, ck.SandboxID, id, ck.ID)
	}
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return err
	}
	phase.Since(ctx, "lookup", t)
	// A crash from here on leaves the mark (resident.go); a completed rollback clears it.
	defer clearRollback(e.cfg.DataDir, id)
	e.touch(id)
	// Records being removed in the background show again as the checkpoint has them.
	defer e.unhide(id)
	// Fastest path: the checkpoint is resident in this very sandbox; next, it was and its
	// images go back into the sandbox's running init, which keeps the others resident.
	if r, ok := e.residentOf(b); ok && sb.State == model.StateRunning {
		done, err := e.rollbackResident(ctx, r, sb, ck)
		if !done && err == nil {
			// Read again: the checkpoint may have just been evicted (its durable copy
			// written, then its zygotes ended) by the background.
			if ck, err = e.checkpoint(ctx, checkpointID); err != nil {
				return err
			}
			done, err = e.rollbackDurable(ctx, r, sb, ck)
		}
		if done {
			return nil
		}
		if err != nil {
			// The sandbox has lost its processes, but its init runs and its other
			// checkpoints' zygotes live: the checkpoint's images (written now if need be,
			// ~0.3 s) go back into that init, as for an evicted checkpoint. A new
			// generation, below, would first make every resident checkpoint durable
			// (seconds when their durable copies are behind, as in a tree search).
			e.cfg.Logf("rollback of %s to %s in place failed (%v); restoring its images into the sandbox", id, ck.ID, err)
			if done, err := e.rollbackFromImages(ctx, r, sb, ck.ID); done {
				return nil
			} else if err != nil {
				e.cfg.Logf("rollback of %s to %s from its images into the sandbox failed (%v); restoring them in a new generation", id, ck.ID, err)
			}
		}
	}
	// Every other path gives the sandbox a new generation (root, init), in which its
	// resident checkpoints' zygotes would be stranded: make them durable and end them.
	if err := e.settleResidents(ctx, sb); err != nil {
		return err
	}
	if ck, err = e.checkpoint(ctx, checkpointID); err != nil {
		return fmt.Errorf("checkpoint %s was lost with its zygotes: %w", checkpointID, err)
	}
	// Fast path: a standby of the checkpoint is already restored and frozen.
	old := *sb
	if ok, err := e.takeStandby(ctx, sb, ck, nil); err != nil {
		return err
	} else if ok {
		e.retire(b, &old)
		e.refill(ck, 1) // replace what was taken: the pool of a checkpoint keeps its size
		return nil
	}
	newRoot := rootVolume(id)
	// The new root is ready before the old tree stops, to keep the gap short.
	if err := e.snapshotLazy(ctx, ck.FSVolume, newRoot, false); err != nil {
		return err
	}
	isb := e.isb(sb)
	if err := b.Stop(ctx, isb); err != nil {
		e.pool.Delete(ctx, newRoot)
		return err
	}
	oldRoot := sb.Root
	isb.Root, isb.Cgroup = e.pool.Path(newRoot), path.Base(newRoot)
	if err := b.Restore(ctx, isb, e.imagesPath(ck.Images)); err != nil {
		e.pool.Delete(context.WithoutCancel(ctx), newRoot)
		sb.State, sb.Init = model.StateStopped, isolation.Proc{}
		e.db.PutSandbox(ctx, sb)
		return fmt.Errorf("rollback of %s to %s: %w (the sandbox is stopped; `cairn resume %s` retries from %s)", id, ck.ID, err, id, sb.Head)
	}
	sb.Root, sb.Head, sb.State, sb.Init = newRoot, ck.ID, model.StateRunning, isb.Init
	if err := e.db.PutSandbox(ctx, sb); err != nil {
		return err
	}
	e.refillIfNone(ctx, ck)
	// Deleted only once the metadata no longer points at it.
	if err := e.pool.Delete(ctx, oldRoot); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("rolled back, but removing the old root failed: %w", err)
	}
	return nil
}

// rollbackFromImages rolls sb back to the checkpoint id by restoring its per-process
// images into sb's running init (rollbackDurable), after writing them if the checkpoint
// has none yet. It returns false, with nothing done, where rollbackDurable does.
func (e *Engine) rollbackFromImages(ctx context.Context, r isolation.Resident, sb *model.Sandbox, id string) (bool, error) {
	if err := e.makeDurable(ctx, id); err != nil {
		return false, fmt.Errorf("write its durable copy: %w", err)
	}
	ck, err := e.checkpoint(ctx, id)
	if err != nil {
		return false, err
	}
	return e.rollbackDurable(ctx, r, sb, ck)
}

// Fork makes count new sandboxes from a checkpoint, each with its own root, restored
// processes and identity (ID, hostname, machine-id).
func (e *Engine) Fork(ctx context.Context, checkpointID string, count int) ([]*model.Sandbox, error) {
	if count < 1 || count > MaxFork {
		return nil, errdefs.InvalidArgument("fork count %d: give 1 to %d", count, MaxFork)
	}
	ck, err := e.checkpoint(ctx, checkpointID)
	if err != nil {
		return nil, err
	}
	src, err := e.db.Sandbox(ctx, ck.SandboxID)
	if err != nil {
		// The source sandbox may be gone; its checkpoint still forks with defaults.
		src = &model.Sandbox{Isolation: ck.Isolation}
		if src.Isolation == "" {
			src.Isolation = "container" // recorded before schema 2
		}
	}
	b, err := e.backend(src.Isolation)
	if err != nil {
		return nil, err
	}
	// Forks restore images: a resident checkpoint's durable copy must be written.
	if err := e.ensureDurable(ctx, ck); err != nil {
		return nil, err
	}
	out := make([]*model.Sandbox, count)
	errs := make([]error, count)
	// Ready standbys first: all claimed in one transaction and thawed together.
	warm, err := e.forkWarm(ctx, b, src, ck, count)
	copy(out, warm)
	if err != nil {
		for _, sb := range warm {
			e.Remove(context.WithoutCancel(ctx), sb.ID)
		}
		return nil, err
	}
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for i := len(warm); i < count; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			out[i], errs[i] = e.forkOne(ctx, b, src, ck)
		}(i)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, sb := range out {
			if sb != nil {
				e.Remove(context.WithoutCancel(ctx), sb.ID)
			}
		}
		return nil, err
	}
	// Replace the standbys taken, once every fork runs.
	e.refill(ck, len(warm))
	return out, nil
}

// forkRecord is the record of a new fork of ck from src, before it has a root.
func forkRecord(b isolation.Backend, src *model.Sandbox, ck *model.Checkpoint) *model.Sandbox {
	id := newID("", 12)
	labels := map[string]string{}
	for k, v := range src.Labels {
		labels[k] = v
	}
	return &model.Sandbox{
		ID: id, Template: src.Template, Isolation: b.Name(), State: model.StateRunning, Hostname: id,
		Head: ck.ID, Origin: ck.ID, Labels: labels, Limits: src.Limits, CreatedAt: time.Now().UTC(),
		Root: rootVolume(id),
	}
}

func (e *Engine) forkOne(ctx context.Context, b isolation.Backend, src *model.Sandbox, ck *model.Checkpoint) (*model.Sandbox, error) {
	sb := forkRecord(b, src, ck)
	id := sb.ID
	unlock, err := e.lock(ctx, id, true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	identity := func(root string) error { return writeIdentity(root, id) }
	if ok, err := e.takeStandby(ctx, sb, ck, identity); err != nil {
		return nil, err
	} else if ok {
		e.refill(ck, 1)
		return sb, nil
	}
	if err := e.snapshotLazy(ctx, ck.FSVolume, sb.Root, false); err != nil {
		return nil, err
	}
	if err := writeIdentity(e.pool.Path(sb.Root), id); err != nil {
		e.pool.Delete(ctx, sb.Root)
		return nil, err
	}
	isb := e.isb(sb)
	if err := b.Restore(ctx, isb, e.imagesPath(ck.Images)); err != nil {
		e.pool.Delete(context.WithoutCancel(ctx), sb.Root)
		return nil, fmt.Errorf("fork of %s: %w", ck.ID, err)
	}
	sb.Init = isb.Init
	crashPoint("fork-restored")
	if err := e.db.PutSandbox(ctx, sb); err != nil {
		b.Stop(ctx, isb)
		e.pool.Delete(ctx, sb.Root)
		return nil, err
	}
	e.refillIfNone(ctx, ck)
	return sb, nil
}

// Tree returns the checkpoints of a sandbox's lineage: its own, and the ancestors of
// its origin, oldest first. Each names its parent.
func (e *Engine) Tree(ctx context.Context, id string) ([]*model.Checkpoint, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	all, err := e.db.Checkpoints(ctx)
	if err != nil {
		return nil, err
	}
	byID := map[string]*model.Checkpoint{}
	for _, c := range all {
		byID[c.ID] = c
	}
	keep := map[string]bool{}
	for _, c := range all {
		if c.SandboxID == id {
			for a := c; a != nil && !keep[a.ID]; a = byID[a.Parent] {
				keep[a.ID] = true
			}
		}
	}
	for a := byID[sb.Origin]; a != nil && !keep[a.ID]; a = byID[a.Parent] {
		keep[a.ID] = true
	}
	var out []*model.Checkpoint
	for _, c := range all {
		if keep[c.ID] {
			out = append(out, c)
		}
	}
	return out, nil
}

// DeleteCheckpoint deletes a checkpoint. With children (later checkpoints branching from
// it) it refuses unless cascade, which deletes the whole subtree; without cascade a leaf
// is removed and nothing else changes. A deleted checkpoint's descendants never break:
// their filesystems are independent copies, and images incremental against the deleted
// ones are rebased first (removeImages).
func (e *Engine) DeleteCheckpoint(ctx context.Context, id string, cascade bool) ([]string, error) {
	ck, err := e.checkpoint(ctx, id)
	if err != nil {
		return nil, err
	}
	all, err := e.db.Checkpoints(ctx)
	if err != nil {
		return nil, err
	}
	children := map[string][]string{}
	for _, c := range all {
		children[c.Parent] = append(children[c.Parent], c.ID)
	}
	if len(children[ck.ID]) > 0 && !cascade {
		return nil, errdefs.FailedPrecondition("checkpoint %s has %d child checkpoint(s); delete them first or pass --cascade to delete the subtree", id, len(children[ck.ID]))
	}
	var victims []string
	var walk func(string)
	walk = func(c string) {
		for _, k := range children[c] {
			walk(k)
		}
		victims = append(victims, c)
	}
	walk(ck.ID)
	if err := e.deleteCheckpoints(ctx, victims); err != nil {
		return nil, err
	}
	return victims, nil
}

// deleteCheckpoints deletes checkpoints, rows first: once they are gone nobody can use
// the files. Their children are re-parented onto their parents, rows and images.
func (e *Engine) deleteCheckpoints(ctx context.Context, victims []string) error {
	if err := e.db.DeleteCheckpoints(ctx, victims); err != nil {
		return err
	}
	e.dropStandbys(ctx, victims)
	for _, v := range victims {
		e.removeCheckpointFiles(ctx, v)
	}
	return nil
}

func (e *Engine) removeCheckpointFiles(ctx context.Context, id string) {
	for _, root := range imageRoots {
		e.dropZygotes(e.imagesPath(filepath.Join(root, id)))
	}
	e.removeStaged(ctx, filepath.Join(checkpointsDir, id))
	e.removeImages(ctx, id)
}

// dropZygotes ends the zygotes of an images directory, if it has some.
func (e *Engine) dropZygotes(dir string) {
	for _, b := range e.backends {
		if r, ok := b.(isolation.Resident); ok {
			if err := r.DropResident(dir); err != nil {
				e.cfg.Logf("end the zygotes of %s: %v", dir, err)
			}
		}
	}
}

// removeStaged removes a pool directory holding a checkpoint's "fs" volume.
func (e *Engine) removeStaged(ctx context.Context, dir string) {
	e.pool.Delete(ctx, filepath.Join(dir, "fs"))
	os.RemoveAll(e.pool.Path(dir))
}

// retire stops a tree a sandbox no longer runs and deletes its root, in the background:
// the sandbox already runs on its new root and cgroups.
func (e *Engine) retire(b isolation.Backend, old *model.Sandbox) {
	isb := e.isb(old)
	e.background(func(ctx context.Context) {
		if err := b.Stop(ctx, isb); err != nil {
			e.cfg.Logf("stop the replaced tree of %s: %v", old.ID, err)
		}
		if err := e.pool.Delete(ctx, old.Root); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			e.cfg.Logf("delete the replaced root of %s: %v", old.ID, err)
		}
	})
}

// method names how a backend captures the process half, for Checkpoint.Method.
func method(b isolation.Backend) string {
	switch b.Name() {
	case "container":
		return "criu-full"
	case "gvisor":
		return "runsc-save"
	}
	return b.Name()
}

// publishLater waits, in the background, for the end of the split snapshot of ck's
// filesystem (storage.SplitSnapshotter), which the checkpoint's call did not wait for.
// The kernel finishes it even if cairn dies meanwhile; should it fail (the filesystem
// turned read-only, say), the checkpoint is deleted and the failure logged.
func (e *Engine) publishLater(ck *model.Checkpoint, published func() error) {
	e.background(func(ctx context.Context) {
		if err := published(); err != nil {
			e.cfg.Logf("checkpoint %s of sandbox %s: its filesystem's snapshot failed once the sandbox ran again, deleting the checkpoint: %v", ck.ID, ck.SandboxID, err)
			if err := e.deleteCheckpoints(ctx, []string{ck.ID}); err != nil {
				e.cfg.Logf("delete checkpoint %s: %v", ck.ID, err)
			}
		}
	})
}
