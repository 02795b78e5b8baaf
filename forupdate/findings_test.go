package forupdate_test

// Regression tests of the review findings on commit 7748e60 that concern forupdate
// (one test per finding, TestFindingNN...). Each asserts what the fix changed.
// Finding 15 (the window after an operator's kill) is locktest's KillWindow case,
// set in TestLocktest.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/locktest"
	"github.com/sqllock/sqllock/testdb"
)

// scratchTable is created by the DDL of Finding 1a, inside a lock transaction.
const scratchTable = "sqllock_forupdate_scratch"

// releaseBounded runs lease.Release(ctx) and returns its error and how long it took,
// or fails the test if it has not returned after limit (the old code blocked in
// COMMIT, which takes no context).
func releaseBounded(t *testing.T, lease *forupdate.Lease, ctx context.Context, limit time.Duration) (error, time.Duration) {
	t.Helper()
	res := make(chan error, 1)
	start := time.Now()
	go func() { res <- lease.Release(ctx) }()
	select {
	case err := <-res:
		return err, time.Since(start)
	case <-time.After(limit):
		t.Fatalf("Release still blocked %v after it was called", limit)
		return nil, 0
	}
}

// TestFinding01aDDLInsideLock: on MySQL a DDL statement run through Lease.Tx commits
// the lock transaction implicitly and frees the row lock while the session lives on.
// The keep-alive sees the committed token (at least the lease's) and ends the lease
// as lost within about one interval, and Release reports ErrLost rather than nil.
func TestFinding01aDDLInsideLock(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		if d == sqllock.Postgres {
			pgDDLKeepsLock(t)
			return
		}
		db, admin := testdb.Open(t, d), testdb.Open(t, d)
		ensureData(t, admin)
		const keepalive = 200 * time.Millisecond
		l := newLocker(t, db, d, forupdate.WithKeepalive(keepalive), forupdate.WithTTL(3*time.Second))
		other := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		lease, err := l.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := insertData(ctx, lease.Tx(), d, name, 1); err != nil {
			t.Fatal(err)
		}
		ddl := time.Now()
		if _, err := lease.Tx().ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+scratchTable+" (id int PRIMARY KEY)"); err != nil {
			t.Fatal(err)
		}
		select {
		case <-lease.Done():
		case <-time.After(keepalive + 5*time.Second):
			lease.Rollback(ctx)
			t.Fatalf("Done not closed %v after a DDL statement committed the lock transaction", keepalive+5*time.Second)
		}
		window := time.Since(ddl)
		t.Logf("Done closed %v after the DDL (keep-alive %v): %v", window.Round(time.Millisecond), keepalive, lease.Err())
		if window > keepalive+time.Second {
			t.Errorf("Done closed %v after the DDL, want within about one keep-alive interval (%v)", window, keepalive)
		}
		if err := lease.Err(); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Err = %v, want ErrLost", err)
		}
		// The fault is real: the lock is free while the lease's session lives, and
		// the lease's write was committed by the DDL.
		next, err := other.TryLock(ctx, name)
		if err != nil {
			t.Errorf("TryLock by another client after the DDL: %v (the row lock should have been freed)", err)
		} else {
			next.Rollback(ctx)
		}
		if v := readData(t, admin, d, name); v != 1 {
			t.Errorf("the write made before the DDL reads %d, want 1 (committed by the DDL)", v)
		}
		if err := lease.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release after the DDL = %v, want ErrLost", err)
		}
	})
}

