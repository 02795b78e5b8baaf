// Package backoff computes capped exponential delays with full jitter.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Policy is a capped exponential backoff: attempt n waits a random duration in
// [Min, min(Max, Min*2^n)].
type Policy struct {
	Min, Max time.Duration
}

// Delay returns the wait before retry number attempt (0-based).
func (p Policy) Delay(attempt int) time.Duration {
	ceil := p.Min
	for i := 0; i < attempt && ceil < p.Max; i++ {
		ceil *= 2
	}
	if ceil > p.Max {
		ceil = p.Max
	}
	if ceil <= p.Min {
		return p.Min
	}
	return p.Min + rand.N(ceil-p.Min)
}

// Sleep waits d or until ctx or wake ends, whichever is first. It returns ctx.Err()
// if ctx ended. wake may be nil.
func Sleep(ctx context.Context, d time.Duration, wake <-chan struct{}) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
	case <-wake:
	}
	return nil
}
