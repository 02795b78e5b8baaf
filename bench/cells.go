package main

// Cells: the ways of taking a lock that a run compares. Every cell makes clients,
// each over a pool of its own, as independent replicas do.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/uniqueindex"
)

// cell is one way of taking a lock, measured like every other.
type cell struct {
	name string
	// raw is the hand-written cell this one is compared with ("" for raw cells and
	// the floor); peer the peer library's cell, if that is in the run.
	raw, peer string
	// peerOf (peer cells only) names the cells whose peer this is.
	peerOf []string
	// isPeer marks a peer library's cell.
	isPeer bool
	// pool, if set, opens the client's pool in place of target.open (a peer on
	// another driver); it must count into wc.
	pool func(t *target, wc *wireCount) (*sql.DB, error)
	// floor marks the SELECT 1 cell: not a lock, so it has no contended phases.
	floor bool
	// pgOnly marks a cell that exists on PostgreSQL only.
	pgOnly bool
	// open makes one client over db, a pool that belongs to that client alone.
	open func(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error)
}

// client is one simulated replica of a cell.
type client interface {
	// lock waits until name is held and returns the function that releases it.
	lock(ctx context.Context, name string) (unlock func(context.Context) error, err error)
	close() error
}

// rawPoll is how long the hand-written polling cells (raw uniqueindex, raw
// optimistic) sleep between attempts, with ±50 % jitter. Set by -poll.
var rawPoll = time.Millisecond

// peerCells returns the cells of the peer libraries for d; peers.go sets it.
var peerCells func(d sqllock.Dialect) []cell

// cellsFor returns the cells of dialect d in the order of the table.
func cellsFor(d sqllock.Dialect) []cell {
	cs := []cell{
		{name: "floor (SELECT 1 x2)", floor: true, open: openFloor},
		{name: "raw uniqueindex", open: openRawInsert},
		{name: "raw advisory", open: openRawAdvisory},
		{name: "raw forupdate", open: openRawForUpdate},
		{name: "raw optimistic", open: openRawOptimistic},
		// raw forupdate that also draws a fencing token by hand: what a token that
		// commits with the work costs over raw forupdate (its x raw columns).
		{name: "raw forupdate token", raw: "raw forupdate", open: openRawForUpdateToken},
		// raw forupdate that also does a job's work: one UPDATE (workSQL) in the
		// transaction before COMMIT.
		{name: "raw forupdate work", open: openRawForUpdateWork},
		// raw uniqueindex whose every release also sends a NOTIFY (PostgreSQL): what
		// notifying on each release would cost, beside the same statements without.
		{name: "raw uniqueindex NOTIFY", raw: "raw uniqueindex", open: openRawInsertNotify, pgOnly: true},
		{name: "uniqueindex", raw: "raw uniqueindex", open: lockerCell(func(db *sql.DB, d sqllock.Dialect) (locker, error) {
			return uniqueindex.New(db, d)
		})},
		{name: "advisory", raw: "raw advisory", open: lockerCell(func(db *sql.DB, d sqllock.Dialect) (locker, error) {
			return advisory.New(db, d)
		})},
		{name: "advisory WithoutToken", raw: "raw advisory", open: lockerCell(func(db *sql.DB, d sqllock.Dialect) (locker, error) {
			return advisory.New(db, d, advisory.WithoutToken())
		})},
		{name: "forupdate", raw: "raw forupdate", open: lockerCell(func(db *sql.DB, d sqllock.Dialect) (locker, error) {
			return forupdate.New(db, d)
		})},
		{name: "forupdate WithoutToken", raw: "raw forupdate", open: lockerCell(func(db *sql.DB, d sqllock.Dialect) (locker, error) {
			return forupdate.New(db, d, forupdate.WithoutToken())
		})},
		// forupdate as a job that writes uses it: one UPDATE of a row of the job's
		// in the lease's transaction, committed with the token at release, against
		// the hand-written transaction that does the same (raw forupdate work).
		{name: "forupdate work", raw: "raw forupdate work", open: openForUpdateWork},
		{name: "optimistic", raw: "raw optimistic", open: lockerCell(func(db *sql.DB, d sqllock.Dialect) (locker, error) {
			return optimistic.New(db, d)
		})},
		// fairqueue has no raw equivalent of its own: a ticket row is inserted and
		// deleted, so it is compared with raw INSERT/DELETE.
		{name: "fairqueue", raw: "raw uniqueindex", open: lockerCell(func(db *sql.DB, d sqllock.Dialect) (locker, error) {
			return fairqueue.New(db, d)
		})},
	}
	cs = slices.DeleteFunc(cs, func(c cell) bool { return c.pgOnly && d != sqllock.Postgres })
	if peerCells != nil {
		for _, p := range peerCells(d) {
			p.isPeer = true
			for i := range cs {
				if slices.Contains(p.peerOf, cs[i].name) {
					cs[i].peer = p.name
				}
			}
			cs = append(cs, p)
		}
	}
	return cs
}

