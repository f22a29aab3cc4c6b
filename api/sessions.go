package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"sync"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/store"
)

// Pause reasons (store.Session.PausedReason).
const (
	pausedIdle     = "idle"
	pausedExpired  = "expired"
	pausedShutdown = "shutdown"
)

// sessions keeps every sandbox's lifetime: its TTL and expiry policy, its idle timer,
// and whether the daemon paused it. A paused sandbox was checkpointed (label
// "idle-pause", "ttl-pause" or "shutdown-pause") and stopped; a call that needs its
// processes resumes it from that checkpoint, unless it expired (then only an explicit
// resume does, with a new TTL).
//
// Lifecycle of an entry: created by register (create, fork) or adopt (a sandbox made
// by another cairn process on the same data directory, or found at start), removed by
// forget (remove, expiry) or by reconcile when the sandbox is gone.
type sessions struct {
	eng     *engine.Engine
	db      *store.Sessions
	broker  *broker
	metrics *metrics
	log     *slog.Logger
	defTTL  time.Duration
	maxTTL  time.Duration
	idle    time.Duration

	mu sync.Mutex
	m  map[string]*tracked // protected by mu
}

type tracked struct {
	// gate is held while the daemon pauses or resumes the sandbox; callers that find it
	// paused wait on it.
	gate sync.Mutex

	// Protected by sessions.mu:
	rec      store.Session
	labels   map[string]string
	inflight int  // API calls in progress on the sandbox (open streams included)
	touched  bool // rec.LastActivity not yet persisted
}

