package uniqueindex

// Regression tests of the review findings on commit 7748e60, one per finding
// (TestFindingNN...). Each asserts what the fix changed and fails on the old code,
// except TestFinding06: that fix is guidance in Check's documentation (run Check as
// the last statement of the transaction), and the test shows the guided use works.

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// recordHandler is a slog.Handler that keeps the messages of the records at or above
// level, and signals the first record whose message contains signal.
type recordHandler struct {
	level  slog.Level
	signal string
	ch     chan struct{}
	once   *sync.Once
	mu     *sync.Mutex
	msgs   *[]string
}

func newRecordHandler(level slog.Level, signal string) recordHandler {
	return recordHandler{level: level, signal: signal, ch: make(chan struct{}), once: new(sync.Once),
		mu: new(sync.Mutex), msgs: new([]string)}
}

func (h recordHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h recordHandler) Handle(_ context.Context, r slog.Record) error {
	if h.signal != "" && strings.Contains(r.Message, h.signal) {
		h.once.Do(func() { close(h.ch) })
	}
	if r.Level < h.level {
		return nil
	}
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	h.mu.Lock()
	*h.msgs = append(*h.msgs, b.String())
	h.mu.Unlock()
	return nil
}
func (h recordHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h recordHandler) WithGroup(string) slog.Handler      { return h }

// records returns the messages kept so far.
func (h recordHandler) records() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), *h.msgs...)
}

// lockRow locks the lease row of name FOR UPDATE in a new transaction of admin, as
// a statement in flight on that row would. It returns the server's id of that
// transaction's session and a function that commits it.
func lockRow(t *testing.T, admin *sql.DB, d sqllock.Dialect, name string) (session int64, unblock func()) {
	t.Helper()
	ctx := testdb.Context(t, time.Minute)
	tx, err := admin.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var done bool
	t.Cleanup(func() {
		if !done {
			tx.Rollback()
		}
	})
	session = testdb.SessionID(ctx, t, d, tx)
	var one int
	if err := tx.QueryRowContext(ctx, testdb.Rebind(d, "SELECT 1 FROM sqllock_lease WHERE lock_key = ? FOR UPDATE"), namekey.Key(name)).Scan(&one); err != nil {
		t.Fatal(err)
	}
	return session, func() {
		done = true
		if err := tx.Commit(); err != nil {
			t.Error(err)
		}
	}
}

// waitBlockedOn polls the server until a statement waits for the lock that session
// (see lockRow) holds on the lease row of name, or fails the test after 10s. On
// PostgreSQL it asks pg_blocking_pids. MariaDB lists in INNODB_TRX neither the
// session nor the lock an INSERT ... ON DUPLICATE KEY UPDATE waits for, so on MySQL
// it looks in SHOW ENGINE INNODB STATUS for a transaction waiting for a lock on the
// row's key (printed in hex). Other tests on the same server run statements of the
// same text: matching on the statement would mistake theirs for this one.
func waitBlockedOn(t *testing.T, admin *sql.DB, d sqllock.Dialect, session int64, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	keyHex := hex.EncodeToString(namekey.Key(name)[:16]) // long fields are printed truncated
	for {
		var blocked bool
		if d == sqllock.Postgres {
			var n int
			if err := admin.QueryRowContext(ctx, "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", session).Scan(&n); err != nil {
				t.Fatalf("waiting for a statement blocked by session %d: %v", session, err)
			}
			blocked = n > 0
		} else {
			var typ, nm, status string
			if err := admin.QueryRowContext(ctx, "SHOW ENGINE INNODB STATUS").Scan(&typ, &nm, &status); err != nil {
				t.Fatalf("waiting for a statement blocked on the lease row: %v", err)
			}
			if i := strings.Index(status, "\nTRANSACTIONS\n"); i >= 0 {
				trx := status[i:]
				if j := strings.Index(trx, "\nFILE I/O\n"); j >= 0 {
					trx = trx[:j]
				}
				blocked = strings.Contains(trx, "FOR THIS LOCK TO BE GRANTED") && strings.Contains(trx, "hex "+keyHex)
			}
		}
		if blocked {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no statement blocked on the lease row of %q within 10s", name)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// leaseRow reads the lease row of name: token, owner, and whether it has expired by
// the database clock. ok is false if there is no row.
func leaseRow(t *testing.T, admin *sql.DB, d sqllock.Dialect, name string) (token int64, owner []byte, expired, ok bool) {
	t.Helper()
	q := "SELECT token, owner, expires_at <= UTC_TIMESTAMP(6) FROM sqllock_lease WHERE lock_key = ?"
	if d == sqllock.Postgres {
		q = "SELECT token, owner, expires_at <= clock_timestamp() FROM sqllock_lease WHERE lock_key = $1"
	}
	err := admin.QueryRowContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name)).Scan(&token, &owner, &expired)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil, false, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return token, owner, expired, true
}

// expireRow makes the lease row of name expired on the database clock.
func expireRow(t *testing.T, admin *sql.DB, d sqllock.Dialect, name string) {
	t.Helper()
	q := testdb.Rebind(d, "UPDATE sqllock_lease SET expires_at = acquired_at WHERE lock_key = ?")
	res, err := admin.ExecContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name))
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		t.Fatalf("expired %d lease rows of %q, want 1", n, name)
	}
}

