package uniqueindex

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/interrupt"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// The server-side line (internal/wait.Line) as uniqueindex uses it; optimistic
// shares the code. Fairness and statements per contended acquisition are checked by
// locktest's Fairness case.

// holdLine takes the line lock of name on a session of its own, as a waiter in line
// or a partitioned holder would hold it, and returns the function that ends that
// session (the server then frees the lock).
func holdLine(t *testing.T, l *Locker, name string) func() {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	db := testdb.Open(t, l.b.Dialect)
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	key := namekey.Key(name)
	var got sql.NullInt64
	if l.b.Dialect == sqllock.Postgres {
		_, err = conn.ExecContext(ctx, "SELECT pg_advisory_lock("+l.b.Line.PgKey("$1")+")", key)
	} else {
		err = conn.QueryRowContext(ctx, "SELECT GET_LOCK("+l.b.Line.MyName(namekey.MySQLHex(key))+", 0)").Scan(&got)
		if err == nil && got.Int64 != 1 {
			err = errors.New("GET_LOCK refused")
		}
	}
	if err != nil {
		conn.Close()
		t.Fatal(err)
	}
	return func() {
		// Given back synchronously (a closed session frees its locks only once its
		// backend notices), then the session is closed, not pooled.
		gctx := testdb.Context(t, 30*time.Second)
		if l.b.Dialect == sqllock.Postgres {
			_, err = conn.ExecContext(gctx, "SELECT pg_advisory_unlock("+l.b.Line.PgKey("$1")+")", key)
		} else {
			_, err = conn.ExecContext(gctx, "DO RELEASE_LOCK("+l.b.Line.MyName(namekey.MySQLHex(key))+")")
		}
		if err != nil {
			t.Error(err)
		}
		conn.Raw(func(any) error { return driver.ErrBadConn })
		conn.Close()
		db.Close()
	}
}

// pgLineKey is the advisory key of the line of key, as the server computes it.
func pgLineKey(t *testing.T, l *Locker, admin *sql.DB, key []byte) int64 {
	t.Helper()
	var k int64
	if err := admin.QueryRowContext(testdb.Context(t, 30*time.Second), "SELECT "+l.b.Line.PgKey("$1"), key).Scan(&k); err != nil {
		t.Fatal(err)
	}
	return k
}

// lineFree reports whether the line lock of name is free, asking the server.
func lineFree(t *testing.T, l *Locker, admin *sql.DB, name string) bool {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	key := namekey.Key(name)
	if l.b.Dialect == sqllock.Postgres {
		var n int
		// The advisory lock of a bigint key: classid and objid are its halves.
		err := admin.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
  AND classid::bigint = ($1::bigint >> 32) & 4294967295 AND objid::bigint = $1::bigint & 4294967295 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
			pgLineKey(t, l, admin, key)).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n == 0
	}
	var free sql.NullInt64
	if err := admin.QueryRowContext(ctx, "SELECT IS_FREE_LOCK("+l.b.Line.MyName(namekey.MySQLHex(key))+")").Scan(&free); err != nil {
		t.Fatal(err)
	}
	return free.Valid && free.Int64 == 1
}

