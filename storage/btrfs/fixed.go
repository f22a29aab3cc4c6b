package btrfs

import (
	"bytes"
	"context"
	"encoding/binary"
	"sync"
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

// SnapshotSplit implements storage.SplitSnapshotter: SnapshotLazy in two halves.
func (p *Pool) SnapshotSplit(ctx context.Context, src, dst string, readonly bool) (func() error, error) {
	fixed := make(chan struct{})
	var once sync.Once
	done := make(chan error, 1)
	go func() {
		done <- p.snapshot(ctx, src, dst, readonly, false, func() { once.Do(func() { close(fixed) }) })
	}()
	t := time.Now()
	select {
	case <-fixed:
		phase.Since(ctx, "snapshot_fixed", t)
		return func() error { return <-done }, nil
	case err := <-done:
		if err != nil {
			return nil, err
		}
		return func() error { return nil }, nil
	}
}

// rootRefLen is struct btrfs_root_ref before its name: the directory, a sequence
// number, the name's length.
const (
	keyRootRef = 156
	rootRefLen = 18
)

// pollFixed is how often watchFixed searches the root tree: ~5 µs a search, so a
// fraction of a core for the few milliseconds a snapshot takes.
const pollFixed = 100 * time.Microsecond

// watchFixed calls fixed once the snapshot name, being made by BTRFS_IOC_SNAP_CREATE_V2
// in the directory dirfd, has its root reference in the root tree; stop ends the watch
// and waits for it. Without what it needs (the directory's tree, the filesystem's
// generation) it watches nothing, and fixed is left to the caller.
func watchFixed(dirfd int, name string, fixed func()) (stop func()) {
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
		tick := time.NewTicker(pollFixed)
		defer tick.Stop()
		for {
			found := false
			// Leaves last written before the snapshot's transaction cannot hold its
			// reference: the search skips them.
			err := s.search(lo, hi, gen, func(k searchKey, d []byte) error {
				if len(d) >= rootRefLen {
					n := int(binary.LittleEndian.Uint16(d[16:]))
					found = found || binary.LittleEndian.Uint64(d) == st.Ino && bytes.Equal(d[rootRefLen:min(len(d), rootRefLen+n)], []byte(name))
				}
				return nil
			})
			if err != nil {
				return
			}
			if found {
				fixed()
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