// warmPool leaves n idle connections in db (each opened and used once), so that
// statements can still be sent on them while the proxy holds replies back (a new
// connection cannot be opened then: the server's greeting is held too).
func warmPool(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	db.SetMaxIdleConns(n + 2)
	ctx := testdb.Context(t, 30*time.Second)
	conns := make([]*sql.Conn, 0, n)
	for i := 0; i < n; i++ {
		c, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.PingContext(ctx); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Close()
	}
}

// TestFinding05AcquireBoundedByContext: Acquire and TryAcquire with a 300ms context
// return within about 300ms while the holder's open Check transaction share-locks the
// lease row (the old code waited for the attempt timeout, 10s, or for the
// transaction), and leave nothing behind: once the transaction ends and the holder
// releases, a third Locker acquires at once.
func TestFinding05AcquireBoundedByContext(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const budget, slack = 300 * time.Millisecond, 700 * time.Millisecond
		h := newLocker(t, testdb.Open(t, d), d)                                        // may start the server's container: before the deadline
		w := newLocker(t, testdb.Open(t, d), d, WithPollInterval(50*time.Millisecond)) // attempt timeout: the default 10s
		third := newLocker(t, testdb.Open(t, d), d)
		ctx := testdb.Context(t, 60*time.Second)
		name := testdb.Name(t)
		held, err := h.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer held.Release(ctx)
		txdb := testdb.Open(t, d)

		for _, try := range []bool{false, true} {
			op := map[bool]string{false: "Acquire", true: "TryAcquire"}[try]
			// The holder's open Check transaction share-locks the lease row: another
			// Locker's attempt waits for it in the server.
			tx, err := txdb.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var endTx sync.Once
			rollback := func() { endTx.Do(func() { tx.Rollback() }) }
			if err := held.(*Lease).Check(ctx, tx); err != nil {
				rollback()
				t.Fatal(err)
			}
			// A backstop, so that code that waits for the transaction returns at all.
			backstop := time.AfterFunc(3*time.Second, rollback)
			cctx, cancel := context.WithTimeout(ctx, budget)
			start := time.Now()
			var le sqllock.Lease
			if try {
				le, err = w.TryAcquire(cctx, name)
			} else {
				le, err = w.Acquire(cctx, name)
			}
			took := time.Since(start)
			cancel()
			backstop.Stop()
			rollback()
			if err == nil {
				le.Release(ctx)
				t.Fatalf("%s of a held lock succeeded", op)
			}
			if !errors.Is(err, sqllock.ErrNotAcquired) {
				t.Errorf("%s: %v, want ErrNotAcquired", op, err)
			}
			if !try && !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s: %v, want an error matching context.DeadlineExceeded too", op, err)
			}
			if took > budget+slack {
				t.Errorf("%s with a %v context returned after %v (want < %v)", op, budget, took.Round(time.Millisecond), budget+slack)
			}
			t.Logf("%s with a %v context behind a Check transaction: %v after %v", op, budget, err, took.Round(time.Millisecond))
		}

		if err := held.Release(ctx); err != nil {
			t.Fatalf("holder's Release: %v", err)
		}
		start := time.Now()
		le, err := third.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("TryAcquire after the holder released: %v (something was left behind)", err)
		}
		t.Logf("third Locker acquired in %v", time.Since(start).Round(time.Millisecond))
		if err := le.Release(ctx); err != nil {
			t.Error(err)
		}
	})
}

