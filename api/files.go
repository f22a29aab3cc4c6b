package api

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"strconv"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// pathQuery is the required ?path= of the file routes.
func pathQuery(r *http.Request) (string, error) {
	p := r.URL.Query().Get("path")
	if p == "" {
		return "", errdefs.InvalidArgument("query parameter path is required (a path inside the sandbox, e.g. ?path=/etc/hostname)")
	}
	return p, nil
}

// fileCall runs f on sandbox {id} and ?path=. Files work on stopped sandboxes too.
func (s *Server) fileCall(r *http.Request, f func(ctx context.Context, id, p string) error) error {
	p, err := pathQuery(r)
	if err != nil {
		return err
	}
	return s.sandboxCall(r, false, func(ctx context.Context, id string) error { return f(ctx, id, p) })
}

func (s *Server) readFile(w http.ResponseWriter, r *http.Request) error {
	return s.fileCall(r, func(ctx context.Context, id, p string) error {
		b, err := s.eng.ReadFile(ctx, id, p)
		if err != nil {
			return err
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		_, err = w.Write(b)
		return err
	})
}

func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) error {
	mode := uint64(0o644)
	if m := r.URL.Query().Get("mode"); m != "" {
		var err error
		if mode, err = strconv.ParseUint(m, 8, 32); err != nil || mode > 0o7777 {
			return errdefs.InvalidArgument("mode=%q: give octal permissions like 0644", m)
		}
	}
	return s.fileCall(r, func(ctx context.Context, id, p string) error {
		data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxUploadBody))
		var big *http.MaxBytesError
		if errors.As(err, &big) {
			return withStatus(http.StatusRequestEntityTooLarge, errdefs.ResourceExhausted("file is larger than %d bytes", big.Limit))
		}
		if err != nil {
			return errdefs.InvalidArgument("reading the request body: %v", err)
		}
		if err := s.op("write_file", func() error { return s.eng.WriteFile(ctx, id, p, data, fs.FileMode(mode)) }); err != nil {
			return err
		}
		fi, err := s.eng.Stat(ctx, id, p)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, fi)
	})
}

func (s *Server) statPath(w http.ResponseWriter, r *http.Request) error {
	return s.fileCall(r, func(ctx context.Context, id, p string) error {
		fi, err := s.eng.Stat(ctx, id, p)
		if err != nil {
			return err
		}
		return writeJSON(w, http.StatusOK, fi)
	})
}

func (s *Server) listDir(w http.ResponseWriter, r *http.Request) error {
	return s.fileCall(r, func(ctx context.Context, id, p string) error {
		l, err := s.eng.ListDir(ctx, id, p)
		if err != nil {
			return err
		}
		if l == nil {
			l = []*model.FileInfo{}
		}
		return writeJSON(w, http.StatusOK, client.FileList{Entries: l})
	})
}

func (s *Server) removePath(w http.ResponseWriter, r *http.Request) error {
	return s.fileCall(r, func(ctx context.Context, id, p string) error {
		if err := s.eng.RemovePath(ctx, id, p); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}
