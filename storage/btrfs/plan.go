package btrfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/storage"
)

// Planned reverts (storage.PlannedReverter).
//
// # Knowing that live still is base
//
// Unchanged must never say yes for a live that changed; it may say no for one that did
// not. btrfs gives two witnesses, neither enough alone:
//
//   - The subvolume's root item, which the kernel keeps in memory, has a ctransid: the
//     transaction of the last change of an inode of the subvolume (btrfs_update_inode
//     and inode creation set it, uncommitted). A snapshot is created when every writer
//     of its transaction is done, and it records that transaction as its otransid: so
//     a change after the snapshot joins a later transaction, and live's ctransid moves
//     past base's otransid. Names, attributes, truncations, holes, clones, links and
//     extended attributes update an inode at once.
//   - Data writes do not: a buffered write, a write through a shared mapping or into a
//     no-copy-on-write file, sets the times in memory only, and the inode is updated
//     once the data is written back (TestUnchangedSeesEveryChange). Until then the
//     data is dirty, and btrfs reserved space for it: the data space's bytes_may_use.
//     Once written back the space is reserved (bytes_reserved) until the extent's
//     reference is run, after the write-back updated the inode. So: may_use zero, then
//     reserved zero, then the ctransid read, in that order, leave no gap for data in
//     flight. Asynchronous or direct writes allocate before they return, so they are
//     reserved too. The two counters are the filesystem's, all volumes together: any
//     dirty data anywhere in the pool makes Unchanged say no.
//
// And base must be a snapshot of live itself (its parent UUID is live's UUID): a
// snapshot of another volume shares nothing with live's transaction history.

// Unchanged implements storage.PlannedReverter.
func (p *Pool) Unchanged(live, base string) (bool, error) {
	for _, n := range []string{live, base} {
		if err := validName(n); err != nil {
			return false, err
		}
	}
	// A base whose snapshot ioctl is still committing (SplitSnapshotter) is read by its
	// tree ID: its content is fixed, and the ioctl's tail need not be waited for.
	baseID, fixed := p.fixedTree(base)
	if fixed {
		p.await(live)
	} else {
		p.await(live, base)
	}
	rootfd, err := p.acquire()
	if err != nil {
		return false, err
	}
	defer p.mu.RUnlock()
	var bi *subvolInfoArgs
	if fixed {
		bi, err = rootItemInfo(rootfd, baseID)
	} else {
		var basefd int
		if basefd, err = openVolume(rootfd, base); err != nil {
			return false, p.opError("unchanged: open", base, err)
		}
		bi, err = subvolInfo(basefd)
		unix.Close(basefd)
	}
	if err != nil {
		return false, p.opError("unchanged: inspect", base, err)
	}
	livefd, err := openVolume(rootfd, live)
	if err != nil {
		return false, p.opError("unchanged: open", live, err)
	}
	defer unix.Close(livefd)
	if bi.flags&rootSubvolRdonly == 0 {
		return false, nil
	}
	clean, err := p.noDataInFlight(rootfd)
	if err != nil || !clean {
		return false, err
	}
	li, err := subvolInfo(livefd)
	if err != nil {
		return false, p.opError("unchanged: inspect", live, err)
	}
	return li.flags&rootSubvolRdonly == 0 && bi.parentUUID == li.uuid && li.ctransid <= bi.otransid, nil
}

// noDataInFlight reports whether the filesystem holds no data that is dirty or written
// back but not yet referenced (see above): bytes_may_use, then bytes_reserved, of its
// data space are zero. A filesystem with mixed block groups has no data space of its
// own, and reports false.
func (p *Pool) noDataInFlight(rootfd int) (bool, error) {
	p.dataSpaceMu.Lock()
	dir := p.dataSpace
	if dir == "" {
		fi, err := fsInfo(rootfd)
		if err != nil {
			p.dataSpaceMu.Unlock()
			return false, p.opError("unchanged: inspect the filesystem of", p.dir, err)
		}
		u := fi.fsid
		dir = fmt.Sprintf("/sys/fs/btrfs/%x-%x-%x-%x-%x/allocation/data/", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
		p.dataSpace = dir
	}
	p.dataSpaceMu.Unlock()
	for _, f := range []string{"bytes_may_use", "bytes_reserved"} {
		b, err := os.ReadFile(dir + f)
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("btrfs pool %s: read %s: %w", p.dir, dir+f, err)
		}
		n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return false, fmt.Errorf("btrfs pool %s: read %s: %q is not a number", p.dir, dir+f, b)
		}
		if n != 0 {
			return false, nil
		}
	}
	return true, nil
}

