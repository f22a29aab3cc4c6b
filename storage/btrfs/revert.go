package btrfs

import (
	"context"
	"errors"
	"fmt"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/storage"
)

// Revert brings a volume back to one of its read-only snapshots in place (see
// storage.Reverter for the contract).
//
// # How
//
// The kernel already knows how to turn one subvolume into another: BTRFS_IOC_SEND with a
// parent computes, from the two committed trees, the operations that make the parent
// equal to the send root, and it matches files by inode number and generation, so a file
// present in both is updated in place rather than recreated. Revert runs it with the
// snapshot as the send root and live as the parent, in no-data mode, and applies the
// stream to live's own directory; the data of each changed range (UPDATE_EXTENT) is
// reflinked from the snapshot's inode with FICLONERANGE, which shares the extents
// instead of copying them. Revert is thus one receive onto the parent itself: the work
// is proportional to what changed since the snapshot, not to the size of the volume.
//
// Where the two volumes' history allows it (both snapshots of one volume, or live made
// from the snapshot), the same commands are read from their trees instead, without
// send (a tree plan, treeplan.go): the items changed since the older of the two was
// taken, compared one by one. Send remains for the rest, and when a tree plan meets
// what it does not model (RevertStats.Diff and DiffNote say which, and why).
//
// The kernel sends only from read-only roots, so Revert takes a temporary read-only
// snapshot of live (a ".tmp-" name, deleted once the difference is read: ~0.2 ms) and
// sends with it as the parent; live itself stays writable throughout (the stream is
// small, metadata only, and is kept in memory). Send reads committed trees, so data
// written to live but not yet written back would be missed: creating the snapshot
// writes back live's delalloc and commits first, which makes it the costly step of a
// Revert (the commit, mostly its delayed references, in docs/performance.md). A syncfs
// before it would be redundant, and would write back every volume of the filesystem,
// other sandboxes' included.
//
// # Crash consistency and idempotence
//
// Every operation of the stream is one system call (a data update a few, each of which
// leaves the file a mixture of old and new ranges), so an interruption leaves live a
// consistent tree somewhere between its old content and the snapshot's, possibly with
// some of the kernel's temporary names ("o257-12-0") and, after a crash before the
// temporary snapshot is deleted, that snapshot (which Recover deletes). Running Revert
// again computes a fresh difference from that state and converges; the kernel picks
// temporary names free in both trees. Files present in both keep their inode across an
// interruption too: the stream unlinks the last name of an inode only if the snapshot
// does not have that inode.
//
// The mapping of a changed range to its source: a stream path names the inode being
// updated in live at that point of the stream. An inode that live and the snapshot
// share has the same number in both; one that this Revert created (MKFILE) is mapped by
// the inode number the command carries. The snapshot's file is then found by number
// with BTRFS_IOC_INO_PATHS, and its generation checked against live's, so that a range
// is never filled from an unrelated file.
//
// # What the stream does not carry
//
// Inode flags (chattr: immutable, append-only, nodatacow, compression) are not part of a
// version 1 stream and are left as live has them; change and birth times cannot be set.
// Send skips volumes nested in live: they stay as they are. And since the kernel matches
// by inode, a file that Revert recreated (it was deleted after the snapshot) differs from
// the snapshot's for good, so every later Revert to that snapshot recreates it again; and
// every inode whose change time a Revert moved differs in its item from every snapshot
// taken before: send sets its times again, a tree plan reads and compares it. A cost
// that grows with what earlier Reverts restored, never a difference in the result.
func (p *Pool) Revert(ctx context.Context, live, snapshot string) (storage.RevertStats, error) {
	p.await(live, snapshot)
	return p.revert(ctx, live, snapshot, revertOptions{})
}

var _ storage.Reverter = (*Pool)(nil)

// revertOptions are the test hooks of revert.
type revertOptions struct {
	// stopAfter, if positive, makes the apply fail after that many operations, leaving
	// live as a crash at that point would (but writable).
	stopAfter int
}

// errStopped is the failure injected by revertOptions.stopAfter.
var errStopped = errors.New("stopped by the test hook")

