package fence_test

import (
	"context"
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
