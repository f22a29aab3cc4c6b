package container

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/cairn-sandbox/cairn/criu"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
	"github.com/cairn-sandbox/cairn/isolation/container/zygote"
	"golang.org/x/sys/unix"
)

// Checkpoint implements isolation.Backend: freeze → hooks.Frozen → CRIU dump (leave
// running) → thaw. The thaw runs whatever happened, so a failed checkpoint leaves the
// sandbox running as it was.
//
// The hook (the filesystem snapshot) runs before CRIU starts, not beside it: running
// both at once saved ~5-10 ms, but a crash of cairn inside the hook then left CRIU
// mid-dump with the tree seized, and the crash tests found the sandbox dead after
// recovery.
func (b *Backend) Checkpoint(ctx context.Context, sb *isolation.Sandbox, dir string, hooks isolation.Hooks) (err error) {
	if !b.Running(sb) {
		return errdefs.FailedPrecondition("sandbox %s is not running", sb.ID)
	}
	if hasZygotes(sb.CgroupName()) {
		// They are init's children: CRIU would dump them with the tree.
		return errdefs.FailedPrecondition("sandbox %s has resident checkpoints (zygotes): end them before a CRIU dump of its tree", sb.ID)
	}
	b.res.untrack(sb.Init)
	// CRIU's start-up is taken off the freeze: a worker started after the previous
	// checkpoint, or one starting now while the tree is frozen and the hook runs.
	worker := b.workers.take(sb)
	var starting chan *criu.Worker
	if worker == nil {
		starting = make(chan *criu.Worker, 1)
		go func() {
			w, err := criu.StartWorker(netnsOf(sb.Init))
			if err != nil {
				w = nil // Dump starts its own CRIU
			}
			starting <- w
		}()
	}
	defer func() {
		if starting != nil { // not waited for: an early failure
			go func() {
				if w := <-starting; w != nil {
					w.Close()
				}
			}()
		}
		b.workers.start(sb, false) // for the next checkpoint
	}()
	t := time.Now()
	if err := freeze(sb.CgroupName()); err != nil {
		thaw(sb.CgroupName())
		return err
	}
	hooks.Report("freeze", t)
	defer func() {
		t := time.Now()
		if terr := thaw(sb.CgroupName()); terr != nil && err == nil {
			err = terr
		}
		hooks.Report("thaw", t)
	}()
	if hooks.Frozen != nil {
		if err := hooks.Frozen(ctx); err != nil {
			return err
		}
	}
	t = time.Now()
	defer hooks.Report("dump", t)
	if starting != nil {
		worker, starting = <-starting, nil
	}
	return criu.Dump(ctx, criu.DumpOptions{
		Pid:          sb.Init.Pid,
		ImagesDir:    dir,
		FreezeCgroup: ctrlDir("freezer", sb.CgroupName()),
		NetNS:        netnsOf(sb.Init),
		PostDump:     hooks.Dumped,
		Worker:       worker,
	})
}

// Restore implements isolation.Backend.
func (b *Backend) Restore(ctx context.Context, sb *isolation.Sandbox, dir string) error {
	return b.restore(ctx, sb, dir, false)
}

// RestoreFrozen implements isolation.FrozenRestorer: CRIU leaves the restored tasks
// stopped, the cgroup freezer then holds them, and the stop is lifted under the freezer,
// so no instruction of the tree runs before Activate.
func (b *Backend) RestoreFrozen(ctx context.Context, sb *isolation.Sandbox, dir string) error {
	return b.restore(ctx, sb, dir, true)
}

// Activate implements isolation.Activator.
func (b *Backend) Activate(ctx context.Context, sb *isolation.Sandbox) error {
	if err := setHostname(sb.Init.Pid, sb.Hostname); err != nil {
		return fmt.Errorf("hostname of sandbox %s: %w", sb.ID, err)
	}
	if err := thaw(sb.CgroupName()); err != nil {
		return err
	}
	b.workers.start(sb, true) // a rollback of a sandbox that checkpoints
	return nil
}

func (b *Backend) restore(ctx context.Context, sb *isolation.Sandbox, dir string, frozen bool) error {
	if perProcess(dir) {
		return b.restoreProcs(ctx, sb, dir, frozen)
	}
	if _, ok, _ := zygote.Read(dir); ok {
		return errdefs.FailedPrecondition("the checkpoint is held in memory only (zygotes): its durable copy is not written yet; wait for it, or roll its own sandbox back to it")
	}
	if err := createCgroups(sb.CgroupName(), sb.Limits); err != nil {
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
		removeCgroups(sb.CgroupName())
		return fmt.Errorf("bind root for restore: %w", err)
	}
	// A worker started ahead brings the tree's new network namespace; without one,
	// criu.Restore makes the namespace and starts CRIU.
	pid, rerr := criu.Restore(ctx, criu.RestoreOptions{
		Worker:       b.restorers.take(frozen),
		Cgroups:      procsFiles(sb.CgroupName()),
		ImagesDir:    dir,
		KeepLog:      filepath.Join(os.TempDir(), "cairn-restore-"+sb.ID+".log"),
		LeaveStopped: frozen,
		Background:   frozen, // standbys are prepared off the critical path
		WorkDir:      work,
		Root:         sb.Root,
	})
	unix.Unmount(sb.Root, unix.MNT_DETACH)
	if rerr != nil {
		b.Stop(ctx, sb)
		return rerr
	}
	if sb.Init, err = isolation.ProcOf(pid); err != nil {
		return err
	}
	// New processes of a restored tree get PIDs from UserPidBase up too (see Start).
	if err := b.res.setPidBase(sb.Init); err != nil {
		b.Stop(ctx, sb)
		return err
	}
	if frozen {
		if err := freezeStopped(sb.CgroupName()); err != nil {
			b.Stop(ctx, sb)
			return err
		}
		return nil
	}
	if err := setHostname(pid, sb.Hostname); err != nil {
		b.Stop(ctx, sb)
		return fmt.Errorf("hostname of restored sandbox: %w", err)
	}
	b.workers.start(sb, true) // a rollback of a sandbox that checkpoints
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

// freezeStopped freezes a cgroup whose tasks CRIU left stopped, then continues them: the
// freezer keeps them from running, and a thaw alone later starts the whole tree at once.
func freezeStopped(cgroup string) error {
	if err := freeze(cgroup); err != nil {
		return err
	}
	for _, pid := range cgroupTasks(cgroup) {
		unix.Kill(pid, unix.SIGCONT)
	}
	return nil
}
