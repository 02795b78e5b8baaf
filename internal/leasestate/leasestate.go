// Package leasestate holds the end-of-life state every Lease implementation shares:
// the Done channel, the error it ended with, and at-most-once transitions.
package leasestate

import "sync"

// State is the life of one lease: held, then lost or released, once.
// The zero value is not usable; call New.
type State struct {
	done chan struct{}
	once sync.Once
	mu   sync.Mutex
	err  error
}

// New returns the State of a held lease.
func New() *State { return &State{done: make(chan struct{})} }

// End ends the lease with err (ErrLost or ErrNotHeld wrapped). It reports whether this
// call ended it; later calls change nothing.
func (s *State) End(err error) bool {
	ended := false
	s.once.Do(func() {
		s.mu.Lock()
		s.err = err
		s.mu.Unlock()
		close(s.done)
		ended = true
	})
	return ended
}

// Done is closed when the lease ends.
func (s *State) Done() <-chan struct{} { return s.done }

// Err is nil while held, then the error the lease ended with.
func (s *State) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}
