package incremental

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/checkpoint-restore/go-criu/v8/crit"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/pagemap"
)

// Pagemap entry flags (criu/include/pagemap.h).
const (
	peParent  = 1 << 0 // the pages are in the parent images directory
	peLazy    = 1 << 1 // the pages may be restored lazily
	pePresent = 1 << 2 // the pages are in this directory's pages file
)

const pageSize = 4096

// entry is one pagemap entry: nr pages from vaddr. off is where the entry's pages start
// in the pages file when the entry is present (pages files hold the present entries'
// pages back to back, in entry order).
type entry struct {
	vaddr uint64
	nr    uint64
	flags uint32
	off   int64
}

func (e entry) end() uint64 { return e.vaddr + e.nr*pageSize }

// taskMap is the pagemap of one task in one images directory, with its pages file open
// and the same task's pagemap in the parent directory (nil when there is none).
type taskMap struct {
	dir     string
	id      string
	pagesID uint32
	entries []entry
	pages   *os.File // nil when no entry is present
	parent  *taskMap
}

func (m *taskMap) close() {
	for ; m != nil; m = m.parent {
		if m.pages != nil {
			m.pages.Close()
		}
	}
}

func pagemapName(id string) string      { return "pagemap-" + id + ".img" }
func pagesName(id uint32) string        { return fmt.Sprintf("pages-%d.img", id) }
func tmpName(name string) string        { return name + tmpSuffix }
func isPagesFile(name string) bool      { _, ok := pagesID(name); return ok }
func hasFlag(f uint32, bit uint32) bool { return f&bit != 0 }

// taskID returns the task ID of a task pagemap's file name (pagemap-<id>.img); shmem
// pagemaps (pagemap-shmem-<id>.img) are not task pagemaps.
func taskID(name string) (string, bool) {
	s, ok := strings.CutPrefix(name, "pagemap-")
	if !ok {
		return "", false
	}
	s, ok = strings.CutSuffix(s, ".img")
	if !ok {
		return "", false
	}
	if _, err := strconv.ParseUint(s, 10, 32); err != nil {
		return "", false
	}
	return s, true
}

// pagesID returns the ID of a pages file's name (pages-<id>.img).
func pagesID(name string) (uint32, bool) {
	s, ok := strings.CutPrefix(name, "pages-")
	if !ok {
		return 0, false
	}
	s, ok = strings.CutSuffix(s, ".img")
	if !ok {
		return 0, false
	}
	v, err := strconv.ParseUint(s, 10, 32)
	return uint32(v), err == nil
}

// readPagemap decodes a pagemap image: its pages file ID and its entries.
func readPagemap(path string) (uint32, []entry, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil, err
	}
	defer f.Close()
	img, err := crit.New(f, nil, "", false, false).Decode(&pagemap.PagemapEntry{})
	if err != nil {
		return 0, nil, fmt.Errorf("decode %s: %w", path, err)
	}
	if img.Magic != "PAGEMAP" || len(img.Entries) == 0 {
		return 0, nil, fmt.Errorf("%s is not a pagemap image (magic %s)", path, img.Magic)
	}
	head, ok := img.Entries[0].Message.(*pagemap.PagemapHead)
	if !ok {
		return 0, nil, fmt.Errorf("%s: no pagemap head", path)
	}
	var out []entry
	var off int64
	for _, ce := range img.Entries[1:] {
		pe, ok := ce.Message.(*pagemap.PagemapEntry)
		if !ok {
			return 0, nil, fmt.Errorf("%s: unexpected entry %T", path, ce.Message)
		}
		e := entry{vaddr: pe.GetVaddr(), nr: pe.GetNrPages(), off: off}
		if pe.NrPages == nil {
			e.nr = uint64(pe.GetCompatNrPages())
		}
		// As CRIU's init_compat_pagemap_entry: an entry without flags is present unless
		// the old in_parent says otherwise.
		switch {
		case pe.GetInParent():
			e.flags = pe.GetFlags() | peParent
		case pe.Flags == nil:
			e.flags = pePresent
		default:
			e.flags = pe.GetFlags()
		}
		if e.vaddr%pageSize != 0 || len(out) > 0 && e.vaddr < out[len(out)-1].end() {
			return 0, nil, fmt.Errorf("%s: entries not page-aligned and sorted at %#x", path, e.vaddr)
		}
		if hasFlag(e.flags, pePresent) {
			off += int64(e.nr) * pageSize
		}
		out = append(out, e)
	}
	return head.GetPagesId(), out, nil
}

