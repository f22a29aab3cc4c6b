package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
	"golang.org/x/sys/unix"
)

// Checkpoint implements isolation.Backend: freeze → hooks.Frozen → CRIU dump (leave
// running) → thaw. The thaw runs whatever happened, so a failed checkpoint leaves the
// sandbox running as it was.
func (b *Backend) Checkpoint(ctx context.Context, sb *isolation.Sandbox, dir string, hooks isolation.Hooks) (err error) {
	if !b.Running(sb) {
		return errdefs.FailedPrecondition("sandbox %s is not running", sb.ID)
	}
	if err := freeze(sb.ID); err != nil {
		thaw(sb.ID)
		return err
	}
	defer func() {
		if terr := thaw(sb.ID); terr != nil && err == nil {
			err = terr
		}
	}()
	if hooks.Frozen != nil {
		if err := hooks.Frozen(ctx); err != nil {
			return err
		}
	}
	return criu.Dump(ctx, criu.DumpOptions{
		Pid:          sb.Init.Pid,
		ImagesDir:    dir,
		FreezeCgroup: ctrlDir("freezer", sb.ID),
	})
}

// Restore implements isolation.Backend.
func (b *Backend) Restore(ctx context.Context, sb *isolation.Sandbox, dir string) error {
	if err := createCgroups(sb.ID, sb.Limits); err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "cairn-restore-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	// CRIU pivots into the root, so it must be a mount point: bind it onto itself for the
	// restore; the restored tree keeps its own mount namespace after we detach ours.
	if err := unix.Mount(sb.Root, sb.Root, "", unix.MS_BIND, ""); err != nil {
		removeCgroups(sb.ID)
		return fmt.Errorf("bind root for restore: %w", err)
	}
	pid, rerr := criu.Restore(ctx, criu.RestoreOptions{
		ImagesDir:   dir,
		WorkDir:     work,
		Root:        sb.Root,
		CgroupRoot:  cgroupPath(sb.ID),
		Controllers: controllers,
	})
	unix.Unmount(sb.Root, unix.MNT_DETACH)
	if rerr != nil {
		if log, err := os.ReadFile(filepath.Join(work, "restore.log")); err == nil {
			os.WriteFile(filepath.Join(filepath.Dir(sb.Root), "last-restore-"+sb.ID+".log"), log, 0o644)
		}
		b.Stop(ctx, sb)
		return rerr
	}
	st, err := startTime(pid)
	if err != nil {
		return err
	}
	sb.Init = isolation.Proc{Pid: pid, StartTime: st}
	if err := setHostname(pid, sb.Hostname); err != nil {
		b.Stop(ctx, sb)
		return fmt.Errorf("hostname of restored sandbox: %w", err)
	}
	return nil
}

// setHostname sets the hostname in the UTS namespace of pid. A restored sandbox comes
// back with the hostname it was dumped with; a fork needs its own.
func setHostname(pid int, name string) error {
	if name == "" {
		return nil
	}
	errc := make(chan error, 1)
	go func() {
		// The thread that joins another UTS namespace is never returned to the runtime:
		// the goroutine exits still locked, and Go ends the thread with it.
		runtime.LockOSThread()
		fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/uts", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWUTS); err != nil {
			errc <- err
			return
		}
		errc <- unix.Sethostname([]byte(name))
	}()
	return <-errc
}

var _ = errors.New
