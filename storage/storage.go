// Package storage defines the copy-on-write volume pool that holds every filesystem
// cairn keeps: templates, sandbox roots and the filesystem half of checkpoints.
//
// Vocabulary and lifecycle. A volume is a directory tree addressed by a name relative to
// the pool (for example "roots/ab12" or "checkpoints/cd34/fs"). A writable volume is
// created empty (Create) or as a copy-on-write snapshot of another (Snapshot with
// readonly=false); a read-only volume is a frozen snapshot (Snapshot with readonly=true).
// Snapshots share storage with their source; deleting a source never affects the
// snapshots taken of it. A volume is published atomically: it appears under its final
// name complete, or not at all.
package storage

import "context"

// Pool is a set of volumes under one directory. Implementations are safe for concurrent
// use on distinct names.
type Pool interface {
	// Path is the absolute host path of the named volume (it need not exist).
	Path(name string) string
	// Create makes an empty writable volume. ErrAlreadyExists if name exists.
	Create(ctx context.Context, name string) error
	// Snapshot makes dst a copy-on-write snapshot of src, read-only if readonly.
	Snapshot(ctx context.Context, src, dst string, readonly bool) error
	// Delete removes the volume (and any volumes nested inside it). ErrNotFound if absent.
	Delete(ctx context.Context, name string) error
	// SetReadOnly freezes a writable volume.
	SetReadOnly(ctx context.Context, name string, readonly bool) error
	// Exists reports whether name is a volume of the pool.
	Exists(name string) bool
	// Sync flushes dirty data of the named volume's filesystem to disk, so that a
	// later Snapshot has little to flush (called outside any freeze).
	Sync(ctx context.Context, name string) error
	// Usage reports the bytes exclusively owned by the volume and referenced by it, where
	// known (-1 where the backend cannot tell).
	Usage(ctx context.Context, name string) (exclusive, referenced int64, err error)
	// Close releases the pool (unmounting what it mounted).
	Close() error
}

// LazySnapshotter is implemented by pools that can publish a snapshot without making it
// durable across a crash of the machine at once: SnapshotLazy is Snapshot but for that,
// which the next Sync of the pool's filesystem gives (or the filesystem's own periodic
// commit): one flush for many snapshots, none on the caller's critical path. A crash of
// the caller's process loses nothing either way. Callers find it by type assertion.
type LazySnapshotter interface {
	SnapshotLazy(ctx context.Context, src, dst string, readonly bool) error
}

// SplitSnapshotter is implemented by pools whose snapshots are fixed before they are
// done: SnapshotSplit returns once nothing written to src from then on can reach dst
// (the caller may let src's writers go), and published, which must be called, returns
// once dst exists, or why it does not. Until then the pool's own operations on dst wait
// for it, but for those that can read its fixed content without its name
// (PlannedReverter's Unchanged and PlanRevert from it); other processes see no dst. A
// checkpoint lets its sandbox run again, and returns, without waiting for the
// snapshot's commit to reach the disk. Callers find it by type assertion.
type SplitSnapshotter interface {
	SnapshotSplit(ctx context.Context, src, dst string, readonly bool) (published func() error, err error)
}

// Reverter is implemented by pools that can bring a writable volume back to the content
// of one of its read-only snapshots in place, instead of replacing it by a new snapshot.
// Callers find it by type assertion on a Pool.
//
// It exists for rollbacks that keep processes (frozen copy-on-write forks taken at a
// checkpoint) whose open descriptors, memory-mapped files, working directories and
// executables point at inodes of the live volume: those inodes must stay the same and
// get the checkpoint's content back, which a switch to a new volume cannot give.
type Reverter interface {
	// Revert makes the writable volume live equal to the read-only volume snapshot:
	// the same names, file types, content, sizes and holes, modes, owners, extended
	// attributes, symlink targets, hard-link structure, and access and modification
	// times (not change and birth times, which are the kernel's, nor inode flags such
	// as immutable, which the btrfs implementation leaves as they are). live and
	// snapshot are volume names of the pool and must differ; snapshot should be a
	// snapshot of live, or live one of snapshot (a rollback's root), since files are
	// matched by inode.
	//
	// Every file present in both keeps its inode: a descriptor open on it before Revert
	// reads the snapshot's content afterwards, and its inode number is unchanged. Files
	// and directories absent from live are created anew (new inodes); files absent from
	// snapshot are unlinked (a process holding one open keeps the unlinked inode, which
	// is not brought back even if snapshot has it under the same name). Volumes nested
	// in live are not part of it and are left as they are.
	//
	// Preconditions: live is writable (ErrFailedPrecondition otherwise), snapshot is
	// read-only (ErrFailedPrecondition), and nothing else writes to live while Revert
	// runs: writes made meanwhile may be lost, half reverted or kept. live stays
	// writable throughout (the difference is computed from a read-only snapshot of it,
	// removed before Revert returns).
	//
	// Revert is not atomic. If it fails or is interrupted (a canceled ctx, a crash),
	// live is partly reverted: a mixture of its old and the snapshot's content, still a
	// consistent tree. Revert is idempotent and converges from any such state, which
	// callers rely on: after a failure, run Revert again with the same arguments; after
	// a crash, run it again too (the pool's recovery removes the snapshot a crash left).
	// Until a Revert has succeeded, live must not be used.
	Revert(ctx context.Context, live, snapshot string) (RevertStats, error)
}

