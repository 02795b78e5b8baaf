package interrupt

import (
	"context"
	"testing"
	"time"
)

// TestTooLate: a ctx without a deadline, or with a millisecond or more left, is not
// too late, and TooLate returns at once; with less left it is, and TooLate returns
// only once ctx has ended.
func TestTooLate(t *testing.T) {
	if TooLate(context.Background()) {
		t.Error("no deadline: too late")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if TooLate(ctx) || ctx.Err() != nil {
		t.Errorf("a minute left: too late (ctx %v)", ctx.Err())
	}
	ctx, cancel = context.WithTimeout(context.Background(), 500*time.Microsecond)
	defer cancel()
	if !TooLate(ctx) {
		t.Error("500µs left: not too late")
	}
	if ctx.Err() == nil {
		t.Error("TooLate returned before ctx ended")
	}
}
