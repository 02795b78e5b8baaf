package lease

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/goleak"

	"github.com/sqllock/sqllock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// keeper is a Keeper whose answers the test sets. It stands in for a strategy's SQL
// only to drive the scheduler through paths a server cannot be made to take on cue
// (a statement that ignores its context, an answer at an exact instant).
type keeper struct {
	mu       sync.Mutex
	answer   func(ctx context.Context) error
	calls    atomic.Int64
	giveBack func(ctx context.Context, lost bool) error
	gave     atomic.Int64
}

func (k *keeper) KeepAlive(ctx context.Context) (time.Duration, error) {
	k.calls.Add(1)
	k.mu.Lock()
	f := k.answer
	k.mu.Unlock()
	if f == nil {
		return 0, nil
	}
	return 0, f(ctx)
}

func (k *keeper) set(f func(ctx context.Context) error) {
	k.mu.Lock()
	k.answer = f
	k.mu.Unlock()
}

func (k *keeper) GiveBack(ctx context.Context, lost bool) error {
	k.gave.Add(1)
	if k.giveBack != nil {
		return k.giveBack(ctx, lost)
	}
	return nil
}

var label = Label{Strategy: "test", Dialect: sqllock.Postgres, Name: "n"}

func start(k Keeper, ttl time.Duration) *Lease {
	t, err := Timing{TTL: ttl}.Resolve()
	if err != nil {
		panic(err)
	}
	return Start(k, Params{Timing: t, Granted: time.Now(), Label: label})
}

func TestRenewsAndReleases(t *testing.T) {
	k := &keeper{}
	l := start(k, 300*time.Millisecond)
	time.Sleep(450 * time.Millisecond)
	if err := l.Err(); err != nil {
		t.Fatalf("Err while renewals succeed: %v", err)
	}
	if n := k.calls.Load(); n < 3 {
		t.Errorf("%d keep-alives in 450ms with a 100ms interval", n)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(l.Err(), sqllock.ErrNotHeld) {
		t.Errorf("Err after Release = %v", l.Err())
	}
	if err := l.Release(context.Background()); err != nil {
		t.Errorf("second Release = %v", err)
	}
	if k.gave.Load() != 1 {
		t.Errorf("GiveBack called %d times", k.gave.Load())
	}
}

// A keep-alive that never returns (ignores its context) cannot keep the lease past
// its local deadline: Done closes at TTL - margin.
func TestStuckKeepAliveLosesAtDeadline(t *testing.T) {
	k := &keeper{}
	release := make(chan struct{})
	k.set(func(ctx context.Context) error { <-release; return nil })
	begin := time.Now()
	l := start(k, 500*time.Millisecond)
	select {
	case <-l.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("Done not closed")
	}
	took := time.Since(begin)
	if took < 390*time.Millisecond || took > 600*time.Millisecond {
		t.Errorf("lost after %v, want about 400ms (TTL 500ms less a 100ms margin)", took)
	}
	if !errors.Is(l.Err(), sqllock.ErrLost) {
		t.Errorf("Err = %v", l.Err())
	}
	close(release)
	if err := l.Release(context.Background()); !errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Release after loss = %v", err)
	}
	if k.gave.Load() != 1 {
		t.Error("GiveBack not called for cleanup after a loss")
	}
}

// Failed keep-alives are retried; one that succeeds before the deadline saves the
// lease.
func TestTransientErrorsRetried(t *testing.T) {
	k := &keeper{}
	var fails atomic.Int64
	k.set(func(ctx context.Context) error {
		if fails.Add(1) <= 3 {
			return errors.New("connection refused")
		}
		return nil
	})
	l := start(k, 600*time.Millisecond)
	time.Sleep(900 * time.Millisecond)
	if err := l.Err(); err != nil {
		t.Fatalf("lost despite a successful retry: %v", err)
	}
	l.Release(context.Background())
}

func TestGoneLosesAtOnce(t *testing.T) {
	k := &keeper{}
	k.set(func(ctx context.Context) error { return Gonef("row taken over") })
	l := start(k, 3*time.Second)
	select {
	case <-l.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("Done not closed one interval after the keeper said gone")
	}
	err := l.Err()
	if !errors.Is(err, sqllock.ErrLost) || errors.Is(err, ErrGone) {
		t.Errorf("Err = %v: want ErrLost, without the internal marker", err)
	}
	l.Release(context.Background())
}

