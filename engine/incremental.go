package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/criu/incremental"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container"
)

// Incremental process images. A container checkpoint is dumped in full (CRIU cannot
// track dirty memory on kernels without soft-dirty bits), on the critical path. Once its
// row is committed, a background compaction rewrites its images against its parent
// checkpoint's (package criu/incremental): pages equal to the parent's become PE_PARENT
// and leave the directory, which gets a relative "parent" link CRIU follows at restore.
// The row then says method "criu-incremental" and the bytes now on disk.
//
// Invariants:
//   - A directory's parent link names its checkpoint's parent row (Parent), or nothing;
//     chains are at most incremental.MaxDepth long. A checkpoint whose parent is at the
//     maximum depth stays full and starts a new chain.
//   - Before a checkpoint's images are removed, every directory linked to them is
//     rebased onto their own parent (removeImages), so no survivor breaks. Rebase, rather
//     than flatten: it copies only the pages the removed directory held itself, keeping
//     the survivor incremental.
//   - CRIU restores hold the images read lock (a restore reads a whole chain); the
//     rewrites take it exclusively only around their renames.
//   - Compactions and image removals are serialized by the compaction lock, across
//     processes sharing the data directory: a removal never runs between a compaction's
//     check that its parent exists and its switch.

// Checkpoint methods of the container backend.
const (
	methodFull        = "criu-full"
	methodIncremental = "criu-incremental"
	// methodShared: full images on the image pool whose pages equal to the parent's
	// share its data on disk (incremental.Share).
	methodShared = "criu-shared"
)

// imagesGuard is a read-write lock over image directories, for this process (mu) and
// across processes (an flock on DataDir/images.lock). Its Lock and Unlock make it the
// sync.Locker a rewrite switches under.
type imagesGuard struct {
	path string
	mu   sync.RWMutex
	// f holds the exclusive flock; protected by mu (held for writing).
	f *os.File
}

func flockFile(path string, how int) *os.File {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil // an unwritable data directory fails elsewhere, loudly
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil
	}
	return f
}

// rlock takes the read lock and returns its release.
func (g *imagesGuard) rlock() func() {
	g.mu.RLock()
	f := flockFile(g.path, unix.LOCK_SH)
	return func() {
		if f != nil {
			f.Close()
		}
		g.mu.RUnlock()
	}
}

func (g *imagesGuard) Lock() {
	g.mu.Lock()
	g.f = flockFile(g.path, unix.LOCK_EX)
}

func (g *imagesGuard) Unlock() {
	if g.f != nil {
		g.f.Close()
		g.f = nil
	}
	g.mu.Unlock()
}

// guardedContainer is the container backend with every CRIU restore under the images
// read lock. Embedding keeps the backend's optional abilities (isolation.Activator,
// ...) visible to type assertions.
type guardedContainer struct {
	*container.Backend
	images *imagesGuard
}

func (g guardedContainer) Restore(ctx context.Context, sb *isolation.Sandbox, dir string) error {
	defer g.images.rlock()()
	return g.Backend.Restore(ctx, sb, dir)
}

func (g guardedContainer) RollbackDurable(ctx context.Context, sb *isolation.Sandbox, dir string, hooks isolation.RollbackHooks) error {
	defer g.images.rlock()()
	return g.Backend.RollbackDurable(ctx, sb, dir, hooks)
}

func (g guardedContainer) RestoreFrozen(ctx context.Context, sb *isolation.Sandbox, dir string) error {
	defer g.images.rlock()()
	return g.Backend.RestoreFrozen(ctx, sb, dir)
}

// lockCompaction takes the compaction lock and returns its release.
func (e *Engine) lockCompaction() func() {
	e.compactMu.Lock()
	f := flockFile(filepath.Join(e.cfg.DataDir, "compact.lock"), unix.LOCK_EX)
	return func() {
		if f != nil {
			f.Close()
		}
		e.compactMu.Unlock()
	}
}

