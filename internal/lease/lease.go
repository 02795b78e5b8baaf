// Package lease is the one lease core of every sqllock strategy: the life of a held
// lock on the client.
//
// A Lease owns what every strategy shares:
//
//   - Done and Err, ended once (lost or released);
//   - the keep-alive: a Keeper supplied by the strategy is called every Interval to
//     prove that the lock is still held and to push its server-enforced bound (a
//     row's expiry on the database clock, a session's idle timeout) TTL further;
//   - the local deadline: the start of the last successful keep-alive plus TTL less
//     the safety margin, measured on the client with the larger of the monotonic and
//     the wall-clock elapsed time. The server cannot hand the lock to anyone before
//     the bound that keep-alive set, which lies after the local deadline, so a
//     holder that is cut off, frozen or too slow is told (Done, ErrLost) before
//     anyone else can acquire. Err, Done and Refresh compare the clock with the
//     deadline themselves, so a holder resumed after a pause learns of the loss at
//     its first look, not when the keep-alive goroutine next runs;
//   - Release: once, after the keep-alive stopped, with a context that still gives
//     the lock back when the caller's context has ended (bounded by GiveBackTimeout);
//   - Refresh: a keep-alive on demand, serialised with the background one and with
//     Release, so that a Refresh racing a Release never reports a loss.
//
// Clock assumptions, stated once: the database clock advances at the rate of real
// time (a forward step of the database clock larger than the margin shortens a row
// lease on the server), and the client's elapsed time is never overestimated by less
// than it really is (a suspended client whose monotonic clock stopped is caught by
// the wall clock).
package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// ErrGone is what a Keeper wraps to say that the lock is certainly no longer held (its
// row was deleted or taken over, its session or transaction ended). Any other error
// from a Keeper means "not proven this time" and is retried until the deadline.
var ErrGone = errors.New("lock no longer held")

// Gone wraps cause as a certain loss: the result matches ErrGone and cause, and reads
// as cause.
func Gone(cause error) error { return goneErr{cause} }

// Gonef is Gone with a formatted cause.
func Gonef(format string, args ...any) error { return Gone(fmt.Errorf(format, args...)) }

type goneErr struct{ cause error }

func (e goneErr) Error() string        { return e.cause.Error() }
func (e goneErr) Unwrap() error        { return e.cause }
func (e goneErr) Is(target error) bool { return target == ErrGone }

// Keeper is what a strategy supplies for one held lock.
type Keeper interface {
	// KeepAlive proves that the lock is still held and that its server-enforced bound
	// lies at least bound after KeepAlive was called: TTL when it extended the bound
	// (return 0 for TTL), less when it could only observe how long the server has
	// left (a session idle for a while). It returns an error wrapping ErrGone if the
	// lock is certainly lost, or another error if it could not tell (retried until
	// the deadline). ctx ends at the local deadline.
	KeepAlive(ctx context.Context) (bound time.Duration, err error)

	// GiveBack releases the lock on the server. lost tells that the lease has already
	// ended as lost on the client: the strategy then only cleans up what is still its
	// own. It returns an error wrapping ErrGone if the lock turned out not to be held
	// any more, or another error if it could not be given back (the server-enforced
	// bound frees it then).
	GiveBack(ctx context.Context, lost bool) error
}

// Label names a lease in errors and logs.
type Label struct {
	Strategy string // "uniqueindex", ...
	Dialect  sqllock.Dialect
	Name     string
	// ExposeName records Name in spans; otherwise they carry a hash of it (names can
	// carry user data).
	ExposeName bool
}

// Err returns the library's error for op on this lease (see NewError).
func (lb Label) Err(op string, kind, cause error) error {
	return NewError(op, lb.Dialect, lb.Name, kind, cause)
}

