package sqllock_test

import (
	"errors"
	"os"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

// The strategies that record their holders.
var _ = []sqllock.HolderInspector{(*uniqueindex.Locker)(nil), (*optimistic.Locker)(nil), (*fairqueue.Locker)(nil)}

// forEachStrategy runs f as a subtest for each dialect and strategy, with a leak
// check registered before f opens anything.
func forEachStrategy(t *testing.T, f func(t *testing.T, d sqllock.Dialect, s strategy)) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		for _, s := range strategies {
			t.Run(s.name, func(t *testing.T) {
				testdb.CheckLeaks(t)
				f(t, d, s)
			})
		}
	})
}

// inspects reports whether the strategy named s records its holders.
func inspects(s string) bool { return s == "uniqueindex" || s == "optimistic" || s == "fairqueue" }

// TestLeader: Leader reports the holder's host, pid, token and grant time, and
// ErrNoHolder before the lock is taken and after it is released, with every strategy
// that records holders; advisory and forupdate answer ErrUnsupported (also matching
// errors.ErrUnsupported), and so does a fairqueue semaphore.
func TestLeader(t *testing.T) {
	host, _ := os.Hostname()
	forEachStrategy(t, func(t *testing.T, d sqllock.Dialect, s strategy) {
		ctx := testdb.Context(t, time.Minute)
		l := s.newShort(t, testdb.Open(t, d), d)
		name := testdb.Name(t, s.name)
		_, err := sqllock.Leader(ctx, l, name)
		if !inspects(s.name) {
			if !errors.Is(err, sqllock.ErrUnsupported) || !errors.Is(err, errors.ErrUnsupported) {
				t.Fatalf("Leader = %v, want an error matching ErrUnsupported and errors.ErrUnsupported", err)
			}
			return
		}
		if !errors.Is(err, sqllock.ErrNoHolder) {
			t.Fatalf("Leader of a free lock = %v, want ErrNoHolder", err)
		}
		before := time.Now()
		lease, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		h, err := sqllock.Leader(ctx, l, name)
		if err != nil {
			t.Fatalf("Leader of a held lock: %v", err)
		}
		if h.Name != name || h.Token != lease.Token() || h.Host != host || h.PID != int64(os.Getpid()) {
			t.Errorf("Leader = %+v, want name %q, token %d, host %q, pid %d", h, name, lease.Token(), host, os.Getpid())
		}
		// Since is on the database clock: the server runs on this machine here.
		if h.Since.Before(before.Add(-5*time.Second)) || h.Since.After(time.Now().Add(5*time.Second)) || h.Since.Location() != time.UTC {
			t.Errorf("Since = %v, want about %v (UTC)", h.Since, before.UTC())
		}
		if h.Remaining <= 0 || h.Remaining > 3*time.Second {
			t.Errorf("Remaining = %v, want in (0, TTL]", h.Remaining)
		}
		if err := lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if h, err := sqllock.Leader(ctx, l, name); !errors.Is(err, sqllock.ErrNoHolder) {
			t.Fatalf("Leader after Release = %+v, %v; want ErrNoHolder", h, err)
		}
		if s.name == "fairqueue" {
			sem, err := fairqueue.NewSemaphore(testdb.Open(t, d), d, 2)
			must(t, err)
			defer sem.Close()
			if _, err := sqllock.Leader(ctx, sem, name); !errors.Is(err, sqllock.ErrUnsupported) {
				t.Errorf("Leader of a semaphore = %v, want ErrUnsupported", err)
			}
		}
	})
}

// TestLeaderInvalidName: Leader checks the name before any SQL.
func TestLeaderInvalidName(t *testing.T) {
	if _, err := sqllock.Leader(t.Context(), &memLocker{}, ""); !errors.Is(err, sqllock.ErrInvalidName) {
		t.Fatalf("Leader(\"\") = %v, want ErrInvalidName", err)
	}
}
