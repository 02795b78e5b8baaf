package sqllock

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Locker acquires named locks. Implementations are safe for concurrent use.
type Locker interface {
	// Acquire waits until the lock is held or ctx ends. It returns a Lease, or an error
	// and a nil Lease: never a nil Lease with a nil error. When ctx ends first, the
	// error matches both ErrNotAcquired and ctx.Err(), and no lock is left behind, even
	// if the database granted it at that instant.
	Acquire(ctx context.Context, name string, opts ...AcquireOption) (Lease, error)

	// TryAcquire makes one attempt and returns an error matching ErrNotAcquired at once
	// if the lock is held by someone else.
	TryAcquire(ctx context.Context, name string, opts ...AcquireOption) (Lease, error)
}

// Lease is a held lock. Its methods are safe for concurrent use.
type Lease interface {
	// Name returns the lock name.
	Name() string

	// Token returns the fencing token of this acquisition: strictly greater than the
	// token of every earlier acquisition of the same name. Pass it to the resource the
	// lock protects, which rejects writes carrying a smaller token than it has seen.
	// Reentrant holds (WithOwner) share the token of the hold they join. A Locker made
	// without tokens (the WithoutToken options of advisory and forupdate) returns 0.
	Token() int64

	// Done returns a channel that is closed when the lease is lost or released. The
	// leases of this module close it as soon as their local deadline has passed,
	// whoever looks first.
	Done() <-chan struct{}

	// Err returns nil while the lease is held, an error matching ErrLost once it is
	// lost, and one matching ErrNotHeld once it was released.
	Err() error

	// Release gives the lock up. It is safe to call more than once: later calls return
	// nil. It returns an error matching ErrLost if the lease had been lost before.
	Release(ctx context.Context) error
}

// AcquireOption changes one acquisition. Strategies that cannot honour an option
// return an error matching ErrInvalidOption.
type AcquireOption func(*AcquireConfig)

// AcquireConfig is the result of applying AcquireOptions. Strategies read it; users
// build it through the With* options.
type AcquireConfig struct {
	// Owner is the reentrancy key set by WithOwner, or "".
	Owner string
	// TTL is the lease time set by WithLeaseTTL, or 0 for the Locker's default.
	TTL time.Duration

	ownerSet, ttlSet bool
}

// WithOwner makes the acquisition reentrant under an explicit owner key, within the
// Locker it is made through: while an acquisition with key holds the lock, another
// acquisition with the same key through the same Locker gets it at once (sharing its
// token), and the lock is free when every acquisition was released. The key must be
// unique to one logical owner (one job, one request): two goroutines sharing a key
// share the lock. Acquisitions with the key through another Locker, or in another
// process, are other owners. Supported by uniqueindex, advisory, optimistic and
// fairqueue; forupdate rejects it.
func WithOwner(key string) AcquireOption {
	return func(c *AcquireConfig) { c.Owner, c.ownerSet = key, true }
}

// WithLeaseTTL overrides the lease time of the Locker (its WithTTL option) for one
// acquisition, for the strategies that hold a lease row (uniqueindex, optimistic,
// fairqueue). The keep-alive interval is then a third of it.
func WithLeaseTTL(ttl time.Duration) AcquireOption {
	return func(c *AcquireConfig) { c.TTL, c.ttlSet = ttl, true }
}

// ApplyAcquireOptions applies opts and validates the result. Strategies call it with
// the operation, dialect and lock name, which label the error (matching
// ErrInvalidOption) it returns for an invalid option.
func ApplyAcquireOptions(op string, d Dialect, name string, opts []AcquireOption) (AcquireConfig, error) {
	var c AcquireConfig
	for _, o := range opts {
		o(&c)
	}
	var cause error
	switch {
	case c.ownerSet && c.Owner == "":
		cause = fmt.Errorf("empty owner key")
	case c.ttlSet && c.TTL <= 0:
		cause = fmt.Errorf("TTL %v is not positive", c.TTL)
	case len(c.Owner) > MaxNameLen:
		cause = fmt.Errorf("owner key longer than %d bytes", MaxNameLen)
	}
	if cause != nil {
		return c, &Error{Op: op, Dialect: d, Name: name, Kind: ErrInvalidOption, Err: cause}
	}
	return c, nil
}