// NewError is the one constructor of the errors the strategies return: an
// *sqllock.Error of op on lock name, matching kind (a sentinel, or nil) and cause. A
// database error saying that a table or column of the library is missing gets the kind
// sqllock.ErrNotMigrated, which says to run the migrations.
func NewError(op string, d sqllock.Dialect, name string, kind, cause error) error {
	if cause == nil { // every Release makes one: nothing to look into
		return &sqllock.Error{Op: op, Dialect: d, Name: name, Kind: kind}
	}
	if kind == nil && sqlerr.Is(cause, sqlerr.UndefinedTable) {
		kind = sqllock.ErrNotMigrated
	}
	if sqlerr.PooledStatement(cause) {
		cause = fmt.Errorf("%w (hint: a prepared statement went missing or exists twice on the server session, "+
			"which a transaction-pooling proxy such as pgbouncer pool_mode=transaction causes with pgx's statement cache: "+
			"set default_query_exec_mode=simple_protocol (or exec) in the DSN, or max_prepared_statements in pgbouncer 1.21+)", cause)
	}
	return &sqllock.Error{Op: op, Dialect: d, Name: name, Kind: kind, Err: cause}
}

// GiveBackTimeout bounds a give-back whose caller's context has ended or has no
// deadline: Release and the give-back of a grant that came as ctx ended.
const GiveBackTimeout = 5 * time.Second

// Lease is the client-side life of one held lock. Its methods are safe for concurrent
// use.
type Lease struct {
	keeper Keeper
	timing Timing
	label  Label
	log    *slog.Logger
	now    func() time.Time

	done chan struct{}

	mu       sync.Mutex
	err      error     // nil while held
	lastOK   time.Time // start of the last successful keep-alive (or of the grant)
	released bool      // Release was called
	cleaned  bool      // GiveBack(lost) ran after a loss
	heldAt   time.Time // MarkHeld: counted as held since (telemetry)
	timer    *time.Timer

	renewMu sync.Mutex // one keep-alive at a time: the loop's, Refresh's, or Release's give-back

	onEnd func() // called once the lease ended
	holds *Holds // see Params.Holds

	stop     chan struct{} // closed by Release: the loop exits after the keep-alive under way
	abort    chan struct{} // closed when Release's context ends: the keep-alive under way is cancelled
	abortMu  sync.Once
	kick     chan struct{} // a Refresh succeeded: reschedule
	loopDone chan struct{}
	// The keep-alive goroutine starts when the first keep-alive is due (loopStart), or
	// at once after a loss (it cleans up): a lease released before that costs no
	// goroutine. loopClaimed (under mu) is set by whoever starts it, or by Release,
	// which then closes loopDone itself.
	loopStart   *time.Timer
	loopClaimed bool
}

// Params describe a granted lock for Start.
type Params struct {
	Timing  Timing
	Granted time.Time // taken on the client before the statement that set the bound was sent
	Label   Label
	Log     *slog.Logger     // nil: discard
	Now     func() time.Time // nil: time.Now (tests shift it)
	OnEnd   func()           // called once, after the lease ended (lost or released)
	// Holds, if not nil, is shared by the leases that are one hold for the holders
	// gauge (the reentrant holds of one owner of one lock): the gauge counts them once.
	Holds *Holds
}

// Start begins the life of a granted lock and starts its keep-alive: Prepare and Run.
func Start(k Keeper, p Params) *Lease {
	l := Prepare(k, p)
	l.Run()
	return l
}

// Prepare returns the lease of a granted lock without starting its keep-alive or its
// deadline timer: a strategy whose Keeper refers to the returned Lease stores it
// first, then calls Run.
func Prepare(k Keeper, p Params) *Lease {
	if p.Now == nil {
		p.Now = time.Now
	}
	if p.Log == nil {
		p.Log = slog.New(slog.DiscardHandler)
	}
	return &Lease{
		keeper: k, timing: p.Timing.withDefaults(), label: p.Label, log: p.Log, now: p.Now,
		done: make(chan struct{}), lastOK: p.Granted, onEnd: p.OnEnd, holds: p.Holds,
		stop: make(chan struct{}), abort: make(chan struct{}), kick: make(chan struct{}, 1), loopDone: make(chan struct{}),
	}
}

// Run starts the keep-alive and the deadline timer, once.
func (l *Lease) Run() {
	l.mu.Lock()
	if l.loopStart != nil {
		l.mu.Unlock()
		return
	}
	l.loopStart = time.AfterFunc(max(l.firstKeepAlive()-elapsed(l.now(), l.lastOK), 0), func() {
		// The deadline timer closes Done even if the keep-alive goroutine is stuck.
		// It is armed here, when the first keep-alive is due, which is before the
		// deadline: a lease released earlier costs no timer for it (Done and Err
		// look at the deadline themselves).
		l.mu.Lock()
		if l.err == nil && l.timer == nil {
			l.timer = time.AfterFunc(max(l.until(l.deadlineLocked()), 0), l.timerFired)
		}
		l.mu.Unlock()
		if l.claimLoop() {
			l.loop()
		}
	})
	l.mu.Unlock()
}

