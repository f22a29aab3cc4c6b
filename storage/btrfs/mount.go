package btrfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/mountinfo"
)

// ensureMounted makes dir the mount point of the btrfs image, creating the image if it
// does not exist. The fast path (already mounted) takes no lock; the slow path runs under
// an exclusive flock on "<image>.lock" so that concurrent Opens format and mount once.
func ensureMounted(ctx context.Context, dir, image string, size int64) error {
	if ok, err := isBtrfsMount(dir); err != nil {
		return err
	} else if ok {
		return noDiscard(dir)
	}
	for _, d := range []string{filepath.Dir(image), dir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("btrfs pool: create %s: %w", d, err)
		}
	}
	unlock, err := lockPath(ctx, image+".lock", unix.LOCK_EX)
	if err != nil {
		return err
	}
	defer unlock()
	// Another process may have mounted it while we waited for the lock.
	if ok, err := isBtrfsMount(dir); err != nil {
		return err
	} else if ok {
		return noDiscard(dir)
	}
	if err := ensureImage(ctx, image, size); err != nil {
		return err
	}
	if err := mountImage(image, dir); err != nil {
		return err
	}
	trim(dir)
	return nil
}

// mountOptions are the options of a pool's filesystem (the data of mount(2); noatime
// is a flag). nodiscard: btrfs discards freed space by default (discard=async), which
// on a loop device punches holes in the image file, 64 MiB at a time, about two
// minutes after the space was freed (deleted checkpoints). Each hole punch holds the
// image file's inode and its ext4 journal commit discards the blocks on the host's
// disk; a transaction commit waiting for its superblock write behind them made a
// checkpoint's snapshot take ~2 s, about once in 80 W1 checkpoints
// (docs/performance.md). The image file gives space back at mount instead (trim), or
// whenever an administrator runs fstrim on the pool directory; btrfs reuses what it
// freed meanwhile, so the file grows only to the most the pool ever held.
const mountOptions = "nodiscard"

// noDiscard remounts dir, a pool filesystem mounted by an earlier cairn with btrfs's
// default discard, with mountOptions.
func noDiscard(dir string) error {
	opt, _, err := discardAt(dir)
	if err != nil || opt == "" {
		return err
	}
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_NOATIME, mountOptions); err != nil {
		return fmt.Errorf("btrfs pool: remount %s %s: %w", dir, mountOptions, err)
	}
	return nil
}

// discardAt returns the discard option ("discard", "discard=async"; "" if none) of the
// mount in effect at dir (the last one there), and whether anything is mounted there.
func discardAt(dir string) (opt string, mounted bool, err error) {
	ms, err := mountinfo.Read(0)
	if err != nil {
		return "", false, fmt.Errorf("btrfs pool: %w", err)
	}
	for _, m := range ms {
		if m.MountPoint != dir {
			continue
		}
		opt, mounted = "", true
		for _, o := range m.SuperOptions {
			if o == "discard" || strings.HasPrefix(o, "discard=") {
				opt = o
			}
		}
	}
	return opt, mounted, nil
}

// trim gives the image file back the space its filesystem does not use (FITRIM: holes
// punched in the file). Best effort, at mount, before any sandbox runs: ~0.1-0.2 s on
// an idle 64 GiB pool.
func trim(dir string) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer unix.Close(fd)
	r := fstrimRange{len: ^uint64(0)}
	ioctl(fd, iocFitrim, unsafe.Pointer(&r))
}

// isBtrfsMount reports whether dir is the root of a btrfs mount. It fails with
// FailedPrecondition if dir is the mount point of another filesystem type.
func isBtrfsMount(dir string) (bool, error) {
	var stx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, dir, 0, unix.STATX_TYPE, &stx)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("btrfs pool: statx %s: %w", dir, err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, errdefs.FailedPrecondition("btrfs pool: the kernel does not report mount points (STATX_ATTR_MOUNT_ROOT needs Linux 5.8); upgrade the kernel")
	}
	if stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, fmt.Errorf("btrfs pool: statfs %s: %w", dir, err)
	}
	if st.Type != unix.BTRFS_SUPER_MAGIC {
		return false, errdefs.FailedPrecondition("btrfs pool: %s is already a mount point of another filesystem (magic %#x); unmount it or choose another pool directory", dir, st.Type)
	}
	return true, nil
}

