package main

import (
	"testing"
	"time"
)

// TestPairedInterval: a paired run's ratio is that of its cycles' sums; the bootstrap
// interval of the ratio contains it,
// is a single point when every cycle is alike, widens with noisy cycles, and is not
// given for too few cycles.
func TestPairedInterval(t *testing.T) {
	cycle := func(na, nb int64) turns {
		return turns{n: []int64{na, nb}, spent: []time.Duration{100 * time.Millisecond, 100 * time.Millisecond}}
	}
	var steady, noisy pairedRun
	for i := range 30 {
		steady.cycles = append(steady.cycles, cycle(80, 100))
		noisy.cycles = append(noisy.cycles, cycle(int64(60+i%5*10), 100)) // 60..100: mean 80
	}
	if r := steady.ratio(0, 1); r != 0.8 {
		t.Errorf("steady cycles: ratio %v, want 0.8", r)
	}
	lo, hi, ok := steady.interval(0, 1)
	if !ok || lo != 0.8 || hi != 0.8 {
		t.Errorf("steady cycles: interval %v-%v (%v), want 0.8-0.8", lo, hi, ok)
	}
	lo, hi, ok = noisy.interval(0, 1)
	if !ok || !(lo < 0.8 && 0.8 < hi) || lo < 0.7 || hi > 0.9 {
		t.Errorf("noisy cycles: interval %v-%v (%v), want around 0.8, within 0.7-0.9", lo, hi, ok)
	}
	if _, _, ok := (pairedRun{cycles: steady.cycles[:4]}).interval(0, 1); ok {
		t.Error("an interval from 4 cycles")
	}
}