// PlannedReverter is implemented by Reverters that can work a Revert out ahead of time.
// A Revert compares live with the snapshot, so it first takes a read-only snapshot of
// live (a transaction commit of the filesystem: milliseconds). When live is known to
// hold exactly the content of one of its earlier read-only snapshots, base, the
// difference can be computed between base and the target instead, both read-only,
// before live is even quiet (while a rollback kills its processes, say): what is left
// for the critical path is applying it. Callers find it by type assertion on a Pool.
type PlannedReverter interface {
	Reverter

	// Unchanged reports whether the writable volume live still holds exactly the
	// content of base, a read-only snapshot taken of it: no name, attribute or data of
	// live has changed since, including data written but not yet written back. false
	// means it may have: a change was seen, or the pool cannot tell (base is not a
	// snapshot of live, or the filesystem holds dirty data of any volume). Call it while
	// nothing writes to live; a change made during the call may or may not be seen.
	Unchanged(live, base string) (bool, error)

	// PlanRevert computes the difference that turns the read-only volume base into the
	// read-only volume snapshot, for RevertPlanned. It changes nothing.
	PlanRevert(ctx context.Context, base, snapshot string) (RevertPlan, error)

	// RevertPlanned applies plans, in order, to the writable volume live, which must
	// hold the content of the first plan's base (as Unchanged said, and nothing written
	// since); each later plan's base is the snapshot of the plan before it. It makes live
	// equal to the last plan's snapshot, as Revert would, and has Revert's
	// preconditions and failure semantics: if it fails or is interrupted, live is partly
	// reverted, and Revert(live, last plan's snapshot) makes it whole. A live whose
	// content is not the first base's may end up anywhere; that is the caller's
	// contract, which the pool cannot check.
	RevertPlanned(ctx context.Context, live string, plans ...RevertPlan) (RevertStats, error)
}

// A RevertPlan is a difference between two read-only volumes of a pool, computed by
// PlanRevert and applied by RevertPlanned of the same pool.
type RevertPlan interface {
	// Base and Snapshot are the volumes it goes from and to.
	Base() string
	Snapshot() string
	// Len is the number of operations in it (what applying it may do, at most).
	Len() int
	// SendMS is the time its computation took.
	SendMS() float64
}

// RevertStats describes what a Revert did and where its time went.
type RevertStats struct {
	// Ops is the number of filesystem operations applied to live (renames, links,
	// unlinks, creations, attribute and data updates). 0 means there was no difference
	// to apply; a Revert right after another may still set times again.
	Ops int
	// Skipped counts the attribute updates of the difference (mode, owner, times) that
	// live already had: they are not applied, since applying them would move the
	// inode's change time, which no call can set back, and the inode would then differ
	// from every snapshot taken before, in every later difference.
	Skipped int
	// ClonedBytes is the file data shared from the snapshot by reflink (no copy);
	// CopiedBytes what had to be copied (block-unaligned edges, or where the
	// filesystem refused a clone).
	ClonedBytes, CopiedBytes int64
	// SnapshotMS is the time spent taking the read-only snapshot of live the difference
	// is computed from (a transaction commit), SendMS computing the difference (which
	// includes flushing live's dirty data), ApplyMS applying it.
	SnapshotMS, SendMS, ApplyMS float64
	// Diff says how the difference was computed: "tree" (read from the two volumes'
	// metadata, the items changed since the older one was taken) or "send" (the
	// kernel's comparison of the two trees); DiffNote, for "send", why no tree plan was
	// possible. Empty when nothing was computed.
	Diff, DiffNote string
	// Compared is the number of inodes a "tree" difference read from both volumes.
	Compared int
}
