package btrfs

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/phase"
)

// Tree plans: the difference between two read-only volumes read from their trees.
//
// # Why not send
//
// The kernel's send compares the two trees node by node and skips what they share, but
// every inode whose item differs costs it a comparison of names, paths and attributes
// (~0.1 ms each here), and a revert in place cannot set a change time back: every file
// that any revert restored differs, in its item, from every snapshot taken before that
// revert. A sandbox rolled back again and again carries more such files at each
// rollback, and send's cost grows with them although the content it finds to change
// does not (docs/performance.md, 2026-12-02 late evening).
//
// # What a tree plan reads instead
//
// Let base and snap both be read-only snapshots of one volume V, snap taken in the
// transaction g and base later (or the other way round). The two are V's tree as of g,
// changed afterwards on one side only: every change after g, of a name, an attribute,
// an extended attribute or data, wrote the changed inode's item in a later transaction,
// which the item records as its transid (data at write-back, which a snapshot's commit
// forces). So an inode differs between the two only if the newer side has it with a
// transid past g, or has it no more; and an inode gone from the newer side had a name
// in a directory of the older that is itself gone or changed. A search of the newer
// tree with g+1 as its minimum transaction visits only the leaves written since, and
// gives the candidates; each candidate is read from both trees (one search each: its
// item, names, extended attributes, entries or extents), and the directories whose
// entries differ lead to the inodes that only one side has, down their subtrees. An
// inode present in both with the same number is the same inode (same generation: V
// never reuses a number), and one that only snap has is recreated in live.
//
// The cost is the candidates, of which the files that reverts restored are a part, but
// each costs two searches (microseconds) rather than send's work, and most are found
// equal but for their change time.
//
// # The operations
//
// They are send's commands (UPDATE_EXTENT for data), applied by the same applier, in
// three phases over a model of live's directories:
//
//  1. every entry of base that snap does not have (or has for another inode), deepest
//     directory first: a file that snap does not have is unlinked, a directory removed
//     (its entries went before it); an inode that snap keeps is renamed to an orphan
//     name in the root ("o<ino>-<gen>-<n>", free in both roots), unless it keeps
//     another name, in which case this one is unlinked;
//  2. every entry of snap that base does not have, shallowest directory first: an
//     orphan is renamed into place, a further name of a file linked, an inode only snap
//     has created;
//  3. data (the ranges whose extents differ, cloned from snap), size, owner, mode,
//     extended attributes and times of every inode that differs or was created.
//
// Directories whose entries changed get snap's times once everything is applied
// (applier.fixDirTimes).
//
// Anything outside this model (a nested subvolume whose entry changed, an encoded
// extent, an inode of another generation, a name that no changed directory accounts
// for) makes planTree return errNoTreePlan, and the caller asks send instead.

// errNoTreePlan says that a tree plan cannot describe the difference; send can.
var errNoTreePlan = errors.New("no tree plan")

const rootIno = btrfsFirstFreeObjectID

// treeLineage decides whether base and snap allow a tree plan, and returns the
// transaction g as of which both were one tree, and whether base is the newer side.
// live, if not nil, is the volume base is a snapshot of (a revert's live volume):
// snap may then be the snapshot live was made from (a rollback's root).
func treeLineage(base, snap, live *subvolInfoArgs) (g uint64, baseNewer bool, ok bool) {
	var zero [16]byte
	for _, v := range []*subvolInfoArgs{base, snap} {
		// Read-only since they were made: no change of their own after their
		// transaction (a volume made writable and changed has a later ctransid).
		if v.flags&rootSubvolRdonly == 0 || v.ctransid > v.otransid {
			return 0, false, false
		}
	}
	switch {
	case base.parentUUID != zero && base.parentUUID == snap.parentUUID:
		if snap.otransid <= base.otransid {
			return snap.otransid, true, true
		}
		return base.otransid, false, true
	case live != nil && base.parentUUID == live.uuid && live.parentUUID == snap.uuid && snap.otransid <= live.otransid:
		// live was made from snap in the transaction live.otransid, and base from live.
		return live.otransid, true, true
	}
	return 0, false, false
}

// treeSide is one of the two trees, with what was read of it.
type treeSide struct {
	s      *searcher
	states map[uint64]*inodeState // nil: not in this tree
	locs   map[uint64]inodeRef    // directories' parent and name
}

