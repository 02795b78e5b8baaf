package wait

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// MaxTransient is how many transient errors (deadlock, serialization failure, lock
// wait timeout, duplicate key) in a row a TryAcquire meets before it reports
// ErrNotAcquired, and Retry retries a statement.
const MaxTransient = 5

// TransientPolicy spaces retries after transient errors: short and jittered, so that
// the two sides of a deadlock do not meet again in step.
var TransientPolicy = backoff.Policy{Min: 2 * time.Millisecond, Max: 64 * time.Millisecond}

// Result is what one attempt found.
type Result struct {
	Acquired   bool
	HolderLeft time.Duration // the holder's remaining lease, if known: the next poll
	// Entered (an attempt of Loop.InLine that enters the line): the statement
	// entered the line, and the turn's session now holds the line lock; false when
	// the entry's wait ran out (nothing else was done then).
	Entered bool
	// Waited (likewise): the entry had to wait for its turn: the key is contended.
	Waited bool
}

// Loop is how the row strategies acquire: attempts until one acquires, until the
// lock is found held (TryAcquire), or until ctx ends, waiting between attempts in
// the Hub without holding a pooled connection, or in the server's line (Line).
type Loop struct {
	Hub   *Hub
	Key   string        // the lock key (queue and wake-ups)
	Block bool          // Acquire (true) or TryAcquire
	Queue bool          // wait in the in-process FIFO of the key first (not for re-entry)
	Poll  time.Duration // longest sleep between attempts
	Log   *slog.Logger
	// Attempt makes one attempt. Its error is classified: transient errors mean "not
	// acquired yet"; errors that leave the outcome unknown (a deadline, a cancel, a
	// broken connection) too, but are remembered (see Run).
	Attempt func(ctx context.Context) (Result, error)
	// OnTransient, if set, is told of each transient error about to be retried.
	OnTransient func(err error)
	// Line, if set, is the Locker's server-side line: an Acquire that waits in the
	// in-process queue (Block and Queue) and finds the lock held, or whose key was
	// seen contended recently, waits in it, with InLine.
	Line *Line
	// InLine makes one attempt on the session of turn t. With enter, the statement
	// first enters the line (see Result.Entered, Result.Waited); without, the session
	// holds the line lock already and the attempt is an ordinary one.
	InLine func(ctx context.Context, t *Turn, enter bool) (Result, error)
}