// locker is what every sqllock strategy's Locker offers.
type locker interface {
	sqllock.Locker
	Close() error
}

type lockerClient struct{ l locker }

func (c lockerClient) lock(ctx context.Context, name string) (func(context.Context) error, error) {
	lease, err := c.l.Acquire(ctx, name)
	if err != nil {
		return nil, err
	}
	return lease.Release, nil
}

func (c lockerClient) close() error { return c.l.Close() }

// lockerCell adapts a sqllock constructor to cell.open.
func lockerCell(newLocker func(*sql.DB, sqllock.Dialect) (locker, error)) func(context.Context, *sql.DB, sqllock.Dialect) (client, error) {
	return func(_ context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
		l, err := newLocker(db, d)
		if err != nil {
			return nil, err
		}
		return lockerClient{l}, nil
	}
}

// Hand-written SQL. Statements are prepared once per client (on MySQL an unprepared
// statement with arguments costs a prepare, an execute and a close), so each one is a
// single round trip: the best a careful user gets by hand.

// rawTables are created in the bench database beside the library's tables.
func rawTables(d sqllock.Dialect) []string {
	if d == sqllock.Postgres {
		return []string{
			`CREATE TABLE bench_raw_lease (name text PRIMARY KEY)`,
			`CREATE TABLE bench_raw_row (name text PRIMARY KEY, version bigint NOT NULL DEFAULT 0, held boolean NOT NULL DEFAULT false)`,
		}
	}
	return []string{
		`CREATE TABLE bench_raw_lease (name varchar(255) PRIMARY KEY)`,
		`CREATE TABLE bench_raw_row (name varchar(255) PRIMARY KEY, version bigint NOT NULL DEFAULT 0, held boolean NOT NULL DEFAULT false)`,
	}
}

// ensureRow creates the row of name in bench_raw_row (raw forupdate and optimistic
// need it), through the set-up pool, before a phase starts.
func ensureRow(ctx context.Context, db *sql.DB, d sqllock.Dialect, name string) error {
	q := `INSERT INTO bench_raw_row (name) VALUES ($1) ON CONFLICT DO NOTHING`
	if d == sqllock.MySQL {
		q = `INSERT IGNORE INTO bench_raw_row (name) VALUES (?)`
	}
	_, err := db.ExecContext(ctx, q, name)
	return err
}

// ph rewrites $n placeholders to ? for MySQL.
func ph(d sqllock.Dialect, q string) string {
	if d == sqllock.Postgres {
		return q
	}
	b := []byte(q)
	out := b[:0]
	for i := 0; i < len(b); i++ {
		if b[i] == '$' {
			out = append(out, '?')
			for i+1 < len(b) && b[i+1] >= '0' && b[i+1] <= '9' {
				i++
			}
			continue
		}
		out = append(out, b[i])
	}
	return string(out)
}

