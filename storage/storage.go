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