// Run runs the loop. On success it returns the caller's slot at the head of the
// in-process queue (nil if Queue is false): hand it on (Slot.Leave) when the lease
// ends; and the turn in the server's line that got the lock, or nil: the lease gives
// its line lock back when it ends (Turn.Leave, or a release statement that does it
// too). Otherwise it returns an error whose kind is sqllock.ErrNotAcquired when the
// lock was held or ctx ended (the error then also matches ctx.Err()), or nil for a
// database error, and uncertain tells that some attempt may have committed a grant
// whose reply never came: the caller deletes what it may have left.
func (lp Loop) Run(ctx context.Context) (slot *Slot, turn *Turn, uncertain bool, kind, err error) {
	if lp.Block && lp.Queue {
		if slot, err = lp.Hub.Enqueue(ctx, lp.Key); err != nil {
			return nil, nil, false, sqllock.ErrNotAcquired, err
		}
	}
	var wake <-chan struct{}
	if lp.Block {
		var unsubscribe func()
		wake, unsubscribe = lp.Hub.Subscribe(lp.Key)
		defer unsubscribe()
	}
	fail := func(k, e error) (*Slot, *Turn, bool, error, error) {
		turn.Leave(ctx)
		slot.Leave()
		return nil, nil, uncertain, k, e
	}
	useLine := lp.Block && lp.Queue && lp.Line != nil && lp.InLine != nil
	// enterNow: turn was just taken and its next statement enters the line. A key seen
	// contended recently goes to the line at once.
	enterNow := false
	if useLine && lp.Line.Contended(lp.Key) {
		turn = lp.Line.Take(ctx, []byte(lp.Key))
		enterNow = turn != nil
	}
	lineTimedOut := false
	transient := 0
	for attempt := 0; ; attempt++ {
		var res Result
		var err error
		entering := enterNow
		enterNow = false
		if turn != nil {
			res, err = lp.InLine(ctx, turn, entering)
			switch {
			case err != nil && entering && ctx.Err() == nil && !sqlerr.Transient(err):
				// The entry failed (a statement a pooler cannot run, a session that
				// broke): the line is a waiting aid, so go on without it, at once. The
				// session may hold the line lock or not: discard it (the server frees
				// what it held).
				lp.Log.Debug("sqllock: entering the server-side line failed; waiting without it", "err", err)
				uncertain = uncertain || OutcomeUnknown(err)
				turn.Discard(ctx)
				turn, lineTimedOut = nil, true
				continue
			case err != nil && (entering || turn.dirty):
				// The session may hold the line lock or not: discard it (the server
				// frees what it held), and go on without the line.
				turn.Discard(ctx)
				turn = nil
			case entering && !res.Entered:
				// The entry's wait ran out (or the line is off): attempt without the
				// line at once.
				turn.Leave(ctx)
				turn, lineTimedOut = nil, true
				if ctx.Err() != nil {
					return fail(sqllock.ErrNotAcquired, ctx.Err())
				}
				continue
			case entering:
				turn.Entered()
				if res.Waited {
					lp.Line.Saw(lp.Key)
				}
			}
		} else {
			res, err = lp.Attempt(ctx)
			if err == nil && res.Acquired && lineTimedOut {
				lp.Line.MarkStale(lp.Key) // the line lock's holder did not hold the lease
			}
		}
		switch {
		case err == nil && res.Acquired:
			return slot, turn, uncertain, nil, nil
		case err == nil:
			transient = 0
			if useLine && turn == nil {
				lp.Line.Saw(lp.Key)
				if !lineTimedOut && ctx.Err() == nil {
					if turn = lp.Line.Take(ctx, []byte(lp.Key)); turn != nil {
						enterNow = true
						continue // the entry waits: no sleep before it
					}
				}
				lineTimedOut = false
			}
		case sqlerr.Transient(err):
			// A conflict with a concurrent attempt, release, renewal or sweep: "not
			// acquired yet", never an error of the caller's.
			transient++
			if !lp.Block && transient >= MaxTransient {
				return fail(sqllock.ErrNotAcquired, err)
			}
			if lp.OnTransient != nil {
				lp.OnTransient(err)
			}
			if !lp.Block {
				if err := backoff.Sleep(ctx, TransientPolicy.Delay(transient-1), nil); err != nil {
					return fail(sqllock.ErrNotAcquired, err)
				}
				continue
			}
		case ctx.Err() != nil:
			uncertain = uncertain || OutcomeUnknown(err)
			return fail(sqllock.ErrNotAcquired, ctx.Err())
		case OutcomeUnknown(err):
			// The attempt ran past its own timeout (typically waiting for a row lock
			// held by a Check transaction), or its connection broke, while the caller's
			// ctx is alive: not acquired yet, as far as we know.
			uncertain = true
			if !lp.Block {
				return fail(sqllock.ErrNotAcquired, err)
			}
			lp.Log.Debug("sqllock: attempt timed out, retrying", "err", err)
		default:
			return fail(nil, err)
		}
		if !lp.Block {
			return fail(sqllock.ErrNotAcquired, errors.New("held by another owner"))
		}
		if err := lp.Hub.Sleep(ctx, wake, attempt, lp.Poll, res.HolderLeft, err != nil); err != nil {
			return fail(sqllock.ErrNotAcquired, err)
		}
	}
}

// OutcomeUnknown reports whether err leaves it open whether the statement committed:
// it was cut by a deadline or cancellation, or its connection broke.
func OutcomeUnknown(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		sqlerr.Is(err, sqlerr.Canceled) || sqlerr.Is(err, sqlerr.SessionLost)
}

// Retry runs f until it returns nil or an error that is not transient, at most
// MaxTransient times, sleeping TransientPolicy between tries (or until ctx ends). It
// returns f's last error. f must be safe to repeat: every statement it sends is
// atomic, and a deadlock or lock wait timeout rolls the statement back. onRetry, if
// set, is told of each transient error about to be retried.
func Retry(ctx context.Context, f func() error, onRetry func(error)) error {
	for attempt := 1; ; attempt++ {
		err := f()
		if err == nil || !sqlerr.Transient(err) || attempt >= MaxTransient {
			return err
		}
		if onRetry != nil {
			onRetry(err)
		}
		if backoff.Sleep(ctx, TransientPolicy.Delay(attempt-1), nil) != nil {
			return err
		}
	}
}

// Forget deletes what an attempt whose outcome the caller never learnt may have left
// (a row, a ticket), so that a caller that gives up leaves nothing held behind. It
// runs for at most timeout, whatever ctx says, and the caller waits for it only until
// shortly after ctx ends (lease.Settle). probe, if set, first looks with a
// consistent read, which takes no lock: on MySQL a DELETE or UPDATE locks the row it
// reads before it compares the owner, so without the probe it would wait for another
// holder's Check transaction long after the caller gave up. Best effort: what is
// left expires after its TTL.
func Forget(ctx context.Context, timeout time.Duration, probe func(context.Context) (bool, error), del func(context.Context) error, log *slog.Logger) {
	lease.Settle(ctx, timeout, func(gctx context.Context) {
		if probe != nil {
			if mine, err := probe(gctx); err == nil && !mine {
				return
			}
		}
		if err := Retry(gctx, func() error { return del(gctx) }, nil); err != nil {
			log.Warn("sqllock: could not delete what an abandoned attempt may have left; it expires after its TTL", "err", err)
		}
	})
}