func newTreeSide(fd int) *treeSide {
	return &treeSide{s: newSearcher(fd), states: map[uint64]*inodeState{}, locs: map[uint64]inodeRef{}}
}

// loadGap is the distance of inode numbers up to which load reads inodes by one search
// (searcher.loadInodes).
const loadGap = 16

// load reads the inodes inos (sorted) that are not read yet.
func (ts *treeSide) load(inos []uint64) error {
	var missing []uint64
	for _, x := range inos {
		if _, ok := ts.states[x]; !ok {
			missing = append(missing, x)
		}
	}
	return ts.s.loadInodes(missing, loadGap, func(ino uint64, st *inodeState) { ts.states[ino] = st })
}

func (ts *treeSide) get(ino uint64) (*inodeState, error) {
	if st, ok := ts.states[ino]; ok {
		return st, nil
	}
	st, err := ts.s.loadInode(ino)
	if err != nil {
		return nil, err
	}
	ts.states[ino] = st
	return st, nil
}

// loc returns the parent and name of the directory dir.
func (ts *treeSide) loc(dir uint64) (inodeRef, error) {
	if r, ok := ts.locs[dir]; ok {
		return r, nil
	}
	st := ts.states[dir]
	if st == nil { // not read whole: its names only
		st = &inodeState{ino: dir}
		err := ts.s.search(searchKey{dir, keyInodeRef, 0}, searchKey{dir, keyInodeRef, ^uint64(0)}, 0, func(k searchKey, d []byte) error {
			return st.addItem(k, d)
		})
		if err != nil {
			return inodeRef{}, err
		}
	}
	if len(st.refs) != 1 {
		return inodeRef{}, fmt.Errorf("%w: directory %d has %d names", errNoTreePlan, dir, len(st.refs))
	}
	ts.locs[dir] = st.refs[0]
	return st.refs[0], nil
}

// depth returns how many directories lie between dir and the root.
func (ts *treeSide) depth(dir uint64) (int, error) {
	names, err := walkUp(dir, ts.loc)
	return len(names), err
}

// path returns dir's path relative to the tree's root.
func (ts *treeSide) path(dir uint64) (string, error) {
	return walkPath(dir, ts.loc)
}

// walkUp returns the names from dir up to the root, by loc.
func walkUp(dir uint64, loc func(uint64) (inodeRef, error)) ([]string, error) {
	var names []string
	for d := dir; d != rootIno; {
		if len(names) > 4096 {
			return nil, fmt.Errorf("%w: directory %d: no way to the root", errNoTreePlan, dir)
		}
		r, err := loc(d)
		if err != nil {
			return nil, err
		}
		names = append(names, r.name)
		d = r.parent
	}
	return names, nil
}

func walkPath(dir uint64, loc func(uint64) (inodeRef, error)) (string, error) {
	names, err := walkUp(dir, loc)
	slices.Reverse(names)
	return strings.Join(names, "/"), err
}

func join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// inodePair is an inode as base (h) and snap (t) have it; nil where one has none.
type inodePair struct{ h, t *inodeState }

// entryChange is an entry of one side that the other does not have.
type entryChange struct {
	dir   uint64
	name  string
	ino   uint64
	depth int
}

// treePlan is the state of planTree.
type treePlan struct {
	ctx   context.Context
	block uint64 // the filesystem's sector size
	h, t  *treeSide
	pairs map[uint64]*inodePair
	inos  []uint64
	cmds  []*sendCommand

	// The model of live as the commands so far leave it.
	moved   map[uint64]inodeRef // directories not where base has them
	anchor  map[uint64]inodeRef // a name in live of a file that snap has
	orphan  map[uint64]bool     // anchor is an orphan name, to be renamed into place
	created map[uint64]bool     // snap's inodes made anew in live
	taken   map[string]bool     // orphan names used
}

// treeRef names a volume's tree for searches: the volume fd is in (id 0), or the tree
// id on any fd of the filesystem.
type treeRef struct {
	fd int
	id uint64
}