// waitingInLine waits until a session waits for the line lock of name on the server.
func waitingInLine(t *testing.T, l *Locker, admin *sql.DB, name string) {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	key := namekey.Key(name)
	for ctx.Err() == nil {
		if l.b.Dialect == sqllock.Postgres {
			var n int
			if err := admin.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND NOT granted
  AND classid::bigint = ($1::bigint >> 32) & 4294967295 AND objid::bigint = $1::bigint & 4294967295`, pgLineKey(t, l, admin, key)).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				return
			}
		} else if userLockWaits(t, ctx, admin, hex.EncodeToString(key)) > 0 {
			return
		}
		time.Sleep(5 * time.Millisecond) // polling the server's view: there is no signal
	}
	t.Fatal("no session ever waited in the line")
}

// userLockWaits counts the MySQL sessions waiting in GET_LOCK in a statement that
// contains text (SHOW PROCESSLIST: information_schema.PROCESSLIST fails on MySQL 9.7
// while a statement with binary text runs).
func userLockWaits(t *testing.T, ctx context.Context, admin *sql.DB, text string) int {
	t.Helper()
	rows, err := admin.QueryContext(ctx, "SHOW FULL PROCESSLIST")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, p := range testdb.RowMaps(t, rows) {
		if strings.Contains(strings.ToLower(p["state"].String), "user lock") && strings.Contains(strings.ToLower(p["info"].String), text) {
			n++
		}
	}
	return n
}

// TestLineStaleLock: a line lock held by a session that does not hold the lease (a
// partitioned holder's, before the server ends its session) delays a waiter by at
// most one entry's wait (the TTL): it then attempts directly and gets the lock once
// it is free.
func TestLineStaleLock(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		admin := testdb.Open(t, d)
		name := testdb.Name(t)
		waiter := newLocker(t, testdb.Open(t, d), d, WithTTL(2*time.Second), WithPollInterval(200*time.Millisecond)) // an entry waits 2s at most
		holder := newLocker(t, testdb.Open(t, d), d)
		giveBack := holdLine(t, waiter, name)
		defer giveBack()
		held, err := holder.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan time.Time, 1)
		errc := make(chan error, 1)
		go func() {
			lease, err := waiter.Acquire(testdb.Context(t, 30*time.Second), name)
			if err != nil {
				errc <- err
				return
			}
			got <- time.Now()
			lease.Release(context.Background())
		}()
		waitingInLine(t, waiter, admin, name) // the waiter waits behind the stale line lock
		released := time.Now()
		if err := held.Release(testdb.Context(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
		select {
		case at := <-got:
			t.Logf("acquired %v after the holder's release, the line lock still held elsewhere", at.Sub(released).Round(time.Millisecond))
		case err := <-errc:
			t.Fatal(err)
		case <-time.After(6 * time.Second):
			t.Fatal("the waiter did not get the lock within 6s of its release (TTL 2s): it waits for a line lock nobody gives back")
		}
	})
}

// TestLineCancelLeavesNothing: an Acquire whose context ends while it waits in line
// (for the line lock, or holding it while the holder holds the lease) leaves no line
// lock and no connection behind.
func TestLineCancelLeavesNothing(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		admin := testdb.Open(t, d)
		name := testdb.Name(t)
		wdb := testdb.Open(t, d)
		waiter := newLocker(t, wdb, d)
		holder := newLocker(t, testdb.Open(t, d), d)
		held, err := holder.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		defer held.Release(context.Background())
		attempt := func(why string) {
			t.Helper()
			ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
			defer cancel()
			lease, err := waiter.Acquire(ctx, name)
			if err == nil {
				lease.Release(context.Background())
				t.Fatalf("%s: acquired a held lock", why)
			}
			if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("%s: %v, want ErrNotAcquired and DeadlineExceeded", why, err)
			}
			// A forget of an attempt of unknown outcome may run on after Acquire returned,
			// for at most lease.GiveBackTimeout.
			deadline := time.Now().Add(6 * time.Second)
			for wdb.Stats().InUse != 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond) // no signal for a pool's connection count
			}
			if n := wdb.Stats().InUse; n != 0 {
				t.Errorf("%s: %d connections of the waiter's pool still in use", why, n)
			}
		}
		// In line, holding the line lock while the holder (who did not come through
		// the line) holds the lease.
		attempt("holding the line lock")
		if !lineFree(t, waiter, admin, name) {
			t.Error("the line lock is still held after the waiter gave up")
		}
		// Waiting for the line lock, held by a session of its own.
		giveBack := holdLine(t, waiter, name)
		attempt("waiting for the line lock")
		giveBack()
		if !lineFree(t, waiter, admin, name) {
			t.Error("the line lock is held after its holder gave it back: the cancelled waiter got it later")
		}
		// Cancelled (no deadline) while it waits for the line lock: interrupted on the
		// server at once, not left queued until the entry's own wait runs out.
		giveBack = holdLine(t, waiter, name)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			_, err := waiter.Acquire(ctx, name)
			done <- err
		}()
		waitingInLine(t, waiter, admin, name)
		cancel()
		cancelled := time.Now()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("cancelled in line: %v, want context.Canceled", err)
			}
			t.Logf("returned %v after the cancel", time.Since(cancelled).Round(time.Millisecond))
		case <-time.After(interrupt.Grace + 500*time.Millisecond):
			t.Fatal("Acquire still waits in line after its context was cancelled")
		}
		giveBack()
		if !lineFree(t, waiter, admin, name) {
			t.Error("the line lock is held after its holder gave it back: the cancelled waiter got it later")
		}
	})
}

// TestLineLongHold: a lease that came through the line and is held for several
// TTLs keeps its turn's session (renewals run on it, so the server's idle bound does
// not end it and free the line lock early), and its release gives the line lock back.
func TestLineLongHold(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		admin := testdb.Open(t, d)
		name := testdb.Name(t)
		l := newLocker(t, testdb.Open(t, d), d, WithTTL(2*time.Second)) // session bound: 2s idle
		l.b.Line.Saw(string(namekey.Key(name)))                         // contended: through the line at once
		lease, err := l.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		if lease.(*Lease).turn == nil {
			t.Fatal("the acquisition did not come through the line")
		}
		select {
		case <-lease.Done():
			t.Fatalf("lease ended while held: %v", lease.Err())
		case <-time.After(6 * time.Second): // three TTLs, three idle bounds
		}
		if lineFree(t, l, admin, name) {
			t.Error("the line lock was freed while its lease was held (the turn's session ended)")
		}
		if err := lease.Release(testdb.Context(t, 30*time.Second)); err != nil {
			t.Fatalf("Release: %v", err)
		}
		// Given back by the release statement; or, had the session failed, freed by
		// the server once it notices the discarded connection.
		deadline := time.Now().Add(3 * time.Second)
		for !lineFree(t, l, admin, name) {
			if time.Now().After(deadline) {
				t.Fatal("the line lock is still held 3s after the release")
			}
			time.Sleep(10 * time.Millisecond) // no signal for a lock the server frees
		}
	})
}

// TestLineEntryLocksNothing: a statement that waits in the line holds no row or gap
// lock meanwhile: another session may write the name's fence counter and lease row.
func TestLineEntryLocksNothing(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		admin := testdb.Open(t, d)
		name := testdb.Name(t)
		key := namekey.Key(name)
		waiter := newLocker(t, testdb.Open(t, d), d)
		giveBack := holdLine(t, waiter, name)
		defer giveBack()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan struct{})
		go func() {
			defer close(done)
			waiter.b.Line.Saw(string(key)) // contended: the Acquire enters the line at once
			if lease, err := waiter.Acquire(ctx, name); err == nil {
				lease.Release(context.Background())
			}
		}()
		waitingInLine(t, waiter, admin, name)
		conn, err := admin.Conn(testdb.Context(t, 30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		wctx := testdb.Context(t, 30*time.Second)
		timeout := "SET SESSION innodb_lock_wait_timeout = 1"
		ins := "INSERT INTO sqllock_fence (lock_key, name, token) VALUES (?, ?, 1) ON DUPLICATE KEY UPDATE token = token + 1"
		if d == sqllock.Postgres {
			timeout = "SET lock_timeout = 1000"
			ins = "INSERT INTO sqllock_fence (lock_key, name, token) VALUES ($1, $2, 1) ON CONFLICT (lock_key) DO UPDATE SET token = sqllock_fence.token + 1"
		}
		if _, err := conn.ExecContext(wctx, timeout); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if _, err := conn.ExecContext(wctx, ins, key, []byte(name)); err != nil {
			t.Fatalf("writing the name's fence counter while a waiter waits in line: %v (after %v)", err, time.Since(start))
		}
		cancel()
		<-done
	})
}
