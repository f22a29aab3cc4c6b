package btrfs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/phase"
	"github.com/cairn-sandbox/cairn/storage"
)

const (
	lockName  = ".lock" // the pool lock, in Dir
	tmpPrefix = ".tmp-" // temporary snapshot names: ".tmp-<dst>-<16 hex digits>"
	// maxElem keeps ".tmp-<elem>-<16 hex>" within NAME_MAX (255).
	maxElem = 255 - len(tmpPrefix) - 1 - 16
)

// IsTemporary reports whether name (a base name) is a snapshot being made: the pool
// renames it into place when done, and Recover deletes it after a crash. Sweeps of the
// pool's directories leave such names alone (another process's Snapshot in flight).
func IsTemporary(name string) bool { return strings.HasPrefix(name, tmpPrefix) }

// resolve is how every path below the pool is opened; see the package documentation.
var resolve = unix.OpenHow{
	Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
	Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
}

// validName checks a volume name: a relative slash path of non-empty elements, none of
// them "." or ".." or otherwise starting with "." (reserved for the pool's bookkeeping).
func validName(name string) error {
	const hint = `; use a relative slash path such as "roots/ab12"`
	if name == "" {
		return errdefs.InvalidArgument("volume name is empty" + hint)
	}
	if strings.HasPrefix(name, "/") {
		return errdefs.InvalidArgument("volume name %q is absolute"+hint, name)
	}
	for _, el := range strings.Split(name, "/") {
		switch {
		case el == "":
			return errdefs.InvalidArgument("volume name %q has an empty element"+hint, name)
		case el == "." || el == "..":
			return errdefs.InvalidArgument("volume name %q contains %q"+hint, name, el)
		case el[0] == '.':
			return errdefs.InvalidArgument("volume name %q has an element starting with \".\", which the pool reserves for itself"+hint, name)
		case len(el) > maxElem:
			return errdefs.InvalidArgument("volume name %q has an element longer than %d bytes; use shorter names", name, maxElem)
		case strings.IndexByte(el, 0) >= 0:
			return errdefs.InvalidArgument("volume name %q contains a NUL byte", name)
		}
	}
	return nil
}

// openDir opens the directory rel (a validated relative path, "" for dirfd itself)
// below dirfd without following symlinks or crossing mounts.
func openDir(dirfd int, rel string) (int, error) {
	if rel == "" {
		rel = "."
	}
	how := resolve
	for {
		fd, err := unix.Openat2(dirfd, rel, &how)
		if err == unix.EINTR || err == unix.EAGAIN { // EAGAIN: a concurrent rename; retry
			continue
		}
		return fd, err
	}
}

// errNotVolume is returned by openVolume for a directory that is not a subvolume root.
var errNotVolume = errors.New("is a plain directory, not a volume")

// openVolume opens the volume name and checks that it is a subvolume root.
func openVolume(rootfd int, name string) (int, error) {
	fd, err := openDir(rootfd, name)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if st.Ino != btrfsFirstFreeObjectID {
		unix.Close(fd)
		return -1, errNotVolume
	}
	return fd, nil
}

// openParent opens the directory that holds the volume name and returns it with the last
// element of name. If create is set, missing parent directories are created (as plain
// directories, one element at a time so that no symlink is ever followed).
func openParent(rootfd int, name string, create bool) (int, string, error) {
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	if !create {
		fd, err := openDir(rootfd, dir)
		return fd, base, err
	}
	fd, err := openDir(rootfd, "")
	if err != nil {
		return -1, "", err
	}
	if dir == "" {
		return fd, base, nil
	}
	for _, el := range strings.Split(dir, "/") {
		if err := unix.Mkdirat(fd, el, 0o755); err != nil && err != unix.EEXIST {
			unix.Close(fd)
			return -1, "", err
		}
		next, err := openDir(fd, el)
		unix.Close(fd)
		if err != nil {
			return -1, "", err
		}
		fd = next
	}
	return fd, base, nil
}

// Create makes an empty writable volume. The subvolume-create ioctl is atomic, so no
// temporary name is needed.
func (p *Pool) Create(ctx context.Context, name string) error {
	if err := validName(name); err != nil {
		return err
	}
	p.await(name)
	if err := ctx.Err(); err != nil {
		return err
	}
	rootfd, err := p.acquire()
	if err != nil {
		return err
	}
	defer p.mu.RUnlock()
	pfd, base, err := openParent(rootfd, name, true)
	if err != nil {
		return p.opError("create", name, err)
	}
	defer unix.Close(pfd)
	if err := subvolCreate(pfd, base); err != nil {
		return p.opError("create", name, err)
	}
	return nil
}