// planTree returns the commands that turn the read-only volume base into snapfd,
// given g and which side is newer (treeLineage), and how many inodes it read from both.
// The first command is a SNAPSHOT header, as in a send stream. lin is the memory of the
// volume both are snapshots of (lineage.go), and o the transaction the newer of the two
// was taken in.
func planTree(ctx context.Context, base treeRef, snapfd int, g uint64, baseNewer bool, lin *lineage, o uint64) ([]*sendCommand, int, error) {
	h := newTreeSide(base.fd)
	h.s.treeID = base.id
	p := &treePlan{
		ctx: ctx, h: h, t: newTreeSide(snapfd),
		pairs: map[uint64]*inodePair{}, moved: map[uint64]inodeRef{}, anchor: map[uint64]inodeRef{},
		orphan: map[uint64]bool{}, created: map[uint64]bool{}, taken: map[string]bool{},
		cmds: []*sendCommand{{cmd: sendCmdSnapshot}},
	}
	defer p.h.s.close()
	defer p.t.s.close()
	var fs unix.Statfs_t
	if err := unix.Fstatfs(snapfd, &fs); err != nil {
		return nil, 0, err
	}
	p.block = uint64(max(fs.Bsize, 512))
	lin.mu.Lock()
	defer lin.mu.Unlock()
	if err := p.plan(g, baseNewer, lin, o); err != nil {
		return nil, 0, err
	}
	return p.cmds, len(p.inos), nil
}

func (p *treePlan) plan(g uint64, baseNewer bool, lin *lineage, o uint64) error {
	newer := p.h
	if !baseNewer {
		newer = p.t
	}
	t0 := time.Now()
	cands, err := lin.candidates(newer.s, g, o)
	if err != nil {
		return err
	}
	work := slices.Collect(maps.Keys(cands))
	phase.Since(p.ctx, "revert_plan_candidates", t0)
	t0 = time.Now()
	if err := p.compare(work); err != nil {
		return err
	}
	phase.Since(p.ctx, "revert_plan_compare", t0)
	defer phase.Since(p.ctx, "revert_plan_ops", time.Now())
	for _, x := range work {
		if newer.states[x] == nil && lin.to == o {
			lin.gone(x)
		}
	}
	gone, placed, err := p.entryChanges()
	if err != nil {
		return err
	}
	if err := p.remove(gone); err != nil {
		return err
	}
	if err := p.place(placed); err != nil {
		return err
	}
	return p.update()
}

// compare reads the inodes of work from both sides, and the inodes that the entries
// of differing directories lead to, down their subtrees, a round of searches per level.
func (p *treePlan) compare(work []uint64) error {
	seen := map[uint64]bool{}
	for len(work) > 0 {
		if err := p.ctx.Err(); err != nil {
			return err
		}
		var batch []uint64
		for _, x := range work {
			if !seen[x] {
				seen[x] = true
				batch = append(batch, x)
			}
		}
		work = nil
		slices.Sort(batch)
		if err := p.h.load(batch); err != nil {
			return err
		}
		if err := p.t.load(batch); err != nil {
			return err
		}
		for _, x := range batch {
			h, t := p.h.states[x], p.t.states[x]
			if h == nil && t == nil {
				continue
			}
			if h != nil && t != nil && (h.item.gen != t.item.gen || h.item.typ() != t.item.typ()) {
				return fmt.Errorf("%w: inode %d is of generation %d (mode %#o) in one volume and %d (%#o) in the other", errNoTreePlan, x, h.item.gen, h.item.mode, t.item.gen, t.item.mode)
			}
			p.pairs[x] = &inodePair{h, t}
			p.inos = append(p.inos, x)
			for _, pr := range [][2]*inodeState{{h, t}, {t, h}} {
				a, b := pr[0], pr[1]
				if a == nil || !a.item.isDir() {
					continue
				}
				for name, e := range a.entries {
					if b != nil {
						if f, ok := b.entries[name]; ok && f == e {
							continue
						}
					}
					if e.subvol {
						return fmt.Errorf("%w: the entry %q of directory %d, a nested subvolume, differs", errNoTreePlan, name, x)
					}
					work = append(work, e.ino)
				}
			}
		}
	}
	slices.Sort(p.inos)
	return nil
}

