package advisory_test

import (
	"context"
	"database/sql"
	"errors"
	"log"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
)

func Example() {
	db, err := sql.Open("pgx", "postgres://app@db.internal/app")
	if err != nil {
		log.Fatal(err)
	}
	locker, err := advisory.New(db, sqllock.Postgres, advisory.WithKeepalive(2*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// Do holds the lock while fn runs; fn's ctx is cancelled if the session dies.
	err = sqllock.Do(ctx, locker, "nightly-report", func(ctx context.Context) error {
		return nil // work protected by the lock
	})
	if errors.Is(err, sqllock.ErrNotAcquired) {
		log.Print("someone else is running the report")
	}

	// Behind pgbouncer in transaction mode: a lock that lives as long as tx.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback()
	token, err := locker.AcquireTx(ctx, tx, "invoice-42")
	if err != nil {
		log.Fatal(err)
	}
	_, err = tx.ExecContext(ctx, "UPDATE invoices SET state = 'sent', fence = $1 WHERE id = 42", token)
	if err == nil {
		err = tx.Commit() // releases the lock
	}
	if err != nil {
		log.Fatal(err)
	}
}