// A frozen holder (its goroutines did not run) learns of the loss at its first look:
// Err compares the clock with the deadline itself.
func TestErrReportsPassedDeadline(t *testing.T) {
	k := &keeper{}
	var shift atomic.Int64
	now := func() time.Time { return time.Now().Add(time.Duration(shift.Load())) }
	tm, _ := Timing{TTL: time.Hour}.Resolve()
	l := Start(k, Params{Timing: tm, Granted: now(), Label: label, Now: now})
	if l.Err() != nil {
		t.Fatal("lost at once")
	}
	shift.Store(int64(2 * time.Hour)) // as if suspended for two hours
	if !errors.Is(l.Err(), sqllock.ErrLost) {
		t.Fatalf("Err after the deadline passed = %v", l.Err())
	}
	select {
	case <-l.Done():
	default:
		t.Fatal("Done not closed after Err saw the deadline")
	}
	l.Release(context.Background())
}

// A frozen holder that looks at Done first, without calling Err, learns of the loss
// at that look: Done compares the clock with the deadline itself and returns a
// closed channel, and Err then matches ErrLost.
func TestDoneReportsPassedDeadline(t *testing.T) {
	k := &keeper{}
	var shift atomic.Int64
	now := func() time.Time { return time.Now().Add(time.Duration(shift.Load())) }
	tm, _ := Timing{TTL: time.Hour}.Resolve()
	l := Start(k, Params{Timing: tm, Granted: now(), Label: label, Now: now})
	select {
	case <-l.Done():
		t.Fatal("Done closed at once")
	default:
	}
	shift.Store(int64(2 * time.Hour)) // as if suspended for two hours
	select {
	case <-l.Done():
	default:
		t.Fatal("Done not closed at the first look after the deadline passed")
	}
	if !errors.Is(l.Err(), sqllock.ErrLost) {
		t.Errorf("Err after Done saw the deadline = %v, want ErrLost", l.Err())
	}
	l.Release(context.Background())
}

// The wall clock counts when it runs ahead of the monotonic one (a suspended VM: the
// monotonic clock stopped).
func TestWallClockCounts(t *testing.T) {
	base := time.Now()
	later := base.Add(time.Second)          // monotonic +1s
	wall := later.Round(0).Add(time.Minute) // wall +61s, no monotonic reading
	if e := elapsed(later, base); e != time.Second {
		t.Errorf("elapsed = %v", e)
	}
	if e := elapsed(wall, base); e < time.Minute {
		t.Errorf("wall-clock elapsed %v not counted", e)
	}
}

// Refresh racing Release: either the Refresh completes first, or it reports that the
// lease was released; never a loss.
func TestRefreshRacingRelease(t *testing.T) {
	for i := 0; i < 200; i++ {
		k := &keeper{}
		var released atomic.Bool
		k.set(func(ctx context.Context) error {
			if released.Load() {
				return Gonef("row deleted") // what a renewal after the DELETE sees
			}
			return nil
		})
		k.giveBack = func(ctx context.Context, lost bool) error { released.Store(true); return nil }
		l := start(k, time.Second)
		var wg sync.WaitGroup
		wg.Add(2)
		var rerr, ferr error
		go func() { defer wg.Done(); rerr = l.Release(context.Background()) }()
		go func() { defer wg.Done(); ferr = l.Refresh(context.Background()) }()
		wg.Wait()
		if rerr != nil || errors.Is(ferr, sqllock.ErrLost) || errors.Is(l.Err(), sqllock.ErrLost) {
			t.Fatalf("round %d: Release = %v, Refresh = %v, Err = %v", i, rerr, ferr, l.Err())
		}
	}
}

func TestReleaseWithEndedContextStillGivesBack(t *testing.T) {
	k := &keeper{}
	var got error
	k.giveBack = func(ctx context.Context, lost bool) error { got = ctx.Err(); return nil }
	l := start(k, time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if got != nil {
		t.Errorf("GiveBack got an ended context: %v", got)
	}
}

func TestReleaseGiveBackFails(t *testing.T) {
	k := &keeper{}
	k.giveBack = func(ctx context.Context, lost bool) error { return errors.New("network down") }
	l := start(k, time.Second)
	err := l.Release(context.Background())
	var se *sqllock.Error
	if !errors.As(err, &se) || errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Release = %v, want a *sqllock.Error that is not ErrLost", err)
	}
	if !errors.Is(l.Err(), sqllock.ErrNotHeld) {
		t.Errorf("Err = %v, want ErrNotHeld", l.Err())
	}
	k2 := &keeper{}
	k2.giveBack = func(ctx context.Context, lost bool) error { return Gonef("row gone") }
	l2 := start(k2, time.Second)
	if err := l2.Release(context.Background()); !errors.Is(err, sqllock.ErrLost) {
		t.Errorf("Release when the row was gone = %v, want ErrLost", err)
	}
}