// compactLater queues the compaction of a just-committed checkpoint (or of a resident
// checkpoint whose durable copy was just written). One background worker compacts in
// commit order, so a parent is compacted before its child and the child's depth is
// final when it is measured.
func (e *Engine) compactLater(ck *model.Checkpoint) {
	if ck.Method != methodFull && ck.Method != methodZygoteImages || ck.Parent == "" {
		return
	}
	e.bgMu.Lock()
	e.compactQ = append(e.compactQ, ck.ID)
	start := !e.compacting
	e.compacting = true
	e.bgMu.Unlock()
	if start {
		e.background(func(ctx context.Context) {
			lowPriorityThread()
			for {
				e.bgMu.Lock()
				if len(e.compactQ) == 0 {
					e.compacting = false
					e.bgMu.Unlock()
					return
				}
				id := e.compactQ[0]
				e.compactQ = e.compactQ[1:]
				e.bgMu.Unlock()
				if err := e.compact(ctx, id); err != nil {
					e.cfg.Logf("compact the images of checkpoint %s: %v", id, err)
				}
			}
		})
	}
}

// Image directories. A CRIU dump of a tree has one, images/<checkpoint>, with every task
// in it; the durable copy of a resident checkpoint one per process,
// images/<checkpoint>/procs/<pid>, each compacted against the directory of the same
// process in the parent checkpoint (its own per-process directory, or the parent's tree
// directory, where the process is a task like any other).

// taskDirs returns the per-process image directories of a checkpoint's durable copy
// (none for other checkpoints), by process ID.
func (e *Engine) taskDirs(ck *model.Checkpoint) map[string]string {
	base := filepath.Join(e.imagesPath(ck.Images), procsDir)
	ents, _ := os.ReadDir(base)
	out := map[string]string{}
	for _, d := range ents {
		if d.IsDir() && !strings.HasSuffix(d.Name(), ".tmp") {
			out[d.Name()] = filepath.Join(base, d.Name())
		}
	}
	return out
}

// procsDir is the subdirectory of a resident checkpoint's per-process images
// (isolation/container).
const procsDir = "procs"

// parentTaskDir is the directory that process pid's images of a checkpoint compact
// against in its parent checkpoint p, or "" if p has none for it.
func (e *Engine) parentTaskDir(p *model.Checkpoint, pid string) string {
	switch p.Method {
	case methodZygoteImages:
		return e.taskDirs(p)[pid]
	case methodFull, methodIncremental, methodShared:
		dir := e.imagesPath(p.Images)
		if _, err := os.Stat(filepath.Join(dir, "pagemap-"+pid+".img")); err == nil {
			return dir
		}
	}
	return ""
}

// compact rewrites checkpoint id's images against its parent's, if both still exist,
// have CRIU images and the chain has room.
func (e *Engine) compact(ctx context.Context, id string) error {
	crashPoint("compact-start")
	unlock := e.lockCompaction()
	defer unlock()
	ck, err := e.db.Checkpoint(ctx, id)
	if err != nil || ck.Method != methodFull && ck.Method != methodZygoteImages || ck.Parent == "" {
		return nil // deleted meanwhile, or not a candidate
	}
	p, err := e.db.Checkpoint(ctx, ck.Parent)
	if err != nil {
		return nil
	}
	start := time.Now()
	dir := e.imagesPath(ck.Images)
	before := DirBytes(dir)
	// The directories to compact, each with its parent's.
	pairs := map[string]string{}
	if ck.Method == methodFull {
		if p.Method == methodFull || p.Method == methodIncremental || p.Method == methodShared {
			pairs[dir] = e.imagesPath(p.Images)
		}
	} else {
		for pid, d := range e.taskDirs(ck) {
			if pd := e.parentTaskDir(p, pid); pd != "" {
				pairs[d] = pd
			}
		}
	}
	if e.onImagePool(dir) {
		return e.share(ctx, ck, pairs, start, before)
	}
	linked := false
	for d, pd := range pairs {
		if depth, err := incremental.Depth(pd); err != nil || depth+1 > incremental.MaxDepth {
			if err != nil {
				return err
			}
			continue
		}
		if _, err := incremental.Compact(d, pd, incremental.Options{Switch: e.images}); err != nil {
			return err
		}
		if l, _ := incremental.Parent(d); l != "" {
			linked = true
		}
	}
	crashPoint("compact-done")
	after := DirBytes(dir)
	e.count(func(st *Stats) {
		st.Compactions++
		st.CompactionMS += float64(time.Since(start).Microseconds()) / 1000
		st.CompactionSavedBytes += before - after
	})
	if !linked {
		return nil // nothing shared with the parent: stays full
	}
	method := ck.Method
	if method == methodFull {
		method = methodIncremental
	}
	return e.db.SetCheckpointImages(ctx, id, method, after)
}