// Do acquires the lock name with l, runs fn with a context that is cancelled (with
// cause ErrLost) when the lease is lost, and releases the lock (also when fn panics:
// the lock is handed on, then the panic goes on). It returns fn's error,
// joined with the release error if any. If the lease was lost while fn ran, the
// returned error matches ErrLost even when fn returned nil: fn's work was not
// protected by the lock for its whole duration.
func Do(ctx context.Context, l Locker, name string, fn func(ctx context.Context) error, opts ...AcquireOption) error {
	lease, err := l.Acquire(ctx, name, opts...)
	if err != nil {
		return err
	}
	ferr, rerr, _ := runHeld(ctx, lease, fn)
	if rerr != nil && ferr != nil && errors.Is(rerr, ErrLost) && errors.Is(ferr, ErrLost) {
		return ferr
	}
	return errors.Join(ferr, rerr)
}

// runHeld runs fn with a LeaseContext of lease, then releases lease with a context
// that survives ctx's end (an expired caller context must not leave the lock held
// until its lease runs out), also when fn panics. lost tells whether the lease was
// lost before the release.
func runHeld(ctx context.Context, lease Lease, fn func(ctx context.Context) error) (ferr, rerr error, lost bool) {
	fctx, stop := LeaseContext(ctx, lease)
	release := func() {
		stop()
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		rerr = lease.Release(rctx)
	}
	done := false
	defer func() {
		if !done { // fn panicked: hand the lock on all the same
			release()
		}
	}()
	ferr = fn(fctx)
	done = true
	lost = errors.Is(lease.Err(), ErrLost)
	release()
	return ferr, rerr, lost
}

// LeaseContext returns a copy of ctx that is cancelled when lease ends (lost or
// released), with the lease's error as its cause (context.Cause), so that work done
// under a lock stops when the lock is lost. Its Err and Done ask the lease first, so
// a holder resumed after a pause sees the loss at its first look, not when a watcher
// goroutine next runs. Call stop when the work is done: it releases the context's
// resources and returns once its watcher has exited.
func LeaseContext(ctx context.Context, lease Lease) (lctx context.Context, stop func()) {
	cctx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-lease.Done():
			cancel(lease.Err())
		case <-cctx.Done():
		}
	}()
	return leaseCtx{Context: cctx, lease: lease, cancel: cancel}, func() {
		cancel(context.Canceled)
		<-done
	}
}

// leaseCtx is the context of LeaseContext: it asks the lease before it answers.
type leaseCtx struct {
	context.Context
	lease  Lease
	cancel context.CancelCauseFunc
}

func (c leaseCtx) poll() {
	if c.Context.Err() == nil {
		if err := c.lease.Err(); err != nil {
			c.cancel(err)
		}
	}
}

func (c leaseCtx) Done() <-chan struct{} {
	c.poll()
	return c.Context.Done()
}

func (c leaseCtx) Err() error {
	c.poll()
	return c.Context.Err()
}

// leaseKey is the context key of the lease of a LeaseContext.
type leaseKey struct{}

func (c leaseCtx) Value(key any) any {
	if key == (leaseKey{}) {
		return c.lease
	}
	return c.Context.Value(key)
}

// LeaseFromContext returns the lease of the innermost LeaseContext that ctx derives
// from: in fn of Do or Campaign, the lease fn runs under, whose Token fences the
// writes fn makes. It reports false for any other context.
func LeaseFromContext(ctx context.Context) (Lease, bool) {
	l, ok := ctx.Value(leaseKey{}).(Lease)
	return l, ok
}

// releaseTimeout bounds the Release that Do makes after fn returns.
const releaseTimeout = 30 * time.Second
