package sqllock_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/lease"
	"github.com/sqllock/sqllock/testdb"
)

// The README's promise that "Err, Done and the context of sqllock.Do look at the
// deadline themselves: a process resumed after a pause learns of the loss at its
// first look", for the context of Do. The leases here are in-process: the lease
// context's own logic is under test, not a database.

// frozenLease is a Lease whose Err reports the loss (as a lease past its local
// deadline does when asked) while its Done channel stays open: the state of a
// process resumed after a pause, before any goroutine of the lease has run.
type frozenLease struct {
	name     string
	lost     atomic.Bool
	done     chan struct{}
	released atomic.Bool
}

func (l *frozenLease) Name() string          { return l.name }
func (l *frozenLease) Token() int64          { return 1 }
func (l *frozenLease) Done() <-chan struct{} { return l.done }
func (l *frozenLease) Err() error {
	if l.lost.Load() {
		return &sqllock.Error{Op: "keepalive", Name: l.name, Kind: sqllock.ErrLost}
	}
	return nil
}
func (l *frozenLease) Release(context.Context) error {
	l.released.Store(true)
	return l.Err()
}

// oneLease is a Locker that grants its one lease.
type oneLease struct{ lease sqllock.Lease }

func (o oneLease) Acquire(context.Context, string, ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return o.lease, nil
}
func (o oneLease) TryAcquire(ctx context.Context, name string, opts ...sqllock.AcquireOption) (sqllock.Lease, error) {
	return o.Acquire(ctx, name, opts...)
}

// closedNow reports whether ch is closed at this instant, without waiting.
func closedNow(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestDoContextSeesLossAtFirstLook: inside Do, once the lease's Err reports ErrLost
// while its Done channel is still open (nothing has closed it yet), the context's
// first look reports the loss: ctx.Done() is already closed when asked first, and
// ctx.Err() is non-nil when asked first, in both cases with a cause matching
// ErrLost. Before the loss, neither reports anything. Do then returns ErrLost and
// releases.
func TestDoContextSeesLossAtFirstLook(t *testing.T) {
	testdb.CheckLeaks(t)
	for _, first := range []string{"Done", "Err"} {
		t.Run(first+"First", func(t *testing.T) {
			fl := &frozenLease{name: "job", done: make(chan struct{})}
			err := sqllock.Do(context.Background(), oneLease{fl}, "job", func(ctx context.Context) error {
				if closedNow(ctx.Done()) || ctx.Err() != nil {
					t.Fatalf("the context of a held lease ended: %v", ctx.Err())
				}
				fl.lost.Store(true) // the deadline passed while the process was paused
				switch first {
				case "Done":
					if !closedNow(ctx.Done()) {
						t.Error("ctx.Done() not closed at the first look after the lease's Err reported the loss")
					}
				case "Err":
					if err := ctx.Err(); err == nil {
						t.Error("ctx.Err() = nil at the first look after the lease's Err reported the loss")
					}
				}
				if cause := context.Cause(ctx); !errors.Is(cause, sqllock.ErrLost) {
					t.Errorf("context cause = %v, want ErrLost", cause)
				}
				return nil
			})
			if !errors.Is(err, sqllock.ErrLost) {
				t.Errorf("Do = %v, want ErrLost", err)
			}
			if !fl.released.Load() {
				t.Error("Do did not release the lease")
			}
		})
	}
}

// coreLease is the lease core the strategies share (package internal/lease) as a
// sqllock.Lease.
type coreLease struct {
	*lease.Lease
	name string
}

func (l coreLease) Name() string { return l.name }
func (l coreLease) Token() int64 { return 1 }

// idleKeeper proves the lock held at every keep-alive and gives it back at once.
type idleKeeper struct{}

func (idleKeeper) KeepAlive(context.Context) (time.Duration, error) { return 0, nil }
func (idleKeeper) GiveBack(context.Context, bool) error             { return nil }

// TestDoContextFrozenHolder: the whole chain with the lease core every strategy
// uses. Inside Do, a process is frozen past the lease's local deadline (its clock
// is shifted by two hours, as a suspended VM's is: no timer or goroutine of the
// lease has run). The context's first look, Done or Err, reports the loss with a
// cause matching ErrLost, and Do returns ErrLost.
func TestDoContextFrozenHolder(t *testing.T) {
	testdb.CheckLeaks(t)
	for _, first := range []string{"Done", "Err"} {
		t.Run(first+"First", func(t *testing.T) {
			var shift atomic.Int64
			now := func() time.Time { return time.Now().Add(time.Duration(shift.Load())) }
			tm, err := lease.Timing{TTL: time.Hour}.Resolve()
			if err != nil {
				t.Fatal(err)
			}
			core := lease.Start(idleKeeper{}, lease.Params{Timing: tm, Granted: now(), Now: now,
				Label: lease.Label{Strategy: "test", Dialect: sqllock.Postgres, Name: "job"}})
			err = sqllock.Do(context.Background(), oneLease{coreLease{core, "job"}}, "job", func(ctx context.Context) error {
				if closedNow(ctx.Done()) || ctx.Err() != nil {
					t.Fatalf("the context of a held lease ended: %v", ctx.Err())
				}
				shift.Store(int64(2 * time.Hour)) // frozen for two hours: the deadline passed
				switch first {
				case "Done":
					if !closedNow(ctx.Done()) {
						t.Error("ctx.Done() not closed at the first look after the local deadline passed")
					}
				case "Err":
					if err := ctx.Err(); err == nil {
						t.Error("ctx.Err() = nil at the first look after the local deadline passed")
					}
				}
				if cause := context.Cause(ctx); !errors.Is(cause, sqllock.ErrLost) {
					t.Errorf("context cause = %v, want ErrLost", cause)
				}
				return nil
			})
			if !errors.Is(err, sqllock.ErrLost) {
				t.Errorf("Do = %v, want ErrLost", err)
			}
		})
	}
}