// pgDDLKeepsLock is finding 1a's counterpart on PostgreSQL, whose DDL is
// transactional: a DDL statement in the lock transaction leaves the lock held (the
// lease is not lost over several keep-alives, another client is refused), and
// Release commits the work done before and after it.
func pgDDLKeepsLock(t *testing.T) {
	d := sqllock.Postgres
	db, admin := testdb.Open(t, d), testdb.Open(t, d)
	ensureData(t, admin)
	const keepalive = 200 * time.Millisecond
	l := newLocker(t, db, d, forupdate.WithKeepalive(keepalive), forupdate.WithTTL(3*time.Second))
	other := newLocker(t, testdb.Open(t, d), d)
	name := testdb.Name(t)
	ctx := testdb.Context(t, 30*time.Second)
	lease, err := l.Lock(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := insertData(ctx, lease.Tx(), d, name, 1); err != nil {
		t.Fatal(err)
	}
	table := fmt.Sprintf("%s_%d", scratchTable, os.Getpid())
	if _, err := lease.Tx().ExecContext(ctx, "CREATE TABLE "+table+" (id int PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+table) })
	// A loss would show within a keep-alive or two: there is no event for "a
	// keep-alive ran and found the lock held", so give it five.
	select {
	case <-lease.Done():
		t.Fatalf("lease lost after a DDL statement in its transaction: %v", lease.Err())
	case <-time.After(5 * keepalive):
	}
	if next, err := other.TryLock(ctx, name); err == nil {
		next.Rollback(ctx)
		t.Fatal("another client took the lock after a DDL statement in the lock transaction")
	} else if !errors.Is(err, sqllock.ErrNotAcquired) {
		t.Fatalf("TryLock by another client: %v", err)
	}
	if err := insertData(ctx, lease.Tx(), d, name+"/after", 2); err != nil {
		t.Fatal(err)
	}
	if err := lease.Release(ctx); err != nil {
		t.Fatalf("Release after a DDL statement = %v, want nil", err)
	}
	if v, w := readData(t, admin, d, name), readData(t, admin, d, name+"/after"); v != 1 || w != 2 {
		t.Errorf("after Release the writes read %d and %d, want 1 and 2 (committed with the DDL)", v, w)
	}
}

// waitLockWait polls the server until the InnoDB transaction of session sid waits
// for a lock, or fails the test. A statement result on res means it stopped waiting
// (or never did).
func waitLockWait(t *testing.T, admin *sql.DB, d sqllock.Dialect, sid int64, res <-chan error) {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	for {
		waiting, err := testdb.WaitsForLock(ctx, admin, d, sid)
		if err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		select {
		case err := <-res:
			t.Fatalf("the lease's UPDATE returned before it waited: %v", err)
		case <-ctx.Done():
			t.Fatalf("the lease's UPDATE never waited for the other transaction's row lock (session %d)", sid)
		case <-time.After(5 * time.Millisecond): // polling the server: no signal to wait on
		}
	}
}

// TestFinding01bDeadlockVictim: InnoDB rolls back the whole transaction of a
// deadlock victim (1213), lock row included, and the session goes on in autocommit.
// PostgreSQL aborts the victim's transaction (40P01) and releases its locks at once,
// although the transaction block stays open (25P02) until ROLLBACK. Either way,
// when the lease's transaction is the victim another client can take the lock at
// once; on PostgreSQL the keep-alive reports the loss within an interval; the
// lease's Release reports ErrLost instead of committing nothing and returning nil,
// and nothing the lease wrote before the rollback is committed.
func TestFinding01bDeadlockVictim(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db, admin := testdb.Open(t, d), testdb.Open(t, d)
		ensureData(t, admin)
		const keepalive = 200 * time.Millisecond
		l := newLocker(t, db, d, forupdate.WithKeepalive(keepalive))
		other := newLocker(t, testdb.Open(t, d), d)
		ctx := testdb.Context(t, 60*time.Second)
		upd := testdb.Rebind(d, "UPDATE "+dataTable+" SET v = ? WHERE k = ?")
		for attempt := 1; ; attempt++ {
			name := testdb.Name(t, fmt.Sprint(attempt))
			a, b := name+"/a", name+"/b"
			if _, err := admin.ExecContext(ctx, testdb.Rebind(d, "INSERT INTO "+dataTable+" (k, v) VALUES (?, 0), (?, 0)"), a, b); err != nil {
				t.Fatal(err)
			}
			lease, err := l.Lock(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := lease.Tx().ExecContext(ctx, upd, 1, a); err != nil {
				t.Fatal(err)
			}
			if err := insertData(ctx, lease.Tx(), d, name+"/lease", 1); err != nil {
				t.Fatal(err)
			}
			// The other transaction does more work, so that InnoDB picks the lease's,
			// the lighter one, as the victim.
			otx, err := admin.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			rows := 100 * attempt
			vals := strings.TrimSuffix(strings.Repeat("(?, 0), ", rows), ", ")
			args := make([]any, rows)
			for i := range args {
				args[i] = fmt.Sprintf("%s/w/%d", name, i)
			}
			if _, err := otx.ExecContext(ctx, testdb.Rebind(d, "INSERT INTO "+dataTable+" (k, v) VALUES "+vals), args...); err != nil {
				t.Fatal(err)
			}
			if _, err := otx.ExecContext(ctx, upd, 2, b); err != nil {
				t.Fatal(err)
			}
			res := make(chan error, 1)
			go func() {
				_, err := lease.Tx().ExecContext(ctx, upd, 1, b) // waits for otx
				res <- err
			}()
			waitLockWait(t, admin, d, lease.SessionID(), res)
			_, oerr := otx.ExecContext(ctx, upd, 2, a) // closes the cycle
			lerr := <-res
			otx.Rollback()
			if !sqlerr.Is(lerr, sqlerr.Deadlock) {
				// The other transaction was the victim: the lease is intact.
				t.Logf("attempt %d: the other transaction was the victim (%v); the lease's UPDATE: %v", attempt, oerr, lerr)
				if err := lease.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
				if attempt == 3 {
					t.Fatal("InnoDB never picked the lease's transaction as the deadlock victim")
				}
				continue
			}
			t.Logf("attempt %d: the lease's transaction was the deadlock victim: %v", attempt, lerr)
			if oerr != nil {
				t.Errorf("the other transaction's UPDATE: %v", oerr)
			}
			if d == sqllock.Postgres {
				// PostgreSQL released the aborted transaction's locks at the error;
				// the keep-alive sees the abort.
				select {
				case <-lease.Done():
				case <-time.After(keepalive + time.Second):
					t.Errorf("Done not closed %v after the deadlock aborted the lock transaction", keepalive+time.Second)
				}
			}
			// The fault is real: the victim's rollback freed the lock row.
			next, err := other.TryLock(ctx, name)
			if err != nil {
				t.Fatalf("TryLock by another client after the lease's transaction was rolled back: %v", err)
			}
			t.Logf("another client holds the lock while the lease's Err() = %v", lease.Err())
			rerr := lease.Release(ctx)
			if !errors.Is(rerr, sqllock.ErrLost) {
				t.Errorf("Release of the deadlock victim's lease = %v, want ErrLost", rerr)
			} else {
				t.Logf("Release: %v", rerr)
			}
			if err := next.Release(ctx); err != nil {
				t.Errorf("Release of the next holder: %v", err)
			}
			if v := readData(t, admin, d, name+"/lease"); v != -1 {
				t.Errorf("the lease's insert before the rollback was committed (%d)", v)
			}
			if v := readData(t, admin, d, a); v != 0 {
				t.Errorf("the lease's update before the rollback was committed (%d)", v)
			}
			if tok, err := l.CommittedToken(ctx, name); err != nil || tok != next.Token() {
				t.Errorf("CommittedToken = %d, %v; want the next holder's %d (the lease's is %d)", tok, err, next.Token(), lease.Token())
			}
			return
		}
	})
}

// TestFinding04aReleaseInPartition: Release of a holder cut off from the database
// returns when its context ends (plus a short bound for breaking the session), with
// an error that says the commit is in doubt or the lock lost. The old Release sent
// COMMIT without a context and blocked until TCP gave up.
func TestFinding04aReleaseInPartition(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		holderDB, proxy := testdb.OpenProxied(t, d)
		admin := testdb.Open(t, d)
		ensureData(t, admin)
		l := newLocker(t, holderDB, d) // TTL 30s: the local deadline is far off
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		lease, err := l.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := insertData(ctx, lease.Tx(), d, name, 1); err != nil {
			t.Fatal(err)
		}
		proxy.Partition()
		defer proxy.Heal()
		const wait = 2 * time.Second
		rctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		err, took := releaseBounded(t, lease, rctx, 15*time.Second)
		kind := "neither ErrCommitUnknown nor ErrLost"
		switch {
		case errors.Is(err, forupdate.ErrCommitUnknown):
			kind = "ErrCommitUnknown"
		case errors.Is(err, sqllock.ErrLost):
			kind = "ErrLost"
		}
		t.Logf("Release in a partition with a %v context returned after %v: %s: %v", wait, took.Round(time.Millisecond), kind, err)
		// The session is ended after ctx ends, through the same (cut) network: a KILL
		// bounded by a second.
		if took > wait+1500*time.Millisecond {
			t.Errorf("Release took %v with a %v context", took, wait)
		}
		if err == nil || kind == "neither ErrCommitUnknown nor ErrLost" {
			t.Errorf("Release in a partition = %v, want an error matching ErrCommitUnknown or ErrLost", err)
		}
	})
}

