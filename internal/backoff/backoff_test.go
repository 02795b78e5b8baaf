package backoff

import (
	"context"
	"testing"
	"time"
)

func TestDelayBounds(t *testing.T) {
	p := Policy{Min: time.Millisecond, Max: 50 * time.Millisecond}
	for attempt := 0; attempt < 20; attempt++ {
		ceil := time.Millisecond << attempt
		if ceil > p.Max || ceil <= 0 {
			ceil = p.Max
		}
		seen := map[time.Duration]bool{}
		for i := 0; i < 200; i++ {
			d := p.Delay(attempt)
			if d < p.Min || d > ceil {
				t.Fatalf("Delay(%d) = %v, outside [%v, %v]", attempt, d, p.Min, ceil)
			}
			seen[d] = true
		}
		if attempt > 2 && len(seen) < 10 {
			t.Errorf("Delay(%d) has only %d distinct values in 200 draws: no jitter", attempt, len(seen))
		}
	}
}

func TestSleepEndsEarly(t *testing.T) {
	wake := make(chan struct{})
	close(wake)
	start := time.Now()
	if err := Sleep(context.Background(), time.Hour, wake); err != nil || time.Since(start) > time.Second {
		t.Fatalf("Sleep with a closed wake channel = %v after %v", err, time.Since(start))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Sleep(ctx, time.Hour, nil); err != context.Canceled {
		t.Fatalf("Sleep with a cancelled ctx = %v", err)
	}
	if err := Sleep(context.Background(), time.Millisecond, nil); err != nil {
		t.Fatal(err)
	}
}
