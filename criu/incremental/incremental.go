// Package incremental turns full CRIU image directories into incremental ones that CRIU
// restores natively, and back.
//
// # Layout
//
// A CRIU images directory D holds, per task, pagemap-<task>.img (a pagemap_head naming a
// pages file, then pagemap_entry records: vaddr, nr_pages, flags) and pages-<id>.img (the
// contents of the present entries' pages, back to back in entry order). An entry with
// PE_PARENT has no pages in D: CRIU reads them, at restore, from the same task's
// pagemap in the directory the symlink D/parent points to, itself possibly incremental
// (criu/pagemap.c: try_open_parent, read_parent_page). The parent link is relative
// ("../<checkpoint>"), so a data directory can be moved.
//
// Compact(D, P) rewrites every task's pagemap of a full D so that pages whose content
// equals P's logical page (at the same address, same task ID, following P's own chain)
// become PE_PARENT and leave D's pages file. Flatten(D) materializes every PE_PARENT page
// back into D and removes the link; Rebase(D) takes D's parent out of its chain.
// Shared-memory pagemaps (pagemap-shmem-*) are left full.
//
// # Crash safety
//
// Each task's new pages go to a pages file under a new, unused ID, and its new pagemap
// to pagemap-<task>.img.incr-tmp; both are synced. The parent link is created (Compact)
// before any pagemap is switched, the switch is a rename of the temporary pagemap over
// the old one, and only after every switch is the link removed (Flatten) or replaced
// (Rebase) and the now unreferenced pages files deleted. A SIGKILL at any point leaves a
// restorable directory: every task's pagemap is either the old or the new one, and both
// resolve through the link. Sweep removes the temporary files and unreferenced pages
// files a crash leaves.
//
// # Concurrency
//
// Rewrites of one directory are serialized by an exclusive flock on the directory,
// which also keeps Sweep away; a rewrite holds shared flocks on the ancestors it reads,
// so their own rewrites wait. Readers that are not rewrites (CRIU restores) are
// protected by Options.Switch: the caller's lock, held only around the renames.
package incremental

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// ParentLink is the name of the symlink CRIU follows to a directory's parent images.
const ParentLink = "parent"

// MaxDepth is the longest chain of parent links a directory is given (see Depth): each
// level costs a restore one more pagemap per task to open and walk. Measured with
// BenchmarkRestoreDepth (2 tasks × 64 MiB): 84 ms full, 91 ms at depth 8, 103 ms at 16,
// 117 ms at 32; every chain starts with a full dump (~1 ms per MB of RSS on disk), so a
// longer cap trades restore time of standby misses for storage.
const MaxDepth = 16

const tmpSuffix = ".incr-tmp"

// Options are options of the rewriting functions.
type Options struct {
	// Switch, if set, is held while pagemaps are switched and the parent link changes;
	// whoever reads the directory outside this package (a CRIU restore) holds it too.
	Switch sync.Locker
}

func (o Options) lock() func() {
	if o.Switch == nil {
		return func() {}
	}
	o.Switch.Lock()
	return o.Switch.Unlock
}

// Result says what a rewrite did.
type Result struct {
	Tasks       int   // task pagemaps rewritten
	SharedPages int64 // pages now read from the parent chain
	OwnPages    int64 // pages in the directory's own pages files, in rewritten tasks
}

// Parent returns the directory dir's parent link points to ("" when there is none).
func Parent(dir string) (string, error) {
	t, err := os.Readlink(filepath.Join(dir, ParentLink))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	if !filepath.IsAbs(t) {
		t = filepath.Join(dir, t)
	}
	return filepath.Clean(t), nil
}

// Depth returns the number of parent links from dir to a full directory (0 for a full
// one).
func Depth(dir string) (int, error) {
	n := 0
	for {
		p, err := Parent(dir)
		if err != nil || p == "" {
			return n, err
		}
		if n++; n > 64 {
			return n, fmt.Errorf("images directory %s: parent chain longer than 64 (a cycle?)", dir)
		}
		dir = p
	}
}

