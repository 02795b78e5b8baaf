package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
)

// Flavor is the kind of server behind a DSN.
type Flavor int

const (
	FlavorPostgres Flavor = iota + 1
	FlavorMariaDB
	FlavorMySQL // Oracle MySQL 8 or later
)

func (f Flavor) String() string {
	switch f {
	case FlavorPostgres:
		return "PostgreSQL"
	case FlavorMariaDB:
		return "MariaDB"
	case FlavorMySQL:
		return "MySQL"
	}
	return "unknown"
}

var flavors sync.Map // *sql.DB -> Flavor

// FlavorOf asks the server behind db what it is (once per pool).
func FlavorOf(ctx context.Context, db *sql.DB, d sqllock.Dialect) (Flavor, error) {
	if d == sqllock.Postgres {
		return FlavorPostgres, nil
	}
	if f, ok := flavors.Load(db); ok {
		return f.(Flavor), nil
	}
	var v string
	if err := db.QueryRowContext(ctx, "SELECT VERSION()").Scan(&v); err != nil {
		return 0, err
	}
	f := FlavorMySQL
	if strings.Contains(strings.ToLower(v), "mariadb") {
		f = FlavorMariaDB
	}
	flavors.Store(db, f)
	return f, nil
}

// Running counts the other sessions whose statement under way contains substr. On
// MySQL it reads performance_schema.processlist (information_schema.PROCESSLIST
// fails, error 3854, while any session runs a statement that is not valid utf8mb3);
// on MariaDB, which has no such table, information_schema.PROCESSLIST.
func Running(ctx context.Context, db *sql.DB, d sqllock.Dialect, substr string) (int, error) {
	pattern := "%" + strings.NewReplacer(`\`, `\\`, "%", `\%`, "_", `\_`).Replace(substr) + "%"
	q := `SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND state = 'active' AND query LIKE $1`
	if d == sqllock.MySQL {
		table, err := processlist(ctx, db)
		if err != nil {
			return 0, err
		}
		q = "SELECT COUNT(*) FROM " + table + " WHERE ID <> CONNECTION_ID() AND COMMAND <> 'Sleep' AND INFO LIKE ?"
	}
	var n int
	err := db.QueryRowContext(ctx, q, pattern).Scan(&n)
	return n, err
}

// processlist is the processlist table to read on the MySQL server behind db:
// performance_schema.processlist on MySQL (information_schema.PROCESSLIST fails
// there, error 3854, while any session runs a statement that is not valid utf8mb3),
// information_schema.PROCESSLIST on MariaDB, which has no such table.
func processlist(ctx context.Context, db *sql.DB) (string, error) {
	f, err := FlavorOf(ctx, db, sqllock.MySQL)
	if err != nil {
		return "", err
	}
	if f == FlavorMariaDB {
		return "information_schema.PROCESSLIST", nil
	}
	return "performance_schema.processlist", nil
}

// TableLockWaiters counts the sessions waiting for a table lock (a DDL statement,
// LOCK TABLE(S)): on PostgreSQL those that session holder blocks (pg_blocking_pids,
// as BlockedBy); on MySQL, which shows a metadata lock wait in the processlist state
// only, every session of db's current database in that state (holder is not used).
func TableLockWaiters(ctx context.Context, db *sql.DB, d sqllock.Dialect, holder int64) (int, error) {
	if d == sqllock.Postgres {
		return BlockedBy(ctx, db, d, holder)
	}
	table, err := processlist(ctx, db)
	if err != nil {
		return 0, err
	}
	var n int
	err = db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table+
		" WHERE DB = DATABASE() AND ID <> CONNECTION_ID() AND STATE = 'Waiting for table metadata lock'").Scan(&n)
	return n, err
}

// BlockedBy counts the sessions waiting for a row lock held by session holder (a
// backend pid, or a MySQL connection id): pg_blocking_pids on PostgreSQL,
// performance_schema.data_lock_waits on MySQL (information_schema.INNODB_LOCK_WAITS
// is gone since 8.0), information_schema.INNODB_LOCK_WAITS on MariaDB.
func BlockedBy(ctx context.Context, db *sql.DB, d sqllock.Dialect, holder int64) (int, error) {
	q := `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`
	if d == sqllock.MySQL {
		f, err := FlavorOf(ctx, db, d)
		if err != nil {
			return 0, err
		}
		q = `SELECT COUNT(*) FROM performance_schema.data_lock_waits w
JOIN performance_schema.threads t ON t.THREAD_ID = w.BLOCKING_THREAD_ID
WHERE t.PROCESSLIST_ID = ?`
		if f == FlavorMariaDB {
			q = `SELECT COUNT(*) FROM information_schema.INNODB_LOCK_WAITS w
JOIN information_schema.INNODB_TRX t ON t.trx_id = w.blocking_trx_id
WHERE t.trx_mysql_thread_id = ?`
		}
	}
	var n int
	err := db.QueryRowContext(ctx, q, holder).Scan(&n)
	return n, err
}

// AwaitBlockedBy polls until at least one session waits for a row lock that session
// holder holds (BlockedBy) while ready, if not nil, reports true, or until ready
// returns an error or ctx ends (an error that says what was last seen). ready runs
// first in each round, on the caller's goroutine. On MariaDB it polls every 200 ms:
// INNODB_LOCK_WAITS is served from a cache that a read refreshes only 0.1 s after the
// previous one (see WaitsForLock), so a faster poll may never see a wait begin;
// elsewhere every 10 ms.
func AwaitBlockedBy(ctx context.Context, db *sql.DB, d sqllock.Dialect, holder int64, ready func() (bool, error)) error {
	every := 10 * time.Millisecond
	if d == sqllock.MySQL {
		f, err := FlavorOf(ctx, db, d)
		if err != nil {
			return err
		}
		if f == FlavorMariaDB {
			every = 200 * time.Millisecond
		}
	}
	for {
		ok := true
		if ready != nil {
			var err error
			if ok, err = ready(); err != nil {
				return err
			}
		}
		n, err := BlockedBy(ctx, db, d, holder)
		if err != nil {
			return err
		}
		if ok && n > 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("testdb: %d sessions blocked by session %d, ready %v: %w", n, holder, ok, ctx.Err())
		case <-time.After(every):
		}
	}
}

// WaitsForLock reports whether session sid (a backend pid, or a MySQL connection id)
// waits for a lock: a row lock, or a session lock (pg_advisory_lock, GET_LOCK).
// PostgreSQL: pg_stat_activity (wait event type Lock covers both). MySQL 8+:
// performance_schema.data_lock_waits and the pending USER LEVEL LOCKs of
// performance_schema.metadata_locks (information_schema.INNODB_TRX and PROCESSLIST
// fail there, error 3854, while any session runs a statement that is not valid
// utf8mb3). MariaDB: the transactions of SHOW ENGINE INNODB STATUS, and the
// processlist state "User lock". Not information_schema.INNODB_TRX there: MariaDB
// serves it from a cache refreshed only by a read at least 0.1 s after the previous
// read (trx_i_s), so a poll every few milliseconds, or two processes polling, never
// see a wait begin (TestInterleavedDraws waited the 50 s of the lock timeout).
func WaitsForLock(ctx context.Context, db *sql.DB, d sqllock.Dialect, sid int64) (bool, error) {
	if d == sqllock.MySQL {
		f, err := FlavorOf(ctx, db, d)
		if err != nil {
			return false, err
		}
		if f == FlavorMariaDB {
			return mariaDBWaits(ctx, db, sid)
		}
	}
	q := `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`
	args := []any{sid}
	if d == sqllock.MySQL {
		q = `SELECT (SELECT COUNT(*) FROM performance_schema.data_lock_waits w
  JOIN performance_schema.threads t ON t.THREAD_ID = w.REQUESTING_THREAD_ID WHERE t.PROCESSLIST_ID = ?)
+ (SELECT COUNT(*) FROM performance_schema.metadata_locks m
  JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID
  WHERE t.PROCESSLIST_ID = ? AND m.OBJECT_TYPE = 'USER LEVEL LOCK' AND m.LOCK_STATUS = 'PENDING')`
		args = append(args, sid)
	}
	var n int
	err := db.QueryRowContext(ctx, q, args...).Scan(&n)
	return n > 0, err
}

// mariaDBWaits is WaitsForLock on MariaDB: a transaction of session sid in LOCK WAIT
// in SHOW ENGINE INNODB STATUS (made when asked, not cached), or the processlist
// state of a GET_LOCK wait.
func mariaDBWaits(ctx context.Context, db *sql.DB, sid int64) (bool, error) {
	var user int
	if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND STATE = 'User lock'`, sid).Scan(&user); err != nil {
		return false, err
	}
	if user > 0 {
		return true, nil
	}
	var typ, name, status string
	if err := db.QueryRowContext(ctx, "SHOW ENGINE INNODB STATUS").Scan(&typ, &name, &status); err != nil {
		return false, err
	}
	// One block per transaction: "---TRANSACTION id, ACTIVE ..." then, for a waiting
	// one, a line "LOCK WAIT ...", and "MariaDB thread id N, ...".
	thread := "thread id " + strconv.FormatInt(sid, 10) + ","
	for _, b := range strings.Split(status, "\n---TRANSACTION ")[1:] {
		if strings.Contains(b, thread) && strings.Contains(b, "\nLOCK WAIT ") {
			return true, nil
		}
	}
	return false, nil
}

