package engine

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/initctl"
	"github.com/cairn-sandbox/cairn/isolation"
)

// running returns a running sandbox (shared lock held until release is called).
func (e *Engine) running(ctx context.Context, id string) (*model.Sandbox, func(), error) {
	unlock, err := e.lock(ctx, id, false)
	if err != nil {
		return nil, nil, err
	}
	sb, err := e.Get(ctx, id)
	if err != nil {
		unlock()
		return nil, nil, err
	}
	if sb.State != model.StateRunning {
		unlock()
		return nil, nil, errdefs.FailedPrecondition("sandbox %s is stopped; resume it with `cairn resume %s`", id, id)
	}
	return sb, unlock, nil
}

// Exec starts a process in a sandbox and returns its handle. The process runs on its
// own; Follow streams its output, Wait waits for its exit.
func (e *Engine) Exec(ctx context.Context, id string, opts model.ExecOptions) (string, error) {
	if len(opts.Args) == 0 || opts.Args[0] == "" {
		return "", errdefs.InvalidArgument("exec needs a command")
	}
	sb, unlock, err := e.running(ctx, id)
	if err != nil {
		return "", err
	}
	defer unlock()
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return "", err
	}
	handle := newID("p", 8)
	spec := initctl.ProcSpec{Args: opts.Args, Env: opts.Env, Cwd: opts.Cwd, Tty: opts.Tty, NoStdin: opts.NoStdin}
	if err := b.Exec(ctx, e.isb(sb), handle, spec); err != nil {
		return "", err
	}
	return handle, nil
}

func (e *Engine) procDir(sb *model.Sandbox, handle string) (string, error) {
	if !initctl.ValidHandle(handle) {
		return "", errdefs.InvalidArgument("%q is not a process handle", handle)
	}
	dir := filepath.Join(e.pool.Path(sb.Root), initctl.Dir, initctl.ProcDir, handle)
	if _, err := os.Stat(dir); err != nil || e.hidden(sb.ID, handle) {
		return "", errdefs.NotFound("process %s in sandbox %s (list them with `cairn ps %s`)", handle, sb.ID, sb.ID)
	}
	return dir, nil
}

// Stdin writes data to a process's stdin, closing it after if eof.
func (e *Engine) Stdin(ctx context.Context, id, handle string, data []byte, eof bool) error {
	sb, unlock, err := e.running(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := e.procDir(sb, handle); err != nil {
		return err
	}
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return err
	}
	return b.WriteStdin(ctx, e.isb(sb), handle, data, eof)
}

// Signal sends a signal to a process (and its process group).
func (e *Engine) Signal(ctx context.Context, id, handle string, sig syscall.Signal) error {
	sb, unlock, err := e.running(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := e.procDir(sb, handle); err != nil {
		return err
	}
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return err
	}
	return b.Signal(ctx, e.isb(sb), handle, sig)
}

// Processes lists the processes started in a sandbox, oldest first.
func (e *Engine) Processes(ctx context.Context, id string) ([]*model.Process, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(e.pool.Path(sb.Root), initctl.Dir, initctl.ProcDir)
	entries, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	var out []*model.Process
	for _, d := range entries {
		if e.hidden(sb.ID, d.Name()) {
			continue
		}
		if p := readProcess(sb, filepath.Join(dir, d.Name())); p != nil {
			out = append(out, p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].StartedAt.Before(out[j].StartedAt) })
	return out, nil
}

func readProcess(sb *model.Sandbox, dir string) *model.Process {
	var st initctl.ProcState
	if initctl.ReadJSON(filepath.Join(dir, "spec.json"), &st) != nil {
		return nil
	}
	p := &model.Process{Handle: st.Handle, Pid: st.Pid, Args: st.Spec.Args, Tty: st.Spec.Tty, StartedAt: st.StartedAt}
	var ex initctl.ExitStatus
	if initctl.ReadJSON(filepath.Join(dir, "exit"), &ex) == nil {
		p.Exit = &ex
	} else {
		p.Running = sb.State == model.StateRunning
	}
	return p
}

// Process returns one process.
func (e *Engine) Process(ctx context.Context, id, handle string) (*model.Process, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	dir, err := e.procDir(sb, handle)
	if err != nil {
		return nil, err
	}
	p := readProcess(sb, dir)
	if p == nil {
		return nil, errdefs.NotFound("process %s in sandbox %s", handle, id)
	}
	return p, nil
}