// A grant that took long is renewed at once, not an Interval after the grant.
func TestSlowGrantRenewsAtOnce(t *testing.T) {
	k := &keeper{}
	tm, _ := Timing{TTL: 3 * time.Second}.Resolve()
	l := Start(k, Params{Timing: tm, Granted: time.Now().Add(-1500 * time.Millisecond), Label: label})
	time.Sleep(100 * time.Millisecond)
	if k.calls.Load() == 0 {
		t.Error("no keep-alive right after a grant that took 1.5s of a 3s TTL")
	}
	if r := l.Remaining(); r < 2*time.Second {
		t.Errorf("remaining %v after the renewal", r)
	}
	l.Release(context.Background())
}

func TestResolve(t *testing.T) {
	for _, tm := range []Timing{
		{TTL: 0},
		{TTL: time.Second, Interval: 600 * time.Millisecond},
		{TTL: time.Second, Interval: -1},
		{TTL: time.Second, Interval: 400 * time.Millisecond, Margin: 600 * time.Millisecond},
	} {
		if _, err := tm.Resolve(); err == nil {
			t.Errorf("%+v accepted", tm)
		}
	}
	tm, err := Timing{TTL: 30 * time.Second}.Resolve()
	if err != nil || tm.Interval != 10*time.Second || tm.Margin != 6*time.Second {
		t.Errorf("defaults: %+v, %v", tm, err)
	}
}