// entryChanges returns the entries of base that snap does not have (gone, deepest
// first) and those of snap that base does not have (placed, shallowest first), and
// checks that they account for every name that differs.
func (p *treePlan) entryChanges() (gone, placed []entryChange, err error) {
	type ent struct {
		dir  uint64
		name string
	}
	goneSet, placedSet := map[ent]uint64{}, map[ent]uint64{}
	for _, x := range p.inos {
		pr := p.pairs[x]
		for side, a := range []*inodeState{pr.h, pr.t} {
			b := pr.t
			if side == 1 {
				b = pr.h
			}
			if a == nil || !a.item.isDir() {
				continue
			}
			ts := p.h
			if side == 1 {
				ts = p.t
			}
			d := -1 // computed at the first entry that differs
			for name, e := range a.entries {
				if b != nil {
					if f, ok := b.entries[name]; ok && f == e {
						continue
					}
				}
				if d < 0 {
					if d, err = ts.depth(x); err != nil {
						return nil, nil, err
					}
				}
				c := entryChange{dir: x, name: name, ino: e.ino, depth: d}
				if side == 0 {
					gone = append(gone, c)
					goneSet[ent{x, name}] = e.ino
				} else {
					placed = append(placed, c)
					placedSet[ent{x, name}] = e.ino
				}
			}
		}
	}
	// Every name that one side has and the other not must be an entry change of a
	// directory read above; otherwise the premise of the plan failed somewhere.
	for _, x := range p.inos {
		pr := p.pairs[x]
		if x == rootIno {
			continue
		}
		for side, a := range []*inodeState{pr.h, pr.t} {
			b := pr.t
			set := goneSet
			if side == 1 {
				b, set = pr.h, placedSet
			}
			if a == nil {
				continue
			}
			for _, r := range a.refs {
				if b != nil && slices.Contains(b.refs, r) {
					continue
				}
				if set[ent{r.parent, r.name}] != x {
					return nil, nil, fmt.Errorf("%w: the name %q in directory %d of inode %d is not among the entries that differ", errNoTreePlan, r.name, r.parent, x)
				}
			}
		}
	}
	byName := func(a, b entryChange) int {
		if c := cmp.Compare(a.dir, b.dir); c != 0 {
			return c
		}
		return strings.Compare(a.name, b.name)
	}
	slices.SortFunc(gone, func(a, b entryChange) int {
		if a.depth != b.depth {
			return b.depth - a.depth
		}
		return byName(a, b)
	})
	slices.SortFunc(placed, func(a, b entryChange) int {
		if a.depth != b.depth {
			return a.depth - b.depth
		}
		return byName(a, b)
	})
	return gone, placed, nil
}

// livePath returns the path in live, as the commands so far leave it, of dir.
func (p *treePlan) livePath(dir uint64) (string, error) {
	return walkPath(dir, func(d uint64) (inodeRef, error) {
		if r, ok := p.moved[d]; ok {
			return r, nil
		}
		return p.h.loc(d)
	})
}

func (p *treePlan) entryPath(r inodeRef) (string, error) {
	dir, err := p.livePath(r.parent)
	return join(dir, r.name), err
}

// rightName returns a name that x has in both volumes, if any.
func (pr *inodePair) rightName() (inodeRef, bool) {
	if pr.h == nil || pr.t == nil {
		return inodeRef{}, false
	}
	for _, r := range pr.h.refs {
		if slices.Contains(pr.t.refs, r) {
			return r, true
		}
	}
	return inodeRef{}, false
}

// orphanName returns a name for x in the root that neither volume's root has and no
// other orphan of this plan took.
func (p *treePlan) orphanName(x, gen uint64) (string, error) {
	hr, err := p.h.get(rootIno)
	if err != nil {
		return "", err
	}
	tr, err := p.t.get(rootIno)
	if err != nil {
		return "", err
	}
	for k := 0; ; k++ {
		n := fmt.Sprintf("o%d-%d-%d", x, gen, k)
		_, inH := hr.entries[n]
		_, inT := tr.entries[n]
		if !inH && !inT && !p.taken[n] {
			p.taken[n] = true
			return n, nil
		}
	}
}