// Output reads a process's output stream ("stdout" or "stderr") from byte offset on.
// It returns the bytes read and the offset to continue from.
func (e *Engine) Output(ctx context.Context, id, handle, stream string, offset int64) ([]byte, int64, error) {
	if stream != "stdout" && stream != "stderr" {
		return nil, offset, errdefs.InvalidArgument("stream %q: give stdout or stderr", stream)
	}
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, offset, err
	}
	dir, err := e.procDir(sb, handle)
	if err != nil {
		return nil, offset, err
	}
	f, err := os.Open(filepath.Join(dir, stream))
	if err != nil {
		return nil, offset, nil
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil, offset, err
	}
	b, err := io.ReadAll(io.LimitReader(f, 16<<20))
	return b, offset + int64(len(b)), err
}

// Follow streams a process's stdout and stderr to the writers until it exits, and
// returns its exit status. It follows the sandbox across rollbacks of its root.
func (e *Engine) Follow(ctx context.Context, id, handle string, stdout, stderr io.Writer) (*initctl.ExitStatus, error) {
	var offOut, offErr int64
	delay := 200 * time.Microsecond
	for {
		p, err := e.Process(ctx, id, handle)
		if err != nil {
			return nil, err
		}
		moved := false
		for _, s := range []struct {
			name string
			w    io.Writer
			off  *int64
		}{{"stdout", stdout, &offOut}, {"stderr", stderr, &offErr}} {
			b, next, err := e.Output(ctx, id, handle, s.name, *s.off)
			if err != nil {
				return nil, err
			}
			if len(b) > 0 {
				moved = true
				if s.w != nil {
					s.w.Write(b)
				}
			}
			*s.off = next
		}
		if p.Exit != nil && !moved {
			return p.Exit, nil
		}
		if !p.Running && p.Exit == nil {
			return nil, errdefs.Unavailable("sandbox %s stopped while process %s was running", id, handle)
		}
		if moved {
			delay = 200 * time.Microsecond
			continue
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, 20*time.Millisecond)
	}
}

// RemoveProcess deletes the record of an exited process: its spec, output and exit
// status under /.cairn/proc in the sandbox's root. Records otherwise stay, so that
// `cairn ps` and `cairn logs` can show them, and each is part of the root: of every
// checkpoint taken while it exists and of what a rollback brings back in place.
// Foreground execs remove theirs once the caller has the output and the exit status
// (a session of thousands of commands would otherwise keep thousands of records, and
// rollbacks across them would recreate and delete them all). A process still running
// is refused.
//
// The sandbox's init removes it (the sandbox must run), so that a gVisor sentry sees
// the removal. Where each call to init is costly (isolation.CostlyCalls: gVisor) it
// does so in the background, and the record is hidden meanwhile; a rollback shows what
// its checkpoint has again.
func (e *Engine) RemoveProcess(ctx context.Context, id, handle string) error {
	sb, unlock, err := e.running(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	dir, err := e.procDir(sb, handle)
	if err != nil {
		return err
	}
	var ex initctl.ExitStatus
	if initctl.ReadJSON(filepath.Join(dir, "exit"), &ex) != nil {
		return errdefs.FailedPrecondition("process %s in sandbox %s has not exited; end it first (`cairn kill %s %s`), then remove it", handle, id, id, handle)
	}
	b, err := e.backend(sb.Isolation)
	if err != nil {
		return err
	}
	if c, ok := b.(isolation.CostlyCalls); !ok || !c.CostlyCalls() {
		return b.RemoveRecord(ctx, e.isb(sb), handle)
	}
	e.bgMu.Lock()
	if e.removing == nil {
		e.removing = map[string]map[string]bool{}
	}
	if e.removing[id] == nil {
		e.removing[id] = map[string]bool{}
	}
	e.removing[id][handle] = true
	e.bgMu.Unlock()
	e.bgWG.Add(1)
	go func() {
		defer e.bgWG.Done()
		ctx := context.WithoutCancel(ctx)
		if sb, unlock, err := e.running(ctx, id); err == nil {
			// Not if a rollback came first: the record is its checkpoint's.
			if e.hidden(id, handle) {
				b.RemoveRecord(ctx, e.isb(sb), handle)
			}
			unlock()
		}
		e.bgMu.Lock()
		delete(e.removing[id], handle)
		if len(e.removing[id]) == 0 {
			delete(e.removing, id)
		}
		e.bgMu.Unlock()
	}()
	return nil
}

// hidden reports whether the record of handle in sandbox id is being removed.
func (e *Engine) hidden(id, handle string) bool {
	e.bgMu.Lock()
	defer e.bgMu.Unlock()
	return e.removing[id][handle]
}

// unhide shows sandbox id's records as they are on disk again (after a rollback: its
// checkpoint's).
func (e *Engine) unhide(id string) {
	e.bgMu.Lock()
	delete(e.removing, id)
	e.bgMu.Unlock()
}

// Wait waits for a process to exit.
func (e *Engine) Wait(ctx context.Context, id, handle string) (*initctl.ExitStatus, error) {
	return e.Follow(ctx, id, handle, nil, nil)
}
