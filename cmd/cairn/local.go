package main

import (
	"context"
	"io"
	"io/fs"
	"syscall"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/template"
)

// local is the in-process backend: the engine, when no cairnd serves the data
// directory. Sandboxes it returns have no session (no TTL, no idle pause).
type local struct{ e *engine.Engine }

var _ client.Backend = local{}

func view(sb *model.Sandbox) *client.Sandbox { return &client.Sandbox{Sandbox: *sb} }

func views(sbs []*model.Sandbox) []*client.Sandbox {
	out := make([]*client.Sandbox, len(sbs))
	for i, sb := range sbs {
		out[i] = view(sb)
	}
	return out
}

// errNeedsDaemon refuses the session options without a daemon.
func errNeedsDaemon(what string) error {
	return errdefs.FailedPrecondition("%s needs cairnd (sessions live in the daemon): start it with `sudo cairnd`", what)
}

func (l local) Create(ctx context.Context, req client.CreateRequest) (*client.Sandbox, error) {
	if req.Lifetime != (client.Lifetime{}) {
		return nil, errNeedsDaemon("a TTL, expiry policy, idle timeout, session or run")
	}
	sb, err := l.e.Create(ctx, model.CreateOptions{Template: req.Template, Isolation: req.Isolation, Labels: req.Labels, Limits: req.Limits})
	if err != nil {
		return nil, err
	}
	return view(sb), nil
}

func (l local) Get(ctx context.Context, id string) (*client.Sandbox, error) {
	sb, err := l.e.Inspect(ctx, id)
	if err != nil {
		return nil, err
	}
	return view(sb), nil
}

func (l local) List(ctx context.Context, opts client.ListOptions) ([]*client.Sandbox, error) {
	if opts.Session != "" || opts.Run != "" {
		return nil, errNeedsDaemon("filtering by session or run")
	}
	all, err := l.e.List(ctx)
	if err != nil {
		return nil, err
	}
	out := []*client.Sandbox{}
	for _, sb := range views(all) {
		if hasLabels(sb.Labels, opts.Labels) && (opts.State == "" || sb.State == opts.State) {
			out = append(out, sb)
		}
	}
	return out, nil
}

func (l local) Remove(ctx context.Context, id string) error { return l.e.Remove(ctx, id) }

func (l local) Stop(ctx context.Context, id string) (*client.Sandbox, error) {
	if err := l.e.Stop(ctx, id); err != nil {
		return nil, err
	}
	return l.Get(ctx, id)
}

func (l local) Resume(ctx context.Context, id string) (*client.Sandbox, error) {
	sb, err := l.e.Resume(ctx, id)
	if err != nil {
		return nil, err
	}
	return view(sb), nil
}

func (l local) Spawn(ctx context.Context, id string, req client.ExecRequest) (*client.Process, error) {
	h, err := l.e.Exec(ctx, id, model.ExecOptions{Args: req.Args, Env: req.Env, Cwd: req.Cwd, Tty: req.Tty})
	if err != nil {
		return nil, err
	}
	return l.e.Process(ctx, id, h)
}

func (l local) Stdin(ctx context.Context, id, h string, data []byte, eof bool) error {
	return l.e.Stdin(ctx, id, h, data, eof)
}

func (l local) RemoveProcess(ctx context.Context, id, h string) error {
	return l.e.RemoveProcess(ctx, id, h)
}

func (l local) Signal(ctx context.Context, id, h string, sig syscall.Signal) error {
	return l.e.Signal(ctx, id, h, sig)
}

func (l local) Processes(ctx context.Context, id string) ([]*client.Process, error) {
	return l.e.Processes(ctx, id)
}

func (l local) Process(ctx context.Context, id, h string) (*client.Process, error) {
	return l.e.Process(ctx, id, h)
}

func (l local) Output(ctx context.Context, id, h, stream string, off int64) ([]byte, int64, error) {
	return l.e.Output(ctx, id, h, stream, off)
}

func (l local) Follow(ctx context.Context, id, h string, stdout, stderr io.Writer) (*client.ExitStatus, error) {
	return l.e.Follow(ctx, id, h, stdout, stderr)
}

