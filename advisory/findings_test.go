package advisory_test

// Regression tests of the review findings on commit 7748e60 that concern advisory
// (one test per finding, TestFindingNN...). Each asserts what the fix changed.
// Finding 15 (the window after an operator's kill) is locktest's KillWindow case,
// set in TestLocktest.

import (
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

// closed reports whether ch is closed, without waiting.
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestFinding03PartitionedSessionFreed: a holder cut off from the database (no FIN,
// no RST) used to keep its session, and the lock, on the server for as long as TCP
// took to give up: hours. With a TTL the server ends the idle session within it, and
// the holder is told (Done) before the lock is free.
func TestFinding03PartitionedSessionFreed(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const ttl = 2 * time.Second
		holderDB, proxy := testdb.OpenProxied(t, d)
		admin := testdb.Open(t, d)
		l := newLocker(t, holderDB, d, advisory.WithTTL(ttl), advisory.WithKeepalive(500*time.Millisecond))
		name := testdb.Name(t)
		lease, err := l.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		if n := serverHolds(t, admin, d, l, name); n != 1 {
			t.Fatalf("%d sessions hold the lock on the server, want 1", n)
		}
		proxy.Partition() // never healed: the proxy's cleanup resets its connections
		cut := time.Now()
		limit := ttl + 2*time.Second
		var doneAt time.Duration = -1 // when Done was first seen closed
		toldWhileHeld := false        // a poll saw the lock held after Done had closed
		for {
			doneBefore := closed(lease.Done())
			if doneBefore && doneAt < 0 {
				doneAt = time.Since(cut)
			}
			if serverHolds(t, admin, d, l, name) == 0 {
				break
			}
			toldWhileHeld = toldWhileHeld || doneBefore
			if time.Since(cut) > limit+10*time.Second {
				t.Fatalf("the partitioned holder's lock still held on the server %v after the partition (Done closed: %v)",
					time.Since(cut).Round(time.Millisecond), closed(lease.Done()))
			}
			time.Sleep(20 * time.Millisecond) // polling the server: there is no signal to wait on
		}
		freed := time.Since(cut)
		t.Logf("TTL %v: holder told (Done) %v after the partition, lock free on the server %v after it",
			ttl, doneAt.Round(time.Millisecond), freed.Round(time.Millisecond))
		if freed > limit {
			t.Errorf("lock free on the server %v after the partition, want within TTL + 2s = %v", freed, limit)
		}
		if !toldWhileHeld {
			t.Errorf("Done was not closed while the server still held the lock (Done seen at %v, free at %v)", doneAt, freed)
		}
		if err := lease.Err(); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Err = %v, want ErrLost", err)
		}
		if err := lease.Release(testdb.Context(t, 30*time.Second)); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release after the loss = %v, want ErrLost", err)
		}
	})
}

// TestLocktestWithoutToken: the conformance suite with WithoutToken Lockers, with
// the settings of TestLocktest.
func TestLocktestWithoutToken(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		const ttl = 3 * time.Second
		locktest.Run(t, locktest.Config{
			Dialect: d,
			New: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d, advisory.WithTTL(ttl), advisory.WithKeepalive(500*time.Millisecond), advisory.WithoutToken())
			},
			Lose:           func(t testing.TB, admin *sql.DB, lease sqllock.Lease) { kill(t, admin, d, lease) },
			NoTokens:       true,
			PartitionBound: ttl + 2*time.Second, // the server's timer and a loaded CI machine: up to 2 s late
			NewDefault: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d, advisory.WithoutToken())
			},
		})
	})
}