// stmts prepares qs on db (or on conn, when not nil).
func stmts(ctx context.Context, db *sql.DB, conn *sql.Conn, d sqllock.Dialect, qs ...string) ([]*sql.Stmt, error) {
	var out []*sql.Stmt
	for _, q := range qs {
		var st *sql.Stmt
		var err error
		if conn != nil {
			st, err = conn.PrepareContext(ctx, ph(d, q))
		} else {
			st, err = db.PrepareContext(ctx, ph(d, q))
		}
		if err != nil {
			return nil, fmt.Errorf("prepare %q: %w", q, err)
		}
		out = append(out, st)
	}
	return out, nil
}

// pause sleeps about rawPoll, or until ctx ends.
func pause(ctx context.Context) error {
	d := rawPoll/2 + rand.N(rawPoll+1)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// funcClient is a client made of two functions.
type funcClient struct {
	lockFn  func(ctx context.Context, name string) (func(context.Context) error, error)
	closeFn func() error
}

func (c funcClient) lock(ctx context.Context, name string) (func(context.Context) error, error) {
	return c.lockFn(ctx, name)
}
func (c funcClient) close() error { return c.closeFn() }

func closeStmts(sts []*sql.Stmt) func() error {
	return func() error {
		var errs []error
		for _, s := range sts {
			errs = append(errs, s.Close())
		}
		return errors.Join(errs...)
	}
}

// openFloor: a "lock" of two SELECT 1 round trips, the least a lock and its
// release can cost. It excludes nothing.
func openFloor(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	one := func(ctx context.Context) error {
		var x int
		return db.QueryRowContext(ctx, "SELECT 1").Scan(&x)
	}
	return funcClient{
		lockFn:  func(ctx context.Context, _ string) (func(context.Context) error, error) { return one, one(ctx) },
		closeFn: func() error { return nil },
	}, nil
}

// openRawInsert: INSERT a row to take the lock (retried every rawPoll while the key
// exists), DELETE it to release.
func openRawInsert(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	return rawInsertClient(ctx, db, d, `DELETE FROM bench_raw_lease WHERE name = $1`)
}

// rawInsertClient is openRawInsert with the release statement del.
func rawInsertClient(ctx context.Context, db *sql.DB, d sqllock.Dialect, del string) (client, error) {
	ins := `INSERT INTO bench_raw_lease (name) VALUES ($1) ON CONFLICT DO NOTHING`
	if d == sqllock.MySQL {
		ins = `INSERT IGNORE INTO bench_raw_lease (name) VALUES (?)`
	}
	sts, err := stmts(ctx, db, nil, d, ins, del)
	if err != nil {
		return nil, err
	}
	return funcClient{
		lockFn: func(ctx context.Context, name string) (func(context.Context) error, error) {
			for {
				res, err := sts[0].ExecContext(ctx, name)
				if deadlock(err) {
					if err := pause(ctx); err != nil {
						return nil, err
					}
					continue
				}
				if err != nil {
					return nil, err
				}
				if n, err := res.RowsAffected(); err != nil || n == 1 {
					return func(ctx context.Context) error { _, err := sts[1].ExecContext(ctx, name); return err }, err
				}
				if err := pause(ctx); err != nil {
					return nil, err
				}
			}
		},
		closeFn: closeStmts(sts),
	}, nil
}

// rawNotifyChannel is the channel of the raw NOTIFY cell.
const rawNotifyChannel = "bench_raw_notify"

// openRawInsertNotify: openRawInsert whose DELETE also notifies, in the same
// statement, as a release that wakes waiters does.
func openRawInsertNotify(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	return rawInsertClient(ctx, db, d, `WITH x AS (DELETE FROM bench_raw_lease WHERE name = $1 RETURNING name)
SELECT pg_notify('`+rawNotifyChannel+`', name) FROM x`)
}

// fnv64 hashes a lock name into a raw advisory key.
func fnv64(name string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return h.Sum64()
}

// deadlock reports whether err is InnoDB's deadlock error, which INSERT IGNORE meets
// when it races a DELETE of the same key: a hand-written loop retries it.
func deadlock(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == 1213
}

// openRawAdvisory: pg_advisory_lock / pg_advisory_unlock, or GET_LOCK /
// RELEASE_LOCK, on one connection the client pins for its whole life.
func openRawAdvisory(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	lockQ, unlockQ := `SELECT pg_advisory_lock($1)`, `SELECT pg_advisory_unlock($1)`
	if d == sqllock.MySQL {
		// GET_LOCK(name, -1) is refused by some MariaDB versions: wait an hour.
		lockQ, unlockQ = `SELECT GET_LOCK(?, 3600)`, `SELECT RELEASE_LOCK(?)`
	}
	sts, err := stmts(ctx, nil, conn, d, lockQ, unlockQ)
	if err != nil {
		conn.Close()
		return nil, err
	}
	key := func(name string) any {
		if d == sqllock.MySQL {
			return fmt.Sprintf("bench:%x", fnv64(name)) // names are server-wide, at most 64 characters
		}
		return int64(fnv64(name))
	}
	run := func(ctx context.Context, st *sql.Stmt, k any) error {
		if d == sqllock.Postgres { // the functions return void (unlock: a boolean)
			_, err := st.ExecContext(ctx, k)
			return err
		}
		var ok sql.NullBool
		if err := st.QueryRowContext(ctx, k).Scan(&ok); err != nil {
			return err
		}
		if !ok.Valid || !ok.Bool {
			return fmt.Errorf("raw advisory: %v returned %v", k, ok)
		}
		return nil
	}
	return funcClient{
		lockFn: func(ctx context.Context, name string) (func(context.Context) error, error) {
			k := key(name)
			if err := run(ctx, sts[0], k); err != nil {
				return nil, err
			}
			return func(ctx context.Context) error { return run(ctx, sts[1], k) }, nil
		},
		closeFn: func() error { return errors.Join(closeStmts(sts)(), conn.Close()) },
	}, nil
}

// openRawForUpdate: BEGIN; SELECT ... FOR UPDATE of the name's row; COMMIT to
// release.
func openRawForUpdate(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	return rawTxClient(ctx, db, d, []string{rawForUpdateSQL},
		func(ctx context.Context, sts []*sql.Stmt, name string) error {
			var v int64
			return sts[0].QueryRowContext(ctx, name).Scan(&v)
		})
}

const rawForUpdateSQL = `SELECT version FROM bench_raw_row WHERE name = $1 FOR UPDATE`

// workSQL is the work of the work cells: an UPDATE of the name's row of
// bench_raw_row (the row raw forupdate locks; ensureRow creates it), run in the
// lock's transaction, so that the commit that releases the lock writes, as a job's
// does.
const workSQL = `UPDATE bench_raw_row SET version = version + 1 WHERE name = $1`

// openRawForUpdateWork: raw forupdate, then workSQL in the same transaction, COMMIT
// to release. The UPDATE finds the row already locked by the transaction.
func openRawForUpdateWork(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	return rawTxClient(ctx, db, d, []string{rawForUpdateSQL, workSQL},
		func(ctx context.Context, sts []*sql.Stmt, name string) error {
			var v int64
			if err := sts[0].QueryRowContext(ctx, name).Scan(&v); err != nil {
				return err
			}
			return work(ctx, sts[1], name)
		})
}

// work runs workSQL (prepared as st, in the lock's transaction) for name.
func work(ctx context.Context, st *sql.Stmt, name string) error {
	res, err := st.ExecContext(ctx, name)
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		return fmt.Errorf("work on %q: %d rows, %v", name, n, err)
	}
	return nil
}

