package advisory

import (
	"context"
	"database/sql"
	"errors"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// AcquireTx takes the lock name for the lifetime of tx (pg_advisory_xact_lock, or
// pg_advisory_xact_lock_shared on a Shared view): it is released by COMMIT or
// ROLLBACK and cannot be released earlier. It waits until the lock is granted or ctx
// ends. It is the form to use behind a transaction-pooling proxy (pgbouncer in
// transaction mode), where session locks do not work, and when the protected writes
// already run in tx.
//
// It returns the fencing token (0 with WithoutToken), drawn by the locking statement
// itself from a sequence (see Lease.Token), which a rollback of tx does not undo: it
// stays strictly increasing even if tx rolls back.
//
// When ctx ends during the wait, pgx breaks tx's connection: tx can then only be
// rolled back. The error matches sqllock.ErrNotAcquired and ctx.Err(). Nothing is
// left behind: the lock belongs to tx.
//
// MySQL has no transaction-scoped GET_LOCK (a GET_LOCK outlives COMMIT): there
// AcquireTx returns an error matching sqllock.ErrInvalidOption; use the forupdate
// strategy.
func (l *Locker) AcquireTx(ctx context.Context, tx *sql.Tx, name string) (int64, error) {
	return l.acquireTx(ctx, "acquire-tx", tx, name, true)
}

// TryAcquireTx is AcquireTx without waiting (pg_try_advisory_xact_lock): it returns an
// error matching sqllock.ErrNotAcquired at once if the lock is held elsewhere. tx
// stays usable after a refusal.
func (l *Locker) TryAcquireTx(ctx context.Context, tx *sql.Tx, name string) (int64, error) {
	return l.acquireTx(ctx, "try-acquire-tx", tx, name, false)
}

func (l *Locker) acquireTx(ctx context.Context, op string, tx *sql.Tx, name string, wait bool) (int64, error) {
	if err := sqllock.ValidateName(name); err != nil {
		return 0, err
	}
	id := l.nameID(name)
	if l.dialect != sqllock.Postgres {
		return 0, l.errorf(op, id, sqllock.ErrInvalidOption,
			errors.New("MySQL has no transaction-scoped GET_LOCK; use the forupdate strategy"))
	}
	if tx == nil {
		return 0, l.errorf(op, id, sqllock.ErrInvalidOption, errors.New("nil *sql.Tx"))
	}
	if err := lease.Admit(ctx, l.guard, op, l.dialect, id.name); err != nil {
		return 0, err
	}
	st := l.pgStmts(id)
	var err error
	var t sql.NullInt64
	if wait {
		var one int
		err = tx.QueryRowContext(ctx, st.xact, id.pgArgs()...).Scan(l.withToken(&t, &one)...)
	} else {
		var ok bool
		err = tx.QueryRowContext(ctx, st.tryXact, id.pgArgs()...).Scan(l.withToken(&t, &ok)...)
		if err == nil && !ok {
			return 0, l.errorf(op, id, sqllock.ErrNotAcquired, nil)
		}
	}
	var tok int64
	if err == nil && l.cfg.token {
		tok, err = fence.Drawn(ctx, t, tx, l.db)
	}
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return 0, l.errorf(op, id, sqllock.ErrNotAcquired, cerr)
		}
		if sqlerr.Transient(err) || sqlerr.Is(err, sqlerr.Canceled) {
			return 0, l.errorf(op, id, sqllock.ErrNotAcquired, err)
		}
		return 0, l.errorf(op, id, nil, err)
	}
	return tok, nil
}