// uncertainGrant sets up an attempt of w whose grant commits while its reply is held
// by the proxy: an expired row of name (acquired by other, expired from admin) is
// locked FOR UPDATE by a transaction of admin; acquire (which must call w's
// Acquire) is started, and once its attempt waits for that row lock in the server,
// the proxy starts holding replies and the transaction commits: the attempt takes the
// row over and commits, and its reply is held. It returns the channel of acquire's
// result and the row's owner before the takeover.
func uncertainGrant(t *testing.T, admin *sql.DB, d sqllock.Dialect, proxy *testdb.Proxy, other *Locker, name string,
	acquire func() (sqllock.Lease, error)) (<-chan acquired, []byte) {
	t.Helper()
	ctx := testdb.Context(t, 60*time.Second)
	old, err := other.TryAcquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { old.Release(context.Background()) }) // lost by then: a no-op
	expireRow(t, admin, d, name)
	session, unblock := lockRow(t, admin, d, name)
	got := make(chan acquired, 1)
	go func() {
		start := time.Now()
		le, err := acquire()
		got <- acquired{le, err, time.Since(start)}
	}()
	waitBlockedOn(t, admin, d, session, name)
	proxy.PauseReplies()
	unblock()
	// The attempt commits its takeover (the row changes owner); its reply is held.
	oldOwner := old.(*Lease).owner
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, owner, _, ok := leaseRow(t, admin, d, name)
		if ok && !bytes.Equal(owner, oldOwner) {
			break
		}
		if time.Now().After(deadline) {
			proxy.Heal()
			t.Fatal("the blocked attempt did not take the expired row over")
		}
		time.Sleep(5 * time.Millisecond) // polling the database
	}
	return got, oldOwner
}

type acquired struct {
	lease sqllock.Lease
	err   error
	took  time.Duration
}

