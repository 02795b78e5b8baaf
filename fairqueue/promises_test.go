package fairqueue_test

import (
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

// guarded is the caller's own table of the fencing tests: the write that a lease's
// Check guards inserts a row.
const guarded = "sqllock_fairqueue_testwrite"

func createGuarded(t testing.TB, db *sql.DB) {
	t.Helper()
	if _, err := db.ExecContext(testdb.Context(t, 30*time.Second),
		"CREATE TABLE IF NOT EXISTS "+guarded+" (id varchar(200) PRIMARY KEY)"); err != nil {
		t.Logf("create: %v", err) // raced by another test binary: the INSERT tells
	}
}

// committed reports whether the guarded write id is visible.
func committed(t testing.TB, db *sql.DB, d sqllock.Dialect, id string) bool {
	t.Helper()
	var n int
	if err := db.QueryRowContext(testdb.Context(t, 30*time.Second),
		testdb.Rebind(d, "SELECT count(*) FROM "+guarded+" WHERE id = ?"), id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// execTicket runs q (? placeholders: the key, then the ticket) on the ticket of
// name, and returns the rows it changed.
func execTicket(t testing.TB, db *sql.DB, d sqllock.Dialect, q, name string, ticket int64) int64 {
	t.Helper()
	res, err := db.ExecContext(testdb.Context(t, 30*time.Second), testdb.Rebind(d, q), namekey.Key(name), ticket)
	if err != nil {
		t.Fatal(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// liveTicket reports whether ticket is there and unexpired on the database clock.
func liveTicket(t testing.TB, db *sql.DB, d sqllock.Dialect, name string, ticket int64) bool {
	t.Helper()
	q := "SELECT count(*) FROM sqllock_ticket WHERE lock_key = $1 AND ticket = $2 AND expires_at > clock_timestamp()"
	if d == sqllock.MySQL {
		q = "SELECT COUNT(*) FROM sqllock_ticket WHERE lock_key = ? AND ticket = ? AND expires_at > UTC_TIMESTAMP(6)"
	}
	var n int
	if err := db.QueryRowContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name), ticket).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// TestCheckLost: Check, run as the last statement of the holder's own transaction
// after its ticket died, returns an error matching ErrLost, and the write it guards
// in that transaction does not commit; the ticket died in three ways: expired on the
// database clock (no successor yet), expired and taken over by a successor (which
// deletes the dead ticket), and expired and deleted as the reaper deletes it. The
// lease has not noticed (its keep-alive is 20 minutes away), so it is the statement
// that tells, not the lease's local state.
func TestCheckLost(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		createGuarded(t, admin)
		db := testdb.Open(t, d)
		a := newLocker(t, db, d, fairqueue.WithTTL(time.Hour), fairqueue.WithKeepalive(20*time.Minute))
		b := newLocker(t, testdb.Open(t, d), d)
		for _, how := range []string{"expired", "taken over", "deleted"} {
			t.Run(how, func(t *testing.T) {
				ctx := testdb.Context(t, time.Minute)
				name := testdb.Name(t)
				sl, err := a.Acquire(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				held := sl.(*fairqueue.Lease)
				defer held.Release(ctx)
				// Dead on the database clock.
				if n := execTicket(t, admin, d, "UPDATE sqllock_ticket SET expires_at = created_at WHERE lock_key = ? AND ticket = ?", name, held.Token()); n != 1 {
					t.Fatalf("expired %d tickets, want 1", n)
				}
				var next sqllock.Lease
				switch how {
				case "taken over":
					next, err = b.TryAcquire(ctx, name)
					if err != nil {
						t.Fatalf("successor after the holder's ticket expired: %v", err)
					}
					defer next.Release(ctx)
					if next.Token() <= held.Token() {
						t.Errorf("successor's token %d, not above %d", next.Token(), held.Token())
					}
				case "deleted":
					// The reaper's delete: dead tickets only (sweepDeleteMySQL).
					q := "DELETE FROM sqllock_ticket WHERE lock_key = ? AND ticket = ? AND expires_at < clock_timestamp()"
					if d == sqllock.MySQL {
						q = "DELETE FROM sqllock_ticket WHERE lock_key = ? AND ticket = ? AND expires_at < UTC_TIMESTAMP(6)"
					}
					if n := execTicket(t, admin, d, q, name, held.Token()); n != 1 {
						t.Fatalf("deleted %d dead tickets, want 1", n)
					}
				}
				if err := held.Err(); err != nil {
					t.Fatalf("the lease saw its loss before Check: %v (the test needs the statement to tell)", err)
				}

				id := testdb.Name(t, "write")
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback()
				if _, err := tx.ExecContext(ctx, testdb.Rebind(d, "INSERT INTO "+guarded+" (id) VALUES (?)"), id); err != nil {
					t.Fatal(err)
				}
				if err := held.Check(ctx, tx); !errors.Is(err, sqllock.ErrLost) {
					t.Errorf("Check of a lease whose ticket is %s = %v, want ErrLost", how, err)
					if err := tx.Commit(); err != nil {
						t.Fatal(err)
					}
				} else {
					tx.Rollback() // what a caller does when Check fails
				}
				if committed(t, admin, d, id) {
					t.Errorf("the write guarded by Check committed although the ticket was %s", how)
				}
				if how == "expired" {
					return
				}
				if err := held.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
					t.Errorf("Release of a lease whose ticket was %s = %v, want ErrLost", how, err)
				}
				if next != nil {
					// The loser's Release left the successor's ticket alone.
					if err := next.(*fairqueue.Lease).Refresh(ctx); err != nil {
						t.Errorf("successor after the loser's Release: %v", err)
					}
				}
			})
		}
	})
}

// TestCheckHoldsOffSuccessor: a holder's transaction that ran Check keeps its ticket
// share-locked until it ends. The ticket expires on the database clock while the
// transaction is open (its keep-alive is 20 minutes away); the waiter behind it,
// which must delete the dead ticket before it may hold the lock, waits for that
// transaction: the server shows it blocked by the holder's session, with the ticket
// dead, and its Acquire has not returned. It is granted only after the COMMIT, which
// commits the guarded write; the old lease is then lost.
func TestCheckHoldsOffSuccessor(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		createGuarded(t, admin)
		ctx := testdb.Context(t, time.Minute)
		db := testdb.Open(t, d)
		a := newLocker(t, db, d, fairqueue.WithTTL(time.Hour), fairqueue.WithKeepalive(20*time.Minute))
		b := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		sl, err := a.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		held := sl.(*fairqueue.Lease)
		defer held.Release(ctx)
		// The ticket dies 2 s from now on the database clock; nothing renews it.
		q := "UPDATE sqllock_ticket SET expires_at = clock_timestamp() + interval '2 seconds' WHERE lock_key = ? AND ticket = ?"
		if d == sqllock.MySQL {
			q = "UPDATE sqllock_ticket SET expires_at = UTC_TIMESTAMP(6) + INTERVAL 2 SECOND WHERE lock_key = ? AND ticket = ?"
		}
		if n := execTicket(t, admin, d, q, name, held.Token()); n != 1 {
			t.Fatalf("changed %d tickets, want 1", n)
		}

		id := testdb.Name(t, "write")
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		sid := testdb.SessionID(ctx, t, d, tx)
		if _, err := tx.ExecContext(ctx, testdb.Rebind(d, "INSERT INTO "+guarded+" (id) VALUES (?)"), id); err != nil {
			t.Fatal(err)
		}
		if err := held.Check(ctx, tx); err != nil {
			t.Fatalf("Check of a current lease: %v", err)
		}

		type result struct {
			le  sqllock.Lease
			err error
		}
		got := make(chan result, 1)
		before, _ := drawn(ctx, admin, d, name)
		go func() {
			le, err := b.Acquire(ctx, name)
			got <- result{le, err}
		}()
		waitDrawn(t, ctx, admin, d, name, before+1)
		// Until the ticket is dead and the successor waits for the checked
		// transaction (polling the server: it sends no signal).
		err = testdb.AwaitBlockedBy(ctx, admin, d, sid, func() (bool, error) {
			select {
			case r := <-got:
				live := liveTicket(t, admin, d, name, held.Token())
				tok := int64(0)
				if r.err == nil {
					tok = r.le.Token()
					r.le.Release(ctx)
				}
				return false, fmt.Errorf("the successor's Acquire returned while the checked transaction was open: token %d (the holder's %d, live: %v), %v",
					tok, held.Token(), live, r.err)
			default:
			}
			return !liveTicket(t, admin, d, name, held.Token()), nil
		})
		if err != nil {
			t.Fatalf("the successor never waited for the checked transaction with the ticket dead: %v", err)
		}
		select {
		case r := <-got:
			t.Fatalf("the successor's Acquire returned while it waited for the checked transaction: %v", r.err)
		default:
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var r result
		select {
		case r = <-got:
		case <-ctx.Done():
			t.Fatal("the successor was not granted after the checked transaction committed")
		}
		if r.err != nil {
			t.Fatalf("successor: %v", r.err)
		}
		defer r.le.Release(ctx)
		if r.le.Token() <= held.Token() {
			t.Errorf("successor's token %d, not above %d", r.le.Token(), held.Token())
		}
		if !committed(t, admin, d, id) {
			t.Error("the write guarded by a passed Check did not commit")
		}
		if err := held.Refresh(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Refresh of the old lease after the successor's grant = %v, want ErrLost", err)
		}
	})
}

// TestSemaphoreGrantsInOrder: a semaphore of 2 permits grants in the order the
// tickets were drawn: with both permits held, three waiters (Lockers and pools of
// their own, as other processes), queued one after the other (each drew its ticket
// before the next started), get one grant per release, in their order: the first
// release grants the first waiter and neither other, the second the second, the third
// the third. Each grant is stamped with the number of releases made when its Acquire
// returned, so a grant out of turn is caught whenever it happens.
func TestSemaphoreGrantsInOrder(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		ctx := testdb.Context(t, 2*time.Minute)
		name := testdb.Name(t)
		const permits = 2
		newSem := func() *fairqueue.Locker {
			s, err := fairqueue.NewSemaphore(testdb.Open(t, d), d, permits)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}
		h := newSem()
		var holders []sqllock.Lease
		for range permits {
			le, err := h.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			holders = append(holders, le)
		}
		var releases atomic.Int32
		type grant struct {
			waiter int
			le     sqllock.Lease
			err    error
			after  int32 // releases made when the Acquire returned
		}
		grants := make(chan grant, 3)
		first, _ := drawn(ctx, admin, d, name)
		for i := 1; i <= 3; i++ {
			w := newSem()
			go func() {
				le, err := w.Acquire(ctx, name)
				grants <- grant{i, le, err, releases.Load()}
			}()
			waitDrawn(t, ctx, admin, d, name, first+int64(i))
		}
		var got []sqllock.Lease
		defer func() {
			for _, le := range got {
				le.Release(ctx)
			}
		}()
		release := func(le sqllock.Lease) {
			releases.Add(1) // before the release: a grant it makes sees the count
			if err := le.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		next := func(want int) sqllock.Lease {
			t.Helper()
			var g grant
			select {
			case g = <-grants:
			case <-ctx.Done():
				t.Fatalf("release %d granted no waiter", releases.Load())
			}
			if g.err != nil {
				t.Fatalf("waiter %d: %v", g.waiter, g.err)
			}
			got = append(got, g.le)
			if g.waiter != want || g.after != int32(want) {
				t.Errorf("waiter %d granted after %d releases, want waiter %d after %d", g.waiter, g.after, want, want)
			}
			return g.le
		}
		release(holders[0])
		w1 := next(1)
		release(holders[1])
		w2 := next(2)
		release(w1)
		w3 := next(3)
		if !(holders[1].Token() < w1.Token() && w1.Token() < w2.Token() && w2.Token() < w3.Token()) {
			t.Errorf("tokens: holders %d, %d, then waiters %d, %d, %d: want increasing", holders[0].Token(), holders[1].Token(), w1.Token(), w2.Token(), w3.Token())
		}
	})
}

// TestLeaseTTLOption: sqllock.WithLeaseTTL sets the lease time of one acquisition,
// the ticket's (locktest.LeaseTTLOption).
func TestLeaseTTLOption(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.LeaseTTLOption(t, d, func(t testing.TB, db *sql.DB, ttl time.Duration) sqllock.Locker {
			return newLocker(t, db, d, fairqueue.WithTTL(ttl))
		}, locktest.TableExpiry(d, "sqllock_ticket", "ticket"))
	})
}

// TestClientClockShift: the client clock is only used for monotonic durations;
// shifted by an hour either way, exclusion and renewal are unchanged
// (locktest.ClientClockShift).
func TestClientClockShift(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		locktest.ClientClockShift(t, d, func(t testing.TB, db *sql.DB, ttl time.Duration, now func() time.Time) sqllock.Locker {
			l := newLocker(t, db, d, fairqueue.WithTTL(ttl))
			fairqueue.SetNow(l, now)
			return l
		})
	})
}
