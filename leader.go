package sqllock

import (
	"context"
	"fmt"
	"time"
)

// Holder is the identity of the current holder of a lock, as its strategy recorded
// it in the database: what a health endpoint or an operator needs to say which
// replica leads, since when, and with which fencing token.
type Holder struct {
	// Name is the lock name.
	Name string
	// Token is the holder's fencing token (Lease.Token of its acquisition).
	Token int64
	// Host and PID identify the holder's process (os.Hostname and os.Getpid when it
	// acquired the lock).
	Host string
	PID  int64
	// Since is when the holder's acquisition was granted, on the database clock, in
	// UTC. For fairqueue it is when the holder's ticket was drawn (its place in the
	// queue), which precedes the grant by the time it waited.
	Since time.Time
	// Remaining is the time left of the holder's lease on the database clock when it
	// was read: a holder that stopped renewing loses the lock after it. It is renewed
	// every keep-alive interval, so a live holder's Remaining stays above TTL less
	// the keep-alive interval, give or take a round trip.
	Remaining time.Duration
}

// HolderInspector is implemented by the Lockers that record who holds a lock:
// uniqueindex, optimistic and fairqueue (whose semaphores of more than one permit,
// which have several holders, answer ErrUnsupported). advisory and forupdate do not
// implement it: their locks live in the server's lock tables, which name a database
// session, not a process of the application.
type HolderInspector interface {
	// Holder returns the current holder of name, read in one statement. A lease
	// whose expiry (database clock) has passed is not a holder: it returns an error
	// matching ErrNoHolder when nobody holds name. For fairqueue, the holder is the
	// lowest live ticket, which may be a waiter whose turn came an instant ago and
	// that has not yet noticed.
	Holder(ctx context.Context, name string) (Holder, error)
}

// Leader reports the current holder of name through l, for health endpoints: who
// leads, since when, with which token. It sends one read statement and takes no lock.
//
// It returns an error matching ErrNoHolder when nobody holds the lock (between
// terms, or for at most TTL after a leader died), and one matching ErrUnsupported
// when l does not implement HolderInspector (advisory, forupdate) or cannot tell (a
// fairqueue semaphore): use a strategy that records its holders, or have the leader
// publish its identity itself from Campaign's fn. The answer is a snapshot: by the
// time it is read, the holder may have changed.
func Leader(ctx context.Context, l Locker, name string) (Holder, error) {
	if err := ValidateName(name); err != nil {
		return Holder{}, err
	}
	hi, ok := l.(HolderInspector)
	if !ok {
		return Holder{}, &Error{Op: "leader", Name: name, Kind: ErrUnsupported,
			Err: fmt.Errorf("%T records no holder identity", l)}
	}
	return hi.Holder(ctx, name)
}
