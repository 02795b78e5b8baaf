package advisory_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/testdb"
)

// TestStatementsPerAcquisition counts the statements the Locker sends (the release
// included), with and without tokens: 2 per uncontended acquisition (the locking
// statement, which also draws the token, and the unlock), and with several Lockers
// of their own pools contending for one name at most 3 with a token (the waiting
// lock, the draw, the unlock) and 2 without. A few more are allowed for what
// happens once per Locker: a session new from the pool (its bound is set, and on
// MySQL its first lock statement also reads CONNECTION_ID()) and the first attempt
// that finds the name held.
func TestStatementsPerAcquisition(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, token := range []bool{false, true} {
			sub := "without-token"
			if token {
				sub = "with-token"
			}
			t.Run(sub, func(t *testing.T) {
				var opts []advisory.Option
				if !token {
					opts = append(opts, advisory.WithoutToken())
				}
				ctx := testdb.Context(t, time.Minute)
				var sent atomic.Int64
				name := testdb.Name(t)

				l := newLocker(t, testdb.OpenCounting(t, d, &sent), d, opts...)
				cycle := func(l *advisory.Locker, try bool) {
					t.Helper()
					le, err := acquire(ctx, l, name, try)
					if err != nil {
						t.Error(err)
						return
					}
					if err := le.Release(ctx); err != nil {
						t.Error(err)
					}
				}
				cycle(l, false) // the session's first use
				const n = 20
				sent.Store(0)
				for i := range n {
					cycle(l, i%2 == 0)
				}
				// Slack: the Locker may give a kept session back and set up a new one.
				if got := sent.Load(); got > 2*n+4 {
					t.Errorf("uncontended: %d statements for %d acquisitions, want 2 each", got, n)
				}

				const lockers, each = 4, 15
				ls := make([]*advisory.Locker, lockers)
				for i := range ls {
					ls[i] = newLocker(t, testdb.OpenCounting(t, d, &sent), d, opts...)
					cycle(ls[i], false)
				}
				sent.Store(0)
				var wg sync.WaitGroup
				for _, l := range ls {
					wg.Go(func() {
						for range each {
							le, err := l.Acquire(ctx, name)
							if err != nil {
								t.Error(err)
								return
							}
							time.Sleep(time.Millisecond) // the work under the lock
							if err := le.Release(context.WithoutCancel(ctx)); err != nil {
								t.Error(err)
							}
						}
					})
				}
				wg.Wait()
				per := int64(2)
				if token && d == sqllock.MySQL {
					per = 3
				}
				if got := sent.Load(); got > per*lockers*each+2*lockers {
					t.Errorf("%d Lockers contending: %d statements for %d acquisitions, want at most %d each",
						lockers, got, lockers*each, per)
				} else {
					t.Logf("%d Lockers contending: %.2f statements per acquisition", lockers, float64(got)/(lockers*each))
				}
			})
		}
	})
}
