// Package sqlerr classifies errors from pgx and go-sql-driver/mysql into the few
// classes the lock strategies act on.
package sqlerr

import (
	"context"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
)

// Class is what an error means to a lock strategy.
type Class int

const (
	Other          Class = iota
	Duplicate            // unique violation: 23505, 1062
	Deadlock             // 40P01, 1213, 3058 (user-level locks, MySQL 8 and later); Group Replication: 3101, 1180 carrying handler error 149
	Serialization        // 40001
	LockTimeout          // lock wait timed out or NOWAIT refused: 55P03, 1205, 3572
	Canceled             // statement cancelled: 57014, 1317, 3024
	SessionLost          // the session is gone: killed, closed, cut
	UndefinedTable       // a table, column or index is missing: 42P01, 42703, 1146, 1054, 1176
)

// Classify returns the class of err.
func Classify(err error) Class {
	if err == nil {
		return Other
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		switch {
		case pg.Code == "23505":
			return Duplicate
		case pg.Code == "40P01":
			return Deadlock
		case pg.Code == "40001":
			return Serialization
		case pg.Code == "55P03":
			return LockTimeout
		case pg.Code == "57014":
			return Canceled
		case pg.Code == "42P01", pg.Code == "42703":
			return UndefinedTable
		case strings.HasPrefix(pg.Code, "08"), pg.Code == "57P01", pg.Code == "57P02", pg.Code == "57P03", pg.Code == "25P03":
			// connection exceptions; admin_shutdown (pg_terminate_backend),
			// crash_shutdown, cannot_connect_now; idle_in_transaction_session_timeout
			return SessionLost
		}
		return Other
	}
	var my *mysql.MySQLError
	if errors.As(err, &my) {
		switch my.Number {
		case 1062:
			return Duplicate
		case 1213, 3058:
			return Deadlock
		case 3101:
			// ER_TRANSACTION_ROLLBACK_DURING_COMMIT: Group Replication's certification
			// found a concurrent change of the same row on another member and rolled
			// this transaction back, nothing committed: what Galera reports as 1213.
			return Deadlock
		case 1180:
			// ER_ERROR_DURING_COMMIT carrying the storage engine's lock deadlock
			// (handler error 149): on Group Replication, a transaction the applier of
			// another member's conflicting change rolled back. Other 1180s stay Other.
			if strings.Contains(my.Message, "error 149 ") {
				return Deadlock
			}
		case 1205, 3572:
			return LockTimeout

		case 1317, 3024:
			return Canceled
		case 1146, 1054, 1176: // 1176: FORCE INDEX of an index a migration adds
			return UndefinedTable
		case 1927, 2006, 2013, 1053, 4031:
			// connection killed, server gone, lost connection, shutdown, idle timeout
			return SessionLost
		}
		return Other
	}
	switch {
	case errors.Is(err, driver.ErrBadConn), errors.Is(err, mysql.ErrInvalidConn),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed):
		return SessionLost
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return Other
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return SessionLost
	}
	var oe *net.OpError
	if errors.As(err, &oe) {
		return SessionLost
	}
	if pgconn.SafeToRetry(err) {
		return SessionLost
	}
	s := err.Error()
	if strings.Contains(s, "conn closed") || strings.Contains(s, "connection reset") || strings.Contains(s, "broken pipe") {
		return SessionLost
	}
	return Other
}

// Transient reports whether err is a conflict that a new attempt may not meet again:
// duplicate key, deadlock, serialization failure or lock wait timeout.
func Transient(err error) bool {
	switch Classify(err) {
	case Duplicate, Deadlock, Serialization, LockTimeout:
		return true
	}
	return false
}

// Is reports whether err is of class c.
func Is(err error, c Class) bool { return Classify(err) == c }

// PooledStatement reports whether err says that a prepared statement went missing
// (26000) or exists twice (42P05) on the server session: what a
// transaction-pooling proxy causes with pgx's statement cache, the statements of one
// client connection landing on several server backends.
func PooledStatement(err error) bool { return IsCode(err, "42P05") || IsCode(err, "26000") }

// IsCode reports whether err is a PostgreSQL error with SQLSTATE code, or a MySQL
// error whose number, in decimal, is code.
func IsCode(err error, code string) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code == code
	}
	var my *mysql.MySQLError
	if errors.As(err, &my) {
		return strconv.Itoa(int(my.Number)) == code
	}
	return false
}
