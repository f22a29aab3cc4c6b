package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
)

// Create makes a sandbox from a template and starts it. The default template is built
// (once, with progress) when it does not exist yet.
func (e *Engine) Create(ctx context.Context, opts model.CreateOptions) (*model.Sandbox, error) {
	if opts.Template == "" {
		opts.Template = DefaultTemplate
	}
	if opts.Isolation == "" {
		opts.Isolation = e.DefaultIsolation()
	}
	if err := validLimits(opts.Limits); err != nil {
		return nil, err
	}
	b, err := e.backend(opts.Isolation)
	if err != nil {
		return nil, err
	}
	tmpl, err := e.db.Template(ctx, opts.Template)
	if errdefs.Code(err) == "not_found" && opts.Template == DefaultTemplate {
		tmpl, err = e.BuildTemplate(ctx, defaultSpec())
	}
	if err != nil {
		return nil, err
	}
	id := newID("", 12)
	unlock, err := e.lock(ctx, id, true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	sb := &model.Sandbox{
		ID: id, Template: tmpl.Name, Isolation: opts.Isolation, State: model.StateRunning,
		Hostname: id, Labels: opts.Labels, Limits: opts.Limits, CreatedAt: time.Now().UTC(),
		Root: rootVolume(id),
	}
	if err := e.snapshotLazy(ctx, tmpl.Volume, sb.Root, false); err != nil {
		return nil, err
	}
	if err := writeIdentity(e.pool.Path(sb.Root), id); err != nil {
		e.pool.Delete(ctx, sb.Root)
		return nil, err
	}
	isb := e.isb(sb)
	if err := b.Start(ctx, isb); err != nil {
		e.pool.Delete(ctx, sb.Root)
		return nil, fmt.Errorf("start sandbox: %w", err)
	}
	sb.Init = isb.Init
	if err := e.db.PutSandbox(ctx, sb); err != nil {
		b.Stop(ctx, isb)
		e.pool.Delete(ctx, sb.Root)
		return nil, err
	}
	return sb, nil
}

func validLimits(l isolation.Limits) error {
	if l.MemoryBytes < 0 || (l.MemoryBytes > 0 && l.MemoryBytes < 16<<20) {
		return errdefs.InvalidArgument("memory limit %d bytes: give at least 16 MiB", l.MemoryBytes)
	}
	if l.Pids < 0 || (l.Pids > 0 && l.Pids < 8) {
		return errdefs.InvalidArgument("pids limit %d: give at least 8", l.Pids)
	}
	if l.CPUs < 0 || l.CPUs > 1024 {
		return errdefs.InvalidArgument("cpus %v: give a positive number of CPUs", l.CPUs)
	}
	return nil
}

// rootVolume names a fresh root volume of sandbox id.
func rootVolume(id string) string { return "roots/" + id + "-" + newID("", 6) }

// writeIdentity gives a sandbox root its own hostname and machine-id.
func writeIdentity(root, id string) error {
	etc := filepath.Join(root, "etc")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(etc, "hostname"), []byte(id+"\n"), 0o644); err != nil {
		return err
	}
	mid := newID("", 32)
	const hex = "0123456789abcdef"
	b := []byte(mid)
	for i := range b {
		b[i] = hex[int(b[i])%16]
	}
	return os.WriteFile(filepath.Join(etc, "machine-id"), append(b, '\n'), 0o444)
}

// Get returns a sandbox, with its state checked against the running processes.
func (e *Engine) Get(ctx context.Context, id string) (*model.Sandbox, error) {
	if !validID(id) {
		return nil, errdefs.InvalidArgument("%q is not a sandbox ID (IDs are lowercase letters and digits)", id)
	}
	sb, err := e.db.Sandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	e.refresh(sb)
	return sb, nil
}

// Inspect is Get with the figures that cost a look at the sandbox's processes and
// checkpoints: ResidentMemoryBytes and ResidentCheckpoints.
func (e *Engine) Inspect(ctx context.Context, id string) (*model.Sandbox, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if r, ok := e.residentFor(sb); ok && sb.State == model.StateRunning {
		sb.ResidentMemoryBytes, _ = r.ResidentMemory(e.isb(sb))
		res, _ := e.residentsOf(ctx, sb, r)
		sb.ResidentCheckpoints = len(res)
	}
	return sb, nil
}

// List returns every sandbox.
func (e *Engine) List(ctx context.Context) ([]*model.Sandbox, error) {
	l, err := e.db.Sandboxes(ctx)
	if err != nil {
		return nil, err
	}
	for _, sb := range l {
		e.refresh(sb)
	}
	return l, nil
}

// Remove stops a sandbox and deletes it and its root. Its checkpoints stay (forks and
// other sandboxes may descend from them) until GC or DeleteCheckpoint removes them.
func (e *Engine) Remove(ctx context.Context, id string) error {
	sb, unlock, err := e.stopLocked(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	if err := e.db.DeleteSandbox(ctx, id); err != nil {
		return err
	}
	if err := e.pool.Delete(ctx, sb.Root); err != nil && errdefs.Code(err) != "not_found" {
		return err
	}
	os.Remove(filepath.Join(e.cfg.DataDir, "locks", id))
	return nil
}

// Resume restarts a stopped sandbox from its head checkpoint.
func (e *Engine) Resume(ctx context.Context, id string) (*model.Sandbox, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if sb.State == model.StateRunning {
		return sb, nil
	}
	if sb.Head == "" {
		return nil, errdefs.FailedPrecondition("sandbox %s is stopped and has no checkpoint to resume from; remove it with `cairn rm %s`", id, id)
	}
	if err := e.Rollback(ctx, id, sb.Head); err != nil {
		return nil, err
	}
	return e.Get(ctx, id)
}

// Stop stops a sandbox's processes, keeping its root and checkpoints (Resume restarts it
// from its head checkpoint).
func (e *Engine) Stop(ctx context.Context, id string) error {
	sb, unlock, err := e.stopLocked(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	sb.State = model.StateStopped
	sb.Init = isolation.Proc{}
	return e.db.PutSandbox(ctx, sb)
}

// stopLocked takes a sandbox's lock and stops its processes; the caller releases the
// lock when done with the record.
func (e *Engine) stopLocked(ctx context.Context, id string) (*model.Sandbox, func(), error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	unlock, err := e.lock(ctx, id, true)
	if err != nil {
		return nil, nil, err
	}
	// Its resident checkpoints outlive its processes only once durable.
	if err := e.settleResidents(ctx, sb); err != nil {
		e.cfg.Logf("stop %s: %v", id, err)
	}
	b, err := e.backend(sb.Isolation)
	if err == nil {
		err = b.Stop(ctx, e.isb(sb))
	}
	if err != nil {
		unlock()
		return nil, nil, err
	}
	return sb, unlock, nil
}
