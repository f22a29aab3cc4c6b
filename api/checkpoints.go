package api

import (
	"context"
	"maps"
	"net/http"
	"time"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/template"
)

func (s *Server) checkpoint(w http.ResponseWriter, r *http.Request) error {
	var req client.CheckpointRequest
	if err := decode(w, r, &req, true); err != nil {
		return err
	}
	return s.sandboxCall(r, true, func(ctx context.Context, id string) error {
		var ck *model.Checkpoint
		err := s.op("checkpoint", func() (err error) {
			ck, err = s.eng.Checkpoint(ctx, id, engine.CheckpointOptions{Label: req.Label, Durable: req.Durable})
			return
		})
		if err != nil {
			return err
		}
		s.sessions.emit(client.EventCheckpointed, id, ck.ID, "api")
		return writeJSON(w, http.StatusCreated, ck)
	})
}

func (s *Server) rollback(w http.ResponseWriter, r *http.Request) error {
	var req client.RollbackRequest
	if err := decode(w, r, &req, false); err != nil {
		return err
	}
	if req.Checkpoint == "" {
		return errdefs.InvalidArgument("rollback needs \"checkpoint\": the ID of a checkpoint of the sandbox's lineage")
	}
	// A rollback restores processes itself: a paused sandbox needs no resume first.
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		if err := s.op("rollback", func() error { return s.eng.Rollback(ctx, id, req.Checkpoint) }); err != nil {
			return err
		}
		s.sessions.setPaused(context.WithoutCancel(ctx), id, "")
		s.sessions.emit(client.EventRolledBack, id, req.Checkpoint, "")
		v, err := s.sandboxView(ctx, id)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, v)
	})
}

func (s *Server) tree(w http.ResponseWriter, r *http.Request) error {
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error {
		sb, err := s.eng.Get(ctx, id)
		if err != nil {
			return err
		}
		cks, err := s.eng.Tree(ctx, id)
		if err != nil {
			return err
		}
		if cks == nil {
			cks = []*model.Checkpoint{}
		}
		return writeJSON(w, http.StatusOK, client.Tree{Sandbox: id, Head: sb.Head, Checkpoints: cks})
	})
}

func (s *Server) getCheckpoint(w http.ResponseWriter, r *http.Request) error {
	ck, err := s.eng.GetCheckpoint(r.Context(), r.PathValue("id"))
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, ck)
}

func (s *Server) deleteCheckpoint(w http.ResponseWriter, r *http.Request) error {
	cascade, err := boolQuery(r.URL.Query(), "cascade")
	if err != nil {
		return err
	}
	var removed []string
	err = s.op("delete_checkpoint", func() (err error) {
		removed, err = s.eng.DeleteCheckpoint(r.Context(), r.PathValue("id"), cascade)
		return
	})
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, client.Removed{Removed: removed})
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request) error {
	var req client.ForkRequest
	if err := decode(w, r, &req, true); err != nil {
		return err
	}
	if req.Count == 0 {
		req.Count = 1 // omitted: the documented default (an explicit 0 cannot be told apart)
	}
	ckID := r.PathValue("id")
	ck, err := s.eng.GetCheckpoint(r.Context(), ckID)
	if err != nil {
		return err
	}
	// Forks inherit the source's session and run unless told otherwise.
	if src, ok := s.sessions.snapshot(ck.SandboxID); ok {
		if req.SessionID == "" {
			req.SessionID = src.SessionID
		}
		if req.RunID == "" {
			req.RunID = src.RunID
		}
	}
	rec, err := s.sessions.lifetime(req.Lifetime, time.Now().UTC())
	if err != nil {
		return err
	}
	var sbs []*model.Sandbox
	if err := s.op("fork", func() (err error) { sbs, err = s.eng.Fork(r.Context(), ckID, req.Count); return }); err != nil {
		return err
	}
	out := client.SandboxList{Sandboxes: make([]*client.Sandbox, 0, len(sbs))}
	ctx := context.WithoutCancel(r.Context())
	for _, sb := range sbs {
		if len(req.Labels) > 0 {
			if err := s.eng.AddLabels(ctx, sb.ID, req.Labels); err != nil {
				return err
			}
			if sb.Labels == nil {
				sb.Labels = map[string]string{}
			}
			maps.Copy(sb.Labels, req.Labels)
		}
		if err := s.sessions.register(ctx, sb, rec); err != nil {
			return err
		}
		s.sessions.emit(client.EventForked, sb.ID, ckID, "")
		v, err := s.sessions.view(ctx, sb)
		if err != nil {
			return err
		}
		out.Sandboxes = append(out.Sandboxes, v)
	}
	return writeJSON(w, http.StatusCreated, out)
}

