package btrfs

import (
	"encoding/binary"
	"sync"
)

// What tree plans remember of a volume's snapshots between plans.
//
// A sandbox's rollbacks plan one difference after another on snapshots of the same
// live volume V, each from V's newest snapshot to an older one. A plan's candidates
// are the inodes the newer snapshot changed since the older was taken, found by a
// search of every leaf written since (W1: ~0.1-0.9 MB of items, 0.5-3.6 ms). V's
// inodes changed in (from, to], with the transaction of their last change, are kept,
// and the next plan, whose newer snapshot was taken at o ≥ to, searches only the
// leaves written in (to, o] (the step since: a few leaves) and takes the rest from
// what is kept. A deletion leaves no item to find, so a deleted inode stays among the
// candidates until a plan reads it and finds it gone: a search wasted, never a
// difference missed (an inode only the older snapshot has is found through the
// directory that lost it, which changed).
//
// It is per volume, keyed by V's UUID (the parent UUID of its snapshots; for a live
// volume made from the target, live's own), and bounded (lineages, inodes); over the
// bound it is dropped, which costs the next plan a full search.
//
// (Inode states are not kept across plans: a state read at transaction t holds for
// every snapshot that has the inode at t, but a kept candidate may have been deleted
// since, with no item to say so, and only a search tells.)

const (
	maxLineages       = 64
	maxLineageChanged = 1 << 15 // ~40 B each: ~1.3 MB a volume at most
)

// lineage is what is remembered of one volume. Its methods are called with mu held.
type lineage struct {
	mu sync.Mutex
	// changed holds every inode of the volume changed in (from, to], with the
	// transaction of its last change up to to; nil if nothing is known.
	from, to uint64
	changed  map[uint64]uint64
	used     uint64 // the pool's lineage clock at its last use
}

// lineages is a Pool's memory of its volumes' lineages.
type lineages struct {
	mu    sync.Mutex
	clock uint64
	m     map[[16]byte]*lineage
}

// get returns the lineage of the volume uuid, made if new; the least recently used one
// is forgotten beyond maxLineages.
func (ls *lineages) get(uuid [16]byte) *lineage {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.clock++
	if l := ls.m[uuid]; l != nil {
		l.used = ls.clock
		return l
	}
	if ls.m == nil {
		ls.m = map[[16]byte]*lineage{}
	}
	if len(ls.m) >= maxLineages {
		var oldest [16]byte
		min := ^uint64(0)
		for k, l := range ls.m {
			if l.used < min {
				oldest, min = k, l.used
			}
		}
		delete(ls.m, oldest)
	}
	l := &lineage{used: ls.clock}
	ls.m[uuid] = l
	return l
}

// candidates returns the inodes that the volume's snapshot newer, taken in the
// transaction o, changed after g, by a search of the leaves newer wrote since what is
// known (or since g), and remembers them, with the transaction of each one's last
// change.
func (l *lineage) candidates(newer *searcher, g, o uint64) (map[uint64]uint64, error) {
	incremental := l.changed != nil && l.from <= g && l.to <= o
	min := g
	if incremental {
		min = l.to
	}
	found := map[uint64]uint64{}
	err := newer.search(keyFirst, keyLast, min+1, func(k searchKey, d []byte) error {
		if k.typ == keyInodeItem && len(d) >= 16 {
			if t := binary.LittleEndian.Uint64(d[8:]); t > min {
				found[k.objectid] = t
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	switch {
	case incremental:
		for x, t := range found {
			l.changed[x] = t
		}
		l.to = o
		if len(l.changed) > maxLineageChanged {
			l.changed = nil
		}
	case l.changed == nil || o >= l.to:
		// Known from g on now; what was known before g, from a later from, is
		// covered again.
		l.from, l.to, l.changed = g, o, found
		if len(found) > maxLineageChanged {
			l.changed = nil
		}
	default:
		// newer is older than what is known: nothing to remember.
		return found, nil
	}
	out := map[uint64]uint64{}
	for x, t := range l.changed {
		if t > g {
			out[x] = t
		}
	}
	return out, nil
}

// gone forgets x, which the volume's newest snapshot known does not have: it was
// deleted, and a plan to a snapshot that has it finds it through a directory that
// changed (treeplan.go).
func (l *lineage) gone(x uint64) {
	if l.changed != nil {
		delete(l.changed, x)
	}
}