// plan is the btrfs RevertPlan: the commands from base to snapshot, of a tree plan or
// of a no-data send stream.
type plan struct {
	base, snapshot string
	cmds           []*sendCommand
	sendMS         float64
	how            storage.RevertStats // Diff, DiffNote and Compared
}

func (pl *plan) Base() string     { return pl.base }
func (pl *plan) Snapshot() string { return pl.snapshot }
func (pl *plan) Len() int         { return len(pl.cmds) - 1 } // but the header
func (pl *plan) SendMS() float64  { return pl.sendMS }

var _ storage.PlannedReverter = (*Pool)(nil)

// PlanRevert implements storage.PlannedReverter: the kernel's send ioctl with base as
// the parent, in no-data mode, as Revert's but for the parent, or a tree plan. A base
// whose split snapshot is still committing (SnapshotSplit) is read by its tree ID, and
// the plan does not wait for the commit: its content is fixed, its root item and
// reference are in the root tree, where tree searches find them, and only its name
// waits for the ioctl to return. Only a tree plan can read it so: the send ioctl reads
// its parent's committed tree. Should that plan fail, the usual one is made once base
// is published.
func (p *Pool) PlanRevert(ctx context.Context, base, snapshot string) (storage.RevertPlan, error) {
	for _, n := range []string{base, snapshot} {
		if err := validName(n); err != nil {
			return nil, err
		}
	}
	if id, ok := p.fixedTree(base); ok && !p.sendOnly {
		if pl, err := p.planRevert(ctx, base, id, snapshot); err == nil || ctx.Err() != nil {
			return pl, err
		}
	}
	return p.planRevert(ctx, base, 0, snapshot)
}

