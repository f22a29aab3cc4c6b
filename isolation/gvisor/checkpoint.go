package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
)

// pausedMarker exists while a checkpoint holds the sandbox paused. It is written before
// `runsc pause` and removed after `runsc resume`, so that recovery after a crash in
// between knows, without asking runsc, which sandboxes to resume.
func (b *Backend) pausedMarker(id string) string {
	return filepath.Join(b.stateDir, "paused", id)
}

// Checkpoint implements isolation.Backend: pause → save (leave running, the sandbox
// stays paused) → hooks.Frozen → resume. The save comes before the filesystem snapshot
// because gVisor flushes what it holds for files (dirty pages of shared file mappings)
// as it saves; the snapshot, still inside the pause, then sees exactly the files the
// memory image refers to. The resume runs whatever happened, so a failed checkpoint
// leaves the sandbox running as it was.
func (b *Backend) Checkpoint(ctx context.Context, sb *isolation.Sandbox, dir string, hooks isolation.Hooks) (err error) {
	if !b.Running(sb) {
		return errdefs.FailedPrecondition("sandbox %s is not running", sb.ID)
	}
	id := cid(sb)
	if err := os.WriteFile(b.pausedMarker(id), nil, 0o600); err != nil {
		return err
	}
	t := time.Now()
	if _, err := b.run(ctx, nil, "pause", id); err != nil {
		b.resume(context.WithoutCancel(ctx), id)
		return fmt.Errorf("pause gVisor sandbox %s: %w", sb.ID, err)
	}
	hooks.Report("freeze", t)
	defer func() {
		t := time.Now()
		if rerr := b.resume(context.WithoutCancel(ctx), id); rerr != nil && err == nil {
			err = rerr
		}
		hooks.Report("thaw", t)
	}()
	t = time.Now()
	if _, err := b.run(ctx, nil, "checkpoint", "--leave-running", "--compression=none", "--image-path", dir, id); err != nil {
		return fmt.Errorf("checkpoint gVisor sandbox %s: %w", sb.ID, err)
	}
	hooks.Report("dump", t)
	if hooks.Frozen != nil {
		return hooks.Frozen(ctx)
	}
	return nil
}

// resume resumes a paused run and clears its marker.
func (b *Backend) resume(ctx context.Context, id string) error {
	if _, err := b.run(ctx, nil, "resume", id); err != nil {
		return fmt.Errorf("resume gVisor sandbox: %w", err)
	}
	os.Remove(b.pausedMarker(id))
	return nil
}

// Recover resumes a sandbox that a checkpoint left paused when its process died between
// pause and resume. It costs nothing (no runsc call) unless a pause marker is left.
func (b *Backend) Recover(ctx context.Context, sb *isolation.Sandbox) error {
	id := cid(sb)
	if _, err := os.Stat(b.pausedMarker(id)); err != nil {
		return nil
	}
	if !b.Running(sb) {
		os.Remove(b.pausedMarker(id))
		return nil
	}
	return b.resume(ctx, id)
}

// Restore implements isolation.Backend: a new runsc container on sb.Root from the image
// in dir, then the sandbox's own hostname (the image carries the UTS namespace of the
// sandbox it was taken from; /etc/hostname and machine-id are already in the root).
func (b *Backend) Restore(ctx context.Context, sb *isolation.Sandbox, dir string) error {
	// The root's /.cairn/init is the one the image maps; it is not replaced here.
	id := cid(sb)
	if err := writeBundle(b.bundle(id), spec(sb, id)); err != nil {
		return err
	}
	pidFile := filepath.Join(b.bundle(id), "pid")
	if _, err := b.run(ctx, nil, "restore", "--detach", "--bundle", b.bundle(id), "--image-path", dir, "--pid-file", pidFile, id); err != nil {
		b.destroy(id, isolation.Proc{})
		return fmt.Errorf("restore gVisor sandbox %s: %w", sb.ID, err)
	}
	p, err := readPid(pidFile)
	if err != nil {
		b.destroy(id, isolation.Proc{})
		return err
	}
	sb.Init = p
	if sb.Hostname != "" {
		_, err = b.run(ctx, nil, "exec", "--cap", "CAP_SYS_ADMIN", id, initPath, "hostname", sb.Hostname)
		if err != nil {
			b.destroy(id, isolation.Proc{})
			sb.Init = isolation.Proc{}
			return errors.Join(errdefs.Unavailable("hostname of restored sandbox %s", sb.ID), err)
		}
	}
	return nil
}
