package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// The daemon's sessions live in their own table of the same database file, created by
// OpenSessions (never by Open: the engine's schema, version 1, is unchanged and a CLI
// that never ran the daemon has no such table):
//
//	sessions(sandbox_id PK, session_id, run_id, expires_at, policy, idle_timeout_s,
//	         last_activity, paused_reason)
//
// A row says how long its sandbox lives and what the daemon did to it (paused_reason
// "idle" or "expired" while the daemon keeps it checkpointed and stopped). Rows of
// sandboxes that no longer exist are deleted by the daemon when it reconciles.
const sessionsSchema = `
CREATE TABLE IF NOT EXISTS sessions(
	sandbox_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, run_id TEXT NOT NULL DEFAULT '',
	expires_at TEXT NOT NULL, policy TEXT NOT NULL, idle_timeout_s INTEGER NOT NULL DEFAULT 0,
	last_activity TEXT NOT NULL, paused_reason TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS sessions_session ON sessions(session_id);
`

// Session is the daemon's record of one sandbox's lifetime.
type Session struct {
	SandboxID    string
	SessionID    string
	RunID        string
	ExpiresAt    time.Time
	Policy       string        // "destroy" or "pause"
	IdleTimeout  time.Duration // 0: never paused for idleness
	LastActivity time.Time
	PausedReason string // "", "idle", "expired" or "shutdown"
}

// Sessions is the sessions table.
type Sessions struct {
	db *sql.DB
}

// OpenSessions opens (creating if needed) the sessions table of the database at path.
func OpenSessions(path string) (*Sessions, error) {
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_txlock=immediate")
	if err != nil {
		return nil, err
	}
	if _, err := db.Exec(sessionsSchema); err != nil {
		db.Close()
		return nil, fmt.Errorf("sessions table in %s: %w", path, err)
	}
	return &Sessions{db: db}, nil
}

// Close closes the database.
func (s *Sessions) Close() error { return s.db.Close() }

// Put inserts or replaces a session.
func (s *Sessions) Put(ctx context.Context, x *Session) error {
	_, err := s.db.ExecContext(ctx, `INSERT OR REPLACE INTO sessions(sandbox_id, session_id, run_id, expires_at, policy, idle_timeout_s, last_activity, paused_reason) VALUES(?,?,?,?,?,?,?,?)`,
		x.SandboxID, x.SessionID, x.RunID, ts(x.ExpiresAt), x.Policy, int64(x.IdleTimeout/time.Second), ts(x.LastActivity), x.PausedReason)
	return err
}

// Delete removes a session (no error if there is none).
func (s *Sessions) Delete(ctx context.Context, sandboxID string) error {
	_, err := s.db.ExecContext(ctx, `DELETE FROM sessions WHERE sandbox_id=?`, sandboxID)
	return err
}

// Touch records the last activity of several sandboxes in one transaction.
func (s *Sessions) Touch(ctx context.Context, last map[string]time.Time) error {
	if len(last) == 0 {
		return nil
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	for id, t := range last {
		if _, err := tx.ExecContext(ctx, `UPDATE sessions SET last_activity=? WHERE sandbox_id=?`, ts(t), id); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// All returns every session.
func (s *Sessions) All(ctx context.Context) ([]*Session, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT sandbox_id, session_id, run_id, expires_at, policy, idle_timeout_s, last_activity, paused_reason FROM sessions`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Session
	for rows.Next() {
		var x Session
		var exp, last string
		var idle int64
		if err := rows.Scan(&x.SandboxID, &x.SessionID, &x.RunID, &exp, &x.Policy, &idle, &last, &x.PausedReason); err != nil {
			return nil, err
		}
		x.ExpiresAt, x.LastActivity, x.IdleTimeout = parseTS(exp), parseTS(last), time.Duration(idle)*time.Second
		out = append(out, &x)
	}
	return out, rows.Err()
}
