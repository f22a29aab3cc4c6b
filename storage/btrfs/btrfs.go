// Package btrfs implements storage.Pool on a btrfs filesystem: every volume is a btrfs
// subvolume, so Create, Snapshot and Delete cost a few metadata operations however large
// the volume is.
//
// # On-disk layout
//
// The pool is one directory, Config.Dir (for example /var/lib/cairn/pool), that is either
// the mount point of a btrfs image cairn manages (Config.Image, a sparse file attached to
// a loop device) or a directory on a btrfs filesystem the host provides. Below it:
//
//	<Dir>/.lock                      flock: shared by Snapshot, exclusive by Recover
//	<Dir>/roots/ab12/                a volume (subvolume; its root inode is 256)
//	<Dir>/checkpoints/cd34/fs/       a volume; "checkpoints/cd34" is a plain directory
//	<Dir>/roots/.tmp-ab12-<hex>/     a snapshot being published (or a crash leftover)
//	<Image>.lock                     flock serialising image creation and mounting
//
// A volume name is a relative slash path. Every element but the last is a plain directory
// created on demand (or a directory inside another volume: volumes may nest). Elements
// starting with "." are reserved for the pool's bookkeeping above and are rejected.
//
// # Crash consistency
//
// A volume appears under its final name complete, or not at all:
//
//   - Create is a single BTRFS_IOC_SUBVOL_CREATE, which is atomic.
//   - Snapshot creates the snapshot under ".tmp-<dst>-<random>" in dst's parent directory
//     (the snapshot ioctl commits a btrfs transaction, so that copy is durable), then
//     renames it to dst with renameat2(RENAME_NOREPLACE) and fsyncs the parent, which
//     makes the rename durable before Snapshot returns. A crash in between leaves only a
//     ".tmp-" name, which Recover deletes. The same directory is required because rename
//     cannot cross subvolumes (EXDEV). SnapshotLazy leaves out the fsync (a second
//     transaction commit): after a crash of the machine before the next Sync or btrfs's
//     periodic commit the snapshot may be under its temporary name, or absent; a crash
//     of the process loses nothing.
//   - Delete unlinks the subvolume (the kernel frees its extents in the background). It
//     is not made durable: after a crash a deleted volume may reappear, and the caller's
//     garbage collection must tolerate that. Volumes nested in the deleted one are deleted
//     first; a read-only volume with nested volumes is made writable for that.
//   - Open creates the image as "<Image>.tmp" and renames it into place once mkfs.btrfs
//     succeeded, so a half-formatted image is never mounted.
//
// Recover must not delete a snapshot that another process is still publishing, hence the
// pool lock: Snapshot holds it shared while its temporary name exists, Recover exclusive.
//
// # Mounting
//
// Open attaches the image with LOOP_CTL_GET_FREE and LOOP_CONFIGURE (one ioctl that binds
// the file and sets the flags, so no other process can observe a half-configured device)
// with LO_FLAGS_AUTOCLEAR, so the kernel frees the loop device when the filesystem is
// unmounted, and LO_FLAGS_DIRECT_IO where the backing filesystem allows it, so file data
// is not cached twice (once for btrfs, once for the image file). The filesystem is mounted
// noatime: with atime, reading a file in a snapshot-shared volume rewrites (and unshares)
// its inode metadata. user_subvol_rm_allowed is not set; cairn runs as root, which may
// destroy subvolumes without it, and the option would let unprivileged users delete
// subvolumes they own.
//
// Every path below Dir is resolved with openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|
// RESOLVE_NO_XDEV) from a descriptor of Dir, because the contents of volumes are written
// by sandboxes: a symlink planted in a sandbox root must not redirect a host operation.
//
// The hot-path operations (Create, Snapshot, Delete, SetReadOnly) use btrfs ioctls
// directly and never run the btrfs binary. Quotas are not enabled (they make snapshot and
// delete much slower), so Usage reports -1.
package btrfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/storage"
)

// DefaultSize is the size of a new pool image when Config.Size is 0. The file is sparse:
// it occupies only what the filesystem has written.
const DefaultSize int64 = 64 << 30

// minSize is below what mkfs.btrfs accepts with its default (DUP metadata) profile.
const minSize int64 = 256 << 20

// Config locates the pool.
type Config struct {
	// Dir is the absolute path of the pool, for example /var/lib/cairn/pool.
	Dir string
	// Image is the absolute path of a sparse btrfs image file to create (if missing) and
	// mount at Dir (if Dir is not a btrfs mount yet), for example /var/lib/cairn/pool.img.
	// Empty means Dir must already be on a btrfs filesystem, and it is used as is.
	Image string
	// Size is the apparent size of a newly created image (DefaultSize if 0). It is not
	// used for an existing image.
	Size int64
	// NoTreePlans makes every revert's difference the kernel's send, never a tree plan
	// (treeplan.go), for comparisons and as a way out.
	NoTreePlans bool
}

// Pool is a storage.Pool of btrfs subvolumes. It is safe for concurrent use, and several
// processes may use the same pool at once.
type Pool struct {
	dir   string
	image string // "" if the pool does not manage the mount

	mu     sync.RWMutex
	rootfd int // directory descriptor of dir; -1 once closed; protected by mu

	// dataSpace is the sysfs directory of the filesystem's data space (Unchanged),
	// found once.
	dataSpaceMu sync.Mutex
	dataSpace   string

	// sendOnly makes every difference the kernel's send (Config.NoTreePlans).
	sendOnly bool
	// lineages is what tree plans remember of the volumes' snapshots (lineage.go).
	lineages lineages

	// pending are the volumes SnapshotSplit is publishing, each with the channel closed
	// once it is; the pool's operations on them wait (await).
	pendingMu sync.Mutex
	pending   map[string]*publishing
	npending  atomic.Int32 // len(pending): every operation checks it, without the lock
}

