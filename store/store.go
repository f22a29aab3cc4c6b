// Package store keeps cairn's metadata in an embedded SQLite database (pure Go,
// modernc.org/sqlite), one file in the data directory: cairn.db.
//
// Schema (version 1):
//
//	meta(key PRIMARY KEY, value)            "schema_version" = "2"
//	templates(name PK, volume, source, bytes, created_at)
//	sandboxes(id PK, template, isolation, hostname, root, head, origin, labels JSON,
//	          limits JSON, init_pid, init_start, state, created_at)
//	checkpoints(id PK, sandbox_id, parent, label, created_at, fs_volume, images,
//	          image_bytes, duration_ms, method, phases JSON, isolation)
//
// The standbys table (standby.go) is a cache of restored-but-frozen copies; it is not
// part of the versioned schema and may be dropped at any time.
//
// A checkpoint's method and image_bytes change once after it is written, when its images
// are compacted against its parent's ("criu-full" becomes "criu-incremental", or
// "criu-shared" on the image pool; image_bytes then counts only what the images hold on
// their own), and again if a parent's removal rebases incremental ones.
//
// Times are RFC 3339 with nanoseconds, UTC. A checkpoint row is written only after its
// filesystem and images are published under their final names, so every row refers to
// complete state; files without a row are leftovers that recovery deletes. The database
// runs in WAL mode with a busy timeout, so several cairn processes may share it.
package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	_ "modernc.org/sqlite"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// SchemaVersion is the version of the schema this package writes.
const SchemaVersion = "2"

// migrations bring an older schema to SchemaVersion, one version at a time.
var migrations = map[string]struct {
	to  string
	sql string
}{
	// 1 → 2: a checkpoint records the isolation it was taken with, so it can be forked
	// after its sandbox is gone.
	"1": {"2", `ALTER TABLE checkpoints ADD COLUMN isolation TEXT NOT NULL DEFAULT ''`},
}

const schema = `
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS templates(
	name TEXT PRIMARY KEY, volume TEXT NOT NULL, source TEXT NOT NULL DEFAULT '',
	bytes INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes(
	id TEXT PRIMARY KEY, template TEXT NOT NULL, isolation TEXT NOT NULL, hostname TEXT NOT NULL,
	root TEXT NOT NULL, head TEXT NOT NULL DEFAULT '', origin TEXT NOT NULL DEFAULT '',
	labels TEXT NOT NULL DEFAULT '{}', limits TEXT NOT NULL DEFAULT '{}',
	init_pid INTEGER NOT NULL DEFAULT 0, init_start INTEGER NOT NULL DEFAULT 0,
	state TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints(
	id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, parent TEXT NOT NULL DEFAULT '',
	label TEXT NOT NULL DEFAULT '', created_at TEXT NOT NULL, fs_volume TEXT NOT NULL,
	images TEXT NOT NULL, image_bytes INTEGER NOT NULL DEFAULT 0,
	duration_ms REAL NOT NULL DEFAULT 0, method TEXT NOT NULL DEFAULT '',
	phases TEXT NOT NULL DEFAULT '{}', isolation TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS checkpoints_sandbox ON checkpoints(sandbox_id);
CREATE INDEX IF NOT EXISTS checkpoints_parent ON checkpoints(parent);
`

// Store is the metadata database.
type Store struct {
	db *sql.DB
}

// Open opens (creating if needed) the database at path.
func Open(path string) (*Store, error) {
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_txlock=immediate")
	if err != nil {
		return nil, err
	}
	if _, err := db.Exec(schema); err != nil {
		db.Close()
		return nil, fmt.Errorf("metadata database %s: %w", path, err)
	}
	var v string
	err = db.QueryRow(`SELECT value FROM meta WHERE key='schema_version'`).Scan(&v)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		_, err = db.Exec(`INSERT INTO meta(key, value) VALUES('schema_version', ?)`, SchemaVersion)
	case err == nil && v != SchemaVersion:
		err = migrate(db, v)
		if err != nil {
			err = errdefs.FailedPrecondition("metadata database %s has schema %s, this cairn knows %s: %v", path, v, SchemaVersion, err)
		}
	}
	if err != nil {
		db.Close()
		return nil, err
	}
	st := &Store{db: db}
	if err := st.standbyTable(); err != nil {
		db.Close()
		return nil, fmt.Errorf("metadata database %s: %w", path, err)
	}
	return st, nil
}