// ensureImage creates a sparse, btrfs-formatted image file if none exists. It formats a
// temporary file and renames it into place, so a crash never leaves a half-formatted
// image under the final name. mkfs.btrfs runs as a subprocess: this happens once per
// host, not on the hot path.
func ensureImage(ctx context.Context, image string, size int64) error {
	switch fi, err := os.Stat(image); {
	case err == nil && fi.Mode().IsRegular():
		return nil
	case err == nil:
		return errdefs.FailedPrecondition("btrfs pool: image %s exists but is not a regular file; remove it or configure another image path", image)
	case !errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("btrfs pool: stat image: %w", err)
	}
	mkfs, err := findMkfs()
	if err != nil {
		return err
	}
	tmp := image + ".tmp"
	_ = os.Remove(tmp) // a leftover of a crashed Open; we hold the lock
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("btrfs pool: create image: %w", err)
	}
	err = f.Truncate(size) // sparse: no blocks are allocated
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EFBIG) {
			return errdefs.ResourceExhausted("btrfs pool: cannot create a %d-byte image at %s: %v; free space or configure a smaller Size", size, image, err)
		}
		return fmt.Errorf("btrfs pool: size image: %w", err)
	}
	// Metadata single, not DUP (mkfs's default): the image is one file on one disk, so a
	// second copy guards against little, and every transaction commit (each snapshot is
	// one) would write its metadata twice. Measured on a W1 step: 1.4 MB in 89 writes
	// with DUP, 0.7 MB in 5 with single; the checkpoint's snapshot 5.4 -> 4.4 ms.
	out, err := exec.CommandContext(ctx, mkfs, "-q", "-L", "cairn", "-m", "single", tmp).CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("btrfs pool: %s %s: %w: %s", mkfs, tmp, err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp, image); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("btrfs pool: publish image: %w", err)
	}
	return fsyncDir(filepath.Dir(image))
}

// findMkfs locates mkfs.btrfs, also in the sbin directories a non-login PATH may lack.
func findMkfs() (string, error) {
	if p, err := exec.LookPath("mkfs.btrfs"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/mkfs.btrfs", "/sbin/mkfs.btrfs"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errdefs.FailedPrecondition("btrfs pool: mkfs.btrfs not found; install btrfs-progs (apt-get install btrfs-progs)")
}

// mountImage attaches image to a free loop device and mounts it at dir.
func mountImage(image, dir string) error {
	imgfd, err := unix.Open(image, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("btrfs pool: open image: %w", err)
	}
	defer unix.Close(imgfd)
	loopfd, dev, err := attachLoop(imgfd, image)
	if err != nil {
		return err
	}
	// With LO_FLAGS_AUTOCLEAR the device is detached at its last close: after a successful
	// mount that is the unmount, and after a failed one this Close.
	defer unix.Close(loopfd)
	if err := unix.Mount(dev, dir, "btrfs", unix.MS_NOATIME, mountOptions); err != nil {
		return errdefs.FailedPrecondition("btrfs pool: mount %s (image %s) at %s: %v; check dmesg, and that the image is not mounted elsewhere", dev, image, dir, err)
	}
	return nil
}

// attachLoop binds imgfd to a free loop device and returns the open device and its path.
func attachLoop(imgfd int, image string) (int, string, error) {
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, "", errdefs.FailedPrecondition("btrfs pool: open /dev/loop-control: %v; load the loop module (modprobe loop) and run as root", err)
	}
	defer unix.Close(ctl)
	var lastErr error
	// Retry: another process (losetup, mount -o loop) may grab the device we were offered.
	for range 16 {
		n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return -1, "", fmt.Errorf("btrfs pool: LOOP_CTL_GET_FREE: %w", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		fd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, "", fmt.Errorf("btrfs pool: open %s: %w", dev, err)
		}
		cfg := unix.LoopConfig{Fd: uint32(imgfd)}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
		copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], image) // informational only
		err = unix.IoctlLoopConfigure(fd, &cfg)
		if errors.Is(err, unix.EINVAL) {
			// The backing filesystem may not support direct I/O; fall back to buffered.
			cfg.Info.Flags &^= unix.LO_FLAGS_DIRECT_IO
			err = unix.IoctlLoopConfigure(fd, &cfg)
		}
		if err == nil {
			return fd, dev, nil
		}
		unix.Close(fd)
		if !errors.Is(err, unix.EBUSY) {
			return -1, "", fmt.Errorf("btrfs pool: LOOP_CONFIGURE %s: %w", dev, err)
		}
		lastErr = err
	}
	return -1, "", errdefs.Unavailable("btrfs pool: no free loop device could be bound (%v); retry", lastErr)
}

// lockPath takes a flock on the file path (creating it) and returns its release.
func lockPath(ctx context.Context, path string, how int) (func(), error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("btrfs pool: open lock %s: %w", path, err)
	}
	return flock(ctx, fd, how, path)
}

// flock locks fd, polling so that a canceled ctx ends the wait; it closes fd on failure,
// and the returned release closes it (which drops the lock).
func flock(ctx context.Context, fd, how int, what string) (func(), error) {
	wait := time.Millisecond
	for {
		err := unix.Flock(fd, how|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Close(fd) }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			unix.Close(fd)
			return nil, fmt.Errorf("btrfs pool: flock %s: %w", what, err)
		}
		select {
		case <-ctx.Done():
			unix.Close(fd)
			return nil, fmt.Errorf("btrfs pool: waiting for lock %s: %w", what, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, 100*time.Millisecond)
	}
}

func fsyncDir(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("btrfs pool: open %s: %w", dir, err)
	}
	defer unix.Close(fd)
	if err := unix.Fsync(fd); err != nil {
		return fmt.Errorf("btrfs pool: fsync %s: %w", dir, err)
	}
	return nil
}