// SessionID returns the server's id of the session q runs on (pg_backend_pid(),
// CONNECTION_ID()); q is a *sql.Conn or a *sql.Tx. It fails the test on error.
func SessionID(ctx context.Context, t testing.TB, d sqllock.Dialect, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) int64 {
	t.Helper()
	query := "SELECT pg_backend_pid()"
	if d == sqllock.MySQL {
		query = "SELECT CONNECTION_ID()"
	}
	var id int64
	if err := q.QueryRowContext(ctx, query).Scan(&id); err != nil {
		t.Fatalf("session id: %v", err)
	}
	return id
}

// Kill ends session sid from admin, as an operator or a failover would:
// pg_terminate_backend on PostgreSQL, KILL on MySQL (which takes no placeholder,
// 6413). The server ends the session asynchronously: wait for what the test needs
// (a failed statement, the session gone from the processlist). It fails the test if
// the server refuses or finds no such session (PostgreSQL).
func Kill(ctx context.Context, t testing.TB, admin *sql.DB, d sqllock.Dialect, sid int64) {
	t.Helper()
	var err error
	if d == sqllock.Postgres {
		var ok bool
		err = admin.QueryRowContext(ctx, "SELECT pg_terminate_backend($1)", sid).Scan(&ok)
		if err == nil && !ok {
			err = fmt.Errorf("pg_terminate_backend(%d) returned false", sid)
		}
	} else {
		_, err = admin.ExecContext(ctx, "KILL "+strconv.FormatInt(sid, 10))
	}
	if err != nil {
		t.Fatalf("killing session %d: %v", sid, err)
	}
}
