package btrfs

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// opError classifies err, from operation op on the volume name, into an errdefs class
// with a message saying what to do. It returns nil for a nil err.
func (p *Pool) opError(op, name string, err error) error {
	if err == nil {
		return nil
	}
	what := fmt.Sprintf("btrfs pool %s: %s %q", p.dir, op, name)
	if errors.Is(err, errNotVolume) {
		return errdefs.NotFound("%s: no such volume (the path %w); check the name", what, err)
	}
	var errno unix.Errno
	if !errors.As(err, &errno) {
		return fmt.Errorf("%s: %w", what, err)
	}
	switch errno {
	case unix.ENOENT:
		return errdefs.NotFound("%s: no such volume or parent directory; check the name or create it first: %w", what, err)
	case unix.EEXIST:
		return errdefs.AlreadyExists("%s: the name is already taken; delete it first or choose another name: %w", what, err)
	case unix.ENOSPC, unix.EDQUOT:
		return errdefs.ResourceExhausted("%s: the pool is out of space; delete unused sandboxes and checkpoints, or grow the pool: %w", what, err)
	case unix.EROFS:
		return errdefs.FailedPrecondition("%s: the location is inside a read-only volume; make that volume writable (SetReadOnly false) or choose another name: %w", what, err)
	case unix.EBUSY:
		return errdefs.FailedPrecondition("%s: the volume is in use (mounted or a swap file); unmount it and retry: %w", what, err)
	case unix.ENOTEMPTY:
		return errdefs.FailedPrecondition("%s: volumes are still nested in it; delete those first: %w", what, err)
	case unix.ELOOP:
		return errdefs.InvalidArgument("%s: the path goes through a symbolic link, which the pool never follows; use a path of real directories: %w", what, err)
	case unix.EXDEV:
		return errdefs.FailedPrecondition("%s: the path crosses a mount point; unmount what is mounted below the pool or choose another name: %w", what, err)
	case unix.ENOTDIR:
		return errdefs.InvalidArgument("%s: an element of the path is a file, not a directory; choose another name: %w", what, err)
	case unix.ENAMETOOLONG:
		return errdefs.InvalidArgument("%s: the name is too long; use a shorter one: %w", what, err)
	case unix.EPERM, unix.EACCES:
		return errdefs.PermissionDenied("%s: btrfs subvolume operations need root (CAP_SYS_ADMIN); run cairn as root: %w", what, err)
	case unix.ENOTTY, unix.EOPNOTSUPP:
		return errdefs.FailedPrecondition("%s: the pool is not on btrfs (or the kernel lacks this btrfs ioctl); check the pool configuration: %w", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}
