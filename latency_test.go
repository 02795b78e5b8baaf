package sqllock_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/testdb"
)

// TestLatencyTolerance: the README's timing rule holds for every strategy on both
// databases: a lease survives keep-alives that take less than the smaller of
// TTL - TTL/5 - interval (a keep-alive sent an interval after the last must
// return before the local deadline) and (TTL - TTL/5)/2 (when keep-alives take
// longer than the interval, they run back to back): 2.4s with TTL 6s and a
// keep-alive every 2s. A keep-alive costs keepAliveTrips round trips at most, so
// a holder whose connections get 0.7 of the limit divided by those as round-trip
// latency keeps its lease for four TTLs, and one that gets 1.6 of the limit (a
// single round trip is too long) is told of the loss (Done, ErrLost) within those
// four TTLs rather than holding on past its deadline. The lease is taken before
// the latency starts: this is the keep-alive's tolerance (locktest's Latency case
// covers a slow acquisition with the default options).
func TestLatencyTolerance(t *testing.T) {
	const ttl, keepalive = 6 * time.Second, 2 * time.Second
	const limit = min(ttl-ttl/5-keepalive, (ttl-ttl/5)/2)
	cases := []struct {
		name string
		lose bool
	}{{"within", false}, {"beyond", true}}
	const hold = 4 * ttl
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		// All cases at once (they mostly wait), not limited by -parallel: t.Run from
		// goroutines.
		var wg sync.WaitGroup
		defer wg.Wait()
		for _, s := range strategies {
			for _, c := range cases {
				trips, less := keepAliveTrips(s.name, d)
				tolerated := (limit - less) / time.Duration(trips) // round trip
				// 0.7: the rest is for the machine. At 0.8 (384 ms for forupdate on
				// PostgreSQL) a keep-alive on a loaded 2-core CI machine took 0.9 s
				// more than its 5 round trips, and the lease ended.
				rtt := tolerated * 7 / 10
				if c.lose {
					rtt = limit * 16 / 10
				}
				wg.Add(1)
				// Done after t.Run returns: a subtest that -run filters out never
				// runs its function.
				go func() {
					defer wg.Done()
					t.Run(s.name+"/"+c.name, func(t *testing.T) {
						db, proxy := testdb.OpenProxied(t, d)
						l := s.timed(t, db, d, ttl, keepalive)
						ctx := testdb.Context(t, hold+time.Minute)
						lease, err := l.Acquire(ctx, testdb.Name(t))
						if err != nil {
							t.Fatal(err)
						}
						proxy.SetLatency(rtt / 2)
						start := time.Now()
						end := time.After(hold)
						// forupdate on MySQL: only the caller's statements keep the lock
						// transaction alive (README, Known limitations): work in it.
						var work <-chan time.Time
						fl, isTx := lease.(*forupdate.Lease)
						if isTx && d == sqllock.MySQL {
							tick := time.NewTicker(time.Second)
							defer tick.Stop()
							work = tick.C
						}
						lost := false
					wait:
						for {
							select {
							case <-lease.Done():
								lost = true
								break wait
							case <-end:
								break wait
							case <-work:
								fl.Tx().ExecContext(ctx, "SELECT 1") // an error shows as a loss
							}
						}
						took := time.Since(start).Round(time.Millisecond)
						switch {
						case lost && !c.lose:
							t.Errorf("round trip %v (tolerated %v): lease lost after %v: %v", rtt, tolerated, took, lease.Err())
						case !lost && c.lose:
							t.Errorf("round trip %v (tolerated %v): lease still held after %v, Err %v", rtt, tolerated, took, lease.Err())
						case lost && !errors.Is(lease.Err(), sqllock.ErrLost):
							t.Errorf("Err after the loss = %v, want ErrLost", lease.Err())
						case lost:
							t.Logf("round trip %v (tolerated %v): told of the loss after %v: %v", rtt, tolerated, took, lease.Err())
						}
						err = lease.Release(ctx)
						if c.lose && !errors.Is(err, sqllock.ErrLost) {
							t.Errorf("Release after the loss = %v, want ErrLost", err)
						}
						if !c.lose && err != nil {
							t.Errorf("Release with round trip %v = %v", rtt, err)
						}
					})
				}()
			}
		}
	})
}

// keepAliveTrips returns the round trips one keep-alive of a strategy costs at most
// (the first one, which prepares its statement on the connection; README, Timing),
// and how much of the limit a strategy loses otherwise.
func keepAliveTrips(strategy string, d sqllock.Dialect) (trips int, less time.Duration) {
	// pgx's database/sql driver pings a pooled connection idle for over a second
	// before handing it out again: one more round trip on PostgreSQL.
	switch {
	case strategy == "forupdate" && d == sqllock.Postgres:
		// The check from a pooled connection (ping, prepare, run) and the touch of
		// the transaction (prepare, run).
		return 5, 0
	case strategy == "forupdate":
		// One check (literals: nothing to prepare); the session's idle time since the
		// caller's last statement (here up to 1s), rounded up to whole seconds, counts
		// against the bound.
		return 1, 2 * time.Second
	case strategy == "advisory" && d == sqllock.Postgres:
		return 2, 0 // its own session: prepare, run
	case strategy == "advisory":
		return 1, 0 // text protocol: nothing to prepare
	case d == sqllock.Postgres:
		return 3, 0 // ping, prepare, run
	}
	return 2, 0 // prepare, run
}
