package forupdate

import "github.com/sqllock/sqllock"

// WaitState reports, for tests, how many Lock calls of l hold a waiter slot, how many
// wait in the process for one (after their NOWAIT attempt), and how many statements
// that may wait for a lock are under way.
func (l *Locker) WaitState() (slots, queued, inDB int) {
	return len(l.waiters), int(l.queued.Load()), int(l.inDB.Load())
}

// TokenSQL is, for tests, the SQL of a sqllock_rowlock row's token on dialect d, as
// CommittedToken reads it.
func TokenSQL(d sqllock.Dialect) string {
	if d == sqllock.MySQL {
		return myToken
	}
	return "token"
}
