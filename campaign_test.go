package sqllock_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/testdb"
)

// TestCampaignTerms: three replicas (a pool and a Locker each) campaign for one name
// with every strategy; each leader steps down (fn returns nil) after a short term.
// Terms never overlap, each term's token is greater than the previous one's, the
// lock changes hands, and when ctx ends every Campaign returns an error matching
// context.Canceled and leaves the lock free.
func TestCampaignTerms(t *testing.T) {
	forEachStrategy(t, func(t *testing.T, d sqllock.Dialect, s strategy) {
		name := testdb.Name(t, s.name)
		ctx, cancel := context.WithCancel(testdb.Context(t, 2*time.Minute))
		defer cancel()
		const replicas, terms = 3, 6
		var (
			leading  atomic.Int32
			mu       sync.Mutex
			tokens   []int64
			leaders  = map[int]bool{}
			finished = make(chan struct{})
		)
		errs := make(chan error, replicas)
		for r := range replicas {
			l := s.newShort(t, testdb.Open(t, d), d)
			go func() {
				errs <- sqllock.Campaign(ctx, l, name, func(lctx context.Context) error {
					if n := leading.Add(1); n != 1 {
						t.Errorf("replica %d leads with %d leaders", r, n)
					}
					defer leading.Add(-1)
					lease, ok := sqllock.LeaseFromContext(lctx)
					if !ok {
						t.Error("no lease in the leader's context")
						return nil
					}
					mu.Lock()
					if n := len(tokens); n > 0 && lease.Token() <= tokens[n-1] {
						t.Errorf("term token %d after %d", lease.Token(), tokens[n-1])
					}
					tokens = append(tokens, lease.Token())
					leaders[r] = true
					if len(tokens) == terms {
						close(finished)
					}
					mu.Unlock()
					select {
					case <-lctx.Done():
					case <-time.After(50 * time.Millisecond): // a short term, then step down
					}
					return nil
				}, sqllock.WithRetryDelay(100*time.Millisecond))
			}()
		}
		select {
		case <-finished:
		case <-ctx.Done():
			t.Fatalf("only %d terms before the deadline", len(tokens))
		}
		cancel()
		for range replicas {
			if err := <-errs; !errors.Is(err, context.Canceled) {
				t.Errorf("Campaign after ctx ended = %v, want context.Canceled", err)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if len(leaders) < 2 {
			t.Errorf("one replica led all %d terms: stepping down does not hand the lock on", len(tokens))
		}
		// Every Campaign released on its way out: the lock is free at once.
		lease, err := s.newShort(t, testdb.Open(t, d), d).TryAcquire(testdb.Context(t, time.Minute), name)
		if err != nil {
			t.Fatalf("TryAcquire after every Campaign returned: %v", err)
		}
		lease.Release(testdb.Context(t, time.Minute))
		t.Logf("%d terms led by %d replicas, tokens %v", len(tokens), len(leaders), tokens)
	})
}

// TestCampaignFnError: an error from fn while the lease is held ends Campaign with
// that error, and the lock is released.
func TestCampaignFnError(t *testing.T) {
	forEachStrategy(t, func(t *testing.T, d sqllock.Dialect, s strategy) {
		ctx := testdb.Context(t, time.Minute)
		name := testdb.Name(t, s.name)
		boom := errors.New("boom")
		runs := 0
		err := sqllock.Campaign(ctx, s.newShort(t, testdb.Open(t, d), d), name, func(context.Context) error {
			runs++
			return boom
		})
		if !errors.Is(err, boom) || runs != 1 {
			t.Fatalf("Campaign = %v after %d runs of fn, want fn's error after 1", err, runs)
		}
		lease, err := s.newShort(t, testdb.Open(t, d), d).TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("TryAcquire after Campaign failed: %v", err)
		}
		lease.Release(ctx)
	})
}

// TestCampaignLoss: a leader partitioned from the database has fn's context
// cancelled with a cause matching ErrLost, within the TTL; Campaign does not return
// (fn's error after a loss is not Campaign's), and once the network heals and the
// other replica steps down, it leads again with a greater token.
func TestCampaignLoss(t *testing.T) {
	forEachStrategy(t, func(t *testing.T, d sqllock.Dialect, s strategy) {
		ctx, cancel := context.WithCancel(testdb.Context(t, 2*time.Minute))
		defer cancel()
		name := testdb.Name(t, s.name)
		db, proxy := testdb.OpenProxied(t, d)
		type term struct {
			token int64
			lost  chan error // the cause of the end of fn's context
		}
		terms := make(chan term, 4)
		done := make(chan error, 1)
		go func() {
			done <- sqllock.Campaign(ctx, s.newShort(t, db, d), name, func(lctx context.Context) error {
				lease, _ := sqllock.LeaseFromContext(lctx)
				tm := term{lease.Token(), make(chan error, 1)}
				terms <- tm
				<-lctx.Done()
				tm.lost <- context.Cause(lctx)
				return errors.New("interrupted") // not Campaign's error: the lease was lost
			}, sqllock.WithRetryDelay(100*time.Millisecond))
		}()
		first := <-terms
		cut := time.Now()
		proxy.Partition()
		if cause := <-first.lost; !errors.Is(cause, sqllock.ErrLost) {
			t.Fatalf("leader's context ended with %v, want ErrLost", cause)
		}
		ttl := 2 * time.Second
		if s.name == "forupdate" {
			ttl = 3 * time.Second
		}
		lostAfter := time.Since(cut)
		if took := lostAfter; took > ttl {
			t.Errorf("the partitioned leader learnt of its loss %v after the cut, TTL %v", took, ttl)
		}
		// Another replica takes the lock, then the partitioned one heals and waits.
		other, err := s.newShort(t, testdb.Open(t, d), d).Acquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if other.Token() <= first.token {
			t.Errorf("token %d after the lost leader's %d", other.Token(), first.token)
		}
		proxy.Heal()
		select {
		case err := <-done:
			t.Fatalf("Campaign returned after a loss: %v", err)
		case tm := <-terms:
			t.Fatalf("the healed replica leads (token %d) while another holds the lock", tm.token)
		case <-time.After(500 * time.Millisecond):
		}
		if err := other.Release(ctx); err != nil {
			t.Fatal(err)
		}
		second := <-terms
		if second.token <= other.Token() {
			t.Errorf("token %d after the other replica's %d", second.token, other.Token())
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Campaign = %v, want context.Canceled", err)
		}
		t.Logf("loss seen %v after the cut; tokens %d, %d, %d", lostAfter.Round(time.Millisecond), first.token, other.Token(), second.token)
	})
}

// TestCampaignInvalid: invalid arguments and options are rejected before any SQL,
// with the sentinel errors; so is a semaphore of more than one permit.
func TestCampaignInvalid(t *testing.T) {
	fn := func(context.Context) error { return nil }
	ctx := t.Context()
	for _, tc := range []struct {
		what string
		err  error
		want error
	}{
		{"empty name", sqllock.Campaign(ctx, &memLocker{}, "", fn), sqllock.ErrInvalidName},
		{"nil Locker", sqllock.Campaign(ctx, nil, "job", fn), sqllock.ErrInvalidOption},
		{"nil fn", sqllock.Campaign(ctx, &memLocker{}, "job", nil), sqllock.ErrInvalidOption},
		{"zero retry delay", sqllock.Campaign(ctx, &memLocker{}, "job", fn, sqllock.WithRetryDelay(0)), sqllock.ErrInvalidOption},
		{"nil logger", sqllock.Campaign(ctx, &memLocker{}, "job", fn, sqllock.WithCampaignLogger(nil)), sqllock.ErrInvalidOption},
		{"bad acquire option", sqllock.Campaign(ctx, &memLocker{}, "job", fn,
			sqllock.WithCampaignAcquireOptions(sqllock.WithLeaseTTL(-time.Second))), sqllock.ErrInvalidOption},
	} {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: Campaign = %v, want %v", tc.what, tc.err, tc.want)
		}
	}
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		sem, err := fairqueue.NewSemaphore(testdb.Open(t, d), d, 2)
		must(t, err)
		defer sem.Close()
		if err := sqllock.Campaign(ctx, sem, "job", fn); !errors.Is(err, sqllock.ErrInvalidOption) {
			t.Errorf("Campaign on a semaphore = %v, want ErrInvalidOption", err)
		}
	})
}