func (p *Pool) revert(ctx context.Context, live, snapshot string, opt revertOptions) (storage.RevertStats, error) {
	var st storage.RevertStats
	for _, n := range []string{live, snapshot} {
		if err := validName(n); err != nil {
			return st, err
		}
	}
	if live == snapshot {
		return st, errdefs.InvalidArgument("btrfs pool %s: revert %q to itself; name a read-only snapshot of it", p.dir, live)
	}
	if err := ctx.Err(); err != nil {
		return st, err
	}
	rootfd, err := p.acquire()
	if err != nil {
		return st, err
	}
	defer p.mu.RUnlock()
	vols, err := p.openRevertPair(rootfd, live, snapshot, "revert", "revert to")
	if err != nil {
		return st, err
	}
	defer vols.close()
	livefd, liveFlags, liveID := vols[0].fd, vols[0].flags, vols[0].id
	snapfd, snapFlags, snapID := vols[1].fd, vols[1].flags, vols[1].id
	switch {
	case liveFlags&btrfsSubvolRdonly != 0:
		return st, errdefs.FailedPrecondition("btrfs pool %s: revert %q: the volume is read-only, and Revert reverts writable volumes; if an earlier Revert was interrupted by a crash, clear the flag with SetReadOnly(false) and run Revert again", p.dir, live)
	case snapFlags&btrfsSubvolRdonly == 0:
		return st, errdefs.FailedPrecondition("btrfs pool %s: revert %q to %q: the target is writable, and Revert needs a read-only snapshot (Snapshot with readonly=true)", p.dir, live, snapshot)
	case liveID == snapID:
		return st, errdefs.InvalidArgument("btrfs pool %s: revert %q to %q: both names are the same volume", p.dir, live, snapshot)
	}

	cmds, err := p.revertDiff(ctx, rootfd, livefd, live, snapfd, &st)
	if err != nil {
		return st, err
	}
	start := time.Now()
	a, err := newApplier(livefd, snapfd, &st, opt)
	if err == nil {
		err = a.apply(ctx, cmds)
		a.close()
	}
	st.ApplyMS = msSince(start)
	if err != nil {
		applied := 0
		if a != nil {
			applied = a.applied
		}
		return st, p.partlyReverted(live, snapshot, applied, len(cmds)-1, err)
	}
	return st, nil
}

// revertVolume is a volume opened by openRevertVolume.
type revertVolume struct {
	fd        int
	flags, id uint64
}

type revertPair [2]revertVolume

func (v revertPair) close() {
	unix.Close(v[0].fd)
	unix.Close(v[1].fd)
}

// openRevertPair opens the volumes a and b (opA and opB are for messages).
func (p *Pool) openRevertPair(rootfd int, a, b, opA, opB string) (revertPair, error) {
	var v revertPair
	var err error
	if v[0].fd, v[0].flags, v[0].id, err = p.openRevertVolume(rootfd, a, opA); err != nil {
		return v, err
	}
	if v[1].fd, v[1].flags, v[1].id, err = p.openRevertVolume(rootfd, b, opB); err != nil {
		unix.Close(v[0].fd)
		return v, err
	}
	return v, nil
}

// openRevertVolume opens the volume name and returns it with its subvolume flags and
// tree id; op is for messages.
func (p *Pool) openRevertVolume(rootfd int, name, op string) (fd int, flags, id uint64, err error) {
	fd, err = openVolume(rootfd, name)
	if err != nil {
		return -1, 0, 0, p.opError(op, name, err)
	}
	if flags, err = getFlags(fd); err == nil {
		id, err = rootID(fd)
	}
	if err != nil {
		unix.Close(fd)
		return -1, 0, 0, p.opError(op+": inspect", name, err)
	}
	return fd, flags, id, nil
}

// revertDiff returns the send stream that turns live into the snapshot. The send
// ioctl compares read-only volumes: live's content is taken as a read-only snapshot of
// it (a hidden ".tmp-" name next to it, which Recover deletes after a crash), removed
// again before revertDiff returns. Live itself stays writable throughout: flipping its
// read-only flag instead would fail whatever writes to it meanwhile (CRIU, dumping a
// zygote from inside the sandbox, creates and removes a directory in its /tmp).
func (p *Pool) revertDiff(ctx context.Context, rootfd, livefd int, live string, snapfd int, st *storage.RevertStats) (cmds []*sendCommand, err error) {
	t := time.Now()
	dirfd, base, err := openParent(rootfd, live, false)
	if err != nil {
		return nil, p.opError("revert: open the directory of", live, err)
	}
	defer unix.Close(dirfd)
	tmp := tmpName(base)
	if err := snapCreate(dirfd, livefd, tmp, true); err != nil {
		return nil, p.opError("revert: snapshot", live, err)
	}
	defer snapDestroy(dirfd, tmp)
	tmpfd, err := unix.Openat(dirfd, tmp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, p.opError("revert: open the snapshot of", live, err)
	}
	defer unix.Close(tmpfd)
	tmpID, err := rootID(tmpfd)
	if err != nil {
		return nil, p.opError("revert: inspect the snapshot of", live, err)
	}
	st.SnapshotMS = msSince(t)

	t = time.Now()
	cmds, err = p.difference(ctx, tmpfd, snapfd, tmpID, livefd, st, fmt.Sprintf("revert %q", live), func(err error) error {
		return p.opError("revert: compare with the snapshot", live, err)
	})
	st.SendMS = msSince(t)
	return cmds, err
}

// difference returns the commands that turn the read-only volume basefd (whose tree is
// baseID) into the read-only volume snapfd: a tree plan (treeplan.go) where the two
// volumes' history allows one, and the kernel's send otherwise. It records in st how
// (Diff, DiffNote, Compared). livefd, or -1, is the volume basefd is a snapshot of. what
// and other are send's.
func (p *Pool) difference(ctx context.Context, basefd, snapfd int, baseID uint64, livefd int, st *storage.RevertStats, what string, other func(error) error) ([]*sendCommand, error) {
	st.DiffNote = "disabled"
	if !p.sendOnly {
		cmds, compared, err := p.treeDiff(ctx, basefd, snapfd, livefd)
		switch {
		case err == nil:
			st.Diff, st.DiffNote, st.Compared = "tree", "", compared
			return cmds, nil
		case ctx.Err() != nil:
			return nil, ctx.Err()
		}
		st.DiffNote = err.Error()
	}
	st.Diff = "send"
	return p.send(snapfd, baseID, what, other)
}

