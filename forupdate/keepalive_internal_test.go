package forupdate

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// TestKeepaliveSessionIdentity: on PostgreSQL a live session with the lease's pid
// that started after the lease (a dead session's pid reused) is not the lease's
// session: the keepalive reports the lease lost.
func TestKeepaliveSessionIdentity(t *testing.T) {
	d := sqllock.Postgres
	db := testdb.Open(t, d) // may start the server's container: before the deadline
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := New(db, d, WithKeepalive(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var since time.Time
	if err := tx.QueryRowContext(ctx, "SELECT now()").Scan(&since); err != nil {
		t.Fatal(err)
	}
	// A session started after the lease's transaction, kept open.
	later, err := testdb.Open(t, d).Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer later.Close()
	var pid int64
	if err := later.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	lease := l.newLease("reused-pid", namekey.Key("reused-pid"), grant{sid: pid, since: since}, conn, tx, waitTarget{}, time.Now())
	defer lease.Rollback(ctx)
	select {
	case <-lease.Done():
	case <-ctx.Done():
		t.Fatal("the keepalive took a later session with the same pid for the lease's")
	}
	if err := lease.Err(); !errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Err = %v, want ErrLost", err)
	}
}
