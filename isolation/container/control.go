package container

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
	"golang.org/x/sys/unix"
)

// requestTimeout bounds how long init may take to answer one request.
const requestTimeout = 30 * time.Second

// call sends one request to the sandbox's init and waits for its response.
func (b *Backend) call(ctx context.Context, sb *isolation.Sandbox, req initctl.Request) (initctl.Response, error) {
	if !b.Running(sb) {
		return initctl.Response{}, errdefs.FailedPrecondition("sandbox %s is not running", sb.ID)
	}
	base := filepath.Join(sb.Root, initctl.Dir)
	var rb [8]byte
	rand.Read(rb[:])
	rid := hex.EncodeToString(rb[:])
	respPath := filepath.Join(base, initctl.RespDir, rid+".json")
	in, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return initctl.Response{}, err
	}
	// Closing an inotify instance waits for an SRCU grace period of the kernel's
	// fsnotify (0.5-20 ms, measured here): off the caller's path, every call to init
	// (a rollback's reload, an exec) would pay it.
	defer func() { go unix.Close(in) }()
	if _, err := unix.InotifyAddWatch(in, filepath.Dir(respPath), unix.IN_MOVED_TO|unix.IN_CREATE); err != nil {
		return initctl.Response{}, fmt.Errorf("watch %s: %w", filepath.Dir(respPath), err)
	}
	if err := initctl.WriteJSONAtomic(filepath.Join(base, initctl.ReqDir, rid+".json"), req); err != nil {
		return initctl.Response{}, err
	}
	ctl, err := os.OpenFile(filepath.Join(base, initctl.CtlFIFO), os.O_WRONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return initctl.Response{}, errdefs.Unavailable("sandbox %s: init's control pipe: %v", sb.ID, err)
	}
	_, err = ctl.Write([]byte(rid + "\n"))
	ctl.Close()
	if err != nil {
		return initctl.Response{}, errdefs.Unavailable("sandbox %s: write to init: %v", sb.ID, err)
	}
	deadline := time.Now().Add(requestTimeout)
	buf := make([]byte, 4096)
	for {
		var resp initctl.Response
		if err := initctl.ReadJSON(respPath, &resp); err == nil {
			os.Remove(respPath)
			return resp, nil
		} else if !errors.Is(err, os.ErrNotExist) {
			return resp, err
		}
		if time.Now().After(deadline) {
			return initctl.Response{}, errdefs.Unavailable("sandbox %s: init did not answer in %s", sb.ID, requestTimeout)
		}
		if err := ctx.Err(); err != nil {
			return initctl.Response{}, err
		}
		fds := []unix.PollFd{{Fd: int32(in), Events: unix.POLLIN}}
		unix.Poll(fds, 100)
		unix.Read(in, buf)
	}
}

// Exec implements isolation.Backend.
func (b *Backend) Exec(ctx context.Context, sb *isolation.Sandbox, handle string, spec isolation.ProcSpec) error {
	if !initctl.ValidHandle(handle) {
		return errdefs.InvalidArgument("bad process handle %q", handle)
	}
	resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpSpawn, Handle: handle, Spec: &spec})
	if err != nil {
		return err
	}
	return resp.Err(sb.ID, "exec "+spec.Args[0])
}

// Signal implements isolation.Backend.
func (b *Backend) Signal(ctx context.Context, sb *isolation.Sandbox, handle string, sig syscall.Signal) error {
	resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpSignal, Handle: handle, Signal: int(sig)})
	if err != nil {
		return err
	}
	return resp.Err(sb.ID, "signal "+handle)
}

// RemoveRecord implements isolation.Backend: init removes it (initctl.OpRemove).
func (b *Backend) RemoveRecord(ctx context.Context, sb *isolation.Sandbox, handle string) error {
	if !initctl.ValidHandle(handle) {
		return errdefs.InvalidArgument("bad process handle %q", handle)
	}
	resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpRemove, Handle: handle})
	if err != nil {
		return err
	}
	return resp.Err(sb.ID, "remove the record of "+handle)
}

// WriteStdin implements isolation.Backend. The data goes straight into the process's
// stdin FIFO inside the sandbox root; init holds the FIFO open, so a reader exists.
func (b *Backend) WriteStdin(ctx context.Context, sb *isolation.Sandbox, handle string, data []byte, eof bool) error {
	if !initctl.ValidHandle(handle) {
		return errdefs.InvalidArgument("bad process handle %q", handle)
	}
	if !b.Running(sb) {
		return errdefs.FailedPrecondition("sandbox %s is not running", sb.ID)
	}
	base := filepath.Join(sb.Root, initctl.Dir)
	if _, err := os.Stat(initctl.ProcPath(base, handle, "exit")); err == nil {
		return errdefs.FailedPrecondition("process %s has exited", handle)
	}
	if len(data) > 0 {
		f, err := os.OpenFile(initctl.ProcPath(base, handle, "stdin"), os.O_WRONLY|unix.O_NONBLOCK, 0)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return errdefs.NotFound("process %s in sandbox %s", handle, sb.ID)
			}
			return errdefs.FailedPrecondition("stdin of process %s: %v", handle, err)
		}
		defer f.Close()
		// The write may block while the pipe is full; the poller honours the deadline.
		if dl, ok := ctx.Deadline(); ok {
			f.SetWriteDeadline(dl)
		} else {
			f.SetWriteDeadline(time.Now().Add(requestTimeout))
		}
		if _, err := f.Write(data); err != nil {
			return errdefs.Unavailable("write stdin of %s: %v (is the process reading its input?)", handle, err)
		}
	}
	if eof {
		resp, err := b.call(ctx, sb, initctl.Request{Op: initctl.OpCloseStdin, Handle: handle})
		if err != nil {
			return err
		}
		return resp.Err(sb.ID, "close stdin of "+handle)
	}
	return nil
}