// Compact rewrites the full images directory dir against parent (full or incremental):
// every page of a task whose content equals parent's logical page at the same address
// becomes PE_PARENT and leaves dir. When no page is shared dir is left as it is, without
// a link. A directory already linked to parent (a compaction interrupted by a crash) is
// completed; one linked elsewhere is refused.
func Compact(dir, parent string, opt Options) (res Result, err error) {
	dir, parent = filepath.Clean(dir), filepath.Clean(parent)
	release, err := lockDir(dir, unix.LOCK_EX)
	if err != nil {
		return res, err
	}
	defer release()
	cur, err := Parent(dir)
	if err != nil {
		return res, err
	}
	if cur != "" && cur != parent {
		return res, fmt.Errorf("images directory %s is already incremental against %s", dir, cur)
	}
	for a := parent; a != ""; a, _ = Parent(a) {
		if a == dir {
			return res, fmt.Errorf("images directory %s is an ancestor of %s", dir, parent)
		}
	}
	defer discardOnError(dir, &err)
	switched, releaseChain, err := rewriteTasks(dir, parent, &res, func(id string, m *taskMap, w *writer) (bool, error) {
		for _, e := range m.entries {
			if hasFlag(e.flags, peParent) {
				return false, nil // switched before a crash: done
			}
		}
		p, err := openTask(parent, id)
		if err != nil || p == nil {
			return false, err
		}
		defer p.close()
		return compactTask(m, p, w)
	})
	if err != nil {
		return res, err
	}
	defer releaseChain()
	if len(switched) == 0 {
		return res, nil
	}
	rel, err := filepath.Rel(dir, parent)
	if err != nil {
		return res, err
	}
	err = switchTasks(dir, switched, opt, func() error {
		if cur == "" {
			if err := os.Symlink(rel, filepath.Join(dir, ParentLink)); err != nil {
				return err
			}
			crashPoint("incremental-link")
		}
		return nil
	}, nil)
	if err != nil {
		return res, err
	}
	return res, removeLeftovers(dir)
}

// Flatten materializes every page dir reads from its parent chain back into dir and
// removes its parent link: dir becomes full. A full dir is left as it is.
func Flatten(dir string, opt Options) (Result, error) {
	return materialize(dir, true, opt)
}

// Rebase takes dir's parent P out of dir's chain: the pages dir reads from P's own pages
// files are copied into dir, and dir's link then points to P's parent (or is removed
// when P is full). Afterwards P may be deleted without breaking dir.
func Rebase(dir string, opt Options) (Result, error) {
	return materialize(dir, false, opt)
}

func materialize(dir string, flatten bool, opt Options) (res Result, err error) {
	dir = filepath.Clean(dir)
	release, err := lockDir(dir, unix.LOCK_EX)
	if err != nil {
		return res, err
	}
	defer release()
	parent, err := Parent(dir)
	if err != nil || parent == "" {
		return res, err
	}
	grand, err := Parent(parent)
	if err != nil {
		return res, err
	}
	if flatten {
		grand = ""
	}
	defer discardOnError(dir, &err)
	switched, releaseChain, err := rewriteTasks(dir, parent, &res, func(_ string, m *taskMap, w *writer) (bool, error) {
		return materializeTask(m, grand == "", w)
	})
	if err != nil {
		return res, err
	}
	defer releaseChain()
	link := filepath.Join(dir, ParentLink)
	err = switchTasks(dir, switched, opt, nil, func() error {
		crashPoint("incremental-unlink")
		if grand == "" {
			return os.Remove(link)
		}
		rel, err := filepath.Rel(dir, grand)
		if err != nil {
			return err
		}
		os.Remove(tmpName(link))
		if err := os.Symlink(rel, tmpName(link)); err != nil {
			return err
		}
		return os.Rename(tmpName(link), link)
	})
	if err != nil {
		return res, err
	}
	return res, removeLeftovers(dir)
}

