package fence_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/fence"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

func TestNextIncreases(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		db := testdb.Open(t, d)
		name := testdb.Name(t, "\x00binary\xff")
		if cur, err := fence.Current(ctx, db, d, name); err != nil || cur != 0 {
			t.Fatalf("Current of a new name = %d, %v; want 0", cur, err)
		}
		// Concurrent increments from many sessions: every value exactly once.
		const n = 40
		seen := make(chan int64, n)
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					tok, err := fence.Next(ctx, db, d, name)
					if err == nil {
						seen <- tok
						return
					}
					if ctx.Err() != nil {
						t.Error(err)
						return
					}
					// InnoDB may report a deadlock on concurrent first inserts: retry.
				}
			}()
		}
		wg.Wait()
		close(seen)
		got := map[int64]bool{}
		for tok := range seen {
			if got[tok] || tok < 1 || tok > n {
				t.Fatalf("token %d duplicated or out of range", tok)
			}
			got[tok] = true
		}
		if cur, err := fence.Current(ctx, db, d, name); err != nil || cur != n {
			t.Fatalf("Current = %d, %v; want %d", cur, err, n)
		}
		// In a rolled-back transaction the increment vanishes.
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if tok, err := fence.Next(ctx, tx, d, name); err != nil || tok != n+1 {
			t.Fatalf("Next in tx = %d, %v", tok, err)
		}
		tx.Rollback()
		if tok, err := fence.Next(ctx, db, d, name); err != nil || tok != n+1 {
			t.Fatalf("Next after rollback = %d, %v; want %d", tok, err, n+1)
		}
	})
}

// TestDrawnMySQLConcurrentFirstUse: sessions that draw at once in a run that has no
// epoch yet (a fresh database here; after a restart of the server alike) all get
// tokens, each session's strictly increasing and no two equal, and record few epochs
// (one per process, whichever session gets there first). A duplicate key or a
// deadlock between recorders never reaches them.
func TestDrawnMySQLConcurrentFirstUse(t *testing.T) {
	for _, run := range []fence.MySQLRun{{}, {NewestEpoch: true}} {
		t.Run(fmt.Sprintf("NewestEpoch=%v", run.NewestEpoch), func(t *testing.T) { concurrentFirstUse(t, run) })
	}
}

func concurrentFirstUse(t *testing.T, run fence.MySQLRun) {
	const d = sqllock.MySQL
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testdb.OpenIsolatedMigrated(ctx, t, d)
	const sessions, each = 16, 10
	toks := make(chan int64, sessions*each)
	var wg sync.WaitGroup
	for range sessions {
		wg.Go(func() {
			conn, err := db.Conn(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			defer conn.Close()
			var last int64
			for range each {
				tok, granted, err := run.Drawn(ctx, conn, run.Draw())
				if err != nil || !granted {
					t.Errorf("draw: %d %v %v", tok, granted, err)
					return
				}
				if tok <= last {
					t.Errorf("token %d after %d on one session", tok, last)
				}
				last = tok
				toks <- tok
			}
		})
	}
	wg.Wait()
	close(toks)
	seen := map[int64]bool{}
	for tok := range toks {
		if seen[tok] {
			t.Fatalf("token %d drawn twice", tok)
		}
		seen[tok] = true
	}
	var epochs int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM sqllock_epoch").Scan(&epochs); err != nil || epochs != 1 {
		t.Fatalf("%d epochs recorded (%v), want 1 (one process)", epochs, err)
	}
}