// openForUpdateWork: a forupdate Locker (with a token), workSQL in the lease's
// transaction (Lease.Tx), Release to commit it.
func openForUpdateWork(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	sts, err := stmts(ctx, db, nil, d, workSQL)
	if err != nil {
		return nil, err
	}
	l, err := forupdate.New(db, d)
	if err != nil {
		closeStmts(sts)()
		return nil, err
	}
	return funcClient{
		lockFn: func(ctx context.Context, name string) (func(context.Context) error, error) {
			lease, err := l.Lock(ctx, name)
			if err != nil {
				return nil, err
			}
			if err := work(ctx, lease.Tx().StmtContext(ctx, sts[0]), name); err != nil {
				lease.Rollback(ctx)
				return nil, err
			}
			return lease.Release, nil
		},
		closeFn: func() error { return errors.Join(l.Close(), closeStmts(sts)()) },
	}, nil
}

// openRawForUpdateToken: the hand-written row lock with a fencing token, in a
// transaction: an UPDATE that waits for the row lock as SELECT ... FOR UPDATE does
// and increments the row's version, the token (returned; on MySQL as the insert id,
// LAST_INSERT_ID(expr)), COMMIT to release. Three statements, as forupdate's; unlike
// forupdate's token, this one is rolled back with a holder that dies, so the next
// holder may get the same number.
func openRawForUpdateToken(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	q := `UPDATE bench_raw_row SET version = version + 1 WHERE name = $1 RETURNING version`
	if d == sqllock.MySQL {
		q = `UPDATE bench_raw_row SET version = LAST_INSERT_ID(version + 1) WHERE name = $1`
	}
	return rawTxClient(ctx, db, d, []string{q}, func(ctx context.Context, sts []*sql.Stmt, name string) error {
		var tok int64
		var err error
		if d == sqllock.Postgres {
			err = sts[0].QueryRowContext(ctx, name).Scan(&tok)
		} else {
			var res sql.Result
			if res, err = sts[0].ExecContext(ctx, name); err == nil {
				tok, err = res.LastInsertId()
			}
		}
		if err == nil && tok <= 0 {
			err = fmt.Errorf("raw forupdate token: token %d for %q", tok, name)
		}
		return err
	})
}