// TestFinding04bCommitReplyLost: when the reply to COMMIT is lost, Release returns
// when its context ends with an error matching ErrCommitUnknown (not ErrLost), and
// CommittedToken tells afterwards whether the work committed.
func TestFinding04bCommitReplyLost(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		// PausedBeforeRelease: every reply is held from before Release, which then
		// gets none (on MySQL that is already the reply of the check before COMMIT).
		t.Run("PausedBeforeRelease", func(t *testing.T) {
			commitReplyLost(t, d, false)
		})
		// AfterCommitRan: COMMIT ran on the server (seen from another pool) and only
		// its reply is lost.
		t.Run("AfterCommitRan", func(t *testing.T) {
			commitReplyLost(t, d, true)
		})
	})
}

func commitReplyLost(t *testing.T, d sqllock.Dialect, afterCommit bool) {
	holderDB, proxy := testdb.OpenProxied(t, d)
	admin := testdb.Open(t, d)
	ensureData(t, admin)
	l := newLocker(t, holderDB, d)
	name := testdb.Name(t)
	ctx := testdb.Context(t, 30*time.Second)
	lease, err := l.Lock(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := insertData(ctx, lease.Tx(), d, name, 1); err != nil {
		t.Fatal(err)
	}
	wait := time.Second
	var paused chan struct{}
	if !afterCommit {
		proxy.PauseReplies()
	} else {
		// With latency on the holder's connections, COMMIT runs on the server a
		// latency before its reply would reach the client: pause the replies as
		// soon as its token is seen committed from another pool.
		const latency = 250 * time.Millisecond
		proxy.SetLatency(latency)
		wait = 3 * time.Second
		paused = make(chan struct{})
		go func() {
			defer close(paused)
			pctx, cancel := context.WithTimeout(ctx, wait)
			defer cancel()
			for {
				var tok int64
				err := admin.QueryRowContext(pctx, "SELECT token FROM sqllock_rowlock WHERE name = "+ph(d, 1), []byte(name)).Scan(&tok)
				if err == nil && tok == lease.Token() {
					proxy.PauseReplies()
					return
				}
				select {
				case <-pctx.Done():
					return
				case <-time.After(2 * time.Millisecond): // polling the server: no signal to wait on
				}
			}
		}()
	}
	defer proxy.Heal()
	rctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	err, took := releaseBounded(t, lease, rctx, 15*time.Second)
	if paused != nil {
		<-paused
	}
	t.Logf("Release with its replies lost and a %v context returned after %v: %v", wait, took.Round(time.Millisecond), err)
	if !errors.Is(err, forupdate.ErrCommitUnknown) || errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Release = %v, want an error matching ErrCommitUnknown and not ErrLost", err)
	}
	if took > wait+1500*time.Millisecond {
		t.Errorf("Release took %v with a %v context", took, wait)
	}
	proxy.SetLatency(0)
	proxy.Heal()
	tok, err := l.CommittedToken(ctx, name)
	if err != nil {
		t.Fatalf("CommittedToken after the heal: %v", err)
	}
	committed := tok == lease.Token()
	t.Logf("CommittedToken after the heal = %d, lease token %d: committed = %v", tok, lease.Token(), committed)
	if v := readData(t, admin, d, name); committed != (v == 1) {
		t.Errorf("CommittedToken says committed = %v, but the lease's write reads %d", committed, v)
	}
	if afterCommit && !committed {
		t.Errorf("COMMIT ran on the server, yet CommittedToken = %d, not the lease's %d", tok, lease.Token())
	}
}