// migrate applies the migrations from version v up to SchemaVersion, each in a
// transaction with its version bump.
func migrate(db *sql.DB, v string) error {
	for v != SchemaVersion {
		m, ok := migrations[v]
		if !ok {
			return fmt.Errorf("no migration from schema %s (a newer cairn wrote it?)", v)
		}
		tx, err := db.Begin()
		if err != nil {
			return err
		}
		if _, err := tx.Exec(m.sql); err != nil {
			tx.Rollback()
			return err
		}
		if _, err := tx.Exec(`UPDATE meta SET value=? WHERE key='schema_version'`, m.to); err != nil {
			tx.Rollback()
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		v = m.to
	}
	return nil
}

// Close closes the database.
func (s *Store) Close() error { return s.db.Close() }

// Sync makes every committed transaction durable across a crash of the machine: with
// synchronous=NORMAL a commit is durable once the write-ahead log is synced, at its next
// checkpoint; this runs that checkpoint (and its syncs) now.
func (s *Store) Sync(ctx context.Context) error {
	_, err := s.db.ExecContext(ctx, "PRAGMA wal_checkpoint(FULL)")
	return err
}

func ts(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

func parseTS(s string) time.Time {
	t, _ := time.Parse(time.RFC3339Nano, s)
	return t
}

// PutTemplate inserts or replaces a template.
func (s *Store) PutTemplate(ctx context.Context, t *model.Template) error {
	_, err := s.db.ExecContext(ctx, `INSERT OR REPLACE INTO templates(name, volume, source, bytes, created_at) VALUES(?,?,?,?,?)`,
		t.Name, t.Volume, t.Source, t.Bytes, ts(t.CreatedAt))
	return err
}

// Template returns the named template.
func (s *Store) Template(ctx context.Context, name string) (*model.Template, error) {
	ts, err := s.templates(ctx, `WHERE name=?`, name)
	if err != nil {
		return nil, err
	}
	if len(ts) == 0 {
		return nil, errdefs.NotFound("template %q not found (list them with `cairn template ls`, build one with `cairn template build`)", name)
	}
	return ts[0], nil
}

// Templates lists all templates by name.
func (s *Store) Templates(ctx context.Context) ([]*model.Template, error) {
	return s.templates(ctx, `ORDER BY name`)
}

// DeleteTemplate removes a template row.
func (s *Store) DeleteTemplate(ctx context.Context, name string) error {
	_, err := s.db.ExecContext(ctx, `DELETE FROM templates WHERE name=?`, name)
	return err
}

func (s *Store) templates(ctx context.Context, where string, args ...any) ([]*model.Template, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT name, volume, source, bytes, created_at FROM templates `+where, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*model.Template
	for rows.Next() {
		var t model.Template
		var c string
		if err := rows.Scan(&t.Name, &t.Volume, &t.Source, &t.Bytes, &c); err != nil {
			return nil, err
		}
		t.CreatedAt = parseTS(c)
		out = append(out, &t)
	}
	return out, rows.Err()
}

const sandboxCols = `id, template, isolation, hostname, root, head, origin, labels, limits, init_pid, init_start, state, created_at`

// PutSandbox inserts or replaces a sandbox.
func (s *Store) PutSandbox(ctx context.Context, sb *model.Sandbox) error {
	return putSandbox(ctx, s.db, sb)
}

type execer interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
}

func putSandbox(ctx context.Context, db execer, sb *model.Sandbox) error {
	labels, _ := json.Marshal(sb.Labels)
	limits, _ := json.Marshal(sb.Limits)
	_, err := db.ExecContext(ctx, `INSERT OR REPLACE INTO sandboxes(`+sandboxCols+`) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?)`,
		sb.ID, sb.Template, sb.Isolation, sb.Hostname, sb.Root, sb.Head, sb.Origin, string(labels), string(limits),
		sb.Init.Pid, sb.Init.StartTime, sb.State, ts(sb.CreatedAt))
	return err
}

// Sandbox returns one sandbox.
func (s *Store) Sandbox(ctx context.Context, id string) (*model.Sandbox, error) {
	l, err := s.sandboxes(ctx, `WHERE id=?`, id)
	if err != nil {
		return nil, err
	}
	if len(l) == 0 {
		return nil, errdefs.NotFound("sandbox %q not found (list sandboxes with `cairn ls`)", id)
	}
	return l[0], nil
}

// Sandboxes lists all sandboxes, oldest first.
func (s *Store) Sandboxes(ctx context.Context) ([]*model.Sandbox, error) {
	return s.sandboxes(ctx, `ORDER BY created_at`)
}

// DeleteSandbox removes a sandbox row (its checkpoints stay).
func (s *Store) DeleteSandbox(ctx context.Context, id string) error {
	_, err := s.db.ExecContext(ctx, `DELETE FROM sandboxes WHERE id=?`, id)
	return err
}

func (s *Store) sandboxes(ctx context.Context, where string, args ...any) ([]*model.Sandbox, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+sandboxCols+` FROM sandboxes `+where, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*model.Sandbox
	for rows.Next() {
		var sb model.Sandbox
		var labels, limits, c string
		if err := rows.Scan(&sb.ID, &sb.Template, &sb.Isolation, &sb.Hostname, &sb.Root, &sb.Head, &sb.Origin,
			&labels, &limits, &sb.Init.Pid, &sb.Init.StartTime, &sb.State, &c); err != nil {
			return nil, err
		}
		json.Unmarshal([]byte(labels), &sb.Labels)
		json.Unmarshal([]byte(limits), &sb.Limits)
		sb.CreatedAt = parseTS(c)
		out = append(out, &sb)
	}
	return out, rows.Err()
}

const ckCols = `id, sandbox_id, parent, label, created_at, fs_volume, images, image_bytes, duration_ms, method, phases, isolation`

// AddCheckpoint records a published checkpoint and, in the same transaction, the
// sandbox whose head it becomes (sb may be nil).
func (s *Store) AddCheckpoint(ctx context.Context, c *model.Checkpoint, sb *model.Sandbox) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	phases, _ := json.Marshal(c.PhasesMS)
	if _, err := tx.ExecContext(ctx, `INSERT INTO checkpoints(`+ckCols+`) VALUES(?,?,?,?,?,?,?,?,?,?,?,?)`,
		c.ID, c.SandboxID, c.Parent, c.Label, ts(c.CreatedAt), c.FSVolume, c.Images, c.ImageBytes, c.DurationMS, c.Method, string(phases), c.Isolation); err != nil {
		return err
	}
	if sb != nil {
		if err := putSandbox(ctx, tx, sb); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// Checkpoint returns one checkpoint.
func (s *Store) Checkpoint(ctx context.Context, id string) (*model.Checkpoint, error) {
	l, err := s.checkpoints(ctx, `WHERE id=?`, id)
	if err != nil {
		return nil, err
	}
	if len(l) == 0 {
		return nil, errdefs.NotFound("checkpoint %q not found (list them with `cairn tree SANDBOX`)", id)
	}
	return l[0], nil
}

// Checkpoints lists every checkpoint, oldest first.
func (s *Store) Checkpoints(ctx context.Context) ([]*model.Checkpoint, error) {
	return s.checkpoints(ctx, `ORDER BY created_at`)
}

// CheckpointsOf lists the checkpoints taken of one sandbox, oldest first.
func (s *Store) CheckpointsOf(ctx context.Context, sandboxID string) ([]*model.Checkpoint, error) {
	return s.checkpoints(ctx, `WHERE sandbox_id=? ORDER BY created_at`, sandboxID)
}

// DeleteCheckpoints removes checkpoint rows and re-parents their children onto the
// deleted checkpoint's parent, in one transaction.
func (s *Store) DeleteCheckpoints(ctx context.Context, ids []string) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	for _, id := range ids {
		var parent string
		if err := tx.QueryRowContext(ctx, `SELECT parent FROM checkpoints WHERE id=?`, id).Scan(&parent); err != nil {
			if errors.Is(err, sql.ErrNoRows) {
				continue
			}
			return err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE checkpoints SET parent=? WHERE parent=?`, parent, id); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE sandboxes SET head=? WHERE head=?`, parent, id); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM checkpoints WHERE id=?`, id); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// SetCheckpointImages records that a checkpoint's images were rewritten: how they are
// now stored (method) and their bytes on disk. A deleted checkpoint is left deleted.
func (s *Store) SetCheckpointImages(ctx context.Context, id, method string, bytes int64) error {
	_, err := s.db.ExecContext(ctx, `UPDATE checkpoints SET method=?, image_bytes=? WHERE id=?`, method, bytes, id)
	return err
}

func (s *Store) checkpoints(ctx context.Context, where string, args ...any) ([]*model.Checkpoint, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+ckCols+` FROM checkpoints `+where, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*model.Checkpoint
	for rows.Next() {
		var c model.Checkpoint
		var created, phases string
		if err := rows.Scan(&c.ID, &c.SandboxID, &c.Parent, &c.Label, &created, &c.FSVolume, &c.Images,
			&c.ImageBytes, &c.DurationMS, &c.Method, &phases, &c.Isolation); err != nil {
			return nil, err
		}
		json.Unmarshal([]byte(phases), &c.PhasesMS)
		c.CreatedAt = parseTS(created)
		out = append(out, &c)
	}
	return out, rows.Err()
}
