package btrfs

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/phase"
	"github.com/cairn-sandbox/cairn/storage"
)

// When a snapshot's content is fixed.
//
// BTRFS_IOC_SNAP_CREATE_V2 flushes the source's dirty data, then commits the running
// transaction, and the snapshot is made inside that commit's critical section: with
// every writer of the filesystem held out, the source's root is copied and the
// snapshot's root reference inserted into the root tree. Writers are let in again as
// the critical section ends, into the next transaction, which the snapshot does not see;
// the commit goes on without them, writing the tree blocks and the superblocks with
// their flushes, and the ioctl returns after that: 4-5 of a 5.6 ms snapshot of a
// W1-like step, on an idle loop device here, and most of the snapshot's tail when other
// writes share the disk.
//
// So the snapshot's content is fixed once its root reference is in the root tree: a
// process let go then may write to the source at once (a write that needs the
// transaction waits for the critical section's end; data it leaves in the page cache is
// the source's inode's, never the snapshot's). A tree search of the root tree sees the
// reference as soon as it is inserted (it reads the tree in memory, not the last
// committed one), and watchFixed polls for it beside the ioctl.

var _ storage.SplitSnapshotter = (*Pool)(nil)

// SnapshotSplit implements storage.SplitSnapshotter. It makes the snapshot under dst
// itself, not under a temporary name renamed into place (Snapshot): the snapshot ioctl
// is atomic (its name and its tree are in the one transaction it commits, and the name
// can be looked up only once it returns), and there is then nothing left to do after
// it: a caller that dies meanwhile loses nothing, as the kernel finishes the ioctl.
// Until published returns, the pool's own operations on dst, or on a name below or
// above it, wait for it (pending).
func (p *Pool) SnapshotSplit(ctx context.Context, src, dst string, readonly bool) (func() error, error) {
	if err := validName(src); err != nil {
		return nil, err
	}
	if err := validName(dst); err != nil {
		return nil, err
	}
	p.await(src, dst)
	pub := p.pend(dst)
	fixed := make(chan struct{})
	var fixOnce sync.Once
	result := make(chan error, 1)
	// The goroutine outlives the call (the ioctl cannot be cancelled).
	go func() {
		err := p.snapshotAt(src, dst, readonly, func(id uint64) {
			fixOnce.Do(func() {
				pub.id.Store(id)
				close(fixed)
			})
		})
		p.unpend(dst, pub)
		result <- err
	}()
	t := time.Now()
	select {
	case <-fixed:
		phase.Since(ctx, "snapshot_fixed", t)
		return sync.OnceValue(func() error { return <-result }), nil
	case err := <-result:
		if err != nil {
			return nil, err // failed before the snapshot existed
		}
		return func() error { return nil }, nil
	}
}

// fixedTree returns the tree ID of name while SnapshotSplit is publishing it and its
// content is fixed (its root item and reference are in the root tree, where tree
// searches find them; its name resolves only once the ioctl returns). ok is false
// otherwise: the name is not being published (open it), or its ID is not known.
func (p *Pool) fixedTree(name string) (id uint64, ok bool) {
	if p.npending.Load() == 0 {
		return 0, false
	}
	p.pendingMu.Lock()
	pub := p.pending[name]
	p.pendingMu.Unlock()
	if pub == nil {
		return 0, false
	}
	id = pub.id.Load()
	return id, id != 0
}

// snapshotAt makes dst a snapshot of src by one ioctl in dst's parent directory (made
// if missing), calling fixed once its content is fixed, with its tree ID when the watch
// found it (0 if not: at the latest on success).
func (p *Pool) snapshotAt(src, dst string, readonly bool, fixed func(id uint64)) error {
	e, err := p.openSnapshotEnds(src, dst)
	if err != nil {
		return err
	}
	defer e.release()
	stop := watchFixed(e.pfd, e.base, fixed)
	err = snapCreate(e.pfd, e.srcfd, e.base, readonly)
	stop()
	if err != nil {
		return p.opError("snapshot "+src+" to", dst, err)
	}
	fixed(0)
	return nil
}

// publishing is a volume SnapshotSplit is publishing: done is closed once it is, and
// id is its tree ID once its content is fixed (0 before).
type publishing struct {
	done chan struct{}
	id   atomic.Uint64
}

// pend records dst as being published.
func (p *Pool) pend(dst string) *publishing {
	p.pendingMu.Lock()
	defer p.pendingMu.Unlock()
	if p.pending == nil {
		p.pending = map[string]*publishing{}
	}
	pub := &publishing{done: make(chan struct{})}
	p.pending[dst] = pub
	p.npending.Store(int32(len(p.pending)))
	return pub
}

func (p *Pool) unpend(dst string, pub *publishing) {
	p.pendingMu.Lock()
	if p.pending[dst] == pub {
		delete(p.pending, dst)
	}
	p.npending.Store(int32(len(p.pending)))
	p.pendingMu.Unlock()
	close(pub.done)
}