// remove is phase 1: base's entries that snap does not have.
func (p *treePlan) remove(gone []entryChange) error {
	for _, c := range gone {
		pr := p.pairs[c.ino]
		if pr == nil || pr.h == nil {
			return fmt.Errorf("%w: entry %q of directory %d names inode %d, which was not read", errNoTreePlan, c.name, c.dir, c.ino)
		}
		path, err := p.entryPath(inodeRef{c.dir, c.name})
		if err != nil {
			return err
		}
		switch {
		case pr.h.item.isDir() && pr.t == nil:
			p.emit(sendCmdRmdir, aStr(sendAttrPath, path))
		case pr.t == nil || len(pr.t.refs) == 0:
			p.emit(sendCmdUnlink, aStr(sendAttrPath, path))
		case !pr.h.item.isDir():
			if _, ok := p.anchor[c.ino]; !ok {
				if r, ok := pr.rightName(); ok {
					p.anchor[c.ino] = r
				}
			}
			if _, ok := p.anchor[c.ino]; ok {
				p.emit(sendCmdUnlink, aStr(sendAttrPath, path))
				continue
			}
			fallthrough
		default: // kept by snap under another name: out of the way
			o, err := p.orphanName(c.ino, pr.h.item.gen)
			if err != nil {
				return err
			}
			p.emit(sendCmdRename, aStr(sendAttrPath, path), aStr(sendAttrPathTo, o))
			if pr.h.item.isDir() {
				p.moved[c.ino] = inodeRef{rootIno, o}
			} else {
				p.anchor[c.ino], p.orphan[c.ino] = inodeRef{rootIno, o}, true
			}
		}
	}
	return nil
}

// place is phase 2: snap's entries that base does not have.
func (p *treePlan) place(placed []entryChange) error {
	for _, c := range placed {
		pr := p.pairs[c.ino]
		if pr == nil || pr.t == nil {
			return fmt.Errorf("%w: entry %q of directory %d names inode %d, which was not read", errNoTreePlan, c.name, c.dir, c.ino)
		}
		to := inodeRef{c.dir, c.name}
		path, err := p.entryPath(to)
		if err != nil {
			return err
		}
		if pr.t.item.isDir() {
			if pr.h != nil {
				from, err := p.livePath(c.ino)
				if err != nil {
					return err
				}
				p.emit(sendCmdRename, aStr(sendAttrPath, from), aStr(sendAttrPathTo, path))
			} else {
				p.emit(sendCmdMkdir, aStr(sendAttrPath, path), aU64(sendAttrIno, c.ino))
				p.created[c.ino] = true
			}
			p.moved[c.ino] = to
			continue
		}
		a, ok := p.anchor[c.ino]
		if !ok && !p.created[c.ino] {
			a, ok = pr.rightName()
		}
		switch {
		case ok && p.orphan[c.ino]:
			from, err := p.entryPath(a)
			if err != nil {
				return err
			}
			p.emit(sendCmdRename, aStr(sendAttrPath, from), aStr(sendAttrPathTo, path))
			p.anchor[c.ino], p.orphan[c.ino] = to, false
		case ok:
			target, err := p.entryPath(a)
			if err != nil {
				return err
			}
			p.emit(sendCmdLink, aStr(sendAttrPath, path), aStr(sendAttrPathLink, target))
			p.anchor[c.ino] = a
		default:
			// Only snap has it, or base has it without a name (open but unlinked): a
			// new inode stands for it.
			if err := p.create(c.ino, pr.t, path); err != nil {
				return err
			}
			p.anchor[c.ino], p.created[c.ino] = to, true
		}
	}
	return nil
}

// create makes the file t of snap anew at path; its content and attributes follow in
// phase 3.
func (p *treePlan) create(ino uint64, t *inodeState, path string) error {
	switch t.item.typ() {
	case unix.S_IFREG:
		p.emit(sendCmdMkfile, aStr(sendAttrPath, path), aU64(sendAttrIno, ino))
	case unix.S_IFLNK:
		target, err := p.symlinkTarget(t)
		if err != nil {
			return err
		}
		p.emit(sendCmdSymlink, aStr(sendAttrPath, path), aU64(sendAttrIno, ino), aStr(sendAttrPathLink, target))
	case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		cmd := map[uint32]uint16{unix.S_IFCHR: sendCmdMknod, unix.S_IFBLK: sendCmdMknod, unix.S_IFIFO: sendCmdMkfifo, unix.S_IFSOCK: sendCmdMksock}[t.item.typ()]
		p.emit(cmd, aStr(sendAttrPath, path), aU64(sendAttrIno, ino), aU64(sendAttrMode, uint64(t.item.mode)), aU64(sendAttrRdev, newEncodeDev(t.item.rdev)))
	default:
		return fmt.Errorf("%w: inode %d has mode %#o", errNoTreePlan, ino, t.item.mode)
	}
	return nil
}