// rewriteTasks rewrites the pagemap of each of dir's tasks with rewrite, into new files
// beside the old ones, holding shared locks on the chain from top. It returns the tasks
// rewrite changed and the release of the chain locks, which the caller holds until it
// has switched them.
func rewriteTasks(dir, top string, res *Result, rewrite func(id string, m *taskMap, w *writer) (bool, error)) (switched []string, release func(), err error) {
	release, err = lockChain(top)
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			release()
		}
	}()
	tasks, err := taskIDs(dir)
	if err != nil {
		return nil, nil, err
	}
	ids, err := newPagesIDs(dir)
	if err != nil {
		return nil, nil, err
	}
	for _, id := range tasks {
		changed, err := rewriteTask(dir, id, ids(), res, func(m *taskMap, w *writer) (bool, error) {
			return rewrite(id, m, w)
		})
		if err != nil {
			return nil, nil, err
		}
		if changed {
			switched = append(switched, id)
		}
	}
	return switched, release, nil
}

// discardOnError removes the temporary and orphaned files of a rewrite of dir that
// failed with *err (deferred by the rewrites).
func discardOnError(dir string, err *error) {
	if *err != nil {
		removeLeftovers(dir)
	}
}

// switchTasks publishes the rewritten pagemaps of tasks, holding opt.Switch: before
// runs first, after once every pagemap is switched.
func switchTasks(dir string, tasks []string, opt Options, before, after func() error) error {
	unlock := opt.lock()
	defer unlock()
	if before != nil {
		if err := before(); err != nil {
			return err
		}
	}
	for _, id := range tasks {
		p := filepath.Join(dir, pagemapName(id))
		if err := os.Rename(tmpName(p), p); err != nil {
			return err
		}
		crashPoint("incremental-switch")
	}
	if after != nil {
		if err := after(); err != nil {
			return err
		}
	}
	return syncDir(dir)
}

// rewriteTask opens task id of dir with its chain and lets plan write its new pages
// (into pages-<newID>.img) and entries; when plan reports a change, the new pagemap is
// left at its temporary name for switchTasks.
func rewriteTask(dir, id string, newID uint32, res *Result, plan func(*taskMap, *writer) (bool, error)) (bool, error) {
	m, err := openTask(dir, id)
	if err != nil || m == nil {
		return false, err
	}
	defer m.close()
	pagesPath := filepath.Join(dir, pagesName(newID))
	w, err := newWriter(pagesPath)
	if err != nil {
		return false, err
	}
	changed, err := plan(m, w)
	if err == nil && changed {
		err = w.finish()
	} else {
		w.f.Close()
	}
	if err != nil || !changed {
		os.Remove(pagesPath)
		return false, err
	}
	crashPoint("incremental-pages")
	if err := writePagemap(tmpName(filepath.Join(dir, pagemapName(id))), newID, w.entries); err != nil {
		os.Remove(pagesPath)
		return false, err
	}
	crashPoint("incremental-pagemap")
	res.Tasks++
	for _, e := range w.entries {
		if hasFlag(e.flags, pePresent) {
			res.OwnPages += int64(e.nr)
		} else if hasFlag(e.flags, peParent) {
			res.SharedPages += int64(e.nr)
		}
	}
	return true, nil
}

// chunk bounds the pages compared or copied at once.
const chunk = 256

// compactTask writes m's entries with every present page equal to p's logical page made
// PE_PARENT. It reports whether any page was.
func compactTask(m, p *taskMap, w *writer) (bool, error) {
	shared := false
	mine := make([]byte, chunk*pageSize)
	theirs := make([]byte, chunk*pageSize)
	same := make([]bool, chunk)
	for _, e := range m.entries {
		if !hasFlag(e.flags, pePresent) {
			w.keep(e)
			continue
		}
		w.split()
		for done := uint64(0); done < e.nr; {
			n := min(e.nr-done, chunk)
			va := e.vaddr + done*pageSize
			buf := mine[:n*pageSize]
			if err := readAt(m.pages, buf, e.off+int64(done*pageSize)); err != nil {
				return false, err
			}
			for i := range same[:n] {
				same[i] = false
			}
			for i := uint64(0); i < n; {
				s := p.lookup(va+i*pageSize, true)
				k := min(s.run, n-i)
				if s.kind == inFile {
					b := theirs[:k*pageSize]
					if err := readAt(s.file, b, s.off); err != nil {
						return false, err
					}
					for j := uint64(0); j < k; j++ {
						same[i+j] = bytes.Equal(b[j*pageSize:(j+1)*pageSize], buf[(i+j)*pageSize:(i+j+1)*pageSize])
						shared = shared || same[i+j]
					}
				}
				i += k
			}
			for i := uint64(0); i < n; {
				j := i
				for j < n && same[j] == same[i] {
					j++
				}
				if same[i] {
					w.add(va+i*pageSize, j-i, peParent, nil)
				} else if err := w.add(va+i*pageSize, j-i, e.flags, buf[i*pageSize:j*pageSize]); err != nil {
					return false, err
				}
				i = j
			}
			done += n
		}
	}
	return shared, nil
}

