// Package locktest is the conformance suite every sqllock.Locker must pass, on every
// dialect it supports. Strategies run it from their integration tests; users can run
// it against a Locker of their own.
//
// The suite checks mutual exclusion under contention with a deliberately non-atomic
// read-sleep-write of a counter row over several pools, TryAcquire, Release (with an
// ended context, and bounded when a partition cuts the holder off), loss, context
// deadlines and cancellation, fencing-token monotonicity, the name rules, a
// network partition of the holder (through a testdb.Proxy: the holder must be told
// before anyone else acquires, and the lock must be free within a bound), latency on
// the holder's connections (no false loss), and that every case leaves no goroutine
// (goleak) and no connection in use (sql.DBStats.InUse) behind.
package locktest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// Config describes the Locker under test.
type Config struct {
	// Dialect of the database.
	Dialect sqllock.Dialect

	// New returns a Locker that uses db. It registers with t.Cleanup whatever must be
	// closed. Required.
	New func(t testing.TB, db *sql.DB) sqllock.Locker

	// Lose makes a held lease lost from outside, as a failure would: it kills the
	// lease's session, or deletes or takes over its row, using admin (a pool of its
	// own). Required.
	Lose func(t testing.TB, admin *sql.DB, lease sqllock.Lease)

	// Open returns a new, independent pool to the migrated database. Default:
	// testdb.Open.
	Open func(t testing.TB, d sqllock.Dialect) *sql.DB

	// Contention settings of the exclusion case. Defaults: 16 goroutines over 4 pools
	// (a Locker each, as replicas have), 2000 critical sections, each sleeping Hold
	// (default 100µs) between its read and its write of the counter.
	Goroutines, Pools, Sections int
	Hold                        time.Duration

	// LossTimeout bounds how long after Lose the lease must report ErrLost, and how
	// long another client may then wait for the lock. Default 15s.
	LossTimeout time.Duration
	// KillWindow, if set, is the documented bound on how long a lease of a
	// NewDefault Locker goes on reporting itself held after Lose (an operator's
	// kill of its session) right after the grant: the KillWindow case checks it.
	KillWindow time.Duration

	// NoTokens tells that the Locker gives no fencing tokens (Token is 0): the token
	// checks then expect 0.
	NoTokens bool

	// PartitionBound is how long after a network partition of its holder the lock
	// must be acquirable by another client: the Locker's TTL plus slack. Required for
	// the Partition case (it is skipped with a log line when 0).
	PartitionBound time.Duration
	// PartitionRounds is how many holders are partitioned, at once, each on a name of
	// its own. Default 10 (20 at once, with three packages' tests in parallel under
	// the race detector on 2 cores, stalled keep-alives past their deadline in CI).
	PartitionRounds int
	// OpenProxied returns a pool whose connections go through a Proxy. Default:
	// testdb.OpenProxied.
	OpenProxied func(t testing.TB, d sqllock.Dialect) (*sql.DB, *testdb.Proxy)

	// NewDefault returns a Locker with the strategy's default options, for the
	// Latency case. Default: New.
	NewDefault func(t testing.TB, db *sql.DB) sqllock.Locker
	// ContendedStatements, if set, is the strategy's documented bound on the
	// statements per acquisition (its release included) when independent Lockers
	// contend for one name: the Fairness case then counts them on counting pools
	// (testdb.OpenCounting) instead of cfg.Open's.
	ContendedStatements float64
	// FairnessFor is how long the Fairness case runs (default 3s).
	FairnessFor time.Duration

	// Latency is added to each direction of the holder's connections in the Latency
	// case (default 200ms), and LatencyHold is how long the holder keeps the lock
	// meanwhile (default 5s): long enough for keep-alives to run.
	Latency, LatencyHold time.Duration
}

func (c *Config) defaults() {
	if c.Open == nil {
		c.Open = testdb.Open
	}
	if c.Goroutines == 0 {
		c.Goroutines = 16
	}
	if c.Pools == 0 {
		c.Pools = 4
	}
	if c.Sections == 0 {
		c.Sections = 2000
	}
	if c.Hold == 0 {
		c.Hold = 100 * time.Microsecond
	}
	if c.LossTimeout == 0 {
		c.LossTimeout = 15 * time.Second
	}
	if c.PartitionRounds == 0 {
		c.PartitionRounds = 10
	}
	if c.OpenProxied == nil {
		c.OpenProxied = testdb.OpenProxied
	}
	if c.NewDefault == nil {
		c.NewDefault = c.New
	}
	if c.Latency == 0 {
		c.Latency = 200 * time.Millisecond
	}
	if c.LatencyHold == 0 {
		c.LatencyHold = 5 * time.Second
	}
	if c.FairnessFor == 0 {
		c.FairnessFor = 3 * time.Second
	}
}

