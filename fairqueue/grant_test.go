package fairqueue_test

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// slowPoll makes only a wake-up (a NOTIFY, a release in the process) end a waiter's
// sleep within a test's time.
var slowPoll = fairqueue.WithPollInterval(10 * time.Minute)

// waitFor waits for an Acquire started by go to return, or fails the test.
func waitFor(t *testing.T, got <-chan error, what string) {
	t.Helper()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: not granted in 30s (its poll interval is 10 minutes)", what)
	}
}

// TestGranteeGoesInWithoutStatement: on PostgreSQL the release that makes a waiter of
// another process the holder names its ticket in the NOTIFY, and the waiter holds the
// lock without a statement of its own: its whole Acquire is the one statement that
// drew its ticket and looked at its predecessor. (A waiter that had to look again
// after the wake-up would send two or more.)
func TestGranteeGoesInWithoutStatement(t *testing.T) {
	d := sqllock.Postgres
	ctx := testdb.Context(t, 2*time.Minute)
	admin := testdb.Open(t, d)
	holder := newLocker(t, testdb.Open(t, d), d, slowPoll)
	var sent atomic.Int64
	waiter := newLocker(t, testdb.OpenCounting(t, d, &sent), d, slowPoll)
	name := testdb.Name(t)

	listen(t, ctx, admin, func(next func() string) {
		wait := func(round int) int64 {
			held, err := holder.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			before, _ := drawn(ctx, admin, d, name)
			got := make(chan error, 1)
			var le sqllock.Lease
			start := sent.Load()
			go func() {
				var err error
				le, err = waiter.Acquire(ctx, name)
				got <- err
			}()
			waitDrawn(t, ctx, admin, d, name, before+1) // the waiter's ticket is in
			if round == 1 {
				// The first wait of a Locker starts its listener, which wakes its
				// waiters once it listens (a release before that would be missed) and
				// sends a probe NOTIFY through the pool: its signal that it listens.
				for !strings.HasPrefix(next(), "sqllock-probe-") {
				}
			}
			if err := held.Release(ctx); err != nil {
				t.Fatal(err)
			}
			waitFor(t, got, "waiter")
			n := sent.Load() - start
			if le.Token() != before+1 {
				t.Errorf("round %d: token %d, want %d", round, le.Token(), before+1)
			}
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
			return n
		}
		wait(1)
		for round := 2; round <= 5; round++ {
			if n := wait(round); n != 1 {
				t.Errorf("round %d: the waiter's Acquire sent %d statements, want 1 (the draw and first look; granted by the release's NOTIFY)", round, n)
			}
		}
	})
}

