package engine

import (
	"context"
	"maps"
)

// AddLabels sets labels on a sandbox (keys given replace existing ones; an empty value
// is kept as such).
func (e *Engine) AddLabels(ctx context.Context, id string, labels map[string]string) error {
	if len(labels) == 0 {
		return nil
	}
	unlock, err := e.lock(ctx, id, true)
	if err != nil {
		return err
	}
	defer unlock()
	sb, err := e.db.Sandbox(ctx, id)
	if err != nil {
		return err
	}
	if sb.Labels == nil {
		sb.Labels = map[string]string{}
	}
	maps.Copy(sb.Labels, labels)
	return e.db.PutSandbox(ctx, sb)
}