// Run runs every case of the suite as a subtest of t.
func Run(t *testing.T, cfg Config) {
	t.Helper()
	if cfg.New == nil || cfg.Lose == nil || !cfg.Dialect.Valid() {
		t.Fatal("locktest: Config needs Dialect, New and Lose")
	}
	cfg.defaults()
	for _, c := range []struct {
		name string
		f    func(*testing.T, *Config)
	}{
		{"Exclusion", testExclusion},
		{"Fairness", testFairness},
		{"TryAcquire", testTryAcquire},
		{"ReleaseTwice", testReleaseTwice},
		{"ReleaseUnreachable", testReleaseUnreachable},
		{"Loss", testLoss},
		{"KillWindow", testKillWindow},
		{"Deadline", testDeadline},
		{"Cancel", testCancel},
		{"Tokens", testTokens},
		{"Names", testNames},
		{"Do", testDo},
		{"Partition", testPartition},
		{"Latency", testLatency},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Registered first, so it runs last: after the pools and lockers the case
			// opened were closed by their own cleanups.
			testdb.CheckLeaks(t)
			cfgc := cfg
			cfgc.Open = func(t testing.TB, d sqllock.Dialect) *sql.DB {
				db := cfg.Open(t, d)
				// Checked before the pool is closed (cleanups run last-in first-out,
				// and the lockers' cleanups were registered after this one).
				t.Cleanup(func() {
					if n := db.Stats().InUse; n != 0 {
						t.Errorf("locktest: %d connections still in use when the case ended", n)
					}
				})
				return db
			}
			c.f(t, &cfgc)
		})
	}
}

func uniqueName(t testing.TB, parts ...string) string { return testdb.Name(t, parts...) }

// lockers opens n pools and a Locker on each.
func lockers(t *testing.T, cfg *Config, n int) []sqllock.Locker {
	ls := make([]sqllock.Locker, n)
	for i := range ls {
		ls[i] = cfg.New(t, cfg.Open(t, cfg.Dialect))
	}
	return ls
}

func release(t testing.TB, l sqllock.Lease) {
	t.Helper()
	if err := l.Release(testdb.Context(t, 30*time.Second)); err != nil {
		t.Errorf("Release(%q): %v", l.Name(), err)
	}
}

func mustAcquire(t testing.TB, l sqllock.Locker, name string) sqllock.Lease {
	t.Helper()
	lease, err := l.Acquire(testdb.Context(t, 30*time.Second), name)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", name, err)
	}
	if lease == nil {
		t.Fatalf("Acquire(%q) returned a nil Lease and a nil error", name)
	}
	return lease
}

// wantNotAcquired checks a TryAcquire that must fail because the lock is held.
func wantNotAcquired(t testing.TB, l sqllock.Locker, name, why string) {
	t.Helper()
	lease, err := l.TryAcquire(testdb.Context(t, 30*time.Second), name)
	if err == nil {
		lease.Release(testdb.Context(t, 30*time.Second))
		t.Fatalf("TryAcquire(%q) succeeded %s", name, why)
	}
	if !errors.Is(err, sqllock.ErrNotAcquired) {
		t.Fatalf("TryAcquire(%q) %s: %v, want ErrNotAcquired", name, why, err)
	}
	if lease != nil {
		t.Fatalf("TryAcquire(%q) returned a Lease with an error", name)
	}
}

const counterTable = "sqllock_locktest_counter"

var counterOnce sync.Map // DSN of the database -> *sync.Once

// ensureCounter creates the counter table once per database and test binary (a
// replicated DDL, even one that changes nothing, can abort concurrent writes on a
// Galera cluster), then the counter row of name.
func ensureCounter(t testing.TB, db *sql.DB, d sqllock.Dialect, name string) {
	t.Helper()
	ctx := testdb.Context(t, 30*time.Second)
	once, _ := counterOnce.LoadOrStore(testdb.DSN(t, d), new(sync.Once))
	once.(*sync.Once).Do(func() {
		ddl := "CREATE TABLE IF NOT EXISTS " + counterTable + " (name varchar(255) PRIMARY KEY, n bigint NOT NULL)"
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			// Concurrent test binaries may race on the DDL; the table exists if the
			// INSERT below works.
			t.Logf("locktest: %s: %v", ddl, err)
		}
	})
	if _, err := db.ExecContext(ctx, testdb.Rebind(d, "INSERT INTO "+counterTable+" (name, n) VALUES (?, 0)"), name); err != nil {
		t.Fatalf("locktest: counter row: %v", err)
	}
}

