package engine

import "context"

// DeleteCheckpointsForTest deletes checkpoints the way DeleteCheckpoint deletes its
// victims, without its refusal to delete one with children: it lets tests take a
// checkpoint out of the middle of a chain.
func (e *Engine) DeleteCheckpointsForTest(ctx context.Context, ids ...string) error {
	return e.deleteCheckpoints(ctx, ids)
}
