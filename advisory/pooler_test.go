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

// TestDeallocatedStatements: on a direct session, pgx's statement cache meets 26000
// (prepared statement does not exist) after the application ran DEALLOCATE ALL on a
// pooled connection, as behind a transaction-pooling proxy. That alone is not the
// proxy: the Locker goes on (no ErrUnsafeDeployment), and its unlock, which the
// cache prepared, runs again by the simple protocol and releases.
func TestDeallocatedStatements(t *testing.T) {
	d := sqllock.Postgres
	db := testdb.Open(t, d) // pgx's default statement cache
	db.SetMaxOpenConns(1)   // the application's DEALLOCATE runs on the Locker's session
	l := newLocker(t, db, d)
	ctx := testdb.Context(t, time.Minute)
	name := testdb.Name(t)
	deallocate := func() {
		t.Helper()
		if _, err := db.ExecContext(ctx, "DEALLOCATE ALL"); err != nil {
			t.Fatal(err)
		}
	}
	le, err := l.TryAcquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
	deallocate()
	acquired := 0
	for i := range 3 {
		le, err := l.TryAcquire(ctx, name)
		if errors.Is(err, sqllock.ErrUnsafeDeployment) {
			t.Fatalf("attempt %d after DEALLOCATE ALL: %v; a direct session taken for a pooler", i, err)
		}
		if err != nil {
			t.Logf("attempt %d after DEALLOCATE ALL: %v", i, err) // pgx drops the stale entry
			continue
		}
		acquired++
		if err := le.Release(ctx); err != nil {
			t.Fatalf("attempt %d: Release: %v", i, err)
		}
		deallocate() // the unlock's statement too, before the next Release
	}
	if acquired == 0 {
		t.Fatal("no acquisition in 3 attempts after DEALLOCATE ALL")
	}
	// Nothing is left: a Locker of another pool takes the name at once.
	le, err = newLocker(t, testdb.Open(t, d), d).TryAcquire(ctx, name)
	if err != nil {
		t.Fatalf("another Locker after the releases: %v", err)
	}
	le.Release(ctx)
}