func TestGranted(t *testing.T) {
	if err := Granted(context.Background(), label, "acquire", func(context.Context) error {
		t.Error("released a grant whose context is alive")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var released bool
	err := Granted(ctx, label, "acquire", func(gctx context.Context) error {
		released = gctx.Err() == nil
		return nil
	})
	if !released || !errors.Is(err, sqllock.ErrNotAcquired) || !errors.Is(err, context.Canceled) {
		t.Errorf("Granted after ctx ended: released %v, err %v", released, err)
	}
}

// A give-back that outlasts the local deadline decides how the lease ends: if it
// finds the lock still the lease's, Release returns nil and the lease was not lost.
func TestSlowGiveBackIsNotALoss(t *testing.T) {
	k := &keeper{}
	k.giveBack = func(ctx context.Context, lost bool) error {
		time.Sleep(400 * time.Millisecond) // past the 240ms deadline
		return nil
	}
	l := start(k, 300*time.Millisecond)
	time.Sleep(10 * time.Millisecond)
	if err := l.Release(context.Background()); err != nil {
		t.Fatalf("Release = %v", err)
	}
	if err := l.Err(); !errors.Is(err, sqllock.ErrNotHeld) {
		t.Errorf("Err = %v, want ErrNotHeld", err)
	}
}

// A grant whose deadline has already passed when its lease starts ends at once,
// without racing the start (run with -race).
func TestGrantPastItsDeadline(t *testing.T) {
	for i := 0; i < 50; i++ {
		k := &keeper{}
		tm, _ := Timing{TTL: 30 * time.Millisecond}.Resolve()
		l := Start(k, Params{Timing: tm, Granted: time.Now().Add(-time.Second), Label: label})
		<-l.Done()
		if !errors.Is(l.Err(), sqllock.ErrLost) {
			t.Fatalf("Err = %v", l.Err())
		}
		l.Release(context.Background())
	}
}

// TestReleaseLetsKeepAliveFinish: a keep-alive statement under way on the lease's own
// connection (OwnConn) when Release is called is not cancelled (with both drivers a
// cancelled statement breaks its connection, and the give-back would then report a
// loss); Release waits for it and gives back.
func TestReleaseLetsKeepAliveFinish(t *testing.T) {
	k := &keeper{}
	inFlight := make(chan struct{})
	finish := make(chan struct{})
	var cancelled atomic.Bool
	var once sync.Once
	k.set(func(ctx context.Context) error {
		once.Do(func() { close(inFlight) })
		select {
		case <-finish:
			return nil
		case <-OwnConn(ctx).Done():
			cancelled.Store(true)
			return ctx.Err()
		}
	})
	tm, err := Timing{TTL: 5 * time.Second, Interval: 10 * time.Millisecond}.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	l := Start(k, Params{Timing: tm, Granted: time.Now(), Label: label})
	<-inFlight
	rel := make(chan error, 1)
	go func() { rel <- l.Release(context.Background()) }()
	select {
	case err := <-rel:
		t.Fatalf("Release returned %v while the keep-alive was under way", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(finish)
	if err := <-rel; err != nil {
		t.Fatalf("Release = %v", err)
	}
	if cancelled.Load() {
		t.Error("the keep-alive under way was cancelled by Release")
	}
	if k.gave.Load() != 1 {
		t.Errorf("GiveBack ran %d times, want 1", k.gave.Load())
	}
}

// TestReleaseCancelsPoolWait: a keep-alive waiting on its context (for a pooled
// connection, say) is cancelled by Release at once, and does not count as a loss.
func TestReleaseCancelsPoolWait(t *testing.T) {
	k := &keeper{}
	inFlight := make(chan struct{})
	var once sync.Once
	k.set(func(ctx context.Context) error {
		once.Do(func() { close(inFlight) })
		<-ctx.Done()
		return ctx.Err()
	})
	tm, err := Timing{TTL: 30 * time.Second, Interval: 10 * time.Millisecond}.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	l := Start(k, Params{Timing: tm, Granted: time.Now(), Label: label})
	<-inFlight
	start := time.Now()
	if err := l.Release(context.Background()); err != nil {
		t.Fatalf("Release = %v", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("Release took %v: it waited for a keep-alive that waits on its context", took)
	}
}

// TestReleaseContextAbortsKeepAlive: a statement on the lease's own connection that
// does not return is cancelled when Release's context ends, and Release returns.
func TestReleaseContextAbortsKeepAlive(t *testing.T) {
	k := &keeper{}
	inFlight := make(chan struct{})
	var once sync.Once
	k.set(func(ctx context.Context) error {
		once.Do(func() { close(inFlight) })
		<-OwnConn(ctx).Done()
		return ctx.Err()
	})
	tm, err := Timing{TTL: 30 * time.Second, Interval: 10 * time.Millisecond}.Resolve()
	if err != nil {
		t.Fatal(err)
	}
	l := Start(k, Params{Timing: tm, Granted: time.Now(), Label: label})
	<-inFlight
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_ = l.Release(ctx)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Release took %v with a 200ms context and a stuck keep-alive", took)
	}
}

// TestSettle: a give-back that answers at once is waited for; one that the server
// holds (a commit waiting for a synchronous standby) keeps the caller at most
// SettleWait after its context ended and still finishes in the background.
func TestSettle(t *testing.T) {
	defer goleak.VerifyNone(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var quick atomic.Bool
	Settle(ctx, time.Minute, func(context.Context) { quick.Store(true) })
	if !quick.Load() {
		t.Fatal("Settle returned before a quick give-back finished")
	}

	release := make(chan struct{})
	finished := make(chan error, 1)
	start := time.Now()
	Settle(ctx, time.Minute, func(gctx context.Context) {
		select {
		case <-release:
			finished <- gctx.Err() // the give-back's context outlives the caller's
		case <-gctx.Done():
			finished <- errors.New("give-back context ended early")
		}
	})
	if took := time.Since(start); took > SettleWait+time.Second {
		t.Fatalf("Settle kept the caller %v (SettleWait %v)", took, SettleWait)
	}
	close(release)
	if err := <-finished; err != nil {
		t.Fatalf("the give-back after Settle returned: %v", err)
	}

	// The limit ends a give-back that never answers.
	var ended atomic.Bool
	done := make(chan struct{})
	Settle(ctx, 10*time.Millisecond, func(gctx context.Context) {
		<-gctx.Done()
		ended.Store(true)
		close(done)
	})
	<-done
	if !ended.Load() {
		t.Fatal("limit did not end the give-back")
	}
}

// TestNewErrorPoolerHint: the errors that pgx's statement cache meets behind a
// transaction-pooling proxy carry a hint (forced here; the ha suite meets the real
// ones behind pgbouncer).
func TestNewErrorPoolerHint(t *testing.T) {
	for _, code := range []string{"42P05", "26000"} {
		cause := &pgconn.PgError{Code: code, Message: "prepared statement \"stmtcache_1\" already exists"}
		err := NewError("acquire", sqllock.Postgres, "n", nil, cause)
		if !errors.As(err, new(*pgconn.PgError)) || !strings.Contains(err.Error(), "default_query_exec_mode") {
			t.Errorf("%s: %v", code, err)
		}
	}
}