// claimLoop reports whether the caller is the one to start the keep-alive goroutine
// (or, for Release, to close loopDone without it): true once.
func (l *Lease) claimLoop() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.loopClaimed {
		return false
	}
	l.loopClaimed = true
	return true
}

// firstKeepAlive is when the first keep-alive is due, after the grant: an Interval,
// or at once for a grant that took long (latency, a slow pool), which is already
// close to its deadline. Call with mu held (or before the lease is shared).
func (l *Lease) firstKeepAlive() time.Duration {
	if l.until(l.deadlineLocked()) < l.timing.TTL-l.timing.Margin-l.timing.Interval/2 {
		return 0
	}
	return l.timing.Interval
}

// Timing returns the lease's timing.
func (l *Lease) Timing() Timing { return l.timing }

// Label returns the lease's label.
func (l *Lease) Label() Label { return l.label }

// elapsed is the time since t on the client: the larger of the monotonic and the
// wall-clock difference, so that a suspended client (monotonic clock stopped) or a
// wall clock stepped forward only ever makes the lease end earlier.
func elapsed(now, t time.Time) time.Duration {
	mono := now.Sub(t)
	wall := now.Round(0).Sub(t.Round(0))
	return max(mono, wall)
}

func (l *Lease) deadlineLocked() time.Duration { return l.timing.TTL - l.timing.Margin }

// until returns how long from now until the local deadline, which lies d after lastOK.
// Call with mu held (or before the lease is shared).
func (l *Lease) until(d time.Duration) time.Duration { return d - elapsed(l.now(), l.lastOK) }

// Remaining returns how long until the local deadline (<= 0 once it has passed).
func (l *Lease) Remaining() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.until(l.deadlineLocked())
}

// checkDeadline ends the lease as lost if the local deadline has passed. It reports
// whether the lease is still held. Once Release was called, the give-back decides
// how the lease ends (a give-back that finds the lock still the lease's proves that
// nobody else had it), so the deadline no longer ends it.
func (l *Lease) checkDeadline() bool {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return false
	}
	if l.released || l.until(l.deadlineLocked()) > 0 {
		l.mu.Unlock()
		return true
	}
	l.mu.Unlock()
	l.loseOp("keepalive", "deadline", fmt.Errorf("no keep-alive succeeded within the lease time (%v) less the safety margin (%v)", l.timing.TTL, l.timing.Margin))
	return false
}