func newID(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// lifetime checks a requested lifetime and fills in the defaults.
func (ss *sessions) lifetime(lt client.Lifetime, now time.Time) (store.Session, error) {
	rec := store.Session{SessionID: lt.SessionID, RunID: lt.RunID, Policy: lt.ExpiryPolicy, LastActivity: now}
	if len(lt.SessionID) > 128 || len(lt.RunID) > 128 {
		return rec, errdefs.InvalidArgument("session_id and run_id are at most 128 bytes")
	}
	if rec.SessionID == "" {
		rec.SessionID = "s-" + newID(8)
	}
	switch rec.Policy {
	case "":
		rec.Policy = client.ExpireDestroy
	case client.ExpireDestroy, client.ExpirePause:
	default:
		return rec, errdefs.InvalidArgument("expiry_policy %q: give destroy or pause", lt.ExpiryPolicy)
	}
	ttl := time.Duration(lt.TTLSeconds) * time.Second
	switch {
	case lt.TTLSeconds < 0:
		return rec, errdefs.InvalidArgument("ttl_seconds %d: give a positive number", lt.TTLSeconds)
	case ttl == 0:
		ttl = ss.defTTL
	case ttl > ss.maxTTL:
		return rec, errdefs.InvalidArgument("ttl_seconds %d is over this daemon's maximum of %d (cairnd --max-ttl)", lt.TTLSeconds, int64(ss.maxTTL/time.Second))
	}
	rec.ExpiresAt = now.Add(ttl)
	idle, err := ss.idleTimeout(lt.IdleTimeoutSeconds)
	rec.IdleTimeout = idle
	return rec, err
}

func (ss *sessions) idleTimeout(secs int64) (time.Duration, error) {
	switch {
	case secs < -1:
		return 0, errdefs.InvalidArgument("idle_timeout_seconds %d: give seconds, 0 for the default or -1 for never", secs)
	case secs == -1:
		return 0, nil
	case secs == 0:
		return ss.idle, nil
	}
	return time.Duration(secs) * time.Second, nil
}

// register records the session of a new sandbox.
func (ss *sessions) register(ctx context.Context, sb *model.Sandbox, rec store.Session) error {
	rec.SandboxID = sb.ID
	if err := ss.db.Put(ctx, &rec); err != nil {
		return err
	}
	ss.mu.Lock()
	ss.m[sb.ID] = &tracked{rec: rec, labels: sb.Labels}
	ss.mu.Unlock()
	return nil
}

// entry returns the entry of a sandbox, adopting it if the engine knows it and the
// daemon does not yet (nil, nil if the sandbox does not exist).
func (ss *sessions) entry(ctx context.Context, id string) (*tracked, error) {
	ss.mu.Lock()
	t := ss.m[id]
	ss.mu.Unlock()
	if t != nil {
		return t, nil
	}
	sb, err := ss.eng.Get(ctx, id)
	if err != nil {
		if errdefs.Code(err) == "not_found" {
			return nil, nil
		}
		return nil, err
	}
	return ss.adopt(ctx, sb)
}

// adopt gives a sandbox the daemon did not create the default lifetime from now.
func (ss *sessions) adopt(ctx context.Context, sb *model.Sandbox) (*tracked, error) {
	rec, _ := ss.lifetime(client.Lifetime{}, time.Now().UTC())
	rec.SandboxID = sb.ID
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if t := ss.m[sb.ID]; t != nil {
		return t, nil
	}
	if err := ss.db.Put(ctx, &rec); err != nil {
		return nil, err
	}
	t := &tracked{rec: rec, labels: sb.Labels}
	ss.m[sb.ID] = t
	ss.log.Info("adopted sandbox", "sandbox", sb.ID, "session", rec.SessionID, "expires_at", rec.ExpiresAt)
	return t, nil
}

// load reads the persisted sessions and reconciles them with the engine's sandboxes.
func (ss *sessions) load(ctx context.Context) error {
	recs, err := ss.db.All(ctx)
	if err != nil {
		return err
	}
	ss.mu.Lock()
	for _, r := range recs {
		ss.m[r.SandboxID] = &tracked{rec: *r}
	}
	ss.mu.Unlock()
	return ss.reconcile(ctx)
}

// reconcile adopts sandboxes without a session and forgets sessions without a sandbox.
func (ss *sessions) reconcile(ctx context.Context) error {
	sbs, err := ss.eng.List(ctx)
	if err != nil {
		return err
	}
	live := map[string]bool{}
	for _, sb := range sbs {
		live[sb.ID] = true
		ss.mu.Lock()
		t := ss.m[sb.ID]
		if t != nil {
			t.labels = sb.Labels
		}
		ss.mu.Unlock()
		if t == nil {
			if _, err := ss.adopt(ctx, sb); err != nil {
				return err
			}
		}
	}
	ss.mu.Lock()
	var gone []string
	for id, t := range ss.m {
		if !live[id] && t.inflight == 0 {
			gone = append(gone, id)
		}
	}
	ss.mu.Unlock()
	for _, id := range gone {
		// A sandbox created in this instant is in the engine before it is registered;
		// it is only forgotten if the engine still does not know it.
		if _, err := ss.eng.Get(ctx, id); errdefs.Code(err) == "not_found" {
			ss.forget(ctx, id)
		}
	}
	return nil
}

// forget drops a sandbox's session.
func (ss *sessions) forget(ctx context.Context, id string) {
	ss.mu.Lock()
	delete(ss.m, id)
	ss.mu.Unlock()
	if err := ss.db.Delete(ctx, id); err != nil {
		ss.log.Warn("delete session", "sandbox", id, "err", err)
	}
}

// acquire marks the start of an API call on sandbox id and returns its release. With
// needRunning, a sandbox the daemon paused for idleness (or at shutdown) is resumed
// first; an expired one is refused.
func (ss *sessions) acquire(ctx context.Context, id string, needRunning bool) (func(), error) {
	t, err := ss.entry(ctx, id)
	if err != nil || t == nil {
		return func() {}, err // the engine call reports the unknown ID
	}
	ss.mu.Lock()
	t.inflight++
	t.rec.LastActivity, t.touched = time.Now().UTC(), true
	paused := t.rec.PausedReason
	ss.mu.Unlock()
	release := func() {
		ss.mu.Lock()
		t.inflight--
		t.rec.LastActivity, t.touched = time.Now().UTC(), true
		ss.mu.Unlock()
	}
	if !needRunning || paused == "" {
		return release, nil
	}
	if err := ss.resumePaused(ctx, id, t, false); err != nil {
		release()
		return nil, err
	}
	return release, nil
}

// resumePaused resumes a sandbox the daemon paused. Only an explicit resume resumes an
// expired one, and gives it a new TTL.
func (ss *sessions) resumePaused(ctx context.Context, id string, t *tracked, explicit bool) error {
	t.gate.Lock()
	defer t.gate.Unlock()
	ss.mu.Lock()
	reason := t.rec.PausedReason
	ss.mu.Unlock()
	if reason == "" {
		return nil // someone else resumed it meanwhile
	}
	if reason == pausedExpired && !explicit {
		return errdefs.FailedPrecondition("sandbox %s expired and was paused; resume it explicitly (POST /v1/sandboxes/%s/resume, `cairn resume %s`) to give it a new TTL", id, id, id)
	}
	start := time.Now()
	_, err := ss.eng.Resume(ctx, id)
	ss.metrics.observe("resume", start, err)
	if err != nil {
		return err
	}
	ss.mu.Lock()
	t.rec.PausedReason = ""
	if reason == pausedExpired {
		t.rec.ExpiresAt = time.Now().UTC().Add(ss.defTTL)
	}
	rec := t.rec
	ss.mu.Unlock()
	if err := ss.db.Put(context.WithoutCancel(ctx), &rec); err != nil {
		return err
	}
	why := "activity"
	if explicit {
		why = "api"
	}
	ss.emit(client.EventResumed, id, "", why)
	return nil
}

// setPaused records (or clears, with "") why the daemon paused a sandbox.
func (ss *sessions) setPaused(ctx context.Context, id, reason string) {
	ss.mu.Lock()
	t := ss.m[id]
	if t == nil {
		ss.mu.Unlock()
		return
	}
	t.rec.PausedReason = reason
	rec := t.rec
	ss.mu.Unlock()
	if err := ss.db.Put(ctx, &rec); err != nil {
		ss.log.Warn("record session", "sandbox", id, "err", err)
	}
}

// snapshot returns a copy of a sandbox's session record.
func (ss *sessions) snapshot(id string) (store.Session, bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	t := ss.m[id]
	if t == nil {
		return store.Session{}, false
	}
	return t.rec, true
}

// view is the API's record of a sandbox.
func (ss *sessions) view(ctx context.Context, sb *model.Sandbox) (*client.Sandbox, error) {
	rec, ok := ss.snapshot(sb.ID)
	if !ok {
		t, err := ss.adopt(ctx, sb)
		if err != nil {
			return nil, err
		}
		ss.mu.Lock()
		rec = t.rec
		ss.mu.Unlock()
	}
	v := &client.Sandbox{Sandbox: *sb, SessionID: rec.SessionID, RunID: rec.RunID, ExpiresAt: rec.ExpiresAt,
		ExpiryPolicy: rec.Policy, IdleTimeoutSeconds: int64(rec.IdleTimeout / time.Second),
		LastActivityAt: rec.LastActivity}
	if rec.PausedReason != "" && sb.State == model.StateStopped {
		v.State, v.PausedReason = client.StatePaused, rec.PausedReason
	}
	return v, nil
}

// update applies PATCH /v1/sandboxes/{id}.
func (ss *sessions) update(ctx context.Context, id string, req client.UpdateRequest) error {
	t, err := ss.entry(ctx, id)
	if err != nil {
		return err
	}
	if t == nil {
		return errdefs.NotFound("sandbox %q not found", id)
	}
	var idle time.Duration
	if req.IdleTimeoutSeconds != nil {
		if idle, err = ss.idleTimeout(*req.IdleTimeoutSeconds); err != nil {
			return err
		}
	}
	if p := req.ExpiryPolicy; p != nil && *p != client.ExpireDestroy && *p != client.ExpirePause {
		return errdefs.InvalidArgument("expiry_policy %q: give destroy or pause", *p)
	}
	if s := req.TTLSeconds; s != nil && (*s <= 0 || time.Duration(*s)*time.Second > ss.maxTTL) {
		return errdefs.InvalidArgument("ttl_seconds %d: give 1 to %d (cairnd --max-ttl)", *s, int64(ss.maxTTL/time.Second))
	}
	ss.mu.Lock()
	if req.TTLSeconds != nil {
		t.rec.ExpiresAt = time.Now().UTC().Add(time.Duration(*req.TTLSeconds) * time.Second)
	}
	if req.ExpiryPolicy != nil {
		t.rec.Policy = *req.ExpiryPolicy
	}
	if req.IdleTimeoutSeconds != nil {
		t.rec.IdleTimeout = idle
	}
	rec := t.rec
	ss.mu.Unlock()
	return ss.db.Put(ctx, &rec)
}

// emit publishes an event about a sandbox, with its session and labels.
func (ss *sessions) emit(typ, id, checkpoint, reason string) {
	ev := client.Event{Type: typ, SandboxID: id, Checkpoint: checkpoint, Reason: reason}
	ss.mu.Lock()
	if t := ss.m[id]; t != nil {
		ev.SessionID, ev.RunID, ev.Labels = t.rec.SessionID, t.rec.RunID, t.labels
	}
	ss.mu.Unlock()
	ss.broker.publish(ev)
}

func (ss *sessions) count() int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return len(ss.m)
}