// symlinkTarget reads the target of the symlink t from snap, by one of its paths.
func (p *treePlan) symlinkTarget(t *inodeState) (string, error) {
	if len(t.refs) == 0 {
		return "", fmt.Errorf("%w: symlink %d has no name", errNoTreePlan, t.ino)
	}
	dir, err := p.t.path(t.refs[0].parent)
	if err != nil {
		return "", err
	}
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(p.t.s.fd, join(dir, t.refs[0].name), buf)
	if err != nil {
		return "", fmt.Errorf("read symlink inode %d of the snapshot: %w", t.ino, err)
	}
	return string(buf[:n]), nil
}

// update is phase 3: data, size, owner, mode, extended attributes and times.
func (p *treePlan) update() error {
	for i, x := range p.inos {
		if i%256 == 255 {
			if err := p.ctx.Err(); err != nil {
				return err
			}
		}
		pr := p.pairs[x]
		t, h := pr.t, pr.h
		if t == nil {
			continue
		}
		var path string
		var err error
		switch {
		case t.item.isDir():
			path, err = p.livePath(x)
		case len(t.refs) == 0:
			continue // unlinked in snap: no name to reach it by, nothing to restore
		default:
			a, ok := p.anchor[x]
			if !ok {
				if a, ok = pr.rightName(); !ok {
					return fmt.Errorf("%w: inode %d has no name in live after the plan", errNoTreePlan, x)
				}
			}
			path, err = p.entryPath(a)
		}
		if err != nil {
			return err
		}
		if p.created[x] {
			h = nil
		}
		n := len(p.cmds)
		if t.item.typ() == unix.S_IFREG {
			if h == nil {
				// Made empty: the data, to the end of snap's file, sets the size.
				if t.item.size > 0 {
					p.emitData(path, 0, t.item.size)
				}
			} else {
				// The size first, so that the data ranges end where snap's file ends (a
				// clone of an unaligned tail is refused short of the file's end), and
				// whole blocks: a clone then makes snap's holes holes, where a copy of
				// a block's part would write zeros. Growing a file zeroes the rest of
				// its last block, whatever snap has there: that block is cloned too.
				rs := dataDiff(h, t)
				if h.item.size != t.item.size {
					p.emit(sendCmdTruncate, aStr(sendAttrPath, path), aU64(sendAttrSize, t.item.size))
					if h.item.size < t.item.size && h.item.size%p.block != 0 {
						rs = append(rs, [2]uint64{h.item.size, h.item.size + 1})
					}
				}
				for _, r := range blockRanges(rs, p.block, t.item.size) {
					p.emitData(path, r[0], r[1]-r[0])
				}
			}
		}
		chown := h == nil || h.item.uid != t.item.uid || h.item.gid != t.item.gid
		if chown {
			p.emit(sendCmdChown, aStr(sendAttrPath, path), aU64(sendAttrUID, uint64(t.item.uid)), aU64(sendAttrGID, uint64(t.item.gid)))
		}
		// A change of owner clears the set-ID bits, and capabilities: mode and extended
		// attributes follow it.
		if t.item.typ() != unix.S_IFLNK && (chown || h.item.mode != t.item.mode) {
			p.emit(sendCmdChmod, aStr(sendAttrPath, path), aU64(sendAttrMode, uint64(t.item.mode&0o7777)))
		}
		if h != nil {
			for _, name := range slices.Sorted(maps.Keys(h.xattrs)) {
				if _, ok := t.xattrs[name]; !ok {
					p.emit(sendCmdRemoveXattr, aStr(sendAttrPath, path), aStr(sendAttrXattrName, name))
				}
			}
		}
		for _, name := range slices.Sorted(maps.Keys(t.xattrs)) {
			v := t.xattrs[name]
			if h != nil && !(chown && strings.HasPrefix(name, "security.")) {
				if w, ok := h.xattrs[name]; ok && w == v {
					continue
				}
			}
			p.emit(sendCmdSetXattr, aStr(sendAttrPath, path), aStr(sendAttrXattrName, name), aBytes(sendAttrXattrData, []byte(v)))
		}
		if h == nil || len(p.cmds) > n || h.item.atime != t.item.atime || h.item.mtime != t.item.mtime {
			p.emit(sendCmdUtimes, aStr(sendAttrPath, path), aTime(sendAttrAtime, t.item.atime), aTime(sendAttrMtime, t.item.mtime), aTime(sendAttrCtime, t.item.mtime))
		}
	}
	return nil
}