// timerFired checks the deadline and, if it moved meanwhile, waits for the new one.
func (l *Lease) timerFired() {
	if !l.checkDeadline() {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err == nil {
		l.timer.Reset(max(l.until(l.deadlineLocked()), time.Millisecond))
	}
}

// Done is closed when the lease ends (lost or released). It reports a passed local
// deadline at once, whoever looks first.
func (l *Lease) Done() <-chan struct{} {
	l.checkDeadline()
	return l.done
}

// Err is nil while the lease is held, then an error matching sqllock.ErrLost or
// sqllock.ErrNotHeld. A passed local deadline is reported at once.
func (l *Lease) Err() error {
	l.checkDeadline()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// Lost reports whether the lease ended as lost.
func (l *Lease) Lost() bool { return errors.Is(l.Err(), sqllock.ErrLost) }

// end ends the lease with err, once: why is "" for a release, or the cause of a
// loss (telemetry). It reports whether this call ended it.
func (l *Lease) end(err error, why string) bool {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return false
	}
	l.err = err
	if l.timer != nil {
		l.timer.Stop()
	}
	heldAt := l.heldAt
	l.mu.Unlock()
	l.ended(heldAt, why)
	close(l.done)
	if l.onEnd != nil {
		l.onEnd()
	}
	if why != "" && l.claimLoop() {
		// Lost before the keep-alive goroutine started: it starts now, sees the loss
		// and cleans up.
		if l.loopStart != nil {
			l.loopStart.Stop()
		}
		go l.loop()
	}
	return true
}

// Lose ends the lease as lost with cause (op "keepalive"), logging it once. It
// reports whether this call ended it.
func (l *Lease) Lose(cause error) bool {
	return l.loseOp("keepalive", "", cause)
}

// loseOp ends the lease as lost in op; why is the cause for telemetry ("" to derive
// it: gone if the database said so, else release or keepalive from op).
func (l *Lease) loseOp(op, why string, cause error) bool {
	if g, ok := cause.(goneErr); ok {
		cause = g.cause // the Kind says it is lost
		if why == "" {
			why = "gone"
		}
	}
	if why == "" {
		why = op
	}
	if !l.end(l.label.Err(op, sqllock.ErrLost, cause), why) {
		return false
	}
	l.log.Warn("sqllock/"+l.label.Strategy+": lock lost", "name", l.label.Name,
		"dialect", l.label.Dialect.String(), "err", cause)
	return true
}

// renewed records a successful keep-alive started at start that proved the bound to
// lie at least bound later.
func (l *Lease) renewed(start time.Time, bound time.Duration) {
	if bound <= 0 || bound > l.timing.TTL {
		bound = l.timing.TTL
	}
	start = start.Add(bound - l.timing.TTL) // the deadline is start + bound - margin
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return
	}
	if elapsed(start, l.lastOK) > 0 {
		l.lastOK = start
	}
	if l.timer != nil {
		l.timer.Reset(max(l.until(l.deadlineLocked()), 0))
	}
}

// keepAlive runs one keep-alive, bounded by the local deadline even if the Keeper
// ignores its context. Release (l.stop) cancels the context the Keeper gets, which
// ends a wait for a pooled connection at once, but not the context of OwnConn: a
// statement on the lease's own connection finishes (cancelling it breaks the
// connection with both drivers, which would turn a healthy lease's Release into a
// loss), unless Release's own context ends first (l.abort). It returns nil on
// success (the deadline was extended), an error wrapping ErrGone when the lease was
// lost (and ended), errStopped when Release stopped it, or another error.
func (l *Lease) keepAlive(parent context.Context) error {
	l.renewMu.Lock()
	defer l.renewMu.Unlock()
	if err := l.Err(); err != nil {
		return err
	}
	select {
	case <-l.stop:
		return errStopped // Release is under way: start nothing new
	default:
	}
	start := l.now()
	left := l.Remaining()
	if left <= 0 {
		l.checkDeadline()
		return l.Err()
	}
	own, stop := context.WithTimeout(parent, left)
	defer stop()
	ctx, stopSoft := context.WithCancel(context.WithValue(own, ownConnKey{}, own))
	defer stopSoft()
	type result struct {
		bound time.Duration
		err   error
	}
	res := make(chan result, 1)
	go func() {
		t0 := time.Now()
		b, err := l.keeper.KeepAlive(ctx)
		l.renewal(t0, err)
		res <- result{b, err}
	}()
	deadline := time.NewTimer(left)
	defer deadline.Stop()
	var err error
	var bound time.Duration
	stopping := l.stop
	for done := false; !done; {
		select {
		case r := <-res:
			err, bound = r.err, r.bound
			done = true
		case <-deadline.C:
			// The statement may be stuck where ctx is not looked at: the lease ends at
			// its deadline whatever it does, then the statement is cancelled and awaited.
			l.checkDeadline()
			stop()
			<-res
			return l.Err()
		case <-stopping:
			stopping = nil // Release is waiting: finish what is on the connection
			stopSoft()
		case <-l.abort:
			stop()
			<-res
			return errStopped
		}
	}
	if stopping == nil && err != nil && !errors.Is(err, ErrGone) {
		return errStopped
	}
	switch {
	case err == nil:
		// A keep-alive that returns after the deadline proves nothing: the lock may
		// have expired on the server meanwhile.
		if !l.checkDeadline() {
			return l.Err()
		}
		l.renewed(start, bound)
		if !l.checkDeadline() { // a short bound may leave nothing
			return l.Err()
		}
		return nil
	case errors.Is(err, ErrGone):
		l.Lose(err)
		return l.Err()
	}
	if !l.checkDeadline() {
		return l.Err()
	}
	return err
}