func (l local) Wait(ctx context.Context, id, h string) (*client.ExitStatus, error) {
	return l.e.Wait(ctx, id, h)
}

func (l local) Checkpoint(ctx context.Context, id string, req client.CheckpointRequest) (*client.Checkpoint, error) {
	return l.e.Checkpoint(ctx, id, engine.CheckpointOptions{Label: req.Label, Durable: req.Durable})
}

func (l local) Rollback(ctx context.Context, id, ck string) (*client.Sandbox, error) {
	if err := l.e.Rollback(ctx, id, ck); err != nil {
		return nil, err
	}
	return l.Get(ctx, id)
}

func (l local) Fork(ctx context.Context, ck string, req client.ForkRequest) ([]*client.Sandbox, error) {
	if req.Lifetime != (client.Lifetime{}) {
		return nil, errNeedsDaemon("a TTL, expiry policy, idle timeout, session or run")
	}
	if req.Count == 0 {
		req.Count = 1
	}
	sbs, err := l.e.Fork(ctx, ck, req.Count)
	if err != nil {
		return nil, err
	}
	for _, sb := range sbs {
		if err := l.e.AddLabels(ctx, sb.ID, req.Labels); err != nil {
			return nil, err
		}
	}
	return views(sbs), nil
}

func (l local) Prewarm(ctx context.Context, ck string, count int) (int, error) {
	if err := l.e.Prewarm(ctx, ck, count); err != nil {
		return 0, err
	}
	return l.e.StandbyCount(ctx, ck)
}

func (l local) Standbys(ctx context.Context, ck string) (int, error) {
	return l.e.StandbyCount(ctx, ck)
}

func (l local) Tree(ctx context.Context, id string) (*client.Tree, error) {
	sb, err := l.e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	cks, err := l.e.Tree(ctx, id)
	if err != nil {
		return nil, err
	}
	if cks == nil {
		cks = []*model.Checkpoint{}
	}
	return &client.Tree{Sandbox: sb.ID, Head: sb.Head, Checkpoints: cks}, nil
}

func (l local) GetCheckpoint(ctx context.Context, id string) (*client.Checkpoint, error) {
	return l.e.GetCheckpoint(ctx, id)
}

func (l local) DeleteCheckpoint(ctx context.Context, id string, cascade bool) ([]string, error) {
	return l.e.DeleteCheckpoint(ctx, id, cascade)
}

func (l local) Diff(ctx context.Context, from, to string) ([]model.Change, error) {
	return l.e.Diff(ctx, from, to)
}

func (l local) GC(ctx context.Context) (*client.GCReport, error) { return l.e.GC(ctx) }

func (l local) ReadFile(ctx context.Context, id, p string) ([]byte, error) {
	return l.e.ReadFile(ctx, id, p)
}

func (l local) WriteFile(ctx context.Context, id, p string, data []byte, mode fs.FileMode) (*client.FileInfo, error) {
	if err := l.e.WriteFile(ctx, id, p, data, mode); err != nil {
		return nil, err
	}
	return l.e.Stat(ctx, id, p)
}

func (l local) Stat(ctx context.Context, id, p string) (*client.FileInfo, error) {
	return l.e.Stat(ctx, id, p)
}

func (l local) ListDir(ctx context.Context, id, p string) ([]*client.FileInfo, error) {
	return l.e.ListDir(ctx, id, p)
}

func (l local) RemovePath(ctx context.Context, id, p string) error { return l.e.RemovePath(ctx, id, p) }

func (l local) BuildTemplate(ctx context.Context, req client.TemplateRequest) (*client.Template, error) {
	spec := template.Spec{Name: req.Name, Dir: req.Dir, OCI: req.OCI}
	if d := req.Debian; d != nil {
		spec.Debian = &template.DebianSource{Suite: d.Suite, Variant: d.Variant, Packages: d.Packages, Mirror: d.Mirror}
	}
	return l.e.BuildTemplate(ctx, spec)
}

func (l local) Templates(ctx context.Context) ([]*client.Template, error) { return l.e.Templates(ctx) }

func (l local) RemoveTemplate(ctx context.Context, name string) error {
	return l.e.RemoveTemplate(ctx, name)
}