// listen runs f with a connection that LISTENs on fairqueue's channel.
func listen(t *testing.T, ctx context.Context, db *sql.DB, f func(next func() string)) {
	t.Helper()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	err = conn.Raw(func(dc any) error {
		pc := dc.(*stdlib.Conn).Conn()
		if _, err := pc.Exec(ctx, "LISTEN sqllock_fairqueue"); err != nil {
			return err
		}
		defer pc.Exec(context.WithoutCancel(ctx), "UNLISTEN sqllock_fairqueue")
		f(func() string {
			n, err := pc.WaitForNotification(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return n.Payload
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestNotifyOnlyWhenWaited: on PostgreSQL a release sends its NOTIFY (which
// serialises the commits of the whole database) only if a ticket after its own
// exists: an uncontended Acquire+Release and a refused TryAcquire send none; a
// release with a waiter in another process sends one that names the released ticket
// and the waiter's, its grant; the same with a semaphore of two permits, whose
// release grants the second-lowest ticket left.
func TestNotifyOnlyWhenWaited(t *testing.T) {
	d := sqllock.Postgres
	ctx := testdb.Context(t, 2*time.Minute)
	admin := testdb.Open(t, d)
	listen(t, ctx, admin, func(next func() string) {
		for _, permits := range []int{1, 2} {
			newL := func() *fairqueue.Locker {
				l, err := fairqueue.NewSemaphore(testdb.Open(t, d), d, permits, slowPoll)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { l.Close() })
				return l
			}
			a, b := newL(), newL()
			quiet, waited := testdb.Name(t, "quiet"), testdb.Name(t, "waited")

			// Uncontended, and a refused TryAcquire: no NOTIFY.
			var held []sqllock.Lease
			for range permits {
				le, err := a.Acquire(ctx, quiet)
				if err != nil {
					t.Fatal(err)
				}
				held = append(held, le)
			}
			if _, err := b.TryAcquire(ctx, quiet); !errors.Is(err, sqllock.ErrNotAcquired) {
				t.Fatalf("TryAcquire of a held lock: %v", err)
			}
			for _, le := range held {
				if err := le.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}

			// Contended: the release names the waiter's ticket.
			held = held[:0]
			for range permits {
				le, err := a.Acquire(ctx, waited)
				if err != nil {
					t.Fatal(err)
				}
				held = append(held, le)
			}
			before, _ := drawn(ctx, admin, d, waited)
			got := make(chan error, 1)
			go func() {
				le, err := b.Acquire(ctx, waited)
				if err == nil {
					err = le.Release(ctx)
				}
				got <- err
			}()
			waitDrawn(t, ctx, admin, d, waited, before+1)
			released := held[0].Token()
			if err := held[0].Release(ctx); err != nil {
				t.Fatal(err)
			}
			waitFor(t, got, "waiter")
			for _, le := range held[1:] {
				le.Release(ctx)
			}

			// Notifications come in commit order: the quiet releases, had they
			// notified, would come first.
			want := hex.EncodeToString(namekey.Key(waited)) + ":" + strconv.FormatInt(released, 10) + ":g" + strconv.FormatInt(before+1, 10)
			for payload := next(); payload != want; payload = next() {
				if strings.HasPrefix(payload, hex.EncodeToString(namekey.Key(quiet))) {
					t.Fatalf("%d permits: a release nobody waited for sent a NOTIFY: %s", permits, payload)
				}
				if strings.HasPrefix(payload, hex.EncodeToString(namekey.Key(waited))+":"+strconv.FormatInt(released, 10)) {
					t.Fatalf("%d permits: NOTIFY %q, want %q", permits, payload, want)
				}
			}
		}
	})
}

// TestContendedStatements: 8 processes (a pool and a Locker each) contending for one
// name, counted as sent (keep-alives, listeners' probes and the line's sessions
// included). PostgreSQL: at most 2.2 statements per acquisition, the draw that also
// looks, and the release that names the next holder; uncontended, exactly 2. MySQL:
// at most 3.5 (3.0 once its Lockers are warm: BenchmarkContended), the draw that
// takes the ticket's GET_LOCK, the look that waits in the server for the
// predecessor's, and the release; uncontended, exactly 3 (the draw that finds no
// other ticket, the dispenser moved on, the delete).
func TestContendedStatements(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		uncontendedWant, contendedMax := 2, 2.2
		if d == sqllock.MySQL {
			uncontendedWant, contendedMax = 3, 3.5
		}
		ctx := testdb.Context(t, 2*time.Minute)
		var sent atomic.Int64
		lockers := make([]*fairqueue.Locker, 8)
		for i := range lockers {
			lockers[i] = newLocker(t, testdb.OpenCounting(t, d, &sent), d)
		}
		name := testdb.Name(t)

		const uncontended = 20
		le, err := lockers[0].Acquire(ctx, name) // the Locker's deployment check
		if err != nil {
			t.Fatal(err)
		}
		le.Release(ctx)
		start := sent.Load()
		for range uncontended {
			le, err := lockers[0].Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if n := sent.Load() - start; n != int64(uncontendedWant*uncontended) {
			t.Errorf("uncontended: %d statements for %d acquisitions, want %d each", n, uncontended, uncontendedWant)
		}

		const each = 60
		start = sent.Load()
		var wg sync.WaitGroup
		for _, l := range lockers {
			wg.Go(func() {
				for range each {
					le, err := l.Acquire(ctx, name)
					if err != nil {
						t.Error(err)
						return
					}
					for t0 := time.Now(); time.Since(t0) < 100*time.Microsecond; { // the critical section
					}
					if err := le.Release(ctx); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		per := float64(sent.Load()-start) / float64(len(lockers)*each)
		t.Logf("%.2f statements per contended acquisition", per)
		if per > contendedMax {
			t.Errorf("%.2f statements per acquisition with 8 contending processes, want at most %.1f", per, contendedMax)
		}
	})
}
