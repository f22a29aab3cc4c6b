package api

import (
	"context"
	"net/http"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	labels, err := labelQuery(q["label"])
	if err != nil {
		return err
	}
	session, run, state := q.Get("session"), q.Get("run"), q.Get("state")
	switch state {
	case "", client.StateRunning, client.StateStopped, client.StatePaused:
	default:
		return errdefs.InvalidArgument("state %q: give running, stopped or paused", state)
	}
	var sbs []*model.Sandbox
	if err := s.op("list", func() (err error) { sbs, err = s.eng.List(r.Context()); return }); err != nil {
		return err
	}
	out := client.SandboxList{Sandboxes: []*client.Sandbox{}}
	for _, sb := range sbs {
		v, err := s.sessions.view(r.Context(), sb)
		if err != nil {
			return err
		}
		if hasLabels(v.Labels, labels) && (session == "" || v.SessionID == session) &&
			(run == "" || v.RunID == run) && (state == "" || v.State == state) {
			out.Sandboxes = append(out.Sandboxes, v)
		}
	}
	return writeJSON(w, http.StatusOK, out)
}

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) error {
	var req client.CreateRequest
	if err := decode(w, r, &req, true); err != nil {
		return err
	}
	rec, err := s.sessions.lifetime(req.Lifetime, time.Now().UTC())
	if err != nil {
		return err
	}
	var sb *model.Sandbox
	err = s.op("create", func() (err error) {
		sb, err = s.eng.Create(r.Context(), model.CreateOptions{Template: req.Template, Isolation: req.Isolation,
			Labels: req.Labels, Limits: req.Limits})
		return
	})
	if err != nil {
		return err
	}
	if err := s.sessions.register(context.WithoutCancel(r.Context()), sb, rec); err != nil {
		return err
	}
	s.sessions.emit(client.EventCreated, sb.ID, "", "")
	v, err := s.sessions.view(r.Context(), sb)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusCreated, v)
}

// sandboxView reads a sandbox and its session.
func (s *Server) sandboxView(ctx context.Context, id string) (*client.Sandbox, error) {
	sb, err := s.eng.Inspect(ctx, id)
	if err != nil {
		return nil, err
	}
	return s.sessions.view(ctx, sb)
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) error {
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		v, err := s.sandboxView(ctx, id)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, v)
	})
}

func (s *Server) updateSandbox(w http.ResponseWriter, r *http.Request) error {
	var req client.UpdateRequest
	if err := decode(w, r, &req, false); err != nil {
		return err
	}
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		if _, err := s.eng.Get(ctx, id); err != nil {
			return err
		}
		if err := s.sessions.update(ctx, id, req); err != nil {
			return err
		}
		v, err := s.sandboxView(ctx, id)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, v)
	})
}

func (s *Server) removeSandbox(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if err := s.op("remove", func() error { return s.eng.Remove(r.Context(), id) }); err != nil {
		return err
	}
	s.sessions.emit(client.EventDestroyed, id, "", "api")
	s.sessions.forget(context.WithoutCancel(r.Context()), id)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) stopSandbox(w http.ResponseWriter, r *http.Request) error {
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		if err := s.op("stop", func() error { return s.eng.Stop(ctx, id) }); err != nil {
			return err
		}
		// An explicit stop is the user's: the daemon no longer resumes it by itself.
		s.sessions.setPaused(context.WithoutCancel(ctx), id, "")
		s.sessions.emit(client.EventStopped, id, "", "api")
		v, err := s.sandboxView(ctx, id)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, v)
	})
}

func (s *Server) resumeSandbox(w http.ResponseWriter, r *http.Request) error {
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		t, err := s.sessions.entry(ctx, id)
		if err != nil {
			return err
		}
		if rec, ok := s.sessions.snapshot(id); ok && rec.PausedReason != "" {
			err = s.sessions.resumePaused(ctx, id, t, true)
		} else {
			var before *model.Sandbox
			if before, err = s.eng.Get(ctx, id); err == nil && before.State != model.StateRunning {
				err = s.op("resume", func() error { _, err := s.eng.Resume(ctx, id); return err })
				if err == nil {
					s.sessions.emit(client.EventResumed, id, "", "api")
				}
			}
		}
		if err != nil {
			return err
		}
		v, err := s.sandboxView(ctx, id)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, v)
	})
}