// testExclusion: many goroutines over several pools take one lock many times; each
// critical section reads a counter row, sleeps, and writes it back plus one. Any
// overlap loses an increment; an in-process detector counts overlaps directly, and
// tokens must increase in the order the sections ran.
func testExclusion(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, cfg.Pools)
	name := uniqueName(t)
	counterDB := cfg.Open(t, cfg.Dialect)
	counterDB.SetMaxOpenConns(cfg.Goroutines + 1)
	ensureCounter(t, counterDB, cfg.Dialect, name)
	sel := testdb.Rebind(cfg.Dialect, "SELECT n FROM "+counterTable+" WHERE name = ?")
	upd := testdb.Rebind(cfg.Dialect, "UPDATE "+counterTable+" SET n = ? WHERE name = ?")

	var (
		remaining  atomic.Int64
		inside     atomic.Int32
		overlaps   atomic.Int64
		done       atomic.Int64
		failed     atomic.Int64 // counter writes that failed: not sections that ran
		tokenMu    sync.Mutex
		lastToken  int64
		tokenFault string
		errMu      sync.Mutex
		errs       []error
	)
	remaining.Store(int64(cfg.Sections))
	fail := func(err error) {
		errMu.Lock()
		if len(errs) < 10 {
			errs = append(errs, err)
		}
		errMu.Unlock()
	}
	ctx := testdb.Context(t, 10*time.Minute)
	var wg sync.WaitGroup
	for g := 0; g < cfg.Goroutines; g++ {
		l := ls[g%len(ls)]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for remaining.Add(-1) >= 0 {
				lease, err := l.Acquire(ctx, name)
				if err != nil {
					fail(fmt.Errorf("Acquire: %w", err))
					return
				}
				if inside.Add(1) > 1 {
					overlaps.Add(1)
				}
				tokenMu.Lock()
				switch tok := lease.Token(); {
				case cfg.NoTokens:
					if tok != 0 && tokenFault == "" {
						tokenFault = fmt.Sprintf("token %d from a Locker without tokens", tok)
					}
				case tok <= lastToken && tokenFault == "":
					tokenFault = fmt.Sprintf("token %d granted after token %d", tok, lastToken)
				default:
					lastToken = tok
				}
				tokenMu.Unlock()
				var n int64
				err = counterDB.QueryRowContext(ctx, sel, name).Scan(&n)
				if err == nil {
					time.Sleep(cfg.Hold) // widen the read-write window on purpose
					_, err = counterDB.ExecContext(ctx, upd, n+1, name)
				}
				inside.Add(-1)
				if err != nil {
					// Not a lost update: the test's own write failed. Reported as an
					// error of the test, and not counted as a section.
					failed.Add(1)
					fail(fmt.Errorf("counter write failed (a test error, not an exclusion failure): %w", err))
				} else {
					done.Add(1)
				}
				if err := lease.Release(ctx); err != nil {
					fail(fmt.Errorf("Release: %w", err))
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	var n int64
	if err := counterDB.QueryRowContext(testdb.Context(t, 30*time.Second), sel, name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if o := overlaps.Load(); o != 0 {
		t.Errorf("mutual exclusion violated: %d overlapping critical sections", o)
	}
	if n != done.Load() {
		t.Errorf("mutual exclusion violated: counter is %d after %d critical sections (lost updates)", n, done.Load())
	}
	if tokenFault != "" {
		t.Errorf("fencing tokens out of order: %s", tokenFault)
	}
	t.Logf("%d sections by %d goroutines over %d pools (%d counter writes failed)", done.Load(), cfg.Goroutines, cfg.Pools, failed.Load())
}

// testFairness: Pools Lockers, each on a pool of its own and with one goroutine, as
// replicas of a service are, take one name over and over (acquire, hold, release,
// acquire again at once) for FairnessFor. Every Locker must get at least half of its
// fair share: a Locker that releases and asks again must not win again and again
// while the others wait. With ContendedStatements set, the statements sent per
// acquisition (release, waits and keep-alives included) must stay within it.
func testFairness(t *testing.T, cfg *Config) {
	var sent atomic.Int64
	ls := make([]sqllock.Locker, cfg.Pools)
	for i := range ls {
		if cfg.ContendedStatements > 0 {
			ls[i] = cfg.New(t, testdb.OpenCounting(t, cfg.Dialect, &sent))
		} else {
			ls[i] = cfg.New(t, cfg.Open(t, cfg.Dialect))
		}
	}
	name := uniqueName(t)
	// Every Locker takes the name once first, so that no Locker's first statements
	// (a session's first use, a listener) are counted.
	for _, l := range ls {
		release(t, mustAcquire(t, l, name))
	}
	counts := make([]atomic.Int64, len(ls))
	var inside atomic.Int32
	var overlaps atomic.Int64
	ctx := testdb.Context(t, cfg.FairnessFor+time.Minute)
	stop := time.Now().Add(cfg.FairnessFor)
	start := sent.Load()
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				lease, err := l.Acquire(ctx, name)
				if err != nil {
					t.Errorf("Locker %d: Acquire: %v", i, err)
					return
				}
				if inside.Add(1) > 1 {
					overlaps.Add(1)
				}
				time.Sleep(cfg.Hold)
				inside.Add(-1)
				counts[i].Add(1)
				if err := lease.Release(ctx); err != nil {
					t.Errorf("Locker %d: Release: %v", i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	stmts := sent.Load() - start
	var total int64
	shares := make([]int64, len(ls))
	for i := range counts {
		shares[i] = counts[i].Load()
		total += shares[i]
	}
	t.Logf("%d acquisitions by %d Lockers in %v: %v each", total, len(ls), cfg.FairnessFor, shares)
	if o := overlaps.Load(); o != 0 {
		t.Errorf("mutual exclusion violated: %d overlapping holds", o)
	}
	if total < int64(4*len(ls)) {
		t.Fatalf("only %d acquisitions in %v", total, cfg.FairnessFor)
	}
	fair := float64(total) / float64(len(ls))
	for i, n := range shares {
		if float64(n) < fair/2 {
			t.Errorf("Locker %d got %d of %d acquisitions (%.1f %%, fair is %.1f %%): a Locker that releases wins again while others wait",
				i, n, total, 100*float64(n)/float64(total), 100/float64(len(ls)))
		}
	}
	if cfg.ContendedStatements > 0 {
		per := float64(stmts) / float64(total)
		t.Logf("%.2f statements per acquisition (bound %.2f)", per, cfg.ContendedStatements)
		if per > cfg.ContendedStatements {
			t.Errorf("%.2f statements per contended acquisition, more than the strategy's %.2f", per, cfg.ContendedStatements)
		}
	}
}

func testTryAcquire(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 2)
	name := uniqueName(t)
	lease := mustAcquire(t, ls[0], name)
	if lease.Name() != name {
		t.Errorf("Name() = %q, want %q", lease.Name(), name)
	}
	if lease.Err() != nil {
		t.Errorf("Err() of a held lease = %v, want nil", lease.Err())
	}
	wantNotAcquired(t, ls[1], name, "from another pool while the lock is held")
	wantNotAcquired(t, ls[0], name, "from the holder's Locker while the lock is held (not reentrant by default)")
	release(t, lease)
	again, err := ls[1].TryAcquire(testdb.Context(t, 30*time.Second), name)
	if err != nil {
		t.Fatalf("TryAcquire after Release: %v", err)
	}
	release(t, again)
}

func testReleaseTwice(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 1)
	lease := mustAcquire(t, ls[0], uniqueName(t))
	release(t, lease)
	if err := lease.Release(testdb.Context(t, 30*time.Second)); err != nil {
		t.Errorf("second Release: %v, want nil", err)
	}
	select {
	case <-lease.Done():
	default:
		t.Error("Done() not closed after Release")
	}
	if err := lease.Err(); !errors.Is(err, sqllock.ErrNotHeld) {
		t.Errorf("Err() after Release = %v, want ErrNotHeld", err)
	}
}

// testReleaseUnreachable: Release gives the lock back even when its context has
// already ended, and is bounded when the server cannot be reached. On a healthy
// server, Release with an ended context returns nil and another client gets the
// lock at once. Then two leases are held through a proxy that is partitioned (no
// FIN, no RST) right after the grants, while another client waits for each lock:
// Release with an ended context still tries, for its own 5 s (README "Release
// always gives back"), and returns an error (it could not give the lock back)
// within 5 s plus slack; Release with a live context of 1 s returns an error within
// that second plus slack. Neither returns before its time is up, unless with
// ErrLost (the local deadline passed while a keep-alive was under way): in a
// partition nothing else can be learnt early, so an earlier return means Release
// did not try. The server-enforced bound then frees both locks: the waiting client
// gets each within PartitionBound of the cut.
func testReleaseUnreachable(t *testing.T, cfg *Config) {
	const (
		giveBack = 5 * time.Second // README: "bounded by its own 5 s"
		liveFor  = time.Second     // the live context's deadline
		early    = 250 * time.Millisecond
	)
	ls := lockers(t, cfg, 2)
	ended, cancel := context.WithCancel(context.Background())
	cancel()

	healthy := uniqueName(t, "healthy")
	lease := mustAcquire(t, ls[0], healthy)
	if err := lease.Release(ended); err != nil {
		t.Errorf("Release with an ended context on a healthy server = %v, want nil", err)
	}
	if after, err := ls[1].TryAcquire(testdb.Context(t, 30*time.Second), healthy); err != nil {
		t.Errorf("TryAcquire right after a Release with an ended context: %v (the lock was not given back)", err)
	} else {
		release(t, after)
	}

	if cfg.PartitionBound == 0 {
		t.Log("locktest: Config.PartitionBound not set: Release through a partition not checked")
		return
	}
	holderDB, proxy := cfg.OpenProxied(t, cfg.Dialect)
	holder := cfg.New(t, holderDB)
	ctx := testdb.Context(t, cfg.PartitionBound+time.Minute)
	names := [2]string{uniqueName(t, "ended"), uniqueName(t, "live")}
	var leases [2]sqllock.Lease
	for i, n := range names {
		leases[i] = mustAcquire(t, holder, n)
	}
	// Partitioned right after the grants, before the first keep-alive is due: no
	// keep-alive is under way when Release is called.
	cut := time.Now()
	proxy.Partition()
	defer proxy.Heal()
	type grant struct {
		i     int
		lease sqllock.Lease
		err   error
		at    time.Time
	}
	grants := make(chan grant, len(names))
	for i, n := range names {
		go func() {
			l, err := ls[1].Acquire(ctx, n)
			grants <- grant{i, l, err, time.Now()}
		}()
	}
	type result struct {
		err  error
		took time.Duration
	}
	var res [2]result
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		start := time.Now()
		err := leases[0].Release(ended)
		res[0] = result{err, time.Since(start)}
	}()
	go func() {
		defer wg.Done()
		live, cancel := context.WithTimeout(context.Background(), liveFor)
		defer cancel()
		start := time.Now()
		err := leases[1].Release(live)
		res[1] = result{err, time.Since(start)}
	}()
	wg.Wait()
	whats := [2]string{"with an ended context", fmt.Sprintf("with a live context of %v", liveFor)}
	for i, c := range []struct {
		what         string
		bound, slack time.Duration
	}{
		{whats[0], giveBack, 2 * time.Second},
		{whats[1], liveFor, time.Second},
	} {
		r := res[i]
		t.Logf("Release %s through a partition: %v after %v", c.what, r.err, r.took.Round(time.Millisecond))
		switch {
		case r.err == nil:
			t.Errorf("Release %s through a partition returned nil after %v: it cannot have given the lock back", c.what, r.took)
		case r.took > c.bound+c.slack:
			t.Errorf("Release %s through a partition returned after %v, want at most %v (+%v slack)", c.what, r.took, c.bound, c.slack)
		case r.took < c.bound-early && !errors.Is(r.err, sqllock.ErrLost):
			t.Errorf("Release %s through a partition returned after %v, before its %v were up, with %v: it did not try to give the lock back",
				c.what, r.took, c.bound, r.err)
		}
		if leases[i].Err() == nil {
			t.Errorf("Err() after Release %s is nil: the lease still reports itself held", c.what)
		}
		select {
		case <-leases[i].Done():
		default:
			t.Errorf("Done() not closed after Release %s", c.what)
		}
	}
	var got []sqllock.Lease
	for range names {
		var g grant
		select {
		case g = <-grants:
		case <-time.After(cfg.PartitionBound + 30*time.Second):
			t.Fatalf("a lock released through the partition was not acquirable %v after the cut (bound %v)", time.Since(cut), cfg.PartitionBound)
		}
		if g.err != nil {
			t.Errorf("Acquire of the lock released %s: %v", whats[g.i], g.err)
			continue
		}
		got = append(got, g.lease)
		took := g.at.Sub(cut)
		t.Logf("lock released %s acquired by another client %v after the cut (bound %v)",
			whats[g.i], took.Round(time.Millisecond), cfg.PartitionBound)
		if took > cfg.PartitionBound {
			t.Errorf("lock released %s through the partition acquirable only %v after the cut, bound %v",
				whats[g.i], took, cfg.PartitionBound)
		}
	}
	proxy.Heal()
	for _, l := range got {
		release(t, l)
	}
}

func testLoss(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 2)
	admin := cfg.Open(t, cfg.Dialect)
	name := uniqueName(t)
	lease := mustAcquire(t, ls[0], name)
	cfg.Lose(t, admin, lease)
	select {
	case <-lease.Done():
	case <-time.After(cfg.LossTimeout):
		t.Fatalf("Done() not closed %v after the lease was lost", cfg.LossTimeout)
	}
	if err := lease.Err(); !errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Err() after loss = %v, want ErrLost", err)
	}
	if err := lease.Release(testdb.Context(t, 30*time.Second)); !errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Release after loss = %v, want ErrLost", err)
	}
	next, err := ls[1].Acquire(testdb.Context(t, cfg.LossTimeout), name)
	if err != nil {
		t.Fatalf("Acquire after loss: %v", err)
	}
	if !cfg.NoTokens && next.Token() <= lease.Token() {
		t.Errorf("token after loss %d, not greater than the lost lease's %d", next.Token(), lease.Token())
	}
	release(t, next)
}