// TestCampaignStops: a Campaign waiting for a lock another replica holds returns at
// once when ctx ends, with an error matching the context's.
func TestCampaignStops(t *testing.T) {
	forEachStrategy(t, func(t *testing.T, d sqllock.Dialect, s strategy) {
		name := testdb.Name(t, s.name)
		held, err := s.newShort(t, testdb.Open(t, d), d).Acquire(testdb.Context(t, time.Minute), name)
		if err != nil {
			t.Fatal(err)
		}
		defer held.Release(testdb.Context(t, time.Minute))
		ctx, cancel := context.WithTimeout(testdb.Context(t, time.Minute), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		err = sqllock.Campaign(ctx, s.newShort(t, testdb.Open(t, d), d), name, func(context.Context) error {
			t.Error("fn ran while another replica held the lock")
			return nil
		})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Campaign = %v, want context.DeadlineExceeded", err)
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("Campaign returned %v after it started, its context ended after 300ms", took)
		}
	})
}

// TestDoReleasesOnPanic: when fn panics, Do hands the lock on before the panic goes
// on (as Campaign does): another client gets it at once, not after the TTL.
func TestDoReleasesOnPanic(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		l := strategies[0].new(t, testdb.Open(t, d), d) // uniqueindex, TTL 10 s
		name := testdb.Name(t)
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("the panic of fn did not reach Do's caller")
				}
			}()
			sqllock.Do(ctx, l, name, func(ctx context.Context) error { panic("boom") })
		}()
		le, err := strategies[0].new(t, testdb.Open(t, d), d).TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("the lock was not handed on after fn panicked: %v", err)
		}
		le.Release(ctx)
	})
}
