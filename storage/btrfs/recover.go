package btrfs

import (
	"context"
	"errors"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// Recover deletes the temporary snapshots (".tmp-*" names) that a crash during Snapshot
// left behind, anywhere in the pool. It holds the pool lock exclusively, so it waits for
// Snapshots in flight (in any process) and blocks new ones until it is done. It finds
// volumes through the btrfs root references (two ioctls per volume) instead of walking
// directory trees, so its cost grows with the number of volumes, not of files.
func (p *Pool) Recover(ctx context.Context) error {
	p.await("")
	rootfd, err := p.acquire()
	if err != nil {
		return err
	}
	defer p.mu.RUnlock()
	lfd, err := unix.Openat(rootfd, lockName, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return p.opError("recover: open pool lock", lockName, err)
	}
	unlock, err := flock(ctx, lfd, unix.LOCK_EX, p.dir+"/"+lockName)
	if err != nil {
		return err
	}
	defer unlock()
	return p.recoverIn(ctx, rootfd, "")
}

// recoverIn deletes the temporary volumes nested in the subvolume of fd below fd, and
// recurses into the other nested volumes; prefix is fd's name in the pool.
func (p *Pool) recoverIn(ctx context.Context, fd int, prefix string) error {
	children, err := nestedSubvols(fd)
	if err != nil {
		return p.opError("recover: list volumes in", orRoot(prefix), err)
	}
	var errs []error
	for _, c := range children {
		if err := ctx.Err(); err != nil {
			return err
		}
		name := path.Join(prefix, c)
		dir, base := path.Split(c)
		if strings.HasPrefix(base, tmpPrefix) {
			pfd, err := openDir(fd, strings.TrimSuffix(dir, "/"))
			if err != nil {
				errs = append(errs, p.opError("recover", name, err))
				continue
			}
			errs = append(errs, p.destroy(ctx, pfd, base, name))
			unix.Close(pfd)
			continue
		}
		cfd, err := openVolume(fd, c)
		if err != nil {
			// ENOENT: deleted concurrently. EXDEV: something is mounted on it (a sandbox
			// root bound for a restore): in use, and not ours to recurse into.
			if err != unix.ENOENT && err != unix.EXDEV {
				errs = append(errs, p.opError("recover", name, err))
			}
			continue
		}
		errs = append(errs, p.recoverIn(ctx, cfd, name))
		unix.Close(cfd)
	}
	return errors.Join(errs...)
}

func orRoot(name string) string {
	if name == "" {
		return "."
	}
	return name
}