// prewarm prepares standbys of a checkpoint and answers once they are ready, with the
// checkpoint's ready count then (which may be lower than asked: the cache's bounds
// evict oldest first, and backends without standbys, like gvisor, prepare none).
func (s *Server) prewarm(w http.ResponseWriter, r *http.Request) error {
	var req client.PrewarmRequest
	if err := decode(w, r, &req, true); err != nil {
		return err
	}
	count := 1 // absent: the documented default
	if req.Count != nil {
		count = *req.Count
	}
	ckID := r.PathValue("id")
	if err := s.op("prewarm", func() error { return s.eng.Prewarm(r.Context(), ckID, count) }); err != nil {
		return err
	}
	n, err := s.eng.StandbyCount(r.Context(), ckID)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, client.Standbys{Checkpoint: ckID, Standbys: n})
}

func (s *Server) standbys(w http.ResponseWriter, r *http.Request) error {
	ckID := r.PathValue("id")
	n, err := s.eng.StandbyCount(r.Context(), ckID)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, client.Standbys{Checkpoint: ckID, Standbys: n})
}

func (s *Server) diff(w http.ResponseWriter, r *http.Request) error {
	var changes []model.Change
	err := s.op("diff", func() (err error) {
		changes, err = s.eng.Diff(r.Context(), r.PathValue("id"), r.PathValue("to"))
		return
	})
	if err != nil {
		return err
	}
	if changes == nil {
		changes = []model.Change{}
	}
	return writeJSON(w, http.StatusOK, client.ChangeList{Changes: changes})
}

func (s *Server) listTemplates(w http.ResponseWriter, r *http.Request) error {
	ts, err := s.eng.Templates(r.Context())
	if err != nil {
		return err
	}
	if ts == nil {
		ts = []*model.Template{}
	}
	return writeJSON(w, http.StatusOK, client.TemplateList{Templates: ts})
}

func (s *Server) buildTemplate(w http.ResponseWriter, r *http.Request) error {
	var req client.TemplateRequest
	if err := decode(w, r, &req, false); err != nil {
		return err
	}
	spec := template.Spec{Name: req.Name, Dir: req.Dir, OCI: req.OCI}
	if d := req.Debian; d != nil {
		spec.Debian = &template.DebianSource{Suite: d.Suite, Variant: d.Variant, Packages: d.Packages, Mirror: d.Mirror}
	}
	var t *model.Template
	if err := s.op("build_template", func() (err error) { t, err = s.eng.BuildTemplate(r.Context(), spec); return }); err != nil {
		return err
	}
	return writeJSON(w, http.StatusCreated, t)
}

func (s *Server) removeTemplate(w http.ResponseWriter, r *http.Request) error {
	if err := s.eng.RemoveTemplate(r.Context(), r.PathValue("name")); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) gc(w http.ResponseWriter, r *http.Request) error {
	var rep *model.GCReport
	if err := s.op("gc", func() (err error) { rep, err = s.eng.GC(r.Context()); return }); err != nil {
		return err
	}
	if rep.Checkpoints == nil {
		rep.Checkpoints = []string{}
	}
	if rep.Volumes == nil {
		rep.Volumes = []string{}
	}
	return writeJSON(w, http.StatusOK, rep)
}
