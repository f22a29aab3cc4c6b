package api

import (
	"context"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
)

// run enforces TTLs and idle timeouts every tick until ctx ends, reconciling with the
// engine every reconcileEvery ticks.
func (ss *sessions) run(ctx context.Context, tick time.Duration) {
	const reconcileEvery = 30
	t := time.NewTicker(tick)
	defer t.Stop()
	for n := 1; ; n++ {
		select {
		case <-ctx.Done():
			ss.flush(context.WithoutCancel(ctx))
			return
		case <-t.C:
		}
		ss.flush(ctx)
		if n%reconcileEvery == 0 {
			if err := ss.reconcile(ctx); err != nil && ctx.Err() == nil {
				ss.log.Warn("reconcile sessions", "err", err)
			}
		}
		ss.enforce(ctx, time.Now().UTC())
	}
}

// flush persists last-activity times.
func (ss *sessions) flush(ctx context.Context) {
	last := map[string]time.Time{}
	ss.mu.Lock()
	for id, t := range ss.m {
		if t.touched {
			last[id], t.touched = t.rec.LastActivity, false
		}
	}
	ss.mu.Unlock()
	if err := ss.db.Touch(ctx, last); err != nil && ctx.Err() == nil {
		ss.log.Warn("record activity", "err", err)
	}
}

// enforce expires and idle-pauses what is due, one sandbox at a time.
func (ss *sessions) enforce(ctx context.Context, now time.Time) {
	type due struct {
		id      string
		expired bool
		policy  string
	}
	var todo []due
	ss.mu.Lock()
	for id, t := range ss.m {
		r := t.rec
		switch {
		case now.After(r.ExpiresAt) && r.PausedReason != pausedExpired:
			todo = append(todo, due{id: id, expired: true, policy: r.Policy})
		case r.PausedReason == "" && r.IdleTimeout > 0 && t.inflight == 0 && now.Sub(r.LastActivity) > r.IdleTimeout:
			todo = append(todo, due{id: id})
		}
	}
	ss.mu.Unlock()
	for _, d := range todo {
		if ctx.Err() != nil {
			return
		}
		switch {
		case d.expired && d.policy == client.ExpireDestroy:
			ss.expireDestroy(ctx, d.id)
		case d.expired:
			ss.pause(ctx, d.id, pausedExpired, true)
		default:
			ss.pause(ctx, d.id, pausedIdle, false)
		}
	}
}

func (ss *sessions) expireDestroy(ctx context.Context, id string) {
	ss.emit(client.EventExpired, id, "", "")
	start := time.Now()
	err := ss.eng.Remove(ctx, id)
	ss.metrics.observe("expire", start, err)
	if err != nil && ctx.Err() == nil {
		ss.log.Error("destroy expired sandbox", "sandbox", id, "err", err)
		return
	}
	ss.log.Info("destroyed expired sandbox", "sandbox", id)
	ss.emit(client.EventDestroyed, id, "", "expired")
	ss.forget(ctx, id)
}

// pause checkpoints a running sandbox and stops it; the checkpoint becomes its head, so
// engine.Resume restores exactly this state. Unless force, it gives up when an API
// call started meanwhile. A stopped sandbox is only marked.
func (ss *sessions) pause(ctx context.Context, id, reason string, force bool) {
	ss.mu.Lock()
	t := ss.m[id]
	ss.mu.Unlock()
	if t == nil {
		return
	}
	t.gate.Lock()
	defer t.gate.Unlock()
	ss.mu.Lock()
	if (t.inflight > 0 && !force) || t.rec.PausedReason != "" && reason != pausedExpired {
		ss.mu.Unlock()
		return
	}
	// From here callers that need the sandbox wait on the gate, then resume it.
	prev := t.rec.PausedReason
	t.rec.PausedReason = reason
	ss.mu.Unlock()
	ck, running, err := ss.checkpointAndStop(ctx, id, reason)
	if err == nil && !running && reason != pausedExpired {
		// Stopped by someone (`cairn stop`): not the daemon's to resume.
		ss.mu.Lock()
		t.rec.PausedReason = prev
		t.rec.LastActivity, t.touched = time.Now().UTC(), true
		ss.mu.Unlock()
		return
	}
	if err != nil {
		ss.mu.Lock()
		t.rec.PausedReason = prev
		// Retry after another idle period rather than every tick.
		t.rec.LastActivity, t.touched = time.Now().UTC(), true
		ss.mu.Unlock()
		if ctx.Err() == nil {
			ss.log.Warn("pause sandbox", "sandbox", id, "reason", reason, "err", err)
		}
		return
	}
	ss.setPaused(context.WithoutCancel(ctx), id, reason)
	if reason == pausedExpired {
		ss.emit(client.EventExpired, id, "", "")
	}
	ss.emit(client.EventPaused, id, ck, reason)
	ss.log.Info("paused sandbox", "sandbox", id, "reason", reason, "checkpoint", ck)
}

// checkpointAndStop returns the pause checkpoint, and false if the sandbox was not
// running (then it does nothing).
func (ss *sessions) checkpointAndStop(ctx context.Context, id, reason string) (string, bool, error) {
	sb, err := ss.eng.Get(ctx, id)
	if err != nil {
		return "", false, err
	}
	if sb.State != model.StateRunning {
		return "", false, nil
	}
	label := map[string]string{pausedIdle: "idle-pause", pausedExpired: "ttl-pause", pausedShutdown: "shutdown-pause"}[reason]
	start := time.Now()
	ck, err := ss.eng.Checkpoint(ctx, id, engine.CheckpointOptions{Label: label})
	ss.metrics.observe("pause_checkpoint", start, err)
	if err != nil {
		return "", true, err
	}
	ss.emit(client.EventCheckpointed, id, ck.ID, reason)
	start = time.Now()
	err = ss.eng.Stop(ctx, id)
	ss.metrics.observe("pause_stop", start, err)
	return ck.ID, true, err
}

// pauseAll pauses every running sandbox (cairnd --on-shutdown pause).
func (ss *sessions) pauseAll(ctx context.Context) {
	ss.mu.Lock()
	ids := make([]string, 0, len(ss.m))
	for id, t := range ss.m {
		if t.rec.PausedReason == "" {
			ids = append(ids, id)
		}
	}
	ss.mu.Unlock()
	for _, id := range ids {
		ss.pause(ctx, id, pausedShutdown, true)
	}
}
