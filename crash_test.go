package sqllock_test

import (
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// TestReleaseThenCrash: the row strategies release without waiting for the disk on
// PostgreSQL (README, Failover and replication). Whatever a crash of the server
// (SIGKILL, no shutdown) right after keeps of it, the lock is never granted twice
// and tokens never repeat:
//   - released, then acquired by another client, then the crash: the other
//     client's acquisition is durable, so after the restart a third client is
//     refused (the TTL outlasts the restart);
//   - released, then the crash: after the restart the lock is free (a new holder
//     gets a larger token) or, if the release was lost, still taken by the gone
//     holder until its TTL.
func TestReleaseThenCrash(t *testing.T) {
	const ttl = time.Minute
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		if !testdb.Restartable(t, d) {
			return
		}
		for _, s := range strategies {
			if s.name == "forupdate" || s.name == "advisory" {
				continue // session locks: a crash ends them (locktest's kill cases)
			}
			for _, handedOn := range []bool{true, false} {
				locker := func() sqllock.Locker { return s.timed(t, testdb.Open(t, d), d, ttl, ttl/4) }
				a, b := locker(), locker()
				name := testdb.Name(t, s.name)
				ctx := testdb.Context(t, 5*time.Minute)
				la, err := a.Acquire(ctx, name)
				if err != nil {
					t.Fatalf("%s: Acquire: %v", s.name, err)
				}
				last := la.Token()
				if err := la.Release(ctx); err != nil {
					t.Fatalf("%s: Release: %v", s.name, err)
				}
				if handedOn {
					lb, err := b.TryAcquire(ctx, name)
					if err != nil {
						t.Fatalf("%s: TryAcquire after Release: %v", s.name, err)
					}
					last = lb.Token()
					defer lb.Release(ctx) // after the checks: stops its keep-alive
				}
				crashed := time.Now()
				testdb.Crash(t, d)
				if took := time.Since(crashed); took > ttl/2 {
					t.Fatalf("%s: the crash and restart took %v, too long for the TTL %v", s.name, took, ttl)
				}
				lc, err := locker().TryAcquire(ctx, name)
				switch {
				case handedOn && err == nil:
					lc.Release(ctx)
					t.Errorf("%s: after a release, a new holder and a crash, a third client got the lock (token %d; the new holder's was %d): the new holder's acquisition was lost", s.name, lc.Token(), last)
				case handedOn && !errors.Is(err, sqllock.ErrNotAcquired):
					t.Errorf("%s: TryAcquire after the crash: %v", s.name, err)
				case handedOn:
					t.Logf("%s: the new holder's acquisition survived the crash", s.name)
				case err == nil:
					if lc.Token() <= last {
						t.Errorf("%s: token %d after the crash, not above %d", s.name, lc.Token(), last)
					}
					t.Logf("%s: the release survived the crash; new token %d > %d", s.name, lc.Token(), last)
					lc.Release(ctx)
				case errors.Is(err, sqllock.ErrNotAcquired):
					t.Logf("%s: the release was lost in the crash: the lock is held by the gone holder until its TTL", s.name)
				default:
					t.Errorf("%s: TryAcquire after the crash: %v", s.name, err)
				}
			}
		}
	})
}
