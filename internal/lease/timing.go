package lease

import (
	"fmt"
	"time"
)

// Timing is the time budget of a lease.
//
//   - TTL is the server-enforced bound: a lock whose holder stops keeping it alive is
//     free on the server at the latest TTL after the last keep-alive the server saw
//     (a row's expires_at, a session's idle timeout).
//   - Interval is how often the holder keeps it alive (default TTL/3).
//   - Margin is how much earlier than TTL the holder gives the lease up on its own
//     clock when no keep-alive succeeded (default TTL/5): it covers the time a
//     keep-alive statement spends on its way to the server and the difference in the
//     rates of the two clocks.
//
// A keep-alive round trip must therefore take less than TTL - Margin - Interval for a
// lease to survive one failed keep-alive: with the defaults, 7/15 of the TTL.
type Timing struct {
	TTL, Interval, Margin time.Duration
}

// MinTTL is the shortest TTL any strategy accepts.
const MinTTL = 10 * time.Millisecond

func (t Timing) withDefaults() Timing {
	if t.Interval == 0 {
		t.Interval = t.TTL / 3
	}
	if t.Margin == 0 {
		t.Margin = t.TTL / 5
	}
	return t
}

// Resolve fills in the defaults and validates t. The error says what is wrong; the
// caller labels it with sqllock.ErrInvalidOption.
func (t Timing) Resolve() (Timing, error) {
	switch {
	case t.TTL < MinTTL:
		return t, fmt.Errorf("TTL %v is shorter than %v", t.TTL, MinTTL)
	case t.Interval < 0:
		return t, fmt.Errorf("keep-alive interval %v is negative", t.Interval)
	case t.Margin < 0:
		return t, fmt.Errorf("safety margin %v is negative", t.Margin)
	}
	t = t.withDefaults()
	switch {
	case t.Interval == 0:
		return t, fmt.Errorf("keep-alive interval of TTL %v rounds to zero", t.TTL)
	case t.TTL < 2*t.Interval:
		return t, fmt.Errorf("TTL %v is shorter than twice the keep-alive interval %v", t.TTL, t.Interval)
	case t.Margin+t.Interval >= t.TTL:
		return t, fmt.Errorf("safety margin %v plus keep-alive interval %v leave nothing of TTL %v", t.Margin, t.Interval, t.TTL)
	}
	return t, nil
}
