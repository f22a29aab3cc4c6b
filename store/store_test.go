package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/isolation"
)

// TestSchemaIsFrozen guards the persistent format: a change to the schema must bump
// SchemaVersion (with a migration) and update the package documentation and this test.
func TestSchemaIsFrozen(t *testing.T) {
	s, err := Open(filepath.Join(t.TempDir(), "cairn.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rows, err := s.db.Query(`SELECT name, sql FROM sqlite_master WHERE type='table' AND name IN ('meta', 'templates', 'sandboxes', 'checkpoints') ORDER BY name`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]string{}
	for rows.Next() {
		var name string
		var q sql.NullString
		rows.Scan(&name, &q)
		got[name] = strings.Join(strings.Fields(q.String), " ")
	}
	want := map[string]string{
		"meta":        "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
		"templates":   "CREATE TABLE templates( name TEXT PRIMARY KEY, volume TEXT NOT NULL, source TEXT NOT NULL DEFAULT '', bytes INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL)",
		"sandboxes":   "CREATE TABLE sandboxes( id TEXT PRIMARY KEY, template TEXT NOT NULL, isolation TEXT NOT NULL, hostname TEXT NOT NULL, root TEXT NOT NULL, head TEXT NOT NULL DEFAULT '', origin TEXT NOT NULL DEFAULT '', labels TEXT NOT NULL DEFAULT '{}', limits TEXT NOT NULL DEFAULT '{}', init_pid INTEGER NOT NULL DEFAULT 0, init_start INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL, created_at TEXT NOT NULL)",
		"checkpoints": "CREATE TABLE checkpoints( id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, parent TEXT NOT NULL DEFAULT '', label TEXT NOT NULL DEFAULT '', created_at TEXT NOT NULL, fs_volume TEXT NOT NULL, images TEXT NOT NULL, image_bytes INTEGER NOT NULL DEFAULT 0, duration_ms REAL NOT NULL DEFAULT 0, method TEXT NOT NULL DEFAULT '', phases TEXT NOT NULL DEFAULT '{}', isolation TEXT NOT NULL DEFAULT '')",
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("schema changed without a version bump (-want +got):\n%s", d)
	}
}

func TestRoundTripAndErrors(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "cairn.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC().Truncate(time.Microsecond)
	sb := &model.Sandbox{ID: "sb1", Template: "debian", Isolation: "container", State: model.StateRunning,
		Hostname: "sb1", Root: "roots/sb1-x", Labels: map[string]string{"run": "r1"},
		Limits: isolation.Limits{MemoryBytes: 1 << 30}, CreatedAt: now, Init: isolation.Proc{Pid: 42, StartTime: 7}}
	if err := s.PutSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	c1 := &model.Checkpoint{ID: "c1", SandboxID: "sb1", Label: "first", CreatedAt: now, FSVolume: "checkpoints/c1/fs",
		Images: "images/c1", ImageBytes: 10, DurationMS: 1.5, Method: "criu-full", PhasesMS: map[string]float64{"dump": 1},
		Isolation: "container"}
	sb.Head = "c1"
	if err := s.AddCheckpoint(ctx, c1, sb); err != nil {
		t.Fatal(err)
	}
	c2 := &model.Checkpoint{ID: "c2", SandboxID: "sb1", Parent: "c1", CreatedAt: now, FSVolume: "f", Images: "i"}
	sb.Head = "c2"
	if err := s.AddCheckpoint(ctx, c2, sb); err != nil {
		t.Fatal(err)
	}
	s.Close()
	// Reopened (as after a restart), everything is there.
	s, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.Sandbox(ctx, "sb1")
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(sb, got); d != "" {
		t.Fatalf("sandbox (-want +got):\n%s", d)
	}
	gc1, _ := s.Checkpoint(ctx, "c1")
	if d := cmp.Diff(c1, gc1); d != "" {
		t.Fatalf("checkpoint (-want +got):\n%s", d)
	}
	// Deleting c1 re-parents c2 onto c1's parent; deleting the head moves the head up.
	if err := s.DeleteCheckpoints(ctx, []string{"c1"}); err != nil {
		t.Fatal(err)
	}
	gc2, _ := s.Checkpoint(ctx, "c2")
	if gc2.Parent != "" {
		t.Fatalf("c2's parent after deleting c1: %q", gc2.Parent)
	}
	if err := s.DeleteCheckpoints(ctx, []string{"c2"}); err != nil {
		t.Fatal(err)
	}
	got, _ = s.Sandbox(ctx, "sb1")
	if got.Head != "" {
		t.Fatalf("head after deleting it: %q", got.Head)
	}
	for _, err := range []error{
		func() error { _, err := s.Sandbox(ctx, "nope"); return err }(),
		func() error { _, err := s.Checkpoint(ctx, "nope"); return err }(),
		func() error { _, err := s.Template(ctx, "nope"); return err }(),
	} {
		if errdefs.Code(err) != "not_found" || !strings.Contains(err.Error(), "not found") {
			t.Errorf("missing record: %v", err)
		}
	}
}

// TestMigrateFromV1 opens a database written by schema 1 and finds its checkpoints.
func TestMigrateFromV1(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cairn.db")
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	v1 := `CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES('schema_version', '1');
CREATE TABLE checkpoints( id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, parent TEXT NOT NULL DEFAULT '',
	label TEXT NOT NULL DEFAULT '', created_at TEXT NOT NULL, fs_volume TEXT NOT NULL,
	images TEXT NOT NULL, image_bytes INTEGER NOT NULL DEFAULT 0,
	duration_ms REAL NOT NULL DEFAULT 0, method TEXT NOT NULL DEFAULT '', phases TEXT NOT NULL DEFAULT '{}');
INSERT INTO checkpoints(id, sandbox_id, created_at, fs_volume, images) VALUES('old', 'sb', '2026-01-01T00:00:00Z', 'f', 'i');`
	if _, err := db.Exec(v1); err != nil {
		t.Fatal(err)
	}
	db.Close()
	s, err := Open(path)
	if err != nil {
		t.Fatalf("open a schema-1 database: %v", err)
	}
	defer s.Close()
	c, err := s.Checkpoint(context.Background(), "old")
	if err != nil || c.Isolation != "" {
		t.Fatalf("migrated checkpoint: %+v %v", c, err)
	}
	var v string
	s.db.QueryRow(`SELECT value FROM meta WHERE key='schema_version'`).Scan(&v)
	if v != SchemaVersion {
		t.Fatalf("schema version after migration: %s", v)
	}
}

// TestSetCheckpointImages: a compaction rewrites a checkpoint's method and bytes, and
// leaves a deleted checkpoint deleted.
func TestSetCheckpointImages(t *testing.T) {
	ctx := context.Background()
	s, err := Open(filepath.Join(t.TempDir(), "cairn.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c := &model.Checkpoint{ID: "c1", SandboxID: "sb1", CreatedAt: time.Now().UTC(), FSVolume: "f", Images: "images/c1",
		ImageBytes: 1000, Method: "criu-full"}
	if err := s.AddCheckpoint(ctx, c, nil); err != nil {
		t.Fatal(err)
	}
	if err := s.SetCheckpointImages(ctx, "c1", "criu-incremental", 10); err != nil {
		t.Fatal(err)
	}
	got, err := s.Checkpoint(ctx, "c1")
	if err != nil {
		t.Fatal(err)
	}
	if got.Method != "criu-incremental" || got.ImageBytes != 10 {
		t.Fatalf("after SetCheckpointImages: method %s, %d bytes", got.Method, got.ImageBytes)
	}
	if err := s.SetCheckpointImages(ctx, "gone", "criu-incremental", 10); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Checkpoint(ctx, "gone"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("SetCheckpointImages created a row: %v", err)
	}
}

// TestSync checkpoints the write-ahead log into the database file: a committed row is
// in cairn.db itself afterwards (what a crash of the machine cannot take).
func TestSync(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "cairn.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	before, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	c := &model.Checkpoint{ID: "c1", SandboxID: "sb1", CreatedAt: time.Now().UTC(), FSVolume: "f", Images: "images/c1",
		Label: strings.Repeat("l", 200), Method: "criu-full"}
	for i := 0; i < 50; i++ {
		c.ID = fmt.Sprintf("c%d", i)
		if err := s.AddCheckpoint(ctx, c, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if after.Size() <= before.Size() {
		t.Fatalf("cairn.db is %d bytes after Sync, %d before 50 rows: the log was not checkpointed into it", after.Size(), before.Size())
	}
}