// testKillWindow: Lose right after the grant (as far as can be from the next
// keep-alive) on a Locker with the default options: Done closes within KillWindow.
func testKillWindow(t *testing.T, cfg *Config) {
	if cfg.KillWindow == 0 {
		t.Log("locktest: Config.KillWindow not set: KillWindow not checked")
		return
	}
	l := cfg.NewDefault(t, cfg.Open(t, cfg.Dialect))
	admin := cfg.Open(t, cfg.Dialect)
	lease := mustAcquire(t, l, uniqueName(t))
	cfg.Lose(t, admin, lease)
	lost := time.Now()
	select {
	case <-lease.Done():
	case <-time.After(cfg.KillWindow + 10*time.Second):
		t.Fatalf("Done not closed %v after the kill", cfg.KillWindow+10*time.Second)
	}
	window := time.Since(lost)
	t.Logf("Done closed %v after the kill (bound %v)", window.Round(time.Millisecond), cfg.KillWindow)
	if window > cfg.KillWindow {
		t.Errorf("Done closed %v after the kill, want at most %v", window, cfg.KillWindow)
	}
	if err := lease.Err(); !errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Err = %v, want ErrLost", err)
	}
	if err := lease.Release(testdb.Context(t, 30*time.Second)); !errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Release = %v, want ErrLost", err)
	}
}