// rawTxClient is a hand-written row lock held by a transaction: BEGIN, lock (the
// statements qs, prepared once, run in the transaction), COMMIT to release.
func rawTxClient(ctx context.Context, db *sql.DB, d sqllock.Dialect, qs []string,
	lock func(ctx context.Context, sts []*sql.Stmt, name string) error) (client, error) {
	sts, err := stmts(ctx, db, nil, d, qs...)
	if err != nil {
		return nil, err
	}
	return funcClient{
		lockFn: func(ctx context.Context, name string) (func(context.Context) error, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return nil, err
			}
			txs := make([]*sql.Stmt, len(sts))
			for i, st := range sts {
				txs[i] = tx.StmtContext(ctx, st)
			}
			if err := lock(ctx, txs, name); err != nil {
				tx.Rollback()
				return nil, err
			}
			return func(context.Context) error { return tx.Commit() }, nil
		},
		closeFn: closeStmts(sts),
	}, nil
}

// openRawOptimistic: SELECT version, held; if free, UPDATE ... SET held WHERE
// version = the one read (retried every rawPoll while held or when another client
// won); release with UPDATE ... WHERE version = the one written.
func openRawOptimistic(ctx context.Context, db *sql.DB, d sqllock.Dialect) (client, error) {
	sts, err := stmts(ctx, db, nil, d,
		`SELECT version, held FROM bench_raw_row WHERE name = $1`,
		`UPDATE bench_raw_row SET version = version + 1, held = true WHERE name = $1 AND version = $2`,
		`UPDATE bench_raw_row SET version = version + 1, held = false WHERE name = $1 AND version = $2`)
	if err != nil {
		return nil, err
	}
	return funcClient{
		lockFn: func(ctx context.Context, name string) (func(context.Context) error, error) {
			for {
				var v int64
				var held bool
				if err := sts[0].QueryRowContext(ctx, name).Scan(&v, &held); err != nil {
					return nil, err
				}
				if !held {
					res, err := sts[1].ExecContext(ctx, name, v)
					if err != nil {
						return nil, err
					}
					if n, err := res.RowsAffected(); err != nil || n == 1 {
						return func(ctx context.Context) error {
							res, err := sts[2].ExecContext(ctx, name, v+1)
							if err == nil {
								if n, _ := res.RowsAffected(); n != 1 {
									err = fmt.Errorf("raw optimistic: %s lost at version %d", name, v+1)
								}
							}
							return err
						}, err
					}
				}
				if err := pause(ctx); err != nil {
					return nil, err
				}
			}
		},
		closeFn: closeStmts(sts),
	}, nil
}
