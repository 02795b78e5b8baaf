package uniqueindex

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// Regression tests of defects found in review of the server-side line.

// TestLineNoTurnNoSpin: a blocked Acquire that cannot get a turn (its Locker has its
// maximum of turns out) waits between attempts as without the line, instead of
// attempting back to back.
func TestLineNoTurnNoSpin(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, 60*time.Second)
		var n atomic.Int64
		db := testdb.OpenCounting(t, d, &n)
		db.SetMaxOpenConns(4) // a quarter: one turn
		holder := newLocker(t, testdb.Open(t, d), d)
		l := newLocker(t, db, d)
		admin := testdb.Open(t, d)
		a, b := testdb.Name(t, "a"), testdb.Name(t, "b")
		for _, name := range []string{a, b} {
			le, err := holder.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			defer le.Release(context.Background())
		}
		// The first waiter takes the Locker's only turn and holds a's line lock.
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		done := make(chan struct{})
		go func() {
			defer close(done)
			l.Acquire(wctx, a)
		}()
		defer func() { <-done }()
		for lineFree(t, l, admin, a) {
			time.Sleep(5 * time.Millisecond) // polling the server's view: there is no signal
		}
		before := n.Load()
		bctx, cancel2 := context.WithTimeout(ctx, 2*time.Second)
		defer cancel2()
		_, err := l.Acquire(bctx, b)
		stmts := n.Load() - before
		t.Logf("a waiter without a turn sent %d statements in 2s (poll interval %v): %v", stmts, DefaultPollInterval, err)
		// Both waiters back off (MySQL: from 2ms, doubling, up to the poll interval):
		// a few dozen statements. A tight loop sends thousands.
		if stmts > 60 {
			t.Errorf("tight loop: %d statements in 2s", stmts)
		}
	})
}

// TestLineTakeoverOfReleasedRow: a waiter whose statement entered the line before
// the holder released takes the released row over with a live expiry, also where
// MariaDB evaluates ON DUPLICATE KEY UPDATE assignments on the old row (sql_mode
// SIMULTANEOUS_ASSIGNMENT): no second holder can get in meanwhile.
func TestLineTakeoverOfReleasedRow(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, 60*time.Second)
		admin := testdb.Open(t, d)
		wdb := testdb.Open(t, d)
		if d == sqllock.MySQL {
			var v string
			if err := admin.QueryRowContext(ctx, "SELECT VERSION()").Scan(&v); err != nil {
				t.Fatal(err)
			}
			if strings.Contains(strings.ToLower(v), "mariadb") {
				dsn := testdb.DSN(t, d)
				sep := "?"
				if strings.Contains(dsn, "?") {
					sep = "&"
				}
				var err error
				if wdb, err = sql.Open("mysql", dsn+sep+"sql_mode=%27STRICT_TRANS_TABLES,SIMULTANEOUS_ASSIGNMENT%27"); err != nil {
					t.Fatal(err)
				}
				defer wdb.Close()
			}
		}
		name := testdb.Name(t)
		l1 := newLocker(t, testdb.Open(t, d), d)
		l2 := newLocker(t, wdb, d, WithPollInterval(5*time.Second))
		l3 := newLocker(t, testdb.Open(t, d), d)
		h, err := l1.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		release := holdLine(t, l2, name)
		got := make(chan sqllock.Lease, 1)
		go func() {
			l2.b.Line.Saw(string(namekey.Key(name))) // contended: the Acquire enters the line at once
			le, err := l2.Acquire(ctx, name)
			if err != nil {
				t.Error(err)
			}
			got <- le
		}()
		waitingInLine(t, l2, admin, name)
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		release()
		le := <-got
		if le == nil {
			return
		}
		defer le.Release(context.Background())
		if le3, err := l3.TryAcquire(ctx, name); err == nil {
			t.Errorf("two live holders: token %d (through the line) and %d", le.Token(), le3.Token())
			le3.Release(ctx)
		}
	})
}

// TestSweepKeepsUnstashedToken (MySQL): the sweep raises sqllock_fence for its
// candidates, then deletes them; a candidate released after the first statement read
// the clock and before the second did must not be deleted without its token (the
// name's next token would repeat).
func TestSweepKeepsUnstashedToken(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		if d != sqllock.MySQL {
			return // PostgreSQL's tokens live in sqllock_fence, and its sweep is one statement
		}
		db := testdb.Open(t, d)
		admin := testdb.Open(t, d)
		ctx := testdb.Context(t, 60*time.Second)
		l := newLocker(t, db, d)
		// Two names, y before x in key order: the sweep locks y first.
		x, y := testdb.Name(t, "x"), ""
		for i := 0; ; i++ {
			y = testdb.Name(t, fmt.Sprintf("y%d", i))
			if bytes.Compare(namekey.Key(y), namekey.Key(x)) < 0 {
				break
			}
		}
		for _, n := range []string{x, x, x, y} {
			le, err := l.Acquire(ctx, n)
			if err != nil {
				t.Fatal(err)
			}
			le.Release(ctx)
		}
		// Something holds y's row lock for a moment (an acquirer's statement, a Check).
		tx, err := admin.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if _, err := tx.ExecContext(ctx, "SELECT 1 FROM sqllock_lease WHERE lock_key = ? FOR UPDATE", namekey.Key(y)); err != nil {
			t.Fatal(err)
		}
		sw, err := NewSweeper(admin, d, 0)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, _, err := sw.SweepBatch(ctx, 100000)
			done <- err
		}()
		for { // the sweep's stash waits for y's row
			n, err := testdb.Running(ctx, admin, d, "INSERT INTO sqllock_fence")
			if err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				break
			}
			time.Sleep(5 * time.Millisecond) // polling the server's view: there is no signal
		}
		le, err := l.Acquire(ctx, x) // x is released again after the stash read the clock
		if err != nil {
			t.Fatal(err)
		}
		before := le.Token()
		le.Release(ctx)
		tx.Commit()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		le, err = l.Acquire(ctx, x)
		if err != nil {
			t.Fatal(err)
		}
		defer le.Release(context.Background())
		if le.Token() <= before {
			t.Errorf("token repeated or went back after a sweep: %d after %d", le.Token(), before)
		}
	})
}