// materializeTask copies into m the pages it reads from its parent: all of them
// (flatten), or those the parent holds itself (rebase; the others stay PE_PARENT and
// then resolve through the parent's parent). It reports whether m had any PE_PARENT
// page.
func materializeTask(m *taskMap, flatten bool, w *writer) (bool, error) {
	changed := false
	buf := make([]byte, chunk*pageSize)
	for _, e := range m.entries {
		if !hasFlag(e.flags, peParent) {
			w.keep(e)
			if hasFlag(e.flags, pePresent) {
				if err := w.copyFrom(m.pages, e.off, e.nr); err != nil {
					return false, err
				}
			}
			continue
		}
		changed = true
		w.split()
		if m.parent == nil {
			return false, fmt.Errorf("images %s: task %s has pages in a parent it has none of", m.dir, m.id)
		}
		for done := uint64(0); done < e.nr; {
			va := e.vaddr + done*pageSize
			s := m.parent.lookup(va, flatten)
			k := min(s.run, e.nr-done, chunk)
			switch s.kind {
			case inFile:
				b := buf[:k*pageSize]
				if err := readAt(s.file, b, s.off); err != nil {
					return false, err
				}
				if err := w.add(va, k, pePresent, b); err != nil {
					return false, err
				}
			case inParent:
				w.add(va, k, peParent, nil)
			default:
				return false, fmt.Errorf("images %s: page %#x of task %s is in no ancestor", m.dir, va, m.id)
			}
			done += k
		}
	}
	return changed, nil
}

// writer builds a task's new pages file and entries.
type writer struct {
	f       *os.File
	bw      *bufio.Writer
	entries []entry
	off     int64
	// mergeable says whether add may extend the last entry.
	mergeable bool
}

func newWriter(path string) (*writer, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, err
	}
	return &writer{f: f, bw: bufio.NewWriterSize(f, 1<<20)}, nil
}

// keep appends e unchanged (its pages, if present, follow by copyFrom).
func (w *writer) keep(e entry) {
	e.off = w.off
	w.mergeable = false
	if hasFlag(e.flags, pePresent) {
		w.off += int64(e.nr) * pageSize
	}
	w.entries = append(w.entries, e)
}

// split ends the current entry: what is added next starts a new one. Entries are split
// by a rewrite, never merged across the original ones (CRIU's own entry boundaries).
func (w *writer) split() { w.mergeable = false }

// add appends nr pages from vaddr: PE_PARENT ones when data is nil, present ones (with
// flags' other bits) otherwise. Consecutive additions of one kind extend one entry.
func (w *writer) add(vaddr, nr uint64, flags uint32, data []byte) error {
	if data == nil {
		flags = peParent
	} else {
		flags = flags&^peParent | pePresent
	}
	n := len(w.entries)
	if last := n - 1; n > 0 && w.mergeable && w.entries[last].end() == vaddr && w.entries[last].flags == flags {
		w.entries[last].nr += nr
	} else {
		w.entries = append(w.entries, entry{vaddr: vaddr, nr: nr, flags: flags, off: w.off})
	}
	w.mergeable = true
	if data == nil {
		return nil
	}
	w.off += int64(len(data))
	_, err := w.bw.Write(data)
	return err
}

func (w *writer) copyFrom(f *os.File, off int64, nr uint64) error {
	buf := make([]byte, chunk*pageSize)
	for nr > 0 {
		k := min(nr, chunk)
		b := buf[:k*pageSize]
		if err := readAt(f, b, off); err != nil {
			return err
		}
		if _, err := w.bw.Write(b); err != nil {
			return err
		}
		off += int64(len(b))
		nr -= k
	}
	return nil
}

func (w *writer) finish() error {
	if err := w.bw.Flush(); err != nil {
		w.f.Close()
		return err
	}
	if err := w.f.Sync(); err != nil {
		w.f.Close()
		return err
	}
	return w.f.Close()
}

