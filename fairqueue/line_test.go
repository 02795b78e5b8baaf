package fairqueue_test

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/internal/wait"
	"github.com/sqllock/sqllock/testdb"
)

// The MySQL line: a contended waiter's session holds the lock of its ticket and waits
// in the server for its predecessor's (see fairqueue's waitTurn).

// inUserLock returns the session that waits in the server for the lock of ticket of
// name, once there is one: performance_schema's pending metadata lock on MySQL; the
// processlist's state and statement on MariaDB (whose performance_schema is off by
// default).
func inUserLock(t *testing.T, admin *sql.DB, name string, ticket int64) int64 {
	t.Helper()
	var version string
	if err := admin.QueryRow("SELECT VERSION()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	k := namekey.MySQLHex(namekey.Key(name))
	q := `SELECT t.PROCESSLIST_ID FROM performance_schema.metadata_locks m
JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID
WHERE m.OBJECT_TYPE = 'USER LEVEL LOCK' AND m.LOCK_STATUS = 'PENDING' AND m.OBJECT_NAME = ` + wait.MyTicketName(k, strconv.FormatInt(ticket, 10))
	if strings.Contains(version, "MariaDB") {
		q = `SELECT ID FROM information_schema.PROCESSLIST WHERE STATE = 'User lock' AND DB = DATABASE()
AND INFO LIKE '%sqllock:q:%' AND INFO LIKE '%` + hex.EncodeToString(namekey.Key(name)) + `%' LIMIT 1`
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		var id int64
		err := admin.QueryRow(q).Scan(&id)
		if err == nil {
			return id
		}
		if !errors.Is(err, sql.ErrNoRows) {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no waiter of %s waits in the server for the lock of ticket %d", name, ticket)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ticketLockHolder returns the session that holds the lock of ticket of name, or 0.
func ticketLockHolder(t *testing.T, admin *sql.DB, name string, ticket int64) int64 {
	t.Helper()
	var id sql.NullInt64
	q := "SELECT IS_USED_LOCK(" + wait.MyTicketName(namekey.MySQLHex(namekey.Key(name)), strconv.FormatInt(ticket, 10)) + ")"
	if err := admin.QueryRow(q).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id.Int64
}

// ticketLockTaken waits until a session holds the lock of ticket of name, and returns
// it.
func ticketLockTaken(t *testing.T, admin *sql.DB, name string, ticket int64) int64 {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		if sid := ticketLockHolder(t, admin, name, ticket); sid != 0 {
			return sid
		}
		if time.Now().After(deadline) {
			t.Fatalf("nobody holds the lock of ticket %d of %s", ticket, name)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// notGranted fails t if one of the Acquires started by acquireAsync returned.
func notGranted(t *testing.T, while string, got ...<-chan acquired) {
	t.Helper()
	for _, g := range got {
		select {
		case r := <-g:
			t.Fatalf("an Acquire returned while %s: %v", while, r.err)
		default:
		}
	}
}

// acquireAsync starts an Acquire and returns its outcome.
func acquireAsync(ctx context.Context, l *fairqueue.Locker, name string) <-chan acquired {
	ch := make(chan acquired, 1)
	go func() {
		le, err := l.Acquire(ctx, name)
		ch <- acquired{le, err, time.Now()}
	}()
	return ch
}

type acquired struct {
	le  sqllock.Lease
	err error
	at  time.Time
}

func (a acquired) must(t *testing.T, what string) sqllock.Lease {
	t.Helper()
	if a.err != nil {
		t.Fatalf("%s: %v", what, a.err)
	}
	return a.le
}

// TestMySQLWaiterWaitsInServer: a waiter whose predecessor waited in the line waits
// in the server for that one's ticket lock, and goes in when its predecessor's release
// gives it back: its whole Acquire is two statements (the draw, which also takes its
// ticket's lock, and the look that waited), none of them a poll, once its Locker has
// seen the name contended and has a session for the line.
func TestMySQLWaiterWaitsInServer(t *testing.T) {
	d := sqllock.MySQL
	ctx := testdb.Context(t, 2*time.Minute)
	admin := testdb.Open(t, d)
	a := newLocker(t, testdb.Open(t, d), d, slowPoll)
	b := newLocker(t, testdb.Open(t, d), d, slowPoll)
	var sent atomic.Int64
	c := newLocker(t, testdb.OpenCounting(t, d, &sent), d, slowPoll)
	name := testdb.Name(t)

	// C waits once (its Locker then knows the name contended, and keeps its line's
	// session for a while).
	la, err := a.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	gotC := acquireAsync(ctx, c, name)
	ticketLockTaken(t, admin, name, la.Token()+1)
	la.Release(ctx)
	(<-gotC).must(t, "C").Release(ctx)

	la, err = a.Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	gotB := acquireAsync(ctx, b, name)
	// B takes its ticket's lock, then polls for A (granted without the line).
	ticketLockTaken(t, admin, name, la.Token()+1)
	before := sent.Load()
	gotC = acquireAsync(ctx, c, name)
	inUserLock(t, admin, name, la.Token()+1)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	lb := (<-gotB).must(t, "B")
	if lb.Token() != la.Token()+1 {
		t.Fatalf("B got ticket %d, want %d", lb.Token(), la.Token()+1)
	}
	notGranted(t, "B held the lock (C's)", gotC)
	released := time.Now()
	if err := lb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-gotC
	n := sent.Load() - before
	lc := r.must(t, "C")
	defer lc.Release(ctx)
	t.Logf("C in %v after B's release, %d statements", r.at.Sub(released), n)
	if n != 2 {
		t.Errorf("C's Acquire sent %d statements, want 2 (the draw, the look that waited)", n)
	}
	if lc.Token() != lb.Token()+1 {
		t.Errorf("C got ticket %d, want %d", lc.Token(), lb.Token()+1)
	}
}

// lineChain sets up the line tests' queue on MySQL: A holds name (granted without
// waiting), B waits in the line holding its ticket's lock (its session: sid), and C
// waits in the server for that lock. bDB is B's pool.
type lineChain struct {
	admin, bDB *sql.DB
	b          *fairqueue.Locker
	name       string
	la         sqllock.Lease
	bTicket    int64
	sid        int64
	gotB, gotC <-chan acquired
}

func newLineChain(t *testing.T, ctx context.Context, opts ...fairqueue.Option) *lineChain {
	t.Helper()
	d := sqllock.MySQL
	ch := &lineChain{admin: testdb.Open(t, d), bDB: testdb.Open(t, d), name: testdb.Name(t)}
	a := newLocker(t, testdb.Open(t, d), d, opts...)
	ch.b = newLocker(t, ch.bDB, d, opts...)
	c := newLocker(t, testdb.Open(t, d), d, opts...)
	var err error
	if ch.la, err = a.Acquire(ctx, ch.name); err != nil {
		t.Fatal(err)
	}
	ch.gotB = acquireAsync(ctx, ch.b, ch.name)
	ch.bTicket = ch.la.Token() + 1
	ch.sid = ticketLockTaken(t, ch.admin, ch.name, ch.bTicket)
	ch.gotC = acquireAsync(ctx, c, ch.name)
	inUserLock(t, ch.admin, ch.name, ch.bTicket)
	return ch
}

// TestMySQLLineWaiterKilled: the session of a waiter in the line is killed while its
// successor waits in the server for its ticket's lock. The successor wakes, finds the
// waiter's ticket still live (its owner renews it through the pool) and does not pass
// it; the waiter goes on without the line. The order holds: A, B, C.
func TestMySQLLineWaiterKilled(t *testing.T) {
	ctx := testdb.Context(t, 2*time.Minute)
	ch := newLineChain(t, ctx, fairqueue.WithTTL(3*time.Second), fairqueue.WithPollInterval(200*time.Millisecond))
	admin, la, gotB, gotC := ch.admin, ch.la, ch.gotB, ch.gotC
	testdb.Kill(ctx, t, admin, sqllock.MySQL, ch.sid)
	// C woke: its ticket lock's holder is gone. B holds its ticket, A the lock.
	time.Sleep(500 * time.Millisecond) // (let C look again while B's ticket is live)
	notGranted(t, "A held the lock", gotB, gotC)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	lb := (<-gotB).must(t, "B")
	notGranted(t, "B held the lock (C's)", gotC)
	if err := lb.Err(); err != nil {
		t.Fatalf("B's lease: %v", err)
	}
	if err := lb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	lc := (<-gotC).must(t, "C")
	if !(la.Token() < lb.Token() && lb.Token() < lc.Token()) {
		t.Errorf("tokens %d, %d, %d: want increasing", la.Token(), lb.Token(), lc.Token())
	}
	lc.Release(ctx)
}

// usedName returns the test's context, an admin pool, a Locker and a name that
// Locker acquired and released n times (its dispenser exists).
func usedName(t *testing.T, d sqllock.Dialect, n int) (context.Context, *sql.DB, *fairqueue.Locker, string) {
	t.Helper()
	ctx := testdb.Context(t, time.Minute)
	l := newLocker(t, testdb.Open(t, d), d)
	name := testdb.Name(t)
	for range n {
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		le.Release(ctx)
	}
	return ctx, testdb.Open(t, d), l, name
}

// TestSweptLastTicketNotDrawnAgain: the holder of the only ticket of a name dies (its
// ticket expires), the reaper deletes the ticket, and the next acquisition gets a
// larger token, never the dead holder's again. On MySQL the draw does not move the
// dispenser on (it numbers past the highest ticket): the sweep moves it past the
// ticket it deletes.
func TestSweptLastTicketNotDrawnAgain(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		// The second release is not the dispenser's first move.
		ctx, admin, l, name := usedName(t, d, 2)
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		dead := le.Token()
		expire := "UPDATE sqllock_ticket SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 HOUR WHERE lock_key = ?"
		if d == sqllock.Postgres {
			expire = "UPDATE sqllock_ticket SET expires_at = clock_timestamp() - interval '1 hour' WHERE lock_key = $1"
		}
		if _, err := admin.ExecContext(ctx, expire, namekey.Key(name)); err != nil {
			t.Fatal(err)
		}
		sw, err := fairqueue.NewSweeper(admin, d, 0)
		if err != nil {
			t.Fatal(err)
		}
		if n, _, err := sw.SweepBatch(ctx, 1000); err != nil || n < 1 {
			t.Fatalf("sweep: %d deleted, %v", n, err)
		}
		if n := tickets(t, admin, d, name); n != 0 {
			t.Fatalf("%d tickets left after the sweep", n)
		}
		defer le.Release(ctx) // (a dead holder never gets there)
		next, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer next.Release(ctx)
		if next.Token() <= dead {
			t.Errorf("token %d after the dead holder's %d was swept: want larger", next.Token(), dead)
		}
	})
}

// TestMySQLLineWaiterLosesTicket: a waiter in the line loses its ticket while it
// waits (deleted by hand here; its renewals failing for a TTL in life). Its session
// gives its ticket's lock up at once, so the waiter behind it, which waits in the
// server for that lock, is not held up; the waiter draws a new ticket behind it, and
// no pooled connection stays out once the Lockers are closed.
func TestMySQLLineWaiterLosesTicket(t *testing.T) {
	ctx := testdb.Context(t, 2*time.Minute)
	const ttl = 3 * time.Second
	ch := newLineChain(t, ctx, fairqueue.WithTTL(ttl), fairqueue.WithKeepalive(300*time.Millisecond))
	admin, name, la, bTicket, gotB, gotC := ch.admin, ch.name, ch.la, ch.bTicket, ch.gotB, ch.gotC
	if _, err := admin.ExecContext(ctx, "DELETE FROM sqllock_ticket WHERE lock_key = ? AND ticket = ?", namekey.Key(name), bTicket); err != nil {
		t.Fatal(err)
	}
	// B's keep-alive finds its ticket gone; B gives the ticket's lock up and draws
	// again, behind C.
	deleted := time.Now()
	for ticketLockHolder(t, admin, name, bTicket) != 0 {
		time.Sleep(5 * time.Millisecond)
	}
	if held := time.Since(deleted); held > ttl/2 {
		t.Errorf("B's session kept its lost ticket's lock %v (keep-alive every 300ms)", held)
	}
	released := time.Now()
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	rc := <-gotC
	lc := rc.must(t, "C")
	if wait := rc.at.Sub(released); wait > ttl/2 {
		t.Errorf("C got the lock %v after A's release: held up by B's lost ticket", wait)
	}
	notGranted(t, "C held the lock (B's)", gotB)
	if err := lc.Release(ctx); err != nil {
		t.Fatal(err)
	}
	lb := (<-gotB).must(t, "B")
	if lb.Token() <= lc.Token() {
		t.Errorf("B's new ticket %d not after C's %d", lb.Token(), lc.Token())
	}
	if err := lb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	ch.b.Close()
	if n := ch.bDB.Stats().InUse; n != 0 {
		t.Errorf("%d of B's pooled connections still out after Close", n)
	}
}

// TestLargeTickets: a name whose dispenser is at 2^62 (a number the MySQL draw's
// answer, twice the ticket plus a flag, overflows in signed arithmetic) still draws:
// tickets go up to 2^63-1.
func TestLargeTickets(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx, admin, l, name := usedName(t, d, 1) // the dispenser
		const big = int64(1) << 62
		q := testdb.Rebind(d, "UPDATE sqllock_queue SET next_ticket = ? WHERE lock_key = ?")
		if _, err := admin.ExecContext(ctx, q, big, namekey.Key(name)); err != nil {
			t.Fatal(err)
		}
		le, err := l.Acquire(ctx, name) // alone
		if err != nil {
			t.Fatal(err)
		}
		if le.Token() != big {
			t.Errorf("token %d, want %d", le.Token(), big)
		}
		if w, err := l.TryAcquire(ctx, name); err == nil { // a draw behind a holder
			w.Release(ctx)
			t.Fatal("TryAcquire of a held name succeeded")
		}
		le.Release(ctx)
		next, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer next.Release(ctx)
		if next.Token() <= big+1 {
			t.Errorf("token %d after %d and a TryAcquire's %d", next.Token(), big, big+1)
		}
	})
}