// onImagePool reports whether an images directory is on the image pool.
func (e *Engine) onImagePool(dir string) bool {
	rel, err := filepath.Rel(e.imagesPath(sharedImagesDir), dir)
	return err == nil && !strings.HasPrefix(rel, "..")
}

// share is compact for images on the image pool: each directory's pages equal to its
// parent's come to share the parent's data (incremental.Share); they stay full and
// standalone, with no chain to bound. A parent elsewhere (taken before the image pool)
// leaves the directory as it is. The row then counts the bytes the images hold alone.
func (e *Engine) share(ctx context.Context, ck *model.Checkpoint, pairs map[string]string, start time.Time, before int64) error {
	var sharedBytes int64
	done := false
	for d, pd := range pairs {
		if !e.onImagePool(pd) {
			continue
		}
		res, err := incremental.Share(d, pd, incremental.ShareOptions{Compress: true})
		if err != nil {
			return err
		}
		sharedBytes += res.SharedBytes()
		// A directory shared before a crash says what it shares (its marker).
		done = done || res.Tasks > 0 || res.SharedPages > 0
	}
	crashPoint("compact-done")
	after := DirBytes(e.imagesPath(ck.Images)) - sharedBytes
	e.count(func(st *Stats) {
		st.Compactions++
		st.CompactionMS += float64(time.Since(start).Microseconds()) / 1000
		st.CompactionSavedBytes += before - after
	})
	if !done {
		return nil
	}
	method := ck.Method
	if method == methodFull {
		method = methodShared
	}
	return e.db.SetCheckpointImages(ctx, ck.ID, method, after)
}

