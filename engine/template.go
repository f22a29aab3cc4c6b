package engine

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/template"
)

func defaultSpec() template.Spec { return template.Default() }

// BuildTemplate builds (or imports) a template and records it. The root is built in a
// temporary volume and published read-only under templates/<name> by snapshot, so a
// crash never leaves a half-built template.
func (e *Engine) BuildTemplate(ctx context.Context, spec template.Spec) (*model.Template, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	unlock, err := e.lock(ctx, "template-"+spec.Name, true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if t, err := e.db.Template(ctx, spec.Name); err == nil {
		return nil, errdefs.AlreadyExists("template %q exists (built %s); remove it first with `cairn template rm %s`", t.Name, t.CreatedAt.Format(time.RFC3339), t.Name)
	}
	build := filepath.Join("templates", "build-"+spec.Name+"-"+newID("", 6))
	final := filepath.Join("templates", spec.Name)
	if e.pool.Exists(final) {
		e.pool.Delete(ctx, final) // unrecorded leftover of a crashed build
	}
	if err := e.pool.Create(ctx, build); err != nil {
		return nil, err
	}
	defer e.pool.Delete(context.WithoutCancel(ctx), build)
	progress := e.cfg.Progress
	if progress == nil {
		progress = template.Nop()
	}
	info, err := template.Build(ctx, spec, e.pool.Path(build), progress)
	if err != nil {
		return nil, err
	}
	if err := e.pool.Snapshot(ctx, build, final, true); err != nil {
		return nil, fmt.Errorf("publish template: %w", err)
	}
	t := &model.Template{Name: spec.Name, Volume: final, Source: info.Source, Bytes: info.Bytes, CreatedAt: time.Now().UTC()}
	if err := e.db.PutTemplate(ctx, t); err != nil {
		e.pool.Delete(ctx, final)
		return nil, err
	}
	return t, nil
}

// Templates lists the templates.
func (e *Engine) Templates(ctx context.Context) ([]*model.Template, error) {
	return e.db.Templates(ctx)
}

// RemoveTemplate deletes a template. Sandboxes made from it are unaffected (their roots
// are independent snapshots).
func (e *Engine) RemoveTemplate(ctx context.Context, name string) error {
	t, err := e.db.Template(ctx, name)
	if err != nil {
		return err
	}
	if err := e.db.DeleteTemplate(ctx, name); err != nil {
		return err
	}
	return e.pool.Delete(ctx, t.Volume)
}