// TestFinding07UncertainGrant: an attempt that committed while its reply was lost
// leaves nothing held by nobody. A caller that gives up (its context ends) deletes
// the row, so another client acquires at once, not after the TTL (20s); a caller that
// goes on retrying adopts its own row once the network is back.
//
// The faults: the attempt waits in the server for a row lock; the proxy starts
// holding replies; the lock is released, the attempt commits its grant and its reply
// is held. The attempt times out (500ms) and its connection is closed by the client
// (on PostgreSQL only after interrupt.Grace: the cancel requests go through the proxy
// on connections of their own, whose end the proxy holds back too), so its reply is
// lost for good.
//
// While replies are held no clean-up can get through either: it needs answers before
// its DELETE is sent (pgx prepares the statement and pings a connection idle for more
// than a second, go-sql-driver prepares, and a new connection waits for the server's
// greeting). So "given up" heals the network when the caller's context ends, before
// Acquire returns: the caller then either deletes the row it never learnt of, or, if
// the held reply gets through first, learns of the grant as it gives up and gives it
// back. Either way another client acquires at once. Healing only after Acquire
// returned leaves the row held for its TTL (checked: the clean-up fails).
func TestFinding07UncertainGrant(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		const ttl, attemptTimeout = 20 * time.Second, 500 * time.Millisecond
		t.Run("given up", func(t *testing.T) {
			testdb.CheckLeaks(t)
			admin := testdb.Open(t, d)
			pdb, proxy := testdb.OpenProxied(t, d)
			w := newLocker(t, pdb, d, WithTTL(ttl), WithAttemptTimeout(attemptTimeout), WithPollInterval(100*time.Millisecond))
			other := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))
			third := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))
			warmPool(t, pdb, 6)
			name := testdb.Name(t)
			actx, acancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
			defer acancel()
			got, _ := uncertainGrant(t, admin, d, proxy, other, name, func() (sqllock.Lease, error) {
				return w.Acquire(actx, name)
			})
			var r acquired
			select {
			case <-actx.Done():
				proxy.Heal() // the caller gives up: the network is back for its clean-up
				r = <-got
			case r = <-got:
				proxy.Heal()
			}
			if r.err == nil {
				r.lease.Release(context.Background())
				t.Fatalf("Acquire succeeded, want ErrNotAcquired")
			}
			if !errors.Is(r.err, sqllock.ErrNotAcquired) || !errors.Is(r.err, context.DeadlineExceeded) {
				t.Errorf("Acquire: %v, want ErrNotAcquired and DeadlineExceeded", r.err)
			}
			start := time.Now()
			le, err := third.TryAcquire(testdb.Context(t, 30*time.Second), name)
			if err != nil {
				tok, owner, expired, ok := leaseRow(t, admin, d, name)
				t.Fatalf("TryAcquire after the caller gave up: %v: the abandoned grant is still held (row token %d owner %x expired %v present %v)",
					err, tok, owner, expired, ok)
			}
			t.Logf("Acquire returned %v after %v; another Locker acquired in %v", r.err, r.took.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
			if err := le.Release(testdb.Context(t, 30*time.Second)); err != nil {
				t.Error(err)
			}
		})
		t.Run("retried", func(t *testing.T) {
			testdb.CheckLeaks(t)
			admin := testdb.Open(t, d)
			pdb, proxy := testdb.OpenProxied(t, d)
			rec := newRecordHandler(slog.LevelWarn, "attempt timed out")
			w := newLocker(t, pdb, d, WithTTL(ttl), WithAttemptTimeout(attemptTimeout), WithPollInterval(100*time.Millisecond),
				WithLogger(slog.New(rec)))
			other := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))
			warmPool(t, pdb, 6)
			name := testdb.Name(t)
			actx, acancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer acancel()
			got, oldOwner := uncertainGrant(t, admin, d, proxy, other, name, func() (sqllock.Lease, error) {
				return w.Acquire(actx, name)
			})
			select {
			case <-rec.ch: // the attempt whose reply is held timed out; Acquire retries
			case r := <-got:
				proxy.Heal()
				t.Fatalf("Acquire returned before its first attempt timed out: %v", r.err)
			}
			proxy.Heal()
			healed := time.Now()
			r := <-got
			if r.err != nil {
				t.Fatalf("Acquire after the network healed: %v (after %v)", r.err, r.took.Round(time.Millisecond))
			}
			le := r.lease.(*Lease)
			defer le.Release(context.Background())
			if took := time.Since(healed); took > 3*time.Second {
				t.Errorf("Acquire returned %v after the network healed (TTL %v)", took.Round(time.Millisecond), ttl)
			}
			if le.Token() <= 0 {
				t.Errorf("token %d", le.Token())
			}
			tok, owner, expired, ok := leaseRow(t, admin, d, name)
			switch {
			case !ok:
				t.Error("no lease row after Acquire succeeded")
			case tok != le.Token() || !bytes.Equal(owner, le.owner) || expired:
				t.Errorf("lease row: token %d owner %x expired %v; the lease: token %d owner %x", tok, owner, expired, le.Token(), le.owner)
			case bytes.Equal(owner, oldOwner):
				t.Error("the row still belongs to the expired holder")
			}
			var n int
			q := testdb.Rebind(d, "SELECT count(*) FROM sqllock_lease WHERE lock_key = ? AND token = ?")
			if err := admin.QueryRowContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name), le.Token()).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != 1 {
				t.Errorf("%d lease rows with the lease's token, want 1", n)
			}
			if err := le.Release(testdb.Context(t, 30*time.Second)); err != nil {
				t.Errorf("Release: %v", err)
			}
			t.Logf("Acquire succeeded %v after the heal (%v in all), token %d", time.Since(healed).Round(time.Millisecond), r.took.Round(time.Millisecond), le.Token())
		})
	})
}