func (p *treePlan) emitData(path string, off, n uint64) {
	c := p.emit(sendCmdUpdateExtent, aStr(sendAttrPath, path), aU64(sendAttrFileOffset, off), aU64(sendAttrSize, n))
	c.exact = true
}

// blockRanges returns rs widened to whole blocks, clipped to size, sorted, and merged
// where they are less than mergeGap apart: a clone costs more than the extents it
// passes over (where live already has snap's, it puts the same ones back).
// BenchmarkRevertHistory's reverts: half the commands, apply 5.8 -> 5.0 ms (three runs
// of five reverts each way).
func blockRanges(rs [][2]uint64, block, size uint64) [][2]uint64 {
	var out [][2]uint64
	for _, r := range rs {
		r = [2]uint64{r[0] / block * block, min((r[1]+block-1)/block*block, size)}
		if r[0] < r[1] {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b [2]uint64) int { return cmp.Compare(a[0], b[0]) })
	n := 0
	for _, r := range out {
		if n > 0 && out[n-1][1]+mergeGap >= r[0] {
			out[n-1][1] = max(out[n-1][1], r[1])
			continue
		}
		out[n] = r
		n++
	}
	return out[:n]
}

const mergeGap = 64 << 10

// dataDiff returns the ranges of [0, t's size) where h's data is not t's, as their
// extent items say: the same extent at the same offset, or a hole on both sides, is the
// same data. What lies past h's size reads as a hole once the file grows.
func dataDiff(h, t *inodeState) [][2]uint64 {
	var out [][2]uint64
	end := t.item.size
	var hi, ti int
	for x := uint64(0); x < end; {
		hs, hNext := extentSpan(h.extents, &hi, x, h.item.size)
		ts, tNext := extentSpan(t.extents, &ti, x, t.item.size)
		y := min(hNext, tNext, end)
		if !sameExtentData(hs, ts, x) {
			if n := len(out); n > 0 && out[n-1][1] == x {
				out[n-1][1] = y
			} else {
				out = append(out, [2]uint64{x, y})
			}
		}
		x = y
	}
	return out
}

// extentSpan returns the extent item holding the file offset x (nil for a hole) and
// where that span ends; *i is a cursor into es (sorted by offset), and x only grows.
// Nothing lies at or past size.
func extentSpan(es []fileExtent, i *int, x, size uint64) (*fileExtent, uint64) {
	if x >= size {
		return nil, ^uint64(0)
	}
	for *i < len(es) && es[*i].end() <= x {
		*i++
	}
	if *i == len(es) {
		return nil, size
	}
	e := &es[*i]
	if e.off > x {
		return nil, min(e.off, size)
	}
	if e.typ != extentInline && e.bytenr == 0 {
		return nil, min(e.end(), size) // an explicit hole
	}
	return e, min(e.end(), size)
}

func sameExtentData(a, b *fileExtent, x uint64) bool {
	switch {
	case a == nil || b == nil:
		return a == nil && b == nil
	case a.typ != b.typ || a.compress != b.compress:
		return false
	case a.typ == extentInline:
		return a.off == b.off && a.ramBytes == b.ramBytes && a.inline == b.inline
	}
	return a.bytenr == b.bytenr && a.diskLen == b.diskLen && a.extOff+(x-a.off) == b.extOff+(x-b.off)
}

// Building commands.

type cmdAttr struct {
	t int
	v []byte
}

func aStr(t int, s string) cmdAttr   { return cmdAttr{t, []byte(s)} }
func aBytes(t int, b []byte) cmdAttr { return cmdAttr{t, b} }
func aU64(t int, v uint64) cmdAttr   { return cmdAttr{t, binary.LittleEndian.AppendUint64(nil, v)} }
func aTime(t int, ts unix.Timespec) cmdAttr {
	b := binary.LittleEndian.AppendUint64(nil, uint64(ts.Sec))
	return cmdAttr{t, binary.LittleEndian.AppendUint32(b, uint32(ts.Nsec))}
}

func (p *treePlan) emit(cmd uint16, attrs ...cmdAttr) *sendCommand {
	c := &sendCommand{cmd: cmd}
	for _, a := range attrs {
		c.attrs[a.t] = a.v
	}
	p.cmds = append(p.cmds, c)
	return c
}
