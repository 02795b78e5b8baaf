package optimistic_test

import (
	"context"
	"database/sql"
	"errors"
	"log"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/optimistic"
)

// A lock whose fencing token is a version: the protected resource keeps the highest
// version it has seen and refuses writes that carry a lower one.
func Example() {
	db, err := sql.Open("pgx", "postgres://app@db.internal/app")
	if err != nil {
		log.Fatal(err)
	}
	locker, err := optimistic.New(db, sqllock.Postgres, optimistic.WithTTL(30*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = sqllock.Do(ctx, locker, "reports/nightly", func(ctx context.Context) error {
		return nil // the job; ctx ends if the lease is lost
	})
	if errors.Is(err, sqllock.ErrNotAcquired) {
		log.Print("another replica runs the report")
	}
}

// Compare-and-swap on the caller's own row: accounts(id, balance, version). Each
// attempt reads the row and swaps from the version it read; Retry re-runs it when
// another writer got there first.
func ExampleRetry() {
	db, err := sql.Open("pgx", "postgres://app@db.internal/app")
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	deposit := func(ctx context.Context) error {
		var balance, version int64
		err := db.QueryRowContext(ctx, "SELECT balance, version FROM accounts WHERE id = $1", 42).Scan(&balance, &version)
		if err != nil {
			return err
		}
		return optimistic.Swap(ctx, db,
			"UPDATE accounts SET balance = $1, version = $2 WHERE id = $3 AND version = $4",
			balance+100, version+1, 42, version)
	}
	err = optimistic.Retry(ctx, deposit, optimistic.WithAttempts(20))
	if errors.Is(err, optimistic.ErrConflict) {
		log.Print("too many concurrent writers: try again later")
	}
}