// TestFinding08RefreshRacingRelease: a Refresh racing a Release never turns the
// release into a loss: Release returns nil, Err matches ErrNotHeld (never ErrLost),
// Refresh returns nil or ErrNotHeld, and no loss is logged.
func TestFinding08RefreshRacingRelease(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const rounds = 300
		rec := newRecordHandler(slog.LevelWarn, "")
		l := newLocker(t, testdb.Open(t, d), d, WithLogger(slog.New(rec)))
		ctx := testdb.Context(t, 60*time.Second)
		name := testdb.Name(t)
		var refreshed, notHeld int
		for i := 0; i < rounds; i++ {
			sl, err := l.TryAcquire(ctx, name)
			if err != nil {
				t.Fatalf("round %d: TryAcquire: %v", i, err)
			}
			le := sl.(*Lease)
			start := make(chan struct{})
			var rerr, ferr error
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { defer wg.Done(); <-start; rerr = le.Release(ctx) }()
			go func() { defer wg.Done(); <-start; ferr = le.Refresh(ctx) }()
			close(start)
			wg.Wait()
			if rerr != nil {
				t.Errorf("round %d: Release: %v", i, rerr)
			}
			if err := le.Err(); !errors.Is(err, sqllock.ErrNotHeld) || errors.Is(err, sqllock.ErrLost) {
				t.Errorf("round %d: Err after Release = %v, want ErrNotHeld", i, err)
			}
			switch {
			case ferr == nil:
				refreshed++
			case errors.Is(ferr, sqllock.ErrNotHeld) && !errors.Is(ferr, sqllock.ErrLost):
				notHeld++
			default:
				t.Errorf("round %d: Refresh: %v, want nil or ErrNotHeld", i, ferr)
			}
			if t.Failed() {
				break
			}
		}
		for _, m := range rec.records() {
			if strings.Contains(m, "lost") {
				t.Errorf("logged: %s", m)
			}
		}
		t.Logf("%d rounds: Refresh succeeded in %d, reported ErrNotHeld in %d", rounds, refreshed, notHeld)
	})
}

// TestFinding09ExpiryIsFinal: a renewal never revives an expired row: Refresh of a
// lease whose row expired on the database clock reports ErrLost, and the row stays
// expired.
func TestFinding09ExpiryIsFinal(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		l := newLocker(t, testdb.Open(t, d), d, WithTTL(3*time.Second))
		ctx := testdb.Context(t, 30*time.Second)
		name := testdb.Name(t)
		sl, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		le := sl.(*Lease)
		defer le.Release(ctx)
		expireRow(t, admin, d, name)
		if err := le.Refresh(ctx); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Refresh of an expired lease: %v, want ErrLost", err)
		}
		// The row is still expired, or gone (deleted as the lease's own after the
		// loss), but never live again.
		tok, owner, expired, ok := leaseRow(t, admin, d, name)
		if ok && !expired {
			t.Errorf("the expired row was revived by the renewal (token %d, the lease's %d; owner the lease's: %v)",
				tok, le.Token(), bytes.Equal(owner, le.owner))
		}
		if err := le.Err(); !errors.Is(err, sqllock.ErrLost) {
			t.Errorf("Err = %v, want ErrLost", err)
		}
	})
}

// Environment of the frozen holder subprocess (with helperEnv, helperDSNEnv and
// helperNameEnv of helper_test.go).
const frozenEnv = "SQLLOCK_UNIQUEINDEX_HELPER_FROZEN"

// TestHelperFrozenHolder is the holder process of TestFinding12FrozenHolder: it
// acquires the lock with a 2s TTL, prints its token, then answers each line read
// from stdin at once with the lease's Err: "HELD", "LOST <err>" or "OTHER <err>".
// Without the helper environment it returns at once.
func TestHelperFrozenHolder(t *testing.T) {
	d, ok := testdb.ChildDialect(helperEnv)
	if !ok || os.Getenv(frozenEnv) == "" {
		return
	}
	db, err := sql.Open(testdb.DriverName(d), os.Getenv(helperDSNEnv))
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	l, err := New(db, d, WithTTL(2*time.Second))
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	lease, err := l.Acquire(context.Background(), os.Getenv(helperNameEnv))
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	fmt.Printf("TOKEN %d\n", lease.Token())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch err := lease.Err(); {
		case err == nil:
			fmt.Println("HELD")
		case errors.Is(err, sqllock.ErrLost):
			fmt.Println("LOST", err)
		default:
			fmt.Println("OTHER", err)
		}
	}
	// stdin closed: the parent is done.
}

// frozenHolder is a running TestHelperFrozenHolder process.
type frozenHolder struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	stderr bytes.Buffer // also copied to os.Stderr; read it only after cmd.Wait
	token  int64
}

