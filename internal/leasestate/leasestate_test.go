package leasestate

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
)

func TestEndOnce(t *testing.T) {
	s := New()
	if s.Err() != nil {
		t.Fatal("a new lease has an error")
	}
	select {
	case <-s.Done():
		t.Fatal("Done closed on a new lease")
	default:
	}
	var wins atomic.Int32
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if s.End(errors.New("end")) {
				wins.Add(1)
			}
			<-s.Done()
			if s.Err() == nil {
				t.Error("Done closed before Err was set")
			}
		}()
	}
	wg.Wait()
	if wins.Load() != 1 {
		t.Fatalf("%d calls ended the lease, want 1", wins.Load())
	}
}
