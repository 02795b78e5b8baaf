package uniqueindex

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/namekey"
)

// ForceRelease takes the live lease of name away from its holder, from outside the
// holder's process: the operator's tool (the CLI's force-release runs it). It
// returns an error matching sqllock.ErrNotHeld if name has no live lease.
//
// Without now the lease is revoked: the holder's next renewal fails, so it reports
// sqllock.ErrLost within one keep-alive interval, and the row stays until its
// current expiry, which lies after the holder's local deadline. Nobody else can
// acquire the lock before the holder was told.
//
// With now the lock is free at once, as after a Release (PostgreSQL deletes the row
// and wakes the waiters; MySQL frees it in place, keeping the name's last token), while
// the holder learns of it only at its next renewal: there may be two holders
// meanwhile. Use it for a holder known to be dead.
func ForceRelease(ctx context.Context, db *sql.DB, d sqllock.Dialect, name string, now bool) error {
	if !d.Valid() {
		return lease.NewError("force-release", d, name, sqllock.ErrInvalidOption, fmt.Errorf("unknown dialect %v", d))
	}
	if err := sqllock.ValidateName(name); err != nil {
		return err
	}
	key := namekey.Key(name)
	var n int64
	var err error
	switch {
	case now && d == sqllock.Postgres:
		err = db.QueryRowContext(ctx, revokeNowPostgres, key).Scan(&n)
	case now:
		n, err = rowsAffected(db.ExecContext(ctx, revokeNowMySQL, []byte(revokedOwner), key))
	case d == sqllock.Postgres:
		n, err = rowsAffected(db.ExecContext(ctx, revokePostgres, []byte(revokedOwner), key))
	default:
		n, err = rowsAffected(db.ExecContext(ctx, revokeMySQL, []byte(revokedOwner), key, []byte(revokedOwner)))
	}
	switch {
	case err != nil:
		return lease.NewError("force-release", d, name, nil, err)
	case n == 0:
		return lease.NewError("force-release", d, name, sqllock.ErrNotHeld, nil)
	}
	return nil
}

func rowsAffected(res sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}