func startFrozenHolder(t *testing.T, d sqllock.Dialect, name string) *frozenHolder {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperFrozenHolder$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+d.String(), frozenEnv+"=1",
		helperDSNEnv+"="+testdb.DSN(t, d), helperNameEnv+"="+name)
	h := &frozenHolder{cmd: cmd}
	cmd.Stderr = io.MultiWriter(os.Stderr, &h.stderr)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h.in, h.out = in, bufio.NewReader(stdout)
	t.Cleanup(func() {
		h.cmd.Process.Signal(syscall.SIGCONT)
		h.cmd.Process.Kill()
		h.cmd.Wait()
	})
	line, err := h.out.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "TOKEN ") {
		t.Fatalf("holder process: %q, %v", line, err)
	}
	h.token, _ = strconv.ParseInt(strings.TrimSpace(strings.TrimPrefix(line, "TOKEN ")), 10, 64)
	return h
}

// stopped waits until the kernel reports the process stopped (state T in
// /proc/<pid>/stat).
func (h *frozenHolder) stopped() error {
	path := fmt.Sprintf("/proc/%d/stat", h.cmd.Process.Pid)
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		// pid (comm) state ...: the state follows the last ')'.
		if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) && (b[i+2] == 'T' || b[i+2] == 't') {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("holder process not stopped: %s", b)
		}
		time.Sleep(time.Millisecond) // polling the kernel
	}
}

// TestFinding12FrozenHolder: a holder process frozen (SIGSTOP) past its TTL while
// another client took the lock learns of the loss at its first look after SIGCONT:
// its first Err is ErrLost, whether or not its keep-alive goroutine or deadline timer
// has run since. Three holders, each on a lock of its own, run at once.
func TestFinding12FrozenHolder(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const holders = 3
		l := newLocker(t, testdb.Open(t, d), d, WithPollInterval(100*time.Millisecond))
		ctx := testdb.Context(t, 60*time.Second)
		var wg sync.WaitGroup
		for i := 0; i < holders; i++ {
			name := testdb.Name(t, strconv.Itoa(i))
			h := startFrozenHolder(t, d, name)
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := h.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
					t.Error(err)
					return
				}
				if err := h.stopped(); err != nil {
					t.Error(err)
					return
				}
				frozen := time.Now()
				le, err := l.Acquire(ctx, name)
				if err != nil {
					t.Errorf("holder %d: Acquire while the holder is frozen: %v", i, err)
					return
				}
				defer le.Release(ctx)
				if le.Token() <= h.token {
					t.Errorf("holder %d: token %d after the frozen holder's %d", i, le.Token(), h.token)
				}
				taken := time.Since(frozen)
				// The question waits in the pipe: the holder reads it as soon as it runs
				// again, its first look after the pause.
				if _, err := io.WriteString(h.in, "err?\n"); err != nil {
					t.Error(err)
					return
				}
				if err := h.cmd.Process.Signal(syscall.SIGCONT); err != nil {
					t.Error(err)
					return
				}
				answer, err := h.out.ReadString('\n')
				if err != nil {
					t.Errorf("holder %d: %v", i, err)
					return
				}
				answer = strings.TrimSpace(answer)
				if !strings.HasPrefix(answer, "LOST ") {
					t.Errorf("holder %d: first Err after SIGCONT (lock taken %v after SIGSTOP): %s, want ErrLost",
						i, taken.Round(time.Millisecond), answer)
				} else {
					t.Logf("holder %d: lock taken %v after SIGSTOP; first Err after SIGCONT: %s", i, taken.Round(time.Millisecond), answer)
				}
				h.in.Close()
				if err := h.cmd.Wait(); err != nil {
					if bytes.Contains(h.stderr.Bytes(), []byte("WARNING: DATA RACE")) {
						err = fmt.Errorf("%w: the race detector found a data race in the holder process (its report is above)", err)
					}
					t.Errorf("holder %d: %v", i, err)
				}
			}()
		}
		wg.Wait()
	})
}