var errStopped = errors.New("keep-alive stopped")

type ownConnKey struct{}

// OwnConn returns the context for a Keeper's statement on the lease's own connection
// (a pinned session): unlike ctx, Release does not cancel it, so that the statement
// finishes rather than breaking the connection the lock is given back on. It still
// ends at the local deadline and when Release's own context ends.
func OwnConn(ctx context.Context) context.Context {
	if own, ok := ctx.Value(ownConnKey{}).(context.Context); ok {
		return own
	}
	return ctx
}

// loop runs the keep-alive every Interval until the lease ends. After a failed
// keep-alive it retries sooner (Interval/4, at least 10ms). When the lease is lost
// before Release, it cleans up (GiveBack with lost set: the strategy frees what is
// still its own, such as a pinned session) so that nothing waits for the caller.
func (l *Lease) loop() {
	defer close(l.loopDone)
	defer l.cleanUpAfterLoss()
	l.mu.Lock()
	next := l.firstKeepAlive()
	l.mu.Unlock()
	retry := max(l.timing.Interval/4, 10*time.Millisecond)
	t := time.NewTimer(max(next-l.sinceLastOK(), 0))
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-l.done:
			return
		case <-l.kick:
			t.Reset(max(l.timing.Interval-l.sinceLastOK(), 0))
			continue
		case <-t.C:
		}
		err := l.keepAlive(context.Background())
		switch {
		case err == nil:
			t.Reset(max(l.timing.Interval-l.sinceLastOK(), 0))
		case errors.Is(err, errStopped), errors.Is(err, sqllock.ErrLost), errors.Is(err, sqllock.ErrNotHeld):
			return
		default:
			l.log.Debug("sqllock/"+l.label.Strategy+": keep-alive failed, retrying", "name", l.label.Name, "err", err)
			t.Reset(retry)
		}
	}
}

func (l *Lease) cleanUpAfterLoss() {
	l.mu.Lock()
	if l.released || !errors.Is(l.err, sqllock.ErrLost) {
		l.mu.Unlock()
		return
	}
	l.cleaned = true
	l.mu.Unlock()
	// Not while a Refresh runs: a keeper's state (a pinned session) is used by one
	// keep-alive or give-back at a time.
	l.renewMu.Lock()
	defer l.renewMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), GiveBackTimeout)
	defer cancel()
	if err := l.keeper.GiveBack(ctx, true); err != nil {
		l.log.Debug("sqllock/"+l.label.Strategy+": clean-up after a loss failed", "name", l.label.Name, "err", err)
	}
}

func (l *Lease) sinceLastOK() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return elapsed(l.now(), l.lastOK)
}

// Refresh runs a keep-alive now. It returns nil if the lock was proven held (the
// deadline moves), an error matching sqllock.ErrLost if it is lost (the lease ends),
// sqllock.ErrNotHeld after Release, or a *sqllock.Error carrying the database error if
// it could not tell: the lease is then still held until its deadline and the
// background keep-alive goes on. It waits at most until ctx ends or the local deadline.
func (l *Lease) Refresh(ctx context.Context) error {
	l.mu.Lock()
	released := l.released
	l.mu.Unlock()
	if released {
		if err := l.Err(); err != nil {
			return err
		}
		return l.label.Err("refresh", sqllock.ErrNotHeld, nil)
	}
	err := l.keepAlive(ctx)
	switch {
	case err == nil:
		select {
		case l.kick <- struct{}{}:
		default:
		}
		return nil
	case errors.Is(err, errStopped):
		return l.label.Err("refresh", sqllock.ErrNotHeld, errors.New("released meanwhile"))
	case errors.Is(err, sqllock.ErrLost), errors.Is(err, sqllock.ErrNotHeld):
		return err
	}
	return l.label.Err("refresh", nil, err)
}

