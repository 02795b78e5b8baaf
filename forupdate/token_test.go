package forupdate_test

import (
	"database/sql"
	"testing"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/locktest"
)

// TestTokensAcrossCrash: on PostgreSQL a token drawn by a lease whose transaction
// never committed (the server is killed with SIGKILL while it is held, so neither
// the transaction nor the sequence's WAL need have reached the disk) is smaller than
// every token drawn after the restart: tokens carry the epoch of the server's run
// (fence.EpochPostgres). Not on MySQL: there tokens are AUTO_INCREMENT values, which
// InnoDB may hand out again after a crash (see the README's known limitations).
func TestTokensAcrossCrash(t *testing.T) {
	locktest.TokensAcrossCrash(t, sqllock.Postgres, func(t testing.TB, db *sql.DB) sqllock.Locker {
		return newLocker(t, db, sqllock.Postgres)
	})
}