// TestFinding13SlowGrantRenewedAtOnce: with 200ms of latency each way on every
// connection of the holder, the acquisitions included, leases with a 4s TTL are not
// lost: 5 of them, acquired at once on a new pool (each acquisition dials its
// connection: a slow grant, 2.6s seen in CI), each held for 3 TTLs. (The finding was
// seen with a 3s TTL; a renewal may take two round trips on MySQL, 0.8s here, and
// 3s leaves it 1.2s (README, Timing): too little on a loaded CI machine. 4s leaves
// 1.6s, and a lease whose first renewal waited an interval after a 2.6s grant would
// still be lost.)
func TestFinding13SlowGrantRenewedAtOnce(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const ttl, latency, leases = 4 * time.Second, 200 * time.Millisecond, 5
		pdb, proxy := testdb.OpenProxied(t, d)
		// Each lease keeps an idle connection: with the default 2 for 5 leases, most
		// renewals would dial a new connection and prepare their statement on it (on
		// MySQL 4-5 round trips, 1.6s+ with this latency), beyond the renewal round
		// trip a 3s TTL allows (7/15 of it). That is not what this test is about.
		pdb.SetMaxIdleConns(leases + 1)
		proxy.SetLatency(latency)
		l := newLocker(t, pdb, d, WithTTL(ttl))
		ctx := testdb.Context(t, 60*time.Second)
		var wg sync.WaitGroup
		for i := 0; i < leases; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				start := time.Now()
				le, err := l.Acquire(ctx, testdb.Name(t, strconv.Itoa(i)))
				if err != nil {
					t.Errorf("lease %d: Acquire: %v", i, err)
					return
				}
				took := time.Since(start)
				select {
				case <-le.Done():
					t.Errorf("lease %d: lost %v after Acquire returned (Acquire took %v): %v",
						i, (time.Since(start) - took).Round(time.Millisecond), took.Round(time.Millisecond), le.Err())
					le.Release(ctx)
					return
				case <-time.After(3 * ttl):
				}
				if err := le.Release(ctx); err != nil {
					t.Errorf("lease %d: Release: %v", i, err)
				}
				t.Logf("lease %d: Acquire took %v, held %v without a loss", i, took.Round(time.Millisecond), 3*ttl)
			}()
		}
		wg.Wait()
	})
}

// TestFinding14ReleaseWithEndedContext: Release with a context that has already ended
// still gives the lock back: another Locker acquires at once, not after the TTL.
func TestFinding14ReleaseWithEndedContext(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		l := newLocker(t, testdb.Open(t, d), d, WithTTL(30*time.Second))
		other := newLocker(t, testdb.Open(t, d), d)
		ctx := testdb.Context(t, 30*time.Second)
		name := testdb.Name(t)
		le, err := l.Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if err := le.Release(cctx); err != nil {
			t.Errorf("Release with a cancelled context: %v", err)
		}
		le2, err := other.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("TryAcquire after Release with a cancelled context: %v (the lock stays held for the TTL)", err)
		}
		if err := le2.Release(ctx); err != nil {
			t.Error(err)
		}
	})
}

// TestFinding06CheckLastInTransaction: a transaction that does its business work for
// most of the lease's local deadline (TTL 2s, 1.6s of work) and calls Check as its
// last statement, as Check's documentation says, commits with the lease intact: the
// renewals were not held back by Check's share lock, the lease is not lost and can be
// refreshed.
func TestFinding06CheckLastInTransaction(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		const ttl, work = 2 * time.Second, 1600 * time.Millisecond
		db := testdb.Open(t, d)
		l := newLocker(t, testdb.Open(t, d), d, WithTTL(ttl))
		ctx := testdb.Context(t, 30*time.Second)
		sl, err := l.Acquire(ctx, testdb.Name(t))
		if err != nil {
			t.Fatal(err)
		}
		le := sl.(*Lease)
		defer le.Release(ctx)
		conn, err := db.Conn(ctx) // the scratch table is a temporary table of this session
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		create := "CREATE TEMPORARY TABLE findings_scratch (v INT)"
		if _, err := conn.ExecContext(ctx, create); err != nil {
			t.Fatal(err)
		}
		tx, err := conn.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if _, err := tx.ExecContext(ctx, "INSERT INTO findings_scratch (v) VALUES (1)"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(work) // the business work: the transaction stays open (the fault, not a synchronisation)
		if err := le.Check(ctx, tx); err != nil {
			t.Fatalf("Check as the last statement after %v of work: %v", work, err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		if err := le.Err(); err != nil {
			t.Fatalf("lease lost: %v", err)
		}
		if err := le.Refresh(ctx); err != nil {
			t.Fatalf("Refresh after the transaction: %v", err)
		}
		var n int
		if err := conn.QueryRowContext(ctx, "SELECT count(*) FROM findings_scratch").Scan(&n); err != nil || n != 1 {
			t.Fatalf("business write: %d rows, %v", n, err)
		}
		if err := le.Release(ctx); err != nil {
			t.Errorf("Release: %v", err)
		}
	})
}
