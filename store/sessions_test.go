package store

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// TestSessionsSchemaIsFrozen guards the sessions table the daemon keeps.
func TestSessionsSchemaIsFrozen(t *testing.T) {
	s, err := OpenSessions(filepath.Join(t.TempDir(), "cairn.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var q string
	if err := s.db.QueryRow(`SELECT sql FROM sqlite_master WHERE type='table' AND name='sessions'`).Scan(&q); err != nil {
		t.Fatal(err)
	}
	want := "CREATE TABLE sessions( sandbox_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, run_id TEXT NOT NULL DEFAULT '', expires_at TEXT NOT NULL, policy TEXT NOT NULL, idle_timeout_s INTEGER NOT NULL DEFAULT 0, last_activity TEXT NOT NULL, paused_reason TEXT NOT NULL DEFAULT '')"
	if got := strings.Join(strings.Fields(q), " "); got != want {
		t.Fatalf("sessions schema changed:\n got %s\nwant %s", got, want)
	}
}

func TestSessionsRoundTrip(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "cairn.db")
	// The engine's store and the sessions table share the file.
	st, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	s, err := OpenSessions(path)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC().Truncate(time.Microsecond)
	x := &Session{SandboxID: "sb1", SessionID: "s1", RunID: "r1", ExpiresAt: now.Add(time.Hour), Policy: "pause",
		IdleTimeout: 5 * time.Minute, LastActivity: now, PausedReason: "idle"}
	if err := s.Put(ctx, x); err != nil {
		t.Fatal(err)
	}
	later := now.Add(time.Minute)
	if err := s.Touch(ctx, map[string]time.Time{"sb1": later, "gone": later}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if s, err = OpenSessions(path); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	all, err := s.All(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := *x
	want.LastActivity = later
	if len(all) != 1 {
		t.Fatalf("got %d sessions", len(all))
	}
	if d := cmp.Diff(want, *all[0]); d != "" {
		t.Fatalf("round trip (-want +got):\n%s", d)
	}
	if err := s.Delete(ctx, "sb1"); err != nil {
		t.Fatal(err)
	}
	if all, _ := s.All(ctx); len(all) != 0 {
		t.Fatalf("after delete: %d sessions", len(all))
	}
}