// treeDiff is difference's tree plan, if the volumes' lineage allows one; it returns
// the commands and how many inodes it compared.
func (p *Pool) treeDiff(ctx context.Context, basefd, snapfd, livefd int) ([]*sendCommand, int, error) {
	var infos [3]*subvolInfoArgs
	for i, fd := range []int{basefd, snapfd, livefd} {
		if fd < 0 {
			continue
		}
		var err error
		if infos[i], err = subvolInfo(fd); err != nil {
			return nil, 0, err
		}
	}
	return p.treeDiffOf(ctx, treeRef{fd: basefd}, infos, snapfd)
}

// treeDiffOf is treeDiff given the volumes' information (base, snapshot, live: nil if
// none) and base's tree.
func (p *Pool) treeDiffOf(ctx context.Context, base treeRef, infos [3]*subvolInfoArgs, snapfd int) ([]*sendCommand, int, error) {
	g, baseNewer, ok := treeLineage(infos[0], infos[1], infos[2])
	if !ok {
		return nil, 0, fmt.Errorf("%w: the volumes are not two read-only snapshots of one volume", errNoTreePlan)
	}
	newer := infos[0]
	if !baseNewer {
		newer = infos[1]
	}
	return planTree(ctx, base, snapfd, g, baseNewer, p.lineages.get(newer.parentUUID), newer.otransid)
}

// send returns the no-data send stream of the read-only volume snapfd with the volume
// parentID as its parent (sendDiff), checked to begin with its SNAPSHOT header; what
// names the operation in messages, and other turns the errors of no class of their own
// into the caller's.
func (p *Pool) send(snapfd int, parentID uint64, what string, other func(error) error) ([]*sendCommand, error) {
	cmds, err := sendDiff(snapfd, parentID)
	if err == nil && (len(cmds) == 0 || cmds[0].cmd != sendCmdSnapshot) {
		err = fmt.Errorf("%w: the stream does not start with a snapshot command", errSendStream)
	}
	switch {
	case err == nil:
		return cmds, nil
	case errors.Is(err, errSendStream):
		return nil, fmt.Errorf("btrfs pool %s: %s: %w (nothing was changed; report this as a bug)", p.dir, what, err)
	case errors.Is(err, unix.EAGAIN):
		return nil, errdefs.Unavailable("btrfs pool %s: %s: the kernel refused to send while a deduplication or balance runs on the volumes; retry later: %w", p.dir, what, err)
	}
	return nil, other(err)
}

// partlyReverted wraps an apply failure err after done of total operations, with the
// class of its cause where there is one.
func (p *Pool) partlyReverted(live, snapshot string, done, total int, err error) error {
	what := fmt.Sprintf("btrfs pool %s: revert %q to %q: stopped after %d of the %d operations to apply, so the volume is partly reverted", p.dir, live, snapshot, done, total)
	var errno unix.Errno
	if errors.As(err, &errno) {
		switch errno {
		case unix.ENOSPC, unix.EDQUOT:
			return errdefs.ResourceExhausted("%s; the pool is out of space: free space, then run Revert again: %w", what, err)
		case unix.EPERM, unix.EACCES:
			return errdefs.PermissionDenied("%s; a file refused the change (immutable or append-only attribute, or not running as root): fix that, then run Revert again: %w", what, err)
		case unix.ETXTBSY:
			return errdefs.FailedPrecondition("%s; a file to rewrite is being executed or used as swap: stop that, then run Revert again: %w", what, err)
		}
	}
	return fmt.Errorf("%s; run Revert again, which converges: %w", what, err)
}

func msSince(t time.Time) float64 { return float64(time.Since(t).Microseconds()) / 1000 }

// maxCachedDirs bounds the directory descriptors an applier keeps open.
const maxCachedDirs = 256

// applier applies a send stream to live. It is used by one goroutine.
type applier struct {
	livefd, snapfd int
	block          int64 // the filesystem's sector size: FICLONERANGE's alignment
	st             *storage.RevertStats
	stopAfter      int
	applied        int  // stream commands applied
	skipped        bool // the command being applied found nothing to change

	// dirs are open directories of live by path relative to it. An entry stays valid
	// until that path or one of its ancestors is renamed or removed (forget).
	dirs map[string]int
	// created maps the inode numbers of files and directories this apply created to
	// the numbers they have in the snapshot.
	created map[uint64]uint64
	// touched are the snapshot inode numbers of the directories whose entries changed.
	touched map[uint64]struct{}
	// dst is the live file last opened for a data or size update, by stream path; it
	// is closed at every command that may change what the path names.
	dst struct {
		path    string
		fd      int
		snapIno uint64
		made    bool // created by this apply
	}
	// src is the snapshot file last opened as a data source, by inode number.
	src struct {
		ino  uint64
		fd   int
		size int64
	}
	pathBuf []uint64 // scratch for BTRFS_IOC_INO_PATHS
	copyBuf []byte   // scratch for copies, allocated on first use
}