// Snapshot makes dst a snapshot of src and publishes it atomically (see the package
// documentation). It fails with AlreadyExists, leaving dst untouched, if dst exists.
func (p *Pool) Snapshot(ctx context.Context, src, dst string, readonly bool) error {
	p.await(src, dst)
	return p.snapshot(ctx, src, dst, readonly, true)
}

var _ storage.LazySnapshotter = (*Pool)(nil)

// SnapshotLazy is Snapshot without the fsync that makes dst's name durable (a second
// transaction commit, ~1 ms here): until the next Sync or btrfs's periodic commit
// (30 s), a crash of the machine may leave the snapshot under its temporary name, which
// Recover removes, or not at all.
func (p *Pool) SnapshotLazy(ctx context.Context, src, dst string, readonly bool) error {
	p.await(src, dst)
	return p.snapshot(ctx, src, dst, readonly, false)
}

func (p *Pool) snapshot(ctx context.Context, src, dst string, readonly, durable bool) error {
	if err := validName(src); err != nil {
		return err
	}
	if err := validName(dst); err != nil {
		return err
	}
	e, err := p.openSnapshotEnds(src, dst)
	if err != nil {
		return err
	}
	defer e.release()
	rootfd, srcfd, pfd, base := e.rootfd, e.srcfd, e.pfd, e.base
	// Shared pool lock: Recover must not take our temporary name for a crash leftover.
	lfd, err := unix.Openat(rootfd, lockName, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return p.opError("snapshot: open pool lock for", dst, err)
	}
	unlock, err := flock(ctx, lfd, unix.LOCK_SH, p.dir+"/"+lockName)
	if err != nil {
		return err
	}
	defer unlock()
	// Fail before the (comparatively expensive) snapshot if dst is obviously taken; the
	// rename below is what actually guarantees dst is never replaced.
	var st unix.Stat_t
	if err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		return p.opError("snapshot", dst, unix.EEXIST)
	}
	tmp := tmpName(base)
	t := time.Now()
	if err := snapCreate(pfd, srcfd, tmp, readonly); err != nil {
		return p.opError("snapshot "+src+" to", dst, err)
	}
	phase.Since(ctx, "snapshot_ioctl", t)
	if err := unix.Renameat2(pfd, tmp, pfd, base, unix.RENAME_NOREPLACE); err != nil {
		_ = snapDestroy(pfd, tmp) // best effort; Recover removes it otherwise
		return p.opError("snapshot: publish", dst, err)
	}
	if !durable {
		return nil
	}
	// Make the rename durable (btrfs commits the transaction for a subvolume rename), so
	// that a snapshot reported as taken survives a crash.
	t = time.Now()
	if err := unix.Fsync(pfd); err != nil {
		return p.opError("snapshot: sync", dst, err)
	}
	phase.Since(ctx, "snapshot_fsync", t)
	return nil
}

// snapshotEnds are what a snapshot needs open: the pool (acquired), its source volume
// and the parent directory of its destination, whose name in it is base.
type snapshotEnds struct {
	rootfd, srcfd, pfd int
	base               string
	release            func() // closes both and lets the pool go
}

// openSnapshotEnds opens a snapshot's ends, making dst's parent directory if missing.
func (p *Pool) openSnapshotEnds(src, dst string) (*snapshotEnds, error) {
	rootfd, err := p.acquire()
	if err != nil {
		return nil, err
	}
	srcfd, err := openVolume(rootfd, src)
	if err != nil {
		p.mu.RUnlock()
		return nil, p.opError("snapshot source", src, err)
	}
	pfd, base, err := openParent(rootfd, dst, true)
	if err != nil {
		unix.Close(srcfd)
		p.mu.RUnlock()
		return nil, p.opError("snapshot", dst, err)
	}
	return &snapshotEnds{rootfd: rootfd, srcfd: srcfd, pfd: pfd, base: base, release: func() {
		unix.Close(srcfd)
		unix.Close(pfd)
		p.mu.RUnlock()
	}}, nil
}

func tmpName(base string) string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on Linux
	return tmpPrefix + base + "-" + hex.EncodeToString(b[:])
}

// Delete removes the volume and every volume nested in it.
func (p *Pool) Delete(ctx context.Context, name string) error {
	if err := validName(name); err != nil {
		return err
	}
	p.await(name)
	rootfd, err := p.acquire()
	if err != nil {
		return err
	}
	defer p.mu.RUnlock()
	pfd, base, err := openParent(rootfd, name, false)
	if err != nil {
		return p.opError("delete", name, err)
	}
	defer unix.Close(pfd)
	return p.destroy(ctx, pfd, base, name)
}

