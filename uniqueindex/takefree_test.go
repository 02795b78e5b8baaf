package uniqueindex

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// TestTakeFreeMySQL: a Locker re-acquiring a name it was last granted takes the free
// row over with one UPDATE (takeFreeMySQL), and falls back to the full statement
// when the row is held or gone; tokens increase through every path: take-over,
// full takeover by another Locker, a miss, and a row swept by the reaper (the
// token then continues from the name's counter).
func TestTakeFreeMySQL(t *testing.T) {
	d := sqllock.MySQL
	admin := testdb.Open(t, d)
	a, b := newLocker(t, testdb.Open(t, d), d), newLocker(t, testdb.Open(t, d), d)
	var took []bool
	a.onTakeFree = func(granted bool) { took = append(took, granted) }
	ctx := testdb.Context(t, time.Minute)
	name := testdb.Name(t)

	var last int64
	cycle := func(l *Locker, step string, wantTook ...bool) {
		t.Helper()
		took = nil
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		if tok := le.Token(); tok <= last {
			t.Errorf("%s: token %d after %d", step, tok, last)
		} else {
			last = tok
		}
		if err := le.Release(ctx); err != nil {
			t.Fatalf("%s: release: %v", step, err)
		}
		if !slices.Equal(took, wantTook) {
			t.Errorf("%s: take-over attempts %v, want %v", step, took, wantTook)
		}
	}
	cycle(a, "first use")   // no row yet: the full statement inserts it
	cycle(a, "again", true) // the row is there and free: taken over
	cycle(a, "and again", true)
	cycle(b, "another Locker") // b was never granted it: the full statement

	// Held by b: a's take-over changes nothing, the full statement says held, and
	// a's next attempt skips the take-over.
	held, err := b.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	last = held.Token()
	for i, want := range [][]bool{{false}, nil} {
		took = nil
		if _, err := a.TryAcquire(ctx, name); !errors.Is(err, sqllock.ErrNotAcquired) {
			t.Fatalf("try %d while b holds: %v", i, err)
		}
		if !slices.Equal(took, want) {
			t.Errorf("try %d while b holds: take-over attempts %v, want %v", i, took, want)
		}
	}
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	cycle(a, "after b") // not last granted: the full statement
	cycle(a, "after b, again", true)

	// The row expired long ago and the reaper swept it (raising the name's counter
	// to its token first): the take-over finds no row, the full statement inserts
	// one with a larger token.
	if _, err := admin.ExecContext(ctx, "UPDATE sqllock_lease SET acquired_at = UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 HOUR WHERE lock_key = ?", namekey.Key(name)); err != nil {
		t.Fatal(err)
	}
	s, err := NewSweeper(testdb.Open(t, d), d, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if n, _, err := s.SweepBatch(ctx, 1000); err != nil || n < 1 {
		t.Fatalf("sweep: %d rows, %v", n, err)
	}
	cycle(a, "after the sweep", false)
	cycle(a, "after the sweep, again", true)

	// Reentrant acquisitions never try it (a nested one would always miss: the row is
	// its owner's, live).
	took = nil
	var held2 []sqllock.Lease
	for i := 0; i < 2; i++ {
		le, err := a.Acquire(ctx, name, sqllock.WithOwner("job"))
		if err != nil {
			t.Fatalf("reentrant acquisition %d: %v", i, err)
		}
		held2 = append(held2, le)
	}
	if len(took) != 0 {
		t.Errorf("reentrant acquisitions: take-over attempts %v, want none", took)
	}
	for _, le := range slices.Backward(held2) {
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
