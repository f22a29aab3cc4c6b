package store

import (
	"context"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/isolation"
)

// Standbys are restored-but-frozen copies of a checkpoint, kept so that a rollback or
// fork to it is a thaw. They are a cache: losing them loses no state.
//
//	standbys(id PK, checkpoint, isolation, root, init_pid, init_start, bytes, created_at)
const standbySchema = `
CREATE TABLE IF NOT EXISTS standbys(
	id TEXT PRIMARY KEY, checkpoint TEXT NOT NULL, isolation TEXT NOT NULL, root TEXT NOT NULL,
	init_pid INTEGER NOT NULL, init_start INTEGER NOT NULL, bytes INTEGER NOT NULL DEFAULT 0,
	created_at TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS standbys_checkpoint ON standbys(checkpoint);
`

// Standby is a restored, frozen copy of a checkpoint.
type Standby struct {
	ID         string
	Checkpoint string
	Isolation  string
	Root       string // pool volume
	Init       isolation.Proc
	Bytes      int64
	CreatedAt  string
}

func (s *Store) standbyTable() error {
	_, err := s.db.Exec(standbySchema)
	return err
}

// AddStandby records a ready standby.
func (s *Store) AddStandby(ctx context.Context, sb *Standby) error {
	_, err := s.db.ExecContext(ctx, `INSERT INTO standbys(id, checkpoint, isolation, root, init_pid, init_start, bytes, created_at)
		VALUES(?,?,?,?,?,?,?,?)`, sb.ID, sb.Checkpoint, sb.Isolation, sb.Root, sb.Init.Pid, sb.Init.StartTime, sb.Bytes, sb.CreatedAt)
	return err
}

// StandbysOf lists the standbys of a checkpoint, oldest first.
func (s *Store) StandbysOf(ctx context.Context, checkpoint string) ([]*Standby, error) {
	return s.standbys(ctx, `WHERE checkpoint=? ORDER BY created_at`, checkpoint)
}

// SwapStandby claims a standby for a sandbox in one transaction: the standby's row is
// deleted and the sandbox's row (now pointing at the standby's root) written, so the
// root is never unreferenced. It reports false if someone else claimed it first.
func (s *Store) SwapStandby(ctx context.Context, standbyID string, sb *model.Sandbox) (bool, error) {
	claimed, err := s.ClaimStandbys(ctx, []string{standbyID}, []*model.Sandbox{sb})
	return len(claimed) == 1, err
}

// ClaimStandbys claims standbys for sandboxes in one transaction: for each pair,
// the standby's row is deleted and the sandbox's row written. A standby someone else
// claimed first is skipped; the claimed pairs' indexes are returned, in order.
func (s *Store) ClaimStandbys(ctx context.Context, standbyIDs []string, sbs []*model.Sandbox) ([]int, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	var claimed []int
	for i, id := range standbyIDs {
		res, err := tx.ExecContext(ctx, `DELETE FROM standbys WHERE id=?`, id)
		if err != nil {
			return nil, err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			continue
		}
		if err := putSandbox(ctx, tx, sbs[i]); err != nil {
			return nil, err
		}
		claimed = append(claimed, i)
	}
	return claimed, tx.Commit()
}

// Standbys lists all standbys, oldest first.
func (s *Store) Standbys(ctx context.Context) ([]*Standby, error) {
	return s.standbys(ctx, `ORDER BY created_at`)
}

func (s *Store) standbys(ctx context.Context, where string, args ...any) ([]*Standby, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, checkpoint, isolation, root, init_pid, init_start, bytes, created_at
		FROM standbys `+where, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Standby
	for rows.Next() {
		var sb Standby
		if err := rows.Scan(&sb.ID, &sb.Checkpoint, &sb.Isolation, &sb.Root, &sb.Init.Pid, &sb.Init.StartTime, &sb.Bytes, &sb.CreatedAt); err != nil {
			return nil, err
		}
		out = append(out, &sb)
	}
	return out, rows.Err()
}

// DeleteStandby removes a standby row; it reports whether the row existed (false: some
// other process claimed or removed it first).
func (s *Store) DeleteStandby(ctx context.Context, id string) (bool, error) {
	res, err := s.db.ExecContext(ctx, `DELETE FROM standbys WHERE id=?`, id)
	if err != nil {
		return false, err
	}
	n, _ := res.RowsAffected()
	return n > 0, nil
}
