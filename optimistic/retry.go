package optimistic

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/lease"
)

// ErrConflict reports that a compare-and-swap changed no row: the version the caller
// read is no longer the row's (another writer got there first), or the row is gone.
var ErrConflict = errors.New("sqllock/optimistic: version conflict")

// Execer is a *sql.DB, *sql.Conn or *sql.Tx.
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// Swap runs the caller's compare-and-swap statement on q: an UPDATE of the caller's
// own versioned row whose WHERE clause compares the version read before, and sets
// the next one, such as
//
//	UPDATE accounts SET balance = $1, version = version + 1 WHERE id = $2 AND version = $3
//
// It returns nil if the statement changed a row, an error matching ErrConflict if it
// changed none (the version moved on, or the row is gone: read it again to tell), or
// the statement's error. With go-sql-driver's clientFoundRows the count is of matched
// rows, which is the same here since a successful swap always changes the version.
func Swap(ctx context.Context, q Execer, query string, args ...any) error {
	res, err := q.ExecContext(ctx, query, args...)
	if err != nil {
		return err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return err
	}
	if n == 0 {
		return ErrConflict
	}
	return nil
}

// Defaults of Retry.
const (
	DefaultAttempts   = 10
	DefaultMinBackoff = time.Millisecond
	DefaultMaxBackoff = 100 * time.Millisecond
)

// RetryOption configures Retry.
type RetryOption func(*retryConfig) error

type retryConfig struct {
	attempts int
	pol      backoff.Policy
}

// WithAttempts bounds the number of times Retry runs fn (DefaultAttempts). It must be
// at least 1.
func WithAttempts(n int) RetryOption {
	return func(c *retryConfig) error {
		if n < 1 {
			return fmt.Errorf("attempts %d is less than 1", n)
		}
		c.attempts = n
		return nil
	}
}

// WithBackoff sets the pause between attempts: capped exponential backoff with full
// jitter, between min and max (DefaultMinBackoff, DefaultMaxBackoff).
func WithBackoff(min, max time.Duration) RetryOption {
	return func(c *retryConfig) error {
		if min <= 0 || max < min {
			return fmt.Errorf("backoff %v..%v: need 0 < min <= max", min, max)
		}
		c.pol = backoff.Policy{Min: min, Max: max}
		return nil
	}
}

// Retry runs fn, a read-modify-swap of the caller's versioned row, until it returns
// anything but an error matching ErrConflict, at most the configured number of
// attempts, pausing with capped exponential backoff and full jitter in between (a
// fresh read after a pause is less likely to meet the same writers). It returns nil
// when fn succeeded, fn's error when it is not a conflict, ctx's error (wrapped,
// matching ErrConflict too if the last attempt conflicted) when ctx ends, and an
// error matching ErrConflict when the attempts ran out. Invalid options return an
// error matching sqllock.ErrInvalidOption before fn runs.
//
// Each attempt must read the row again and swap from the version it read:
//
//   - On a *sql.DB (autocommit), fn reads and swaps with two statements.
//   - In a transaction, begin and commit it inside fn, one per attempt: a
//     transaction opened outside Retry keeps its REPEATABLE READ snapshot (InnoDB's
//     default), in which a re-read does not see the competing write, so every
//     attempt would conflict again; and a failed statement aborts a PostgreSQL
//     transaction. Under READ COMMITTED a re-read in one transaction does see it,
//     and fn may reuse the caller's transaction if no statement of it failed.
//
// Under heavy contention attempts are wasted (the documents warn about it): for one
// hot row, forupdate.WithLock serialises writers without retries (see the README's
// "optimistic or forupdate?").
func Retry(ctx context.Context, fn func(ctx context.Context) error, opts ...RetryOption) error {
	c := retryConfig{attempts: DefaultAttempts, pol: backoff.Policy{Min: DefaultMinBackoff, Max: DefaultMaxBackoff}}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return lease.NewError("retry", 0, "", sqllock.ErrInvalidOption, err)
		}
	}
	var last error
	for attempt := 0; attempt < c.attempts; attempt++ {
		if err := ctx.Err(); err != nil {
			if last != nil {
				return fmt.Errorf("%w (after %d attempts: %w)", err, attempt, last)
			}
			return err
		}
		err := fn(ctx)
		if !errors.Is(err, ErrConflict) {
			return err
		}
		last = err
		if attempt+1 < c.attempts {
			if err := backoff.Sleep(ctx, c.pol.Delay(attempt), nil); err != nil {
				return fmt.Errorf("%w (after %d attempts: %w)", err, attempt+1, last)
			}
		}
	}
	return fmt.Errorf("%d attempts: %w", c.attempts, last)
}