func newApplier(livefd, snapfd int, st *storage.RevertStats, opt revertOptions) (*applier, error) {
	var fs unix.Statfs_t
	if err := unix.Fstatfs(snapfd, &fs); err != nil {
		return nil, err
	}
	a := &applier{
		livefd: livefd, snapfd: snapfd, block: max(fs.Bsize, 512), st: st, stopAfter: opt.stopAfter,
		dirs: map[string]int{}, created: map[uint64]uint64{}, touched: map[uint64]struct{}{},
		pathBuf: make([]uint64, 8<<10/8),
	}
	a.dst.fd, a.src.fd = -1, -1
	return a, nil
}

func (a *applier) close() {
	a.closeDst()
	if a.src.fd >= 0 {
		unix.Close(a.src.fd)
		a.src.fd = -1
	}
	for k, fd := range a.dirs {
		unix.Close(fd)
		delete(a.dirs, k)
	}
}

func (a *applier) closeDst() {
	if a.dst.fd >= 0 {
		unix.Close(a.dst.fd)
		a.dst.fd = -1
	}
}

// apply applies cmds, whose first is the stream's SNAPSHOT header.
func (a *applier) apply(ctx context.Context, cmds []*sendCommand) error {
	for _, c := range cmds[1:] {
		if err := ctx.Err(); err != nil {
			return err
		}
		if a.stopAfter > 0 && a.st.Ops == a.stopAfter {
			return errStopped
		}
		a.trimDirs()
		a.skipped = false
		if err := a.do(c); err != nil {
			return fmt.Errorf("%s: %w", c, err)
		}
		if a.skipped {
			a.st.Skipped++
		} else {
			a.st.Ops++
		}
		a.applied++
	}
	return a.fixDirTimes(ctx)
}

// do applies one command. The semantics are those of btrfs receive; every path is
// resolved below live without following symlinks, and no operation follows a symlink
// at its last element either.
func (a *applier) do(c *sendCommand) error {
	if c.cmd != sendCmdUpdateExtent && c.cmd != sendCmdClone && c.cmd != sendCmdTruncate {
		a.closeDst()
	}
	p, err := c.str(sendAttrPath)
	if err != nil {
		return err
	}
	switch c.cmd {
	case sendCmdMkfile, sendCmdMkdir, sendCmdMknod, sendCmdMkfifo, sendCmdMksock,
		sendCmdSymlink, sendCmdLink, sendCmdUnlink, sendCmdRmdir:
		if err := a.namespace(c, p); err != nil {
			return err
		}
		return a.touch(p)
	case sendCmdRename:
		to, err := c.str(sendAttrPathTo)
		if err != nil {
			return err
		}
		if err := a.rename(p, to); err != nil {
			return err
		}
		if err := a.touch(p); err != nil {
			return err
		}
		return a.touch(to)
	case sendCmdSetXattr, sendCmdRemoveXattr:
		return a.xattr(c, p)
	case sendCmdTruncate:
		return a.truncate(c, p)
	case sendCmdChmod, sendCmdChown, sendCmdUtimes:
		return a.setattr(c, p)
	case sendCmdUpdateExtent, sendCmdClone:
		return a.update(c, p)
	}
	// SUBVOL (a full stream), SNAPSHOT past the header, WRITE (data in a no-data
	// stream), END (consumed by the reader).
	return fmt.Errorf("%w: unexpected command", errSendStream)
}

// namespace applies a command that adds or removes a name.
func (a *applier) namespace(c *sendCommand, p string) error {
	switch c.cmd {
	case sendCmdMkfile:
		return a.mkfile(c, p)
	case sendCmdMkdir:
		ino, err := c.u64(sendAttrIno)
		if err != nil {
			return err
		}
		return a.at(p, func(d int, b string, _ int) error {
			if err := unix.Mkdirat(d, b, 0o700); err != nil {
				return err
			}
			var st unix.Stat_t
			if err := unix.Fstatat(d, b, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return err
			}
			a.created[st.Ino] = ino // for touch
			return nil
		})
	case sendCmdMknod, sendCmdMkfifo, sendCmdMksock:
		return a.mknod(c, p)
	case sendCmdSymlink:
		target, err := c.str(sendAttrPathLink)
		if err != nil {
			return err
		}
		return a.at(p, func(d int, b string, _ int) error { return unix.Symlinkat(target, d, b) })
	case sendCmdLink:
		target, err := c.str(sendAttrPathLink)
		if err != nil {
			return err
		}
		return a.link(p, target)
	case sendCmdUnlink:
		return a.at(p, func(d int, b string, _ int) error { return gone(unix.Unlinkat(d, b, 0)) })
	case sendCmdRmdir:
		defer a.forget(p)
		return a.at(p, func(d int, b string, _ int) error { return gone(unix.Unlinkat(d, b, unix.AT_REMOVEDIR)) })
	}
	return fmt.Errorf("%w: unexpected command", errSendStream)
}