// Release gives the lock back once: it stops the keep-alive (cancelling one under
// way), then calls GiveBack with a context derived from ctx that does not end before
// GiveBackTimeout when ctx has already ended, so that a caller whose context expired
// still frees the lock. It returns nil when the lock was given back, an error matching
// sqllock.ErrLost if the lease had been lost or turned out lost, and a *sqllock.Error
// with the cause if the lock could not be given back (the lease ends on the client;
// the server-enforced bound frees the lock). Later calls return nil.
func (l *Lease) Release(ctx context.Context) (err error) {
	l.checkDeadline() // a deadline that passed before Release was called counts
	ctx, span := l.releaseSpan(ctx)
	defer func() { endSpan(span, err) }()
	l.mu.Lock()
	if l.released {
		l.mu.Unlock()
		return nil
	}
	l.released = true
	l.mu.Unlock()
	gctx, cancel := GiveBackContext(ctx)
	defer cancel()
	// A keep-alive under way finishes (at most until the local deadline) unless gctx
	// ends first.
	stopAbort := context.AfterFunc(gctx, func() { l.abortMu.Do(func() { close(l.abort) }) })
	defer stopAbort()
	close(l.stop)
	if l.claimLoop() { // the keep-alive goroutine never started, and now never will
		if l.loopStart != nil {
			l.loopStart.Stop()
		}
		close(l.loopDone)
	}
	<-l.loopDone
	l.renewMu.Lock() // wait for a Refresh under way
	defer l.renewMu.Unlock()

	l.mu.Lock()
	cleaned := l.cleaned
	l.mu.Unlock()
	if cleaned {
		return l.Err()
	}
	lostBefore := l.Lost()
	err = l.keeper.GiveBack(gctx, lostBefore)
	switch {
	case lostBefore:
		return l.Err()
	case errors.Is(err, ErrGone):
		l.loseOp("release", "", err)
		return l.Err()
	case err != nil && errors.As(err, new(*sqllock.Error)):
		// The strategy said precisely what happened.
		l.end(l.label.Err("release", sqllock.ErrNotHeld, err), "")
		return err
	case err != nil:
		l.end(l.label.Err("release", sqllock.ErrNotHeld, err), "")
		return l.label.Err("release", nil, fmt.Errorf(
			"not given back: the lock stays taken until it expires on the server, at most %v after the last keep-alive: %w", l.timing.TTL, err))
	}
	l.end(l.label.Err("release", sqllock.ErrNotHeld, nil), "")
	return nil
}

// GiveBackContext returns the context for giving a lock back on behalf of a caller
// whose context is ctx: ctx itself while it lives (bounded by GiveBackTimeout if it
// has no deadline), or, once ctx has ended, a context without its cancellation
// bounded by GiveBackTimeout.
func GiveBackContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if ctx.Err() != nil {
		return context.WithTimeout(context.WithoutCancel(ctx), GiveBackTimeout)
	}
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, GiveBackTimeout)
}

// Granted checks a lock granted to a caller whose context is ctx: if ctx has ended
// meanwhile, the grant is given back (release is called with a context that outlives
// ctx) and the error to return, matching sqllock.ErrNotAcquired and ctx's error, is
// returned. Otherwise it returns nil.
func Granted(ctx context.Context, lb Label, op string, release func(context.Context) error) error {
	if ctx.Err() == nil {
		return nil
	}
	Settle(ctx, GiveBackTimeout, func(gctx context.Context) { release(gctx) })
	return lb.Err(op, sqllock.ErrNotAcquired, ctx.Err())
}

// SettleWait is how long, after the caller's context ended, an acquisition waits for
// the give-back of what it may hold (Settle) before it returns and lets the give-back
// finish on its own. A healthy server answers in milliseconds, so the lock is free
// when Acquire returns; a server that cannot commit (its synchronous standby gone)
// no longer holds the caller.
const SettleWait = 250 * time.Millisecond

// Settle runs giveBack, which frees what an acquisition of a caller whose context is
// ctx may hold (a grant that came as ctx ended, the row of an attempt whose outcome
// is unknown), with a context that outlives ctx and ends after limit. It returns when
// giveBack returns, or SettleWait after ctx ended, whichever comes first; giveBack
// then goes on in the background until it returns (at most limit): a statement that
// the server finishes later (a commit waiting for a synchronous standby) still
// deletes what it should, and Acquire honours its context.
func Settle(ctx context.Context, limit time.Duration, giveBack func(context.Context)) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), limit)
		defer cancel()
		giveBack(gctx)
	}()
	select {
	case <-done:
		return
	case <-ctx.Done():
	}
	t := time.NewTimer(SettleWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}