// await waits until no volume being published is one of names, or below or above one
// of them ("" is the whole pool).
func (p *Pool) await(names ...string) {
	if p.npending.Load() == 0 {
		return
	}
	p.pendingMu.Lock()
	var wait []chan struct{}
	for dst, pub := range p.pending {
		for _, n := range names {
			if n == "" || n == dst || strings.HasPrefix(dst, n+"/") || strings.HasPrefix(n, dst+"/") {
				wait = append(wait, pub.done)
				break
			}
		}
	}
	p.pendingMu.Unlock()
	for _, done := range wait {
		<-done
	}
}

// rootRefLen is struct btrfs_root_ref before its name: the directory, a sequence
// number, the name's length.
const (
	keyRootRef = 156
	rootRefLen = 18
)

// watchFixed's first search comes after firstPoll (the source's dirty data is flushed
// before the commit begins: ~1 ms at least here), the next ones every pollFixed: a
// search costs ~5 µs, but each wakes a thread on a machine whose two cores are busy
// with the zygotes' forks and the commit itself (polling every 0.1 ms from the start,
// W1's snapshot ioctl took 12-13 ms p50 against 9.5-12 without the watch).
const (
	firstPoll = 500 * time.Microsecond
	pollFixed = 250 * time.Microsecond
)

// watchFixed calls fixed once the snapshot name, being made by BTRFS_IOC_SNAP_CREATE_V2
// in the directory dirfd, has its root reference in the root tree; stop ends the watch
// and waits for it. Without what it needs (the directory's tree, the filesystem's
// generation) it watches nothing, and fixed is left to the caller.
func watchFixed(dirfd int, name string, fixed func(id uint64)) (stop func()) {
	info, err := subvolInfo(dirfd)
	if err != nil {
		return func() {}
	}
	var st unix.Stat_t
	if err := unix.Fstat(dirfd, &st); err != nil {
		return func() {}
	}
	gen, err := generation(dirfd)
	if err != nil {
		return func() {}
	}
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		s := newSearcher(dirfd)
		defer s.close()
		s.treeID = 1 // the root tree
		lo := searchKey{info.treeID, keyRootRef, 0}
		hi := searchKey{info.treeID, keyRootRef, ^uint64(0)}
		select {
		case <-quit:
			return
		case <-time.After(firstPoll):
		}
		tick := time.NewTicker(pollFixed)
		defer tick.Stop()
		for {
			var found uint64 // the snapshot's tree ID: the reference's key offset
			// Leaves last written before the snapshot's transaction cannot hold its
			// reference: the search skips them.
			err := s.search(lo, hi, gen, func(k searchKey, d []byte) error {
				if len(d) >= rootRefLen {
					n := int(binary.LittleEndian.Uint16(d[16:]))
					if binary.LittleEndian.Uint64(d) == st.Ino && bytes.Equal(d[rootRefLen:min(len(d), rootRefLen+n)], []byte(name)) {
						found = k.offset
					}
				}
				return nil
			})
			if err != nil {
				return
			}
			if found != 0 {
				fixed(found)
				return
			}
			select {
			case <-quit:
				return
			case <-tick.C:
			}
		}
	})
	return func() {
		close(quit)
		wg.Wait()
	}
}

// fsInfoFlagGeneration asks BTRFS_IOC_FS_INFO for the filesystem's generation.
const fsInfoFlagGeneration = 1 << 1

// generation returns the transaction the filesystem of fd is in.
func generation(fd int) (uint64, error) {
	a := fsInfoArgs{flags: fsInfoFlagGeneration}
	if err := ioctl(fd, iocFsInfo, unsafe.Pointer(&a)); err != nil {
		return 0, err
	}
	return a.generation, nil
}

// Offsets in struct btrfs_root_item (packed; after its 160-byte inode item) of what
// subvolInfo reports and the tree plans read; rootItemLen is its size with them all.
const (
	rootItemGeneration = 160
	rootItemFlags      = 208
	rootItemUUID       = 247
	rootItemParentUUID = 263
	rootItemCtransid   = 295
	rootItemOtransid   = 303
	rootItemLen        = 439
)

// rootItemInfo returns what subvolInfo would of the subvolume whose tree is id, read
// from its root item in the root tree by a search on fd (any file of the filesystem):
// it needs no name, so it reads a snapshot whose ioctl is still committing.
func rootItemInfo(fd int, id uint64) (*subvolInfoArgs, error) {
	s := newSearcher(fd)
	defer s.close()
	s.treeID = 1
	var a *subvolInfoArgs
	err := s.search(searchKey{id, keyRootItem, 0}, searchKey{id, keyRootItem, ^uint64(0)}, 0, func(k searchKey, d []byte) error {
		if len(d) < rootItemLen {
			return fmt.Errorf("root item of tree %d: %d bytes, want %d", id, len(d), rootItemLen)
		}
		le := binary.LittleEndian
		a = &subvolInfoArgs{treeID: id, generation: le.Uint64(d[rootItemGeneration:]), flags: le.Uint64(d[rootItemFlags:]),
			ctransid: le.Uint64(d[rootItemCtransid:]), otransid: le.Uint64(d[rootItemOtransid:])}
		copy(a.uuid[:], d[rootItemUUID:])
		copy(a.parentUUID[:], d[rootItemParentUUID:])
		return nil
	})
	if err == nil && a == nil {
		err = fmt.Errorf("tree %d has no root item", id)
	}
	return a, err
}