// removeImages removes a checkpoint's images directory after rebasing every directory
// linked to it (or to one of its per-process directories) onto its own parent. If a
// rebase fails the directory is kept (a later sweep retries): a leftover is better than
// a broken survivor.
//
// Preconditions: the checkpoint's row is gone (nothing new can start from it).
func (e *Engine) removeImages(ctx context.Context, id string) {
	for _, root := range imageRoots {
		if dir := e.imagesPath(filepath.Join(root, id)); exists(dir) {
			e.removeImagesDir(ctx, id, dir)
		}
	}
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// removeImagesDir is removeImages for one directory. Images on the image pool have no
// parent link to them, and share extents the filesystem counts: they just go.
func (e *Engine) removeImagesDir(ctx context.Context, id, dir string) {
	unlock := e.lockCompaction()
	defer unlock()
	for _, child := range e.linkedTo(dir) {
		res, err := incremental.Rebase(child, incremental.Options{Switch: e.images})
		if err != nil {
			e.cfg.Logf("rebase the images of %s off %s: %v (kept %s)", child, id, err, dir)
			return
		}
		crashPoint("rebase-done")
		if res.Tasks > 0 {
			e.recordImages(ctx, child)
		}
	}
	e.images.Lock()
	defer e.images.Unlock()
	os.RemoveAll(dir)
}

// recordImages brings the row of the checkpoint owning image directory d in line with
// the disk (its method and bytes), after a rebase of d.
func (e *Engine) recordImages(ctx context.Context, d string) {
	rel, err := filepath.Rel(e.imagesPath(imagesDir), d)
	if err != nil || strings.HasPrefix(rel, "..") {
		return // not a legacy directory: nothing is ever rebased onto the image pool's
	}
	id := strings.SplitN(rel, string(filepath.Separator), 2)[0]
	ck, err := e.db.Checkpoint(ctx, id)
	if err != nil {
		return
	}
	method := ck.Method
	if method == methodIncremental || method == methodFull {
		method = methodIncremental
		if p, _ := incremental.Parent(d); p == "" {
			method = methodFull
		}
	}
	e.db.SetCheckpointImages(ctx, id, method, DirBytes(e.imagesPath(ck.Images)))
}

// linkedTo lists the image directories (a checkpoint's, or one of its processes') whose
// parent link points to dir or into it.
func (e *Engine) linkedTo(dir string) []string {
	var out []string
	for _, r := range e.imageDirs(true) {
		c := e.imagesPath(r)
		if p, err := incremental.Parent(c); err == nil && (p == dir || strings.HasPrefix(p, dir+string(filepath.Separator))) {
			out = append(out, c)
		}
	}
	return out
}

// imageEntries lists the names in the image root root (imageRoots): checkpoints' image
// directories and staging ones, not the image pool's own files (dot files: its lock).
func (e *Engine) imageEntries(root string) []string {
	ents, _ := os.ReadDir(e.imagesPath(root))
	var out []string
	for _, d := range ents {
		if !strings.HasPrefix(d.Name(), ".") {
			out = append(out, d.Name())
		}
	}
	return out
}

// imageDirs lists, relative to the data directory, every image directory of both roots:
// <root>/<id> and <root>/<id>/procs/<pid>, a checkpoint's staging ones only if staging.
func (e *Engine) imageDirs(staging bool) []string {
	var out []string
	for _, root := range imageRoots {
		for _, name := range e.imageEntries(root) {
			if !staging && strings.HasPrefix(name, stagingDir+"-") {
				continue
			}
			rel := filepath.Join(root, name)
			out = append(out, rel)
			procs, _ := os.ReadDir(filepath.Join(e.imagesPath(rel), procsDir))
			for _, p := range procs {
				if p.IsDir() {
					out = append(out, filepath.Join(rel, procsDir, p.Name()))
				}
			}
		}
	}
	return out
}

// recoverImages undoes what a crash left in image directories: the temporary and
// orphaned files of an interrupted rewrite are swept, compactions that did not finish
// are queued again, and rows a rebase changed the images of without recording it are
// brought in line with the disk. It holds the compaction lock, so that no rewrite of
// another process sharing the data directory runs between its look and its update.
func (e *Engine) recoverImages(ctx context.Context) {
	unlock := e.lockCompaction()
	defer unlock()
	cks, err := e.db.Checkpoints(ctx) // in commit order: parents queued before children
	if err != nil {
		return
	}
	for _, ck := range cks {
		if ck.Method == methodZygoteImages {
			for _, d := range e.taskDirs(ck) {
				if err := incremental.Sweep(d); err != nil {
					e.cfg.Logf("sweep the images of checkpoint %s: %v", ck.ID, err)
				}
			}
			// On the image pool the directory's size counts the pages it shares: the
			// compaction queued next records its own bytes (Share remembers them).
			if !e.onImagePool(e.imagesPath(ck.Images)) {
				e.db.SetCheckpointImages(ctx, ck.ID, ck.Method, DirBytes(e.imagesPath(ck.Images)))
			}
			e.compactLater(ck)
			continue
		}
		if ck.Method != methodFull && ck.Method != methodIncremental {
			continue
		}
		dir := e.imagesPath(ck.Images)
		if err := incremental.Sweep(dir); err != nil {
			e.cfg.Logf("sweep the images of checkpoint %s: %v", ck.ID, err)
		}
		// The compaction queue lives in memory: a crash loses the compactions not yet
		// done (not begun, begun but not linked, linked but not all switched, done but
		// not recorded). Every full checkpoint with a parent is queued again; compact
		// decides cheaply when there is nothing to do (a chain at its limit, a parent
		// gone), and otherwise a full one is compared once more.
		if ck.Method == methodFull && ck.Parent != "" {
			e.compactLater(ck)
			continue
		}
		// A rebase rewrites its directory before its row (removeImages): a crash
		// between them leaves the row's method (flattened to full) or bytes stale.
		method := methodIncremental
		if p, _ := incremental.Parent(dir); p == "" {
			method = methodFull
		}
		if n := DirBytes(dir); method != ck.Method || n != ck.ImageBytes {
			e.db.SetCheckpointImages(ctx, ck.ID, method, n)
		}
	}
}

// imageLeftovers lists, as data-directory-relative paths, the files interrupted
// rewrites left in checkpoints' image directories (what recoverImages sweeps; a
// checkpoint's own staging is sweep's).
func (e *Engine) imageLeftovers() []string {
	var out []string
	for _, r := range e.imageDirs(false) {
		l, err := incremental.Leftovers(e.imagesPath(r))
		if err != nil {
			out = append(out, r+": "+err.Error())
		}
		for _, f := range l {
			out = append(out, filepath.Join(r, f))
		}
	}
	return out
}

// withDepth fills a checkpoint's ImagesDepth from its images directory, and its
// MethodReason.
func (e *Engine) withDepth(ck *model.Checkpoint, err error) (*model.Checkpoint, error) {
	if err != nil {
		return ck, err
	}
	const dumped = "full CRIU dump on the critical path (this kernel has no soft-dirty bits for CRIU to dump only what changed)"
	switch ck.Method {
	case methodIncremental:
		ck.ImagesDepth, _ = incremental.Depth(e.imagesPath(ck.Images))
		ck.MethodReason = fmt.Sprintf("%s, compacted in the background: pages equal to parent %s's are read from its images (chain depth %d of at most %d)",
			dumped, ck.Parent, ck.ImagesDepth, incremental.MaxDepth)
	case methodShared:
		ck.MethodReason = fmt.Sprintf("%s; its pages equal to parent %s's share that checkpoint's data on disk (reflinks on the image pool): full images, restored without a chain",
			dumped, ck.Parent)
	case methodFull:
		ck.MethodReason = dumped + ", kept full: " + e.whyFull(ck)
	case "runsc-save":
		ck.MethodReason = "gVisor: runsc saves the whole sandbox, kernel state included; its images are not compacted"
	case methodZygote, methodZygoteImages:
		ck.Resident = e.isResident(ck)
		ck.MethodReason = residentReason(ck)
		if ck.Resident {
			ck.ResidentMemoryBytes = e.checkpointMemory(ck)
		}
	}
	if why, err := os.ReadFile(filepath.Join(e.imagesPath(ck.Images), whyFile)); err == nil {
		ck.MethodReason += "; not kept resident: " + strings.TrimSpace(string(why))
	}
	return ck, nil
}

// whyFull says why a container checkpoint's images are not incremental.
func (e *Engine) whyFull(ck *model.Checkpoint) string {
	if ck.Parent == "" {
		return "it has no parent checkpoint to share pages with"
	}
	e.bgMu.Lock()
	queued := e.compacting && slices.Contains(e.compactQ, ck.ID)
	e.bgMu.Unlock()
	if queued {
		return "its compaction against parent " + ck.Parent + " is queued (background)"
	}
	p, err := e.db.Checkpoint(context.Background(), ck.Parent)
	if err != nil || p.Method != methodFull && p.Method != methodIncremental && p.Method != methodShared {
		return "its parent " + ck.Parent + " has no CRIU images"
	}
	if e.onImagePool(e.imagesPath(ck.Images)) != e.onImagePool(e.imagesPath(p.Images)) {
		return "its parent's images are on another filesystem (taken before the image pool): nothing to share"
	}
	if d, err := incremental.Depth(e.imagesPath(p.Images)); err == nil && d+1 > incremental.MaxDepth {
		return fmt.Sprintf("its parent's image chain is at the maximum depth (%d): a new chain starts here", incremental.MaxDepth)
	}
	return "not compacted against parent " + ck.Parent + " (yet: compaction runs in the background of the process that took it)"
}

// lowPriorityThread runs the calling goroutine, until it returns, on a thread of its own
// at the lowest CPU priority (nice 19), so background work yields to sandboxes and to
// the critical path of checkpoints. The thread is never unlocked: it ends with the
// goroutine instead of going back, niced, to the runtime's pool.
func lowPriorityThread() {
	runtime.LockOSThread()
	unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19)
}

// lowPriorityWorkers is how many goroutines of an engine run on a lowPriorityThread at
// once: the durable copies' worker and the compactions' worker.
const lowPriorityWorkers = 2

var spareProcsOnce sync.Once

// spareProcs (at Open) gives the Go runtime a processor (P) more than its default for each
// low-priority worker, unless GOMAXPROCS is set. A goroutine holds its P while its
// thread is runnable, and a thread of nice 19 on a busy machine waits long for the
// CPU: with GOMAXPROCS at the core count (2 here), a worker holding one P left the
// critical path one, and a checkpoint's snapshot goroutine, started beside the
// zygotes' forks on the tracer's locked thread, waited for it until the forks were
// done (W1: up to 7.6 ms, 0.3-4 ms typically; the two halves ran one after the
// other). With the spare Ps the snapshot starts within 0.1 ms (docs/performance.md).
func spareProcs() {
	spareProcsOnce.Do(func() {
		if os.Getenv("GOMAXPROCS") != "" {
			return
		}
		runtime.GOMAXPROCS(runtime.GOMAXPROCS(0) + lowPriorityWorkers)
	})
}