func testDeadline(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 3)
	name := uniqueName(t)
	holder := mustAcquire(t, ls[0], name)
	const wait = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	start := time.Now()
	lease, err := ls[1].Acquire(ctx, name)
	took := time.Since(start)
	if err == nil {
		lease.Release(testdb.Context(t, 30*time.Second))
		t.Fatal("Acquire of a held lock succeeded")
	}
	if lease != nil {
		t.Error("Acquire returned a Lease with an error")
	}
	if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire past its deadline: %v, want ErrNotAcquired and context.DeadlineExceeded", err)
	}
	if took < wait-10*time.Millisecond || took > wait+2*time.Second {
		t.Errorf("Acquire with a %v deadline returned after %v", wait, took)
	}
	release(t, holder)
	// Nothing of the timed-out attempt may remain: a third client gets the lock at once.
	after, err := ls[2].TryAcquire(testdb.Context(t, 30*time.Second), name)
	if err != nil {
		t.Fatalf("TryAcquire after the timed-out Acquire and Release: %v (a lock was left behind)", err)
	}
	release(t, after)
}

func testCancel(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 3)
	name := uniqueName(t)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if lease, err := ls[0].Acquire(ctx, name); err == nil {
		lease.Release(testdb.Context(t, 30*time.Second))
		t.Error("Acquire with a cancelled context succeeded")
	} else if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.Canceled) {
		t.Errorf("Acquire with a cancelled context: %v, want ErrNotAcquired and context.Canceled", err)
	}

	holder := mustAcquire(t, ls[0], name)
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	type result struct {
		lease sqllock.Lease
		err   error
	}
	res := make(chan result, 1)
	go func() {
		l, err := ls[1].Acquire(ctx, name)
		res <- result{l, err}
	}()
	time.AfterFunc(200*time.Millisecond, cancel)
	var r result
	select {
	case r = <-res:
	case <-time.After(30 * time.Second):
		t.Fatal("Acquire did not return 30s after its context was cancelled")
	}
	if r.err == nil {
		r.lease.Release(testdb.Context(t, 30*time.Second))
		t.Fatal("Acquire of a held lock succeeded")
	}
	if !errors.Is(r.err, sqllock.ErrNotAcquired) || !errors.Is(r.err, context.Canceled) {
		t.Errorf("cancelled Acquire: %v, want ErrNotAcquired and context.Canceled", r.err)
	}
	release(t, holder)
	after, err := ls[2].TryAcquire(testdb.Context(t, 30*time.Second), name)
	if err != nil {
		t.Fatalf("TryAcquire after the cancelled Acquire and Release: %v (a lock was left behind)", err)
	}
	release(t, after)
}