// TestLocktestWithoutToken: the conformance suite with WithoutToken Lockers, with
// the settings of TestLocktest.
func TestLocktestWithoutToken(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		const ttl = 3 * time.Second
		locktest.Run(t, locktest.Config{
			Dialect: d,
			New: func(t testing.TB, db *sql.DB) sqllock.Locker {
				return newLocker(t, db, d, forupdate.WithTTL(ttl), forupdate.WithKeepalive(400*time.Millisecond), forupdate.WithoutToken())
			},
			Lose:           func(t testing.TB, admin *sql.DB, lease sqllock.Lease) { kill(t, admin, d, lease) },
			NoTokens:       true,
			PartitionBound: ttl + 2*time.Second, // the server's timer and a loaded CI machine: up to 2 s late
			NewDefault: func(t testing.TB, db *sql.DB) sqllock.Locker {
				l, err := forupdate.New(db, d, forupdate.WithoutToken())
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { l.Close() })
				return l
			},
			LatencyHold: 2*forupdate.DefaultKeepalive + time.Second,
		})
	})
}

// TestErrorInLockTransaction: a statement of the caller's that fails inside the lock
// transaction. On PostgreSQL the error aborts the transaction and releases its locks
// at once (another client gets the lock), so Release, called before any keep-alive
// could notice, reports ErrLost rather than a bare COMMIT error. On MySQL the failed
// statement leaves the transaction and its lock alone: another client is refused
// and Release commits.
func TestErrorInLockTransaction(t *testing.T) {
	testdb.CheckLeaks(t)
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		admin := testdb.Open(t, d)
		ensureData(t, admin)
		l := newLocker(t, testdb.Open(t, d), d, forupdate.WithKeepalive(10*time.Second), forupdate.WithTTL(30*time.Second))
		other := newLocker(t, testdb.Open(t, d), d)
		name := testdb.Name(t)
		ctx := testdb.Context(t, 30*time.Second)
		lease, err := l.Lock(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := insertData(ctx, lease.Tx(), d, name, 1); err != nil {
			t.Fatal(err)
		}
		if err := insertData(ctx, lease.Tx(), d, name, 2); err == nil { // a duplicate key
			t.Fatal("a duplicate insert succeeded")
		}
		next, err := other.TryLock(ctx, name)
		if d == sqllock.MySQL {
			if err == nil {
				next.Rollback(ctx)
				t.Fatal("another client took the lock after a failed statement in the lock transaction")
			}
			if err := lease.Release(ctx); err != nil {
				t.Fatalf("Release = %v, want nil", err)
			}
			if v := readData(t, admin, d, name); v != 1 {
				t.Errorf("the write before the failed statement reads %d, want 1", v)
			}
			return
		}
		if err != nil {
			t.Fatalf("TryLock after the error aborted the lock transaction: %v (PostgreSQL should have released the lock)", err)
		}
		defer next.Release(ctx)
		if err := lease.Release(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Release after an error aborted the lock transaction = %v, want ErrLost", err)
		} else {
			t.Logf("Release: %v", err)
		}
		if v := readData(t, admin, d, name); v != -1 {
			t.Errorf("the aborted transaction's write reads %d, want none", v)
		}
	})
}