// destroy deletes the volume base in the directory pfd; name is for messages. The common
// case is one ioctl; only if the kernel refuses because volumes are nested in it
// (ENOTEMPTY) are those found and deleted first.
func (p *Pool) destroy(ctx context.Context, pfd int, base, name string) error {
	fd, err := openVolume(pfd, base)
	if err != nil {
		return p.opError("delete", name, err)
	}
	defer unix.Close(fd)
	err = snapDestroy(pfd, base)
	if err != unix.ENOTEMPTY {
		return p.opError("delete", name, err)
	}
	// Unlinking a nested volume writes to the directory holding it, which fails with
	// EROFS inside a read-only volume: make the doomed volume writable first.
	flags, err := getFlags(fd)
	if err != nil {
		return p.opError("delete: get flags of", name, err)
	}
	if flags&btrfsSubvolRdonly != 0 {
		if err := setFlags(fd, flags&^btrfsSubvolRdonly); err != nil {
			return p.opError("delete: make writable", name, err)
		}
	}
	children, err := nestedSubvols(fd)
	if err != nil {
		return p.opError("delete: list volumes nested in", name, err)
	}
	for _, c := range children {
		if err := ctx.Err(); err != nil {
			return err
		}
		dir, b := path.Split(c)
		cpfd, err := openDir(fd, strings.TrimSuffix(dir, "/"))
		if err != nil {
			return p.opError("delete", name+"/"+c, err)
		}
		err = p.destroy(ctx, cpfd, b, name+"/"+c)
		unix.Close(cpfd)
		if err != nil && !errors.Is(err, errdefs.ErrNotFound) { // NotFound: deleted concurrently
			return err
		}
	}
	return p.opError("delete", name, snapDestroy(pfd, base))
}

// SetReadOnly sets or clears the volume's read-only flag (a no-op if already so). The
// kernel commits a transaction for it, so the change is durable when it returns.
func (p *Pool) SetReadOnly(ctx context.Context, name string, readonly bool) error {
	if err := validName(name); err != nil {
		return err
	}
	p.await(name)
	if err := ctx.Err(); err != nil {
		return err
	}
	rootfd, err := p.acquire()
	if err != nil {
		return err
	}
	defer p.mu.RUnlock()
	fd, err := openVolume(rootfd, name)
	if err != nil {
		return p.opError("set read-only", name, err)
	}
	defer unix.Close(fd)
	flags, err := getFlags(fd)
	if err != nil {
		return p.opError("set read-only: get flags of", name, err)
	}
	want := flags &^ btrfsSubvolRdonly
	if readonly {
		want |= btrfsSubvolRdonly
	}
	if want == flags {
		return nil
	}
	return p.opError("set read-only", name, setFlags(fd, want))
}

// Exists reports whether name is a volume (a subvolume root, inode 256) of the pool.
func (p *Pool) Exists(name string) bool {
	if validName(name) != nil {
		return false
	}
	p.await(name)
	rootfd, err := p.acquire()
	if err != nil {
		return false
	}
	defer p.mu.RUnlock()
	fd, err := openVolume(rootfd, name)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

// Sync flushes the pool filesystem (syncfs(2): a btrfs transaction commit), so that a
// later Snapshot's own commit has little left to write.
func (p *Pool) Sync(ctx context.Context, name string) error {
	if err := validName(name); err != nil {
		return err
	}
	p.await(name)
	if err := ctx.Err(); err != nil {
		return err
	}
	rootfd, err := p.acquire()
	if err != nil {
		return err
	}
	defer p.mu.RUnlock()
	fd, err := openVolume(rootfd, name)
	if err != nil {
		return p.opError("sync", name, err)
	}
	defer unix.Close(fd)
	return p.opError("sync", name, unix.Syncfs(fd))
}

// Usage returns -1, -1 for an existing volume: per-volume accounting needs btrfs quotas,
// which the pool leaves disabled because they make snapshots and deletes much slower.
func (p *Pool) Usage(ctx context.Context, name string) (exclusive, referenced int64, err error) {
	if err := validName(name); err != nil {
		return 0, 0, err
	}
	p.await(name)
	rootfd, err := p.acquire()
	if err != nil {
		return 0, 0, err
	}
	defer p.mu.RUnlock()
	fd, err := openVolume(rootfd, name)
	if err != nil {
		return 0, 0, p.opError("usage", name, err)
	}
	unix.Close(fd)
	return -1, -1, nil
}