// planRevert is PlanRevert from base opened by its name (baseID 0) or read by its tree
// ID while it is being published.
func (p *Pool) planRevert(ctx context.Context, base string, baseID uint64, snapshot string) (storage.RevertPlan, error) {
	if baseID == 0 {
		p.await(base, snapshot)
	} else {
		p.await(snapshot)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	rootfd, err := p.acquire()
	if err != nil {
		return nil, err
	}
	defer p.mu.RUnlock()
	basefd := -1
	baseFlags := uint64(btrfsSubvolRdonly) // SnapshotSplit makes read-only snapshots only
	if baseID == 0 {
		if basefd, baseFlags, baseID, err = p.openRevertVolume(rootfd, base, "plan a revert from"); err != nil {
			return nil, err
		}
		defer unix.Close(basefd)
	}
	snapfd, snapFlags, snapID, err := p.openRevertVolume(rootfd, snapshot, "plan a revert to")
	if err != nil {
		return nil, err
	}
	defer unix.Close(snapfd)
	switch {
	case baseFlags&btrfsSubvolRdonly == 0 || snapFlags&btrfsSubvolRdonly == 0:
		return nil, errdefs.FailedPrecondition("btrfs pool %s: plan a revert from %q to %q: both must be read-only snapshots", p.dir, base, snapshot)
	case baseID == snapID:
		return nil, errdefs.InvalidArgument("btrfs pool %s: plan a revert from %q to %q: both names are the same volume", p.dir, base, snapshot)
	}
	t := time.Now()
	pl := &plan{base: base, snapshot: snapshot}
	if basefd >= 0 {
		pl.cmds, err = p.difference(ctx, basefd, snapfd, baseID, -1, &pl.how, fmt.Sprintf("plan a revert from %q to %q", base, snapshot), func(err error) error {
			return p.opError("plan a revert to", snapshot, err)
		})
	} else {
		pl.cmds, pl.how.Compared, err = p.treeDiffByID(ctx, rootfd, base, baseID, snapshot, snapfd)
		pl.how.Diff = "tree"
	}
	if err != nil {
		return nil, err
	}
	pl.sendMS = msSince(t)
	return pl, nil
}

// treeDiffByID is the tree plan from the volume whose tree is baseID (named base, for
// messages), read by searches on rootfd, to snapfd.
func (p *Pool) treeDiffByID(ctx context.Context, rootfd int, base string, baseID uint64, snapshot string, snapfd int) ([]*sendCommand, int, error) {
	var infos [3]*subvolInfoArgs
	var err error
	if infos[0], err = rootItemInfo(rootfd, baseID); err != nil {
		return nil, 0, p.opError("plan a revert from", base, err)
	}
	if infos[1], err = subvolInfo(snapfd); err != nil {
		return nil, 0, p.opError("plan a revert to", snapshot, err)
	}
	return p.treeDiffOf(ctx, treeRef{fd: rootfd, id: baseID}, infos, snapfd)
}

// RevertPlanned implements storage.PlannedReverter.
func (p *Pool) RevertPlanned(ctx context.Context, live string, plans ...storage.RevertPlan) (storage.RevertStats, error) {
	var st storage.RevertStats
	if err := validName(live); err != nil {
		return st, err
	}
	p.await(live)
	if len(plans) == 0 {
		return st, errdefs.InvalidArgument("btrfs pool %s: revert %q: no plan to apply", p.dir, live)
	}
	pls := make([]*plan, len(plans))
	for i, rp := range plans {
		pl, ok := rp.(*plan)
		if !ok || pl == nil {
			return st, errdefs.InvalidArgument("btrfs pool %s: revert %q: plan %d was not made by this pool's PlanRevert", p.dir, live, i)
		}
		if i > 0 && pl.base != pls[i-1].snapshot {
			return st, errdefs.InvalidArgument("btrfs pool %s: revert %q: plan %d goes from %q, not from %q where the plan before it ends", p.dir, live, i, pl.base, pls[i-1].snapshot)
		}
		if pl.base == live || pl.snapshot == live {
			return st, errdefs.InvalidArgument("btrfs pool %s: revert %q: plan %d goes from or to live itself", p.dir, live, i)
		}
		pls[i] = pl
		st.SendMS += pl.sendMS
		st.Compared += pl.how.Compared
		if st.Diff == "" || pl.how.Diff == "send" {
			st.Diff, st.DiffNote = pl.how.Diff, pl.how.DiffNote
		}
	}
	if err := ctx.Err(); err != nil {
		return st, err
	}
	rootfd, err := p.acquire()
	if err != nil {
		return st, err
	}
	defer p.mu.RUnlock()
	livefd, liveFlags, _, err := p.openRevertVolume(rootfd, live, "revert")
	if err != nil {
		return st, err
	}
	defer unix.Close(livefd)
	if liveFlags&btrfsSubvolRdonly != 0 {
		return st, errdefs.FailedPrecondition("btrfs pool %s: revert %q: the volume is read-only, and Revert reverts writable volumes", p.dir, live)
	}
	start := time.Now()
	// A file that one plan recreates (a new inode of live) stands for its snapshot's
	// inode; a later plan that updates it in place names that same inode, which its own
	// snapshot shares with the earlier's (a stream updates a file in place only where
	// its two volumes have the same inode). So what each plan created carries over.
	created := map[uint64]uint64{}
	for _, pl := range pls {
		snapfd, _, _, err := p.openRevertVolume(rootfd, pl.snapshot, "revert to")
		if err != nil {
			return st, err
		}
		a, err := newApplier(livefd, snapfd, &st, revertOptions{})
		if err == nil {
			a.created = created
			err = a.apply(ctx, pl.cmds)
			a.close()
		}
		unix.Close(snapfd)
		if err != nil {
			applied := 0
			if a != nil {
				applied = a.applied
			}
			st.ApplyMS = msSince(start)
			return st, p.partlyReverted(live, pl.snapshot, applied, pl.Len(), err)
		}
	}
	st.ApplyMS = msSince(start)
	return st, nil
}
