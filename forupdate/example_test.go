package forupdate_test

import (
	"context"
	"database/sql"
	"log"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
)

// The lock and the business write commit together: if the process or its session
// dies before WithLock returns, neither the write nor the token is committed.
func ExampleLocker_WithLock() {
	db, err := sql.Open("pgx", "postgres://app@db/app")
	if err != nil {
		log.Fatal(err)
	}
	db.SetMaxOpenConns(20)
	// At most 8 Lock calls of this process wait in the database at once; the others
	// wait in the process without holding a connection.
	locker, err := forupdate.New(db, sqllock.Postgres, forupdate.WithMaxWaiters(8))
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = locker.WithLock(ctx, "invoice/2026-11", func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, "UPDATE invoices SET issued = true WHERE month = '2026-11'")
		return err // nil commits, an error rolls back
	})
	if err != nil {
		log.Print(err)
	}
}

// A lease keeps the transaction open until Release (COMMIT) or Rollback.
func ExampleLocker_Lock() {
	db, _ := sql.Open("mysql", "app@tcp(db:3306)/app")
	locker, _ := forupdate.New(db, sqllock.MySQL, forupdate.WithMaxWaiters(4))
	defer locker.Close()
	ctx := context.Background()
	lease, err := locker.Lock(ctx, "report")
	if err != nil {
		log.Fatal(err)
	}
	if _, err := lease.Tx().ExecContext(ctx, "INSERT INTO reports (token) VALUES (?)", lease.Token()); err != nil {
		lease.Rollback(ctx)
		log.Fatal(err)
	}
	if err := lease.Release(ctx); err != nil { // COMMIT
		log.Print(err)
	}
}