func testTokens(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 2)
	name := uniqueName(t)
	var last int64
	for i := 0; i < 6; i++ {
		lease := mustAcquire(t, ls[i%2], name)
		if tok := lease.Token(); cfg.NoTokens {
			if tok != 0 {
				t.Errorf("acquisition %d: token %d from a Locker without tokens", i, tok)
			}
		} else if tok <= last {
			t.Errorf("acquisition %d: token %d, not greater than the previous %d", i, tok, last)
		} else {
			last = tok
		}
		release(t, lease)
	}
}

// testNames: a name is 1 to MaxNameLen bytes, any bytes, and two names are the same
// lock if and only if their bytes are equal (README "Exact names"). The empty name
// and a name of MaxNameLen+1 bytes are refused with ErrInvalidName; every name in
// between is accepted, so ErrInvalidName for one (a NUL byte, invalid UTF-8, a
// trailing space) fails the case. For each pair of names that differ (in case, a
// trailing space, normalisation, a byte after a NUL, the last byte of MaxNameLen
// bytes of NULs and invalid UTF-8), both are held at once by two Lockers, the held
// name is refused to the other Locker, and once released it is free. A name of
// exactly MaxNameLen bytes is acquired end to end: Acquire, Name, a second Locker
// refused by TryAcquire and by a blocking Acquire until its deadline, Release, then
// acquired by the second Locker.
func testNames(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 2)
	ctx := testdb.Context(t, 2*time.Minute)
	for _, bad := range []string{"", strings.Repeat("x", sqllock.MaxNameLen+1)} {
		lease, err := ls[0].TryAcquire(ctx, bad)
		if !errors.Is(err, sqllock.ErrInvalidName) || lease != nil {
			t.Errorf("TryAcquire(%d-byte name) = %v, %v; want ErrInvalidName", len(bad), lease, err)
		}
		lease, err = ls[0].Acquire(ctx, bad)
		if !errors.Is(err, sqllock.ErrInvalidName) || lease != nil {
			t.Errorf("Acquire(%d-byte name) = %v, %v; want ErrInvalidName", len(bad), lease, err)
		}
	}
	base := uniqueName(t)
	long := base + "/" + strings.Repeat("L", 1024)
	// maxName is MaxNameLen bytes: base, then NULs and bytes that are not UTF-8,
	// then last.
	maxName := func(last byte) string {
		b := []byte(base + "/")
		for i := 0; len(b) < sqllock.MaxNameLen-1; i++ {
			b = append(b, "\x00\xff\xfe "[i%4])
		}
		return string(append(b, last))
	}
	pairs := []struct{ a, b, why string }{
		{base + "/Job", base + "/job", "case"},
		{base + "/a", base + "/a ", "trailing space"},
		{base + "/e", base + "/\u00e9", "accent"},
		{base + "/\u00e9", base + "/e\u0301", "Unicode normalisation"},
		{long + "1", long + "2", "1 KiB names that differ in the last byte"},
		{base + "/nul\x00a", base + "/nul\x00b", "bytes after a NUL"},
		{base + "/nul", base + "/nul\x00", "a trailing NUL"},
		{base + "/\xff\xfe", base + "/\xff\xfd", "invalid UTF-8"},
		{base + "/\x00", base + "/\x01", "a NUL and another control byte"},
		{maxName(0), maxName(0xff), "MaxNameLen-byte names of NULs and invalid UTF-8 that differ in the last byte"},
	}
	for _, p := range pairs {
		a, err := ls[0].TryAcquire(ctx, p.a)
		if err != nil {
			t.Errorf("names differing by %s: TryAcquire(%s) of a free lock: %v (a name of 1 to %d bytes, any bytes, must be accepted)",
				p.why, showName(p.a), err, sqllock.MaxNameLen)
			continue
		}
		if a.Name() != p.a {
			t.Errorf("Name() = %s, want %s", showName(a.Name()), showName(p.a))
		}
		b, err := ls[1].TryAcquire(ctx, p.b)
		if err != nil {
			t.Errorf("names differing by %s: TryAcquire(%s) while %s is held: %v (want it acquired: a different lock)",
				p.why, showName(p.b), showName(p.a), err)
		} else {
			if b.Name() != p.b {
				t.Errorf("Name() = %s, want %s", showName(b.Name()), showName(p.b))
			}
			// Both locks really are held: each is refused to the other Locker.
			wantNotAcquired(t, ls[1], p.a, "on a name that is held ("+p.why+")")
			wantNotAcquired(t, ls[0], p.b, "on a name that is held ("+p.why+")")
			release(t, b)
		}
		release(t, a)
		// Released under its exact name: free for the other Locker.
		again, err := ls[1].TryAcquire(ctx, p.a)
		if err != nil {
			t.Errorf("names differing by %s: TryAcquire(%s) after its Release: %v", p.why, showName(p.a), err)
			continue
		}
		release(t, again)
	}

	// A MaxNameLen-byte name end to end, through the blocking paths.
	name := maxName('!')
	if len(name) != sqllock.MaxNameLen {
		t.Fatalf("test bug: a %d-byte name", len(name))
	}
	lease, err := ls[0].Acquire(ctx, name)
	if err != nil {
		t.Fatalf("Acquire of a %d-byte name: %v", len(name), err)
	}
	if lease.Name() != name {
		t.Errorf("Name() of a %d-byte name = %s", len(name), showName(lease.Name()))
	}
	wantNotAcquired(t, ls[1], name, fmt.Sprintf("on a held %d-byte name", len(name)))
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	other, err := ls[1].Acquire(short, name)
	cancel()
	if err == nil {
		other.Release(ctx)
		t.Errorf("Acquire of a held %d-byte name by another Locker succeeded", len(name))
	} else if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire of a held %d-byte name by another Locker until its deadline: %v, want ErrNotAcquired and DeadlineExceeded", len(name), err)
	}
	release(t, lease)
	next, err := ls[1].Acquire(ctx, name)
	if err != nil {
		t.Fatalf("Acquire of a released %d-byte name by another Locker: %v", len(name), err)
	}
	release(t, next)
}