// writePagemap writes a pagemap image to path and syncs it.
func writePagemap(path string, pagesID uint32, entries []entry) error {
	img := &crit.CriuImage{Magic: "PAGEMAP"}
	img.Entries = append(img.Entries, &crit.CriuEntry{Message: &pagemap.PagemapHead{PagesId: &pagesID}})
	for _, e := range entries {
		vaddr, nr, flags, compat := e.vaddr, e.nr, e.flags, uint32(0)
		// CRIU >= 4.2 writes the page count in nr_pages and 0 in the required
		// compat_nr_pages.
		img.Entries = append(img.Entries, &crit.CriuEntry{Message: &pagemap.PagemapEntry{
			Vaddr: &vaddr, CompatNrPages: &compat, NrPages: &nr, Flags: &flags}})
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if err := crit.New(nil, f, "", false, false).Encode(img); err != nil {
		f.Close()
		return fmt.Errorf("encode %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// openTask opens the pagemap of task id in dir and, following parent links, in every
// ancestor that has one. It returns nil, nil when dir has no pagemap for the task.
func openTask(dir, id string) (*taskMap, error) {
	pid, entries, err := readPagemap(filepath.Join(dir, pagemapName(id)))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	m := &taskMap{dir: dir, id: id, pagesID: pid, entries: entries}
	for _, e := range entries {
		if hasFlag(e.flags, pePresent) {
			if m.pages, err = os.Open(filepath.Join(dir, pagesName(pid))); err != nil {
				return nil, err
			}
			break
		}
	}
	p, err := Parent(dir)
	if err != nil {
		m.close()
		return nil, err
	}
	if p != "" {
		if m.parent, err = openTask(p, id); err != nil {
			m.close()
			return nil, err
		}
	}
	return m, nil
}

// Where a page's content is.
const (
	missing  = iota // nowhere: the page is not in the images (CRIU restores it as zeroes or not at all)
	inFile          // in a pages file
	inParent        // in the parent directory (only when lookup is asked to stop there)
)

// span says where the content of the pages from vaddr is: run pages in a row share the
// answer (for inFile, consecutive in file from off).
type span struct {
	kind int
	file *os.File
	off  int64
	run  uint64
}

// lookup resolves vaddr in m. With follow, pages in the parent are resolved there (m's
// logical content); without, they are reported as inParent.
func (m *taskMap) lookup(vaddr uint64, follow bool) span {
	i := sort.Search(len(m.entries), func(i int) bool { return m.entries[i].end() > vaddr })
	if i == len(m.entries) {
		return span{kind: missing, run: ^uint64(0)}
	}
	e := m.entries[i]
	if vaddr < e.vaddr {
		return span{kind: missing, run: (e.vaddr - vaddr) / pageSize}
	}
	run := (e.end() - vaddr) / pageSize
	switch {
	case hasFlag(e.flags, pePresent):
		return span{kind: inFile, file: m.pages, off: e.off + int64(vaddr-e.vaddr), run: run}
	case hasFlag(e.flags, peParent) && !follow:
		return span{kind: inParent, run: run}
	case hasFlag(e.flags, peParent) && m.parent != nil:
		s := m.parent.lookup(vaddr, true)
		s.run = min(s.run, run)
		return s
	}
	return span{kind: missing, run: run}
}

// readAt fills p from f at off, which must be within f.
func readAt(f *os.File, p []byte, off int64) error {
	_, err := f.ReadAt(p, off)
	if err == io.EOF {
		return fmt.Errorf("%s is shorter than its pagemap says", f.Name())
	}
	return err
}