// gone treats a name already removed as removed: something may have deleted a transient
// entry between the snapshot the difference was computed from and the apply (CRIU
// running inside the sandbox removes the directory it made in its /tmp), and an
// interrupted apply may have removed it already.
func gone(err error) error {
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

// at calls fn with the directory holding p and p's last element; for the volume's root
// (the empty path) it passes live itself, "" and AT_EMPTY_PATH, and otherwise
// AT_SYMLINK_NOFOLLOW as the flag to use.
func (a *applier) at(p string, fn func(dirfd int, base string, nofollow int) error) error {
	if p == "" {
		return fn(a.livefd, "", unix.AT_EMPTY_PATH)
	}
	dir, base := path.Split(p)
	if base == "." || base == ".." {
		return fmt.Errorf("%w: path %q", errSendStream, p)
	}
	d, err := a.dir(strings.TrimSuffix(dir, "/"))
	if err != nil {
		return err
	}
	return fn(d, base, unix.AT_SYMLINK_NOFOLLOW)
}

// dir returns an open descriptor of the directory rel of live.
func (a *applier) dir(rel string) (int, error) {
	if rel == "" {
		return a.livefd, nil
	}
	if fd, ok := a.dirs[rel]; ok {
		return fd, nil
	}
	fd, err := openDir(a.livefd, rel) // beneath live, no symlinks, no mount crossing
	if err != nil {
		return -1, fmt.Errorf("open directory %q: %w", rel, err)
	}
	a.dirs[rel] = fd
	return fd, nil
}

// trimDirs closes the cached directories if there are too many. It runs only between
// commands, since a command may hold several of them (rename, link).
func (a *applier) trimDirs() {
	if len(a.dirs) < maxCachedDirs {
		return
	}
	for k, fd := range a.dirs {
		unix.Close(fd)
		delete(a.dirs, k)
	}
}

// forget drops the cached directories at p or below it, which that path no longer
// names once it is renamed or removed.
func (a *applier) forget(p string) {
	for k, fd := range a.dirs {
		if k == p || strings.HasPrefix(k, p+"/") {
			unix.Close(fd)
			delete(a.dirs, k)
		}
	}
}

// touch records that the directory holding p changed, by its snapshot inode number.
func (a *applier) touch(p string) error {
	dir, _ := path.Split(p)
	d, err := a.dir(strings.TrimSuffix(dir, "/"))
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(d, &st); err != nil {
		return err
	}
	ino := st.Ino
	if s, ok := a.created[ino]; ok {
		ino = s
	}
	a.touched[ino] = struct{}{}
	return nil
}

// fixDirTimes gives the directories whose entries the stream changed the snapshot's
// access and modification times, where they differ. The kernel sends the times of a
// directory whose content differs between the volumes, but not of one it only used for
// temporary names (most often the root, where orphans are created and renamed away).
// Once the stream is applied the trees are equal, so a directory's path in the snapshot
// is its path in live.
func (a *applier) fixDirTimes(ctx context.Context) error {
	for ino := range a.touched {
		if err := ctx.Err(); err != nil {
			return err
		}
		a.trimDirs()
		rel := ""
		if ino != btrfsFirstFreeObjectID {
			var err error
			if rel, err = inodePath(a.snapfd, ino, a.pathBuf); err == unix.ENOENT {
				continue // a directory of live only, removed by the stream
			} else if err != nil {
				return fmt.Errorf("find directory inode %d in the snapshot: %w", ino, err)
			}
		}
		var want, got unix.Stat_t
		sfd, err := openDir(a.snapfd, rel)
		if err != nil {
			return fmt.Errorf("open directory %q of the snapshot: %w", rel, err)
		}
		err = unix.Fstat(sfd, &want)
		unix.Close(sfd)
		if err != nil {
			return err
		}
		d, err := a.dir(rel)
		if err != nil {
			return err
		}
		if err := unix.Fstat(d, &got); err != nil {
			return err
		}
		if got.Atim == want.Atim && got.Mtim == want.Mtim {
			continue
		}
		if err := unix.UtimesNanoAt(d, "", []unix.Timespec{want.Atim, want.Mtim}, unix.AT_EMPTY_PATH); err != nil {
			return fmt.Errorf("set the times of directory %q: %w", rel, err)
		}
		a.st.Ops++
	}
	return nil
}

func (a *applier) rename(from, to string) error {
	err := a.at(from, func(fd1 int, b1 string, _ int) error {
		return a.at(to, func(fd2 int, b2 string, _ int) error {
			return unix.Renameat(fd1, b1, fd2, b2)
		})
	})
	// After the call, not before: the descriptors used above are of the parents, which
	// neither path is an ancestor of.
	a.forget(from)
	a.forget(to)
	return err
}

// link makes p a new name of the existing target.
func (a *applier) link(p, target string) error {
	return a.at(target, func(fd1 int, b1 string, _ int) error {
		return a.at(p, func(fd2 int, b2 string, _ int) error {
			return unix.Linkat(fd1, b1, fd2, b2, 0) // 0: link a symlink itself
		})
	})
}

// mkfile creates an empty file and records which snapshot inode it stands for; its
// data, mode and owner follow in later commands.
func (a *applier) mkfile(c *sendCommand, p string) error {
	ino, err := c.u64(sendAttrIno)
	if err != nil {
		return err
	}
	return a.at(p, func(d int, b string, _ int) error {
		fd, err := unix.Openat(d, b, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return err
		}
		a.created[st.Ino] = ino
		return nil
	})
}

// mknod creates a device node, FIFO or socket; the permission bits are fixed by the
// CHMOD that follows (as the umask may mask them here).
func (a *applier) mknod(c *sendCommand, p string) error {
	mode, rdev := uint64(0o600), uint64(0)
	if c.attrs[sendAttrMode] != nil {
		var err error
		if mode, err = c.u64(sendAttrMode); err != nil {
			return err
		}
		if rdev, err = c.u64(sendAttrRdev); err != nil {
			return err
		}
	}
	switch c.cmd {
	case sendCmdMkfifo:
		mode = mode&0o7777 | unix.S_IFIFO
	case sendCmdMksock:
		mode = mode&0o7777 | unix.S_IFSOCK
	}
	return a.at(p, func(d int, b string, _ int) error {
		// rdev is the kernel's new_encode_dev, the same encoding as user space's dev_t
		// for every 32-bit device number.
		return unix.Mknodat(d, b, uint32(mode), int(rdev))
	})
}

// procPath names the entry b of the open directory d through /proc, for the xattr
// calls, which have no *at form before Linux 6.13; the empty b names d itself.
func procPath(d int, b string) string {
	if b == "" {
		return fmt.Sprintf("/proc/self/fd/%d", d)
	}
	return fmt.Sprintf("/proc/self/fd/%d/%s", d, b)
}

func (a *applier) xattr(c *sendCommand, p string) error {
	name, err := c.str(sendAttrXattrName)
	if err != nil {
		return err
	}
	var data []byte
	if c.cmd == sendCmdSetXattr {
		if data, err = c.attr(sendAttrXattrData); err != nil {
			return err
		}
	}
	return a.at(p, func(d int, b string, _ int) error {
		// The l-forms do not follow a symlink at the last element; for the root (b
		// empty) the last element is /proc's link to the directory, which must be
		// followed.
		pp := procPath(d, b)
		switch {
		case c.cmd == sendCmdRemoveXattr && b == "":
			return unix.Removexattr(pp, name)
		case c.cmd == sendCmdRemoveXattr:
			return unix.Lremovexattr(pp, name)
		case b == "":
			return unix.Setxattr(pp, name, data, 0)
		default:
			return unix.Lsetxattr(pp, name, data, 0)
		}
	})
}

// setattr applies CHMOD, CHOWN or UTIMES. The kernel orders CHOWN before CHMOD, since
// a change of owner clears the set-user-ID and set-group-ID bits. An attribute live
// already has is left alone (a.skipped): the kernel sends them for every inode whose
// item changed, a change time alone included, and setting them would move the change
// time again.
func (a *applier) setattr(c *sendCommand, p string) error {
	var cur unix.Stat_t
	stat := func(d int, b string, nofollow int) error { return unix.Fstatat(d, b, &cur, nofollow) }
	switch c.cmd {
	case sendCmdChmod:
		mode, err := c.u64(sendAttrMode)
		if err != nil {
			return err
		}
		return a.at(p, func(d int, b string, nofollow int) error {
			if stat(d, b, nofollow) == nil && cur.Mode&0o7777 == uint32(mode&0o7777) {
				a.skipped = true
				return nil
			}
			return unix.Fchmodat(d, b, uint32(mode&0o7777), nofollow) // fchmodat2
		})
	case sendCmdChown:
		uid, err := c.u64(sendAttrUID)
		if err != nil {
			return err
		}
		gid, err := c.u64(sendAttrGID)
		if err != nil {
			return err
		}
		return a.at(p, func(d int, b string, nofollow int) error {
			if stat(d, b, nofollow) == nil && uint64(cur.Uid) == uid && uint64(cur.Gid) == gid {
				a.skipped = true
				return nil
			}
			return unix.Fchownat(d, b, int(uid), int(gid), nofollow)
		})
	default:
		at, err := c.timespec(sendAttrAtime)
		if err != nil {
			return err
		}
		mt, err := c.timespec(sendAttrMtime)
		if err != nil {
			return err
		}
		return a.at(p, func(d int, b string, nofollow int) error {
			if stat(d, b, nofollow) == nil && cur.Atim == at && cur.Mtim == mt {
				a.skipped = true
				return nil
			}
			return unix.UtimesNanoAt(d, b, []unix.Timespec{at, mt}, nofollow)
		})
	}
}

// update brings the range of a data command (UPDATE_EXTENT, or CLONE, which a no-data
// stream may carry for data it found shared) of the file p to the snapshot's content:
// whatever the command's source, the destination range must end up equal to the same
// range of the snapshot's inode.
func (a *applier) update(c *sendCommand, p string) error {
	off, err := c.u64(sendAttrFileOffset)
	if err != nil {
		return err
	}
	lenAttr := sendAttrSize
	if c.cmd == sendCmdClone {
		lenAttr = sendAttrCloneLen
	}
	n, err := c.u64(lenAttr)
	if err != nil {
		return err
	}
	if err := a.openDst(p); err != nil {
		return err
	}
	if err := a.openSrc(a.dst.snapIno); err != nil {
		return err
	}
	start, end := int64(off), min(int64(off+n), a.src.size)
	if start >= end {
		return nil
	}
	if err := a.fillEOFBlock(end); err != nil {
		return err
	}
	if a.dst.made || c.exact || end-start < refineMin {
		return a.copyRange(start, end)
	}
	diff, err := a.differing(start, end)
	if err != nil {
		return err
	}
	for _, r := range diff {
		if err := a.copyRange(r[0], r[1]); err != nil {
			return err
		}
	}
	return nil
}

// openDst opens the live file p for writing (or keeps it open), and finds which
// snapshot inode it stands for.
func (a *applier) openDst(p string) error {
	if a.dst.fd >= 0 && a.dst.path == p {
		return nil
	}
	a.closeDst()
	return a.at(p, func(d int, b string, _ int) error {
		// O_NONBLOCK: were p a FIFO, against the stream's word, fail rather than hang.
		fd, err := unix.Openat(d, b, unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return err
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			unix.Close(fd)
			return fmt.Errorf("%w: data update of %q, which is not a regular file (mode %#o)", errSendStream, p, st.Mode)
		}
		snapIno, made := a.created[st.Ino]
		if !made {
			snapIno = st.Ino
		}
		a.dst.path, a.dst.fd, a.dst.snapIno, a.dst.made = p, fd, snapIno, made
		if made {
			return nil
		}
		// A shared inode: same number and, if the stream is understood right, the same
		// generation in both volumes.
		return a.checkSameInode(p)
	})
}

// checkSameInode checks that dst and the snapshot file of the same number are one inode
// (the same generation), opening that snapshot file as src.
func (a *applier) checkSameInode(p string) error {
	if err := a.openSrc(a.dst.snapIno); err != nil {
		return err
	}
	g1, err := inodeGeneration(a.dst.fd)
	if err != nil {
		return err
	}
	g2, err := inodeGeneration(a.src.fd)
	if err != nil {
		return err
	}
	if g1 != g2 {
		return fmt.Errorf("%w: %q is inode %d of generation %d in the volume but %d in the snapshot; is the snapshot one of this volume?", errSendStream, p, a.dst.snapIno, g1, g2)
	}
	return nil
}

// openSrc opens (or keeps open) the snapshot's inode ino.
func (a *applier) openSrc(ino uint64) error {
	if a.src.fd >= 0 && a.src.ino == ino {
		return nil
	}
	if a.src.fd >= 0 {
		unix.Close(a.src.fd)
		a.src.fd = -1
	}
	rel, err := inodePath(a.snapfd, ino, a.pathBuf)
	if err != nil {
		return fmt.Errorf("find inode %d in the snapshot: %w", ino, err)
	}
	how := unix.OpenHow{Flags: unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_CLOEXEC, Resolve: resolve.Resolve}
	fd, err := unix.Openat2(a.snapfd, rel, &how)
	if err != nil {
		return fmt.Errorf("open %q of the snapshot: %w", rel, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return err
	}
	if st.Ino != ino || st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return fmt.Errorf("%w: %q of the snapshot is inode %d (mode %#o), not regular file %d", errSendStream, rel, st.Ino, st.Mode, ino)
	}
	a.src.ino, a.src.fd, a.src.size = ino, fd, st.Size
	return nil
}

// truncate sets the size of the file p, growing it as fillEOFBlock requires.
func (a *applier) truncate(c *sendCommand, p string) error {
	size, err := c.u64(sendAttrSize)
	if err != nil {
		return err
	}
	if err := a.openDst(p); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(a.dst.fd, &st); err != nil {
		return err
	}
	if int64(size) > st.Size && st.Size%a.block != 0 {
		if err := a.openSrc(a.dst.snapIno); err != nil {
			return err
		}
		if err := a.fillEOFBlock(int64(size)); err != nil {
			return err
		}
	}
	return unix.Ftruncate(a.dst.fd, int64(size))
}

// fillEOFBlock prepares dst to grow to newEnd. Growing a file whose size is not block
// aligned zeroes the rest of its last block, whatever the extent there holds; but the
// stream, which compares extents, does not report that block as changed when live's
// extent is the snapshot's (a truncation that shortened a file keeps the extent). So
// the rest of the block is first made the snapshot's, by a write at the end of file,
// which zeroes nothing.
func (a *applier) fillEOFBlock(newEnd int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(a.dst.fd, &st); err != nil {
		return err
	}
	if st.Size%a.block == 0 || newEnd <= st.Size || st.Size >= a.src.size {
		return nil
	}
	return a.copyData(st.Size, min(alignUp(st.Size, a.block), newEnd, a.src.size))
}

// copyRange makes [off, end) of dst equal to the same range of src: reflinked where
// the range is block aligned (or ends at src's end, which clone accepts unaligned),
// copied elsewhere. end is at most src's size; the TRUNCATE that follows a data update
// sets dst's size.
func (a *applier) copyRange(off, end int64) error {
	if off >= end {
		return nil
	}
	cs := alignUp(off, a.block)
	ce := end
	if end != a.src.size {
		ce = alignDown(end, a.block)
	}
	if cs >= ce {
		return a.copyData(off, end)
	}
	if err := a.copyData(off, cs); err != nil {
		return err
	}
	err := a.clone(cs, ce)
	if err == unix.EINVAL && ce%a.block != 0 {
		// Cloning an unaligned end of file into the middle of a longer file may be
		// refused: clone the aligned part, copy the rest.
		ce = alignDown(ce, a.block)
		err = nil
		if cs < ce {
			err = a.clone(cs, ce)
		}
	}
	switch err {
	case nil:
	case unix.EINVAL, unix.EOPNOTSUPP, unix.EXDEV:
		ce = cs // refused (an inline extent, say): copy all of it
	default:
		return fmt.Errorf("clone %d bytes at %d from the snapshot: %w", ce-cs, cs, err)
	}
	return a.copyData(ce, end)
}

func (a *applier) clone(from, to int64) error {
	err := unix.IoctlFileCloneRange(a.dst.fd, &unix.FileCloneRange{
		Src_fd: int64(a.src.fd), Src_offset: uint64(from), Src_length: uint64(to - from), Dest_offset: uint64(from),
	})
	if err == nil {
		a.st.ClonedBytes += to - from
	}
	return err
}

// copyData copies [from, to) from src to dst.
func (a *applier) copyData(from, to int64) error {
	if a.copyBuf == nil && from < to {
		a.copyBuf = make([]byte, 1<<20)
	}
	for from < to {
		b := a.copyBuf[:min(int64(len(a.copyBuf)), to-from)]
		r, err := unix.Pread(a.src.fd, b, from)
		if err != nil {
			return fmt.Errorf("read the snapshot at %d: %w", from, err)
		}
		if r == 0 {
			return nil // src is shorter (it cannot be: it is read-only)
		}
		for b = b[:r]; len(b) > 0; {
			w, err := unix.Pwrite(a.dst.fd, b, from)
			if err != nil {
				return fmt.Errorf("write at %d: %w", from, err)
			}
			a.st.CopiedBytes += int64(w)
			from += int64(w)
			b = b[w:]
		}
	}
	return nil
}

// refineMin is the size from which a data range is narrowed to the parts that actually
// differ before cloning. Below it two FIEMAP calls cost more than cloning the range.
const refineMin = 64 << 10

// differing returns the parts of [off, end) where dst's data is not already the
// snapshot's, in order, block aligned.
//
// The stream reports changes at the granularity of the snapshot's extents: rewriting 4
// KiB of a file written in one go reports the whole extent, up to 128 MiB. Cloning all
// of it would be correct, but it drops dst's page cache for the whole range (and that
// of every process mapping it), and ClonedBytes would say little. Where both files map
// a block to the same place on disk they share it already; only the rest is cloned.
// Extents whose mapping is not one to one (compressed, inline, delalloc, prealloc) are
// counted as differing, which is never wrong, only slower.
func (a *applier) differing(off, end int64) ([][2]int64, error) {
	src, err := fileExtents(a.src.fd, off, end, false, a.pathBuf) // read-only: nothing dirty
	if err != nil {
		return nil, fmt.Errorf("map the snapshot's extents: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(a.dst.fd, &st); err != nil {
		return nil, err
	}
	// Sync: this apply's own copies into dst may still be in memory (see fileExtents).
	dst, err := fileExtents(a.dst.fd, off, end, true, a.pathBuf)
	if err != nil {
		return nil, fmt.Errorf("map the extents: %w", err)
	}
	// What lies past dst's end reads as zeros once it grows, whatever extents say
	// (fillEOFBlock made its size block aligned if the range goes past it).
	dst = clipExtents(dst, st.Size)
	var out [][2]int64
	var si, di int // cursors: x only grows, so the walk is linear
	for x := off; x < end; {
		s, sNext := extentAt(src, &si, x)
		d, dNext := extentAt(dst, &di, x)
		y := min(sNext, dNext, end)
		if !sameData(s, d, x) {
			if n := len(out); n > 0 && out[n-1][1] >= x {
				out[n-1][1] = y
			} else {
				out = append(out, [2]int64{x, y})
			}
		}
		x = y
	}
	for i := range out { // extents are block aligned but for an end of file
		out[i][0] = alignDown(out[i][0], a.block)
		out[i][1] = min(alignUp(out[i][1], a.block), end)
	}
	return out, nil
}
