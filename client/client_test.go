package client

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// TestErrorClasses: problems map back to cairn's error classes, and so do responses
// that are not problems (a proxy's) and an unreachable daemon.
func TestErrorClasses(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/sandboxes/gone":
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(404)
			w.Write([]byte(`{"type":"urn:cairn:error:not_found","title":"Not Found","status":404,"code":"not_found","detail":"sandbox gone"}`))
		case "/v1/sandboxes/stopped/checkpoints":
			w.WriteHeader(412)
			w.Write([]byte(`{"type":"x","title":"x","status":412,"code":"failed_precondition","detail":"stopped"}`))
		default:
			w.WriteHeader(502)
			w.Write([]byte("bad gateway"))
		}
	}))
	defer srv.Close()
	c := New(srv.URL, "tok")
	ctx := context.Background()
	_, err := c.Get(ctx, "gone")
	var ae *Error
	if !errors.Is(err, errdefs.ErrNotFound) || !errors.As(err, &ae) || ae.Status != 404 || err.Error() != "sandbox gone" {
		t.Fatalf("404 problem: %v", err)
	}
	if _, err := c.Checkpoint(ctx, "stopped", CheckpointRequest{}); errdefs.Code(err) != "failed_precondition" || errdefs.ExitCode(err) != 5 {
		t.Fatalf("412 problem: %v", err)
	}
	if _, err := c.Templates(ctx); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("502 without a problem: %v", err)
	}
	down := New("unix:///nonexistent/cairnd.sock", "")
	if _, err := down.Health(ctx); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("no daemon: %v", err)
	}
	if _, err := New("ftp://x", "").Health(ctx); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad URL: %v", err)
	}
}
