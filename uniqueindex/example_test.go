package uniqueindex_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/migrations"
	"github.com/sqllock/sqllock/uniqueindex"
)

// Acquire a lease, fence a business write with it, and release it. (The example needs
// a database, so it is compiled but not run by go test; the integration tests run the
// same calls.)
func Example() {
	dsn := os.Getenv("DATABASE_URL") // postgres://user@host:5432/db
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := migrations.Up(ctx, db, sqllock.Postgres); err != nil {
		log.Fatal(err)
	}
	locker, err := uniqueindex.New(db, sqllock.Postgres, uniqueindex.WithTTL(30*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	lease, err := locker.Acquire(ctx, "example/nightly-report")
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(ctx)

	// The business write commits only if the lease is still the current holder:
	// Check is the transaction's last statement before COMMIT.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback()
	// ... tx.ExecContext(ctx, "UPDATE reports SET ... WHERE fence_token < $1", lease.Token()) ...
	if err := lease.(*uniqueindex.Lease).Check(ctx, tx); err != nil {
		log.Fatal(err) // matches sqllock.ErrLost: roll back
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("fenced write committed with token", lease.Token())
}

// An operator revokes the lease of a stuck job: its holder reports sqllock.ErrLost at
// its next renewal, and the lock is free once the lease expires.
func ExampleForceRelease() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	err = uniqueindex.ForceRelease(ctx, db, sqllock.Postgres, "example/nightly-report", false)
	switch {
	case errors.Is(err, sqllock.ErrNotHeld):
		fmt.Println("nobody holds it")
	case err != nil:
		log.Fatal(err)
	default:
		fmt.Println("revoked")
	}
}