// showName quotes a name for a message, eliding the middle of a long one.
func showName(n string) string {
	if len(n) <= 120 {
		return fmt.Sprintf("%q", n)
	}
	return fmt.Sprintf("%q...%q (%d bytes)", n[:60], n[len(n)-20:], len(n))
}

func testDo(t *testing.T, cfg *Config) {
	ls := lockers(t, cfg, 2)
	name := uniqueName(t)
	ran := false
	err := sqllock.Do(testdb.Context(t, 30*time.Second), ls[0], name, func(ctx context.Context) error {
		ran = true
		wantNotAcquired(t, ls[1], name, "while Do runs")
		return nil
	})
	if err != nil || !ran {
		t.Fatalf("Do = %v, ran %v", err, ran)
	}
	sentinel := errors.New("fn failed")
	err = sqllock.Do(testdb.Context(t, 30*time.Second), ls[1], name, func(ctx context.Context) error { return sentinel })
	if !errors.Is(err, sentinel) {
		t.Errorf("Do returned %v, want fn's error", err)
	}
	after, err := ls[0].TryAcquire(testdb.Context(t, 30*time.Second), name)
	if err != nil {
		t.Fatalf("TryAcquire after Do: %v (Do did not release)", err)
	}
	release(t, after)
}

// testPartition: the holder's connections are cut (no FIN, no RST) while another
// client waits for the lock. The holder must be told (Done, ErrLost) strictly before
// the other client's Acquire returns, and the lock must be acquirable within
// PartitionBound. After the partition heals there are never two holders. Rounds run
// at once, each with its own holder, proxy and name.
func testPartition(t *testing.T, cfg *Config) {
	if cfg.PartitionBound == 0 {
		t.Log("locktest: Config.PartitionBound not set: Partition not run")
		return
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var worst time.Duration // partition -> other's Acquire returned
	var minGap time.Duration = -1
	for r := 0; r < cfg.PartitionRounds; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gap, took, err := partitionRound(t, cfg, r)
			if err != nil {
				t.Errorf("round %d: %v", r, err)
				return
			}
			mu.Lock()
			worst = max(worst, took)
			if minGap < 0 || gap < minGap {
				minGap = gap
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	t.Logf("%d partitioned holders: each told before the next holder got in (smallest lead %v); next holder in at most %v after the partition (bound %v)",
		cfg.PartitionRounds, minGap.Round(time.Millisecond), worst.Round(time.Millisecond), cfg.PartitionBound)
}

func partitionRound(t *testing.T, cfg *Config, r int) (lead, took time.Duration, err error) {
	holderDB, proxy := cfg.OpenProxied(t, cfg.Dialect)
	holder := cfg.New(t, holderDB)
	other := cfg.New(t, cfg.Open(t, cfg.Dialect))
	third := cfg.New(t, cfg.Open(t, cfg.Dialect))
	name := uniqueName(t, fmt.Sprint(r))
	ctx := testdb.Context(t, cfg.PartitionBound+time.Minute)
	lease, err := holder.Acquire(ctx, name)
	if err != nil {
		return 0, 0, fmt.Errorf("holder Acquire: %w", err)
	}
	type got struct {
		lease sqllock.Lease
		err   error
		at    time.Time
	}
	next := make(chan got, 1)
	go func() {
		l, err := other.Acquire(ctx, name)
		next <- got{l, err, time.Now()}
	}()
	cutAt := time.Now()
	proxy.Partition()
	var lostAt time.Time
	select {
	case <-lease.Done():
		lostAt = time.Now()
	case g := <-next:
		proxy.Heal()
		if g.err == nil {
			g.lease.Release(ctx)
			return 0, 0, fmt.Errorf("another client acquired %v into the partition while the holder was not told (Err %v)", g.at.Sub(cutAt), lease.Err())
		}
		return 0, 0, fmt.Errorf("other Acquire: %w", g.err)
	case <-time.After(cfg.PartitionBound + 30*time.Second):
		proxy.Heal()
		return 0, 0, errors.New("holder not told of the loss")
	}
	if !errors.Is(lease.Err(), sqllock.ErrLost) {
		err = errors.Join(err, fmt.Errorf("holder Err after the partition = %v, want ErrLost", lease.Err()))
	}
	var g got
	select {
	case g = <-next:
	case <-time.After(cfg.PartitionBound + 30*time.Second):
		proxy.Heal()
		return 0, 0, fmt.Errorf("lock not acquirable %v after the partition (bound %v)", cfg.PartitionBound+30*time.Second, cfg.PartitionBound)
	}
	if g.err != nil {
		proxy.Heal()
		return 0, 0, fmt.Errorf("other Acquire: %w", g.err)
	}
	lead, took = g.at.Sub(lostAt), g.at.Sub(cutAt)
	if !g.at.After(lostAt) {
		err = errors.Join(err, fmt.Errorf("other client acquired at +%v, not after the holder was told at +%v", g.at.Sub(cutAt), lostAt.Sub(cutAt)))
	}
	if took > cfg.PartitionBound {
		err = errors.Join(err, fmt.Errorf("lock acquirable only %v after the partition, bound %v", took, cfg.PartitionBound))
	}
	// Heal: the old holder stays lost, the new one holds.
	proxy.Heal()
	healAt := time.Now()
	if rerr := lease.Release(ctx); !errors.Is(rerr, sqllock.ErrLost) {
		err = errors.Join(err, fmt.Errorf("old holder's Release after the heal = %v, want ErrLost", rerr))
	}
	releasedAt := time.Now()
	if g.lease.Err() != nil {
		// The times say where the new holder's keep-alive stalled (a loaded machine, or
		// something the heal let through).
		err = errors.Join(err, fmt.Errorf("new holder lost after the heal (the old holder's Release took %v): %v",
			releasedAt.Sub(healAt).Round(time.Millisecond), g.lease.Err()))
	}
	if l, terr := third.TryAcquire(ctx, name); terr == nil {
		l.Release(ctx)
		err = errors.Join(err, errors.New("a third client acquired while the new holder held the lock after the heal"))
	} else if !errors.Is(terr, sqllock.ErrNotAcquired) {
		err = errors.Join(err, fmt.Errorf("third TryAcquire: %w", terr))
	}
	if rerr := g.lease.Release(ctx); rerr != nil {
		err = errors.Join(err, fmt.Errorf("new holder's Release %v after its grant: %w", time.Since(g.at).Round(time.Millisecond), rerr))
	}
	if !cfg.NoTokens && g.lease.Token() <= lease.Token() {
		err = errors.Join(err, fmt.Errorf("token %d after the partitioned holder's %d", g.lease.Token(), lease.Token()))
	}
	return lead, took, err
}

// testLatency: with the strategy's default options, latency on every connection of
// the holder (the acquisition included) costs no false loss.
func testLatency(t *testing.T, cfg *Config) {
	db, proxy := cfg.OpenProxied(t, cfg.Dialect)
	proxy.SetLatency(cfg.Latency)
	l := cfg.NewDefault(t, db)
	name := uniqueName(t)
	ctx := testdb.Context(t, cfg.LatencyHold+time.Minute)
	start := time.Now()
	lease, err := l.Acquire(ctx, name)
	if err != nil {
		t.Fatalf("Acquire with %v latency: %v", cfg.Latency, err)
	}
	took := time.Since(start)
	select {
	case <-lease.Done():
		t.Fatalf("lease lost %v after Acquire with %v latency each way: %v", time.Since(start)-took, cfg.Latency, lease.Err())
	case <-time.After(cfg.LatencyHold):
	}
	if err := lease.Release(ctx); err != nil {
		t.Fatalf("Release with latency: %v", err)
	}
	t.Logf("held %v with %v latency each way (Acquire took %v): no loss", cfg.LatencyHold, cfg.Latency, took.Round(time.Millisecond))
}

// TokensAcrossCrash checks that fencing tokens grow across a crash of the server of
// d (SIGKILL, no shutdown: what was not flushed is lost): after 40 acquisitions
// (tokens strictly increasing; past a logged batch of a sequence), a lease held
// while the server is killed has a token smaller than the first one drawn after the
// restart. newLocker makes a Locker on a pool. It needs a server it can crash
// (testdb.Restartable): against one given by DSN it logs that and returns.
func TokensAcrossCrash(t *testing.T, d sqllock.Dialect, newLocker func(t testing.TB, db *sql.DB) sqllock.Locker) {
	if !testdb.Restartable(t, d) {
		return
	}
	ctx := testdb.Context(t, 5*time.Minute)
	l := newLocker(t, testdb.Open(t, d))
	name := uniqueName(t)
	var last int64
	for i := range 40 {
		le := mustAcquire(t, l, name)
		if le.Token() <= last {
			t.Fatalf("acquisition %d: token %d after %d", i, le.Token(), last)
		}
		last = le.Token()
		release(t, le)
	}
	held := mustAcquire(t, l, name)
	before := held.Token()
	testdb.Crash(t, d)
	select { // the session died with the server
	case <-held.Done():
	case <-ctx.Done():
		t.Fatal("the lease held through the crash did not end")
	}
	le, err := newLocker(t, testdb.Open(t, d)).Acquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer le.Release(ctx)
	if le.Token() <= before {
		t.Fatalf("token %d after the crash, %d drawn before it by a lease held through it", le.Token(), before)
	}
	t.Logf("token before the crash %d, after %d", before, le.Token())
}
