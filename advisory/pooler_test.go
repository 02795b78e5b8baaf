package advisory_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/testdb"
)

// TestForeignSessionStampRefuses: a session that carries another client
// connection's stamp (what a transaction-pooling proxy hands out: a backend another
// client used) makes the Locker refuse with ErrUnsafeDeployment, give back what its
// statement took, and refuse from then on. The stamp is forced here with a startup
// parameter on a real server; the ha suite shows it through pgbouncer. A plain
// session is accepted (every other test of the package).
func TestForeignSessionStampRefuses(t *testing.T) {
	d := sqllock.Postgres
	cfg, err := pgx.ParseConfig(testdb.DSN(t, d))
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["sqllock.session"] = "another-client"
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { db.Close() })
	l, err := advisory.New(db, d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ctx := testdb.Context(t, time.Minute)
	name := testdb.Name(t)
	for i, acquire := range []func() (sqllock.Lease, error){
		func() (sqllock.Lease, error) { return l.TryAcquire(ctx, name) },
		func() (sqllock.Lease, error) { return l.Acquire(ctx, name) },
	} {
		le, err := acquire()
		if le != nil || !errors.Is(err, sqllock.ErrUnsafeDeployment) || !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Fatalf("attempt %d: lease %v, err %v; want ErrUnsafeDeployment", i, le, err)
		}
		t.Logf("attempt %d: %v", i, err)
	}
	// Nothing is held: a Locker on a plain session takes the name at once.
	plain, err := advisory.New(testdb.Open(t, d), d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plain.Close() })
	le, err := plain.TryAcquire(ctx, name)
	if err != nil {
		t.Fatalf("a plain session: %v", err)
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// AcquireTx, scoped to a transaction, is not refused.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := l.AcquireTx(ctx, tx, name); err != nil {
		t.Fatalf("AcquireTx after the refusal: %v", err)
	}
}
