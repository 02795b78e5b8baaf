package sqllock_test

import (
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// TestReleaseDuringKeepAlive: Release of a healthy lease whose keep-alive is under
// way returns nil and frees the lock at once. With 100ms latency each way and a
// keep-alive every 200ms, keep-alives run back to back, so every Release lands on
// one in flight. (Cancelling it broke the connection and turned the give-back into
// a false ErrLost: seen in CI as locktest's Partition case failing on the new
// holder's Release.)
func TestReleaseDuringKeepAlive(t *testing.T) {
	const ttl, keepalive, latency, rounds = 6 * time.Second, 200 * time.Millisecond, 100 * time.Millisecond, 5
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		var wg sync.WaitGroup
		defer wg.Wait()
		for _, s := range strategies {
			wg.Add(1)
			// Done after t.Run returns: a subtest that -run filters out never runs
			// its function.
			go func() {
				defer wg.Done()
				t.Run(s.name, func(t *testing.T) {
					db, proxy := testdb.OpenProxied(t, d)
					l := s.timed(t, db, d, ttl, keepalive)
					other := s.timed(t, testdb.Open(t, d), d, ttl, keepalive)
					name := testdb.Name(t)
					ctx := testdb.Context(t, 2*time.Minute)
					for r := 0; r < rounds; r++ {
						proxy.SetLatency(0)
						lease, err := l.Acquire(ctx, name)
						if err != nil {
							t.Fatalf("round %d: Acquire: %v", r, err)
						}
						proxy.SetLatency(latency)
						time.Sleep(keepalive * 5 / 2) // not synchronisation: let keep-alives run
						if err := lease.Err(); err != nil {
							t.Fatalf("round %d: lost with %v latency: %v", r, latency, err)
						}
						if err := lease.Release(ctx); err != nil {
							t.Fatalf("round %d: Release during a keep-alive = %v, want nil", r, err)
						}
						got, err := other.TryAcquire(ctx, name)
						if err != nil {
							t.Fatalf("round %d: TryAcquire right after Release: %v", r, err)
						}
						must(t, got.Release(ctx))
					}
				})
			}()
		}
	})
}