// taskIDs lists the task pagemaps of dir.
func taskIDs(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, d := range ents {
		if id, ok := taskID(d.Name()); ok {
			out = append(out, id)
		}
	}
	return out, nil
}

// newPagesIDs returns a generator of pages file IDs unused in dir.
func newPagesIDs(dir string) (func() uint32, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var max uint32
	for _, d := range ents {
		if id, ok := pagesID(d.Name()); ok && id > max {
			max = id
		}
	}
	return func() uint32 { max++; return max }, nil
}

// leftovers lists the files a failed or interrupted rewrite left in dir: temporary
// pagemaps, and pages files no pagemap (task or shmem) names (among them those the
// temporary pagemaps named). From names alone it answers nothing is left in a
// directory with no temporary file and no more pages files than pagemaps, reading no
// pagemap; otherwise, if any pagemap cannot be read, it fails.
func leftovers(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	pagemaps, pages := 0, 0
	for _, d := range ents {
		switch n := d.Name(); {
		case strings.HasSuffix(n, tmpSuffix):
			out = append(out, n)
		case strings.HasPrefix(n, "pagemap-") && strings.HasSuffix(n, ".img"):
			pagemaps++
		case isPagesFile(n):
			pages++
		}
	}
	if len(out) == 0 && pages <= pagemaps {
		return nil, nil
	}
	used := map[uint32]bool{}
	for _, d := range ents {
		if n := d.Name(); strings.HasPrefix(n, "pagemap-") && strings.HasSuffix(n, ".img") {
			id, _, err := readPagemap(filepath.Join(dir, n))
			if err != nil {
				return nil, err
			}
			used[id] = true
		}
	}
	for _, d := range ents {
		if id, ok := pagesID(d.Name()); ok && !used[id] {
			out = append(out, d.Name())
		}
	}
	return out, nil
}

// removeLeftovers deletes what leftovers lists. If any pagemap cannot be read, nothing
// is deleted.
func removeLeftovers(dir string) error {
	l, err := leftovers(dir)
	if err != nil || len(l) == 0 {
		return err
	}
	for _, n := range l {
		if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return syncDir(dir)
}

// Sweep removes what an interrupted rewrite left in dir: temporary files and pages
// files no pagemap names. A directory being rewritten now is skipped. It costs a
// directory listing when nothing is left.
func Sweep(dir string) error {
	release, err := lockDir(dir, unix.LOCK_EX|unix.LOCK_NB)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return nil
	}
	if err != nil {
		return err
	}
	defer release()
	return removeLeftovers(dir)
}

// Leftovers lists the files Sweep would remove from dir now (none in a directory no
// rewrite was interrupted in). A directory being rewritten now is skipped.
func Leftovers(dir string) ([]string, error) {
	release, err := lockDir(dir, unix.LOCK_SH|unix.LOCK_NB)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer release()
	return leftovers(dir)
}

// lockDir takes a flock (how: LOCK_EX or LOCK_SH) on dir and returns its release.
func lockDir(dir string, how int) (func(), error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock images %s: %w", dir, err)
	}
	return func() { f.Close() }, nil
}

// lockChain takes shared flocks on dir and its ancestors, in that order (a rewrite locks
// its own directory first, then its ancestors: always descendants before ancestors).
func lockChain(dir string) (func(), error) {
	var rels []func()
	release := func() {
		for _, r := range rels {
			r()
		}
	}
	for n := 0; dir != ""; n++ {
		if n > 64 {
			release()
			return nil, fmt.Errorf("images directory %s: parent chain longer than 64", dir)
		}
		r, err := lockDir(dir, unix.LOCK_SH)
		if err != nil {
			release()
			return nil, err
		}
		rels = append(rels, r)
		if dir, err = Parent(dir); err != nil {
			release()
			return nil, err
		}
	}
	return release, nil
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// crashPoint kills the process when CAIRN_TEST_CRASH_AT names this point, so tests can
// prove that a SIGKILL there leaves a restorable directory.
func crashPoint(name string) {
	if os.Getenv("CAIRN_TEST_CRASH_AT") == name {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
}