var _ storage.Pool = (*Pool)(nil)

// Open opens the pool described by cfg, creating and mounting its image if needed. It is
// idempotent and safe to call from several processes at once.
func Open(ctx context.Context, cfg Config) (*Pool, error) {
	if !filepath.IsAbs(cfg.Dir) {
		return nil, errdefs.InvalidArgument("btrfs pool: Dir %q is not an absolute path; configure an absolute pool directory", cfg.Dir)
	}
	dir := filepath.Clean(cfg.Dir)
	var image string
	if cfg.Image != "" {
		if !filepath.IsAbs(cfg.Image) {
			return nil, errdefs.InvalidArgument("btrfs pool: Image %q is not an absolute path; configure an absolute image path", cfg.Image)
		}
		image = filepath.Clean(cfg.Image)
		size := cfg.Size
		if size == 0 {
			size = DefaultSize
		}
		if size < minSize {
			return nil, errdefs.InvalidArgument("btrfs pool: image size %d is below the minimum of %d bytes; configure a larger Size", size, minSize)
		}
		if err := ensureMounted(ctx, dir, image, size); err != nil {
			return nil, err
		}
	} else if err := ensureBtrfsDir(dir); err != nil {
		return nil, err
	}

	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("btrfs pool: open %s: %w", dir, err)
	}
	// Check the descriptor rather than the path: the mount may have changed since.
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil || st.Type != unix.BTRFS_SUPER_MAGIC {
		unix.Close(fd)
		return nil, errdefs.FailedPrecondition("btrfs pool: %s is not on a btrfs filesystem (was it unmounted concurrently?); retry", dir)
	}
	// Create the pool lock now so that Snapshot never has to.
	lfd, err := unix.Openat(fd, lockName, unix.O_RDWR|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("btrfs pool: create %s: %w", filepath.Join(dir, lockName), err)
	}
	unix.Close(lfd)
	return &Pool{dir: dir, image: image, rootfd: fd, sendOnly: cfg.NoTreePlans}, nil
}

// Root returns the pool directory.
func (p *Pool) Root() string { return p.dir }

// Path returns the host path of the named volume, or "" if name is not a valid volume
// name (so that an invalid name cannot be turned into a path outside the pool).
func (p *Pool) Path(name string) string {
	if validName(name) != nil {
		return ""
	}
	p.await(name)
	return filepath.Join(p.dir, filepath.FromSlash(name))
}

// Close releases the pool's descriptor. It deliberately does not unmount the filesystem,
// although storage.Pool's documentation says so: other cairn processes and running
// sandboxes use the same mount, and Open would only have to mount it again. Use Unmount
// to take the filesystem down. Close is idempotent; other methods fail after it.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.rootfd < 0 {
		return nil
	}
	err := unix.Close(p.rootfd)
	p.rootfd = -1
	return err
}

// Unmount closes the pool and unmounts its filesystem if the pool manages the mount
// (Config.Image was set), which also frees the loop device. It fails with
// FailedPrecondition while something still uses the filesystem. It is meant for tests
// and for an administrator's teardown; nothing else should unmount a shared pool.
func (p *Pool) Unmount() error {
	if err := p.Close(); err != nil {
		return err
	}
	if p.image == "" {
		return nil
	}
	switch err := unix.Unmount(p.dir, 0); {
	case err == nil, errors.Is(err, unix.EINVAL): // EINVAL: not mounted (any more)
		return nil
	case errors.Is(err, unix.EBUSY):
		return errdefs.FailedPrecondition("btrfs pool: unmount %s: still in use (open files, mounts or other pools inside it); stop them and retry: %w", p.dir, err)
	default:
		return fmt.Errorf("btrfs pool: unmount %s: %w", p.dir, err)
	}
}

// acquire returns the pool descriptor with mu read-locked; the caller must call
// p.mu.RUnlock when done with it, so that Close cannot close (and the kernel recycle) the
// descriptor under an operation.
func (p *Pool) acquire() (int, error) {
	p.mu.RLock()
	if p.rootfd < 0 {
		p.mu.RUnlock()
		return -1, errdefs.FailedPrecondition("btrfs pool %s is closed; open it again", p.dir)
	}
	return p.rootfd, nil
}

// ensureBtrfsDir checks that dir is (or, if missing, would be) on btrfs, and creates it.
func ensureBtrfsDir(dir string) error {
	probe := dir
	for {
		if _, err := os.Stat(probe); err == nil || probe == "/" {
			break
		}
		probe = filepath.Dir(probe)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(probe, &st); err != nil {
		return fmt.Errorf("btrfs pool: statfs %s: %w", probe, err)
	}
	if st.Type != unix.BTRFS_SUPER_MAGIC {
		return errdefs.FailedPrecondition("btrfs pool: %s is not on a btrfs filesystem (filesystem magic %#x); set Image to let cairn create and mount a btrfs image there, or mount btrfs at %s", dir, st.Type, dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("btrfs pool: create %s: %w", dir, err)
	}
	return nil
}
