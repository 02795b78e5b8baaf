package reaper_test

import (
	"context"
	"database/sql"
	"log"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/reaper"
)

// Run the reaper on every node: batches are short and concurrent reapers do not
// block each other.
func Example() {
	var db *sql.DB // opened by the application, migrated with migrations.Up
	r, err := reaper.New(db, sqllock.Postgres,
		reaper.WithSchedule("@every 5m"), reaper.WithGrace(10*time.Minute), reaper.WithBatchSize(500))
	if err != nil {
		log.Fatal(err)
	}
	r.Start()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		r.Stop(ctx)
	}()
	// ... serve ...
}
