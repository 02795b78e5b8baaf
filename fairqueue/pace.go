package fairqueue

import (
	"sync"
	"time"

	"github.com/sqllock/sqllock/internal/backoff"
)

// paceNames bounds the names a Locker keeps a pace for (the map is emptied when
// full: a forgotten pace is learnt again in two looks).
const paceNames = 1024

// pace is how MySQL waiters, which have no notifications and poll, keep the
// statements a grant costs from growing with the queue: a waiter sleeps until about
// its turn instead of looking at a rate that grows with its place.
//
// Each look tells a waiter how far it moved since its first look, so the mean time
// between two grants of its name while it waited. A waiter that has moved sleeps its
// place (1 is next to be granted) less one times that mean; before it has moved, it
// takes the estimate its Locker keeps per name from its other waiters' looks (an
// average that follows a shorter interval at once and a longer one slowly: a late
// look idles the lock, and the longer intervals it causes must not make every waiter
// look later still), which also bounds its own mean by a quarter more; before any, it
// sleeps nextPoll times its place. Next in line, it
// looks every nextPoll or so. So a waiter looks about four times whatever its place:
// when it enqueues, once or twice on the way, and at the front.
//
// A wrong estimate costs only time, never order: too short, one more look; too long,
// the lock idles until the waiter looks (at most the poll interval, and that look
// corrects the estimate).
type pace struct {
	mu  sync.Mutex
	per map[string]time.Duration
}

// sighting is a waiter's record of its looks: its first, and its position then.
type sighting struct {
	first    time.Time
	position int
	mean     time.Duration // since first; 0 until it has moved
}

// saw records a waiter's look at now, finding position (live tickets below its
// own), and updates its mean and its Locker's estimate for the name.
func (p *pace) saw(key []byte, s *sighting, position int, now time.Time) {
	if s.first.IsZero() {
		*s = sighting{first: now, position: position}
		return
	}
	moved := s.position - position
	if moved <= 0 {
		return
	}
	s.mean = now.Sub(s.first) / time.Duration(moved)
	p.mu.Lock()
	defer p.mu.Unlock()
	est, known := p.per[string(key)]
	switch {
	case !known:
		est = s.mean
	case s.mean > est:
		est += (s.mean - est) / 16
	default:
		est = (est + s.mean) / 2
	}
	if p.per == nil || len(p.per) >= paceNames {
		p.per = map[string]time.Duration{}
	}
	p.per[string(key)] = est
}

// sleep returns how long a waiter at place (1 is next to be granted) that has seen s
// sleeps before its next look, at most poll.
func (p *pace) sleep(key []byte, s *sighting, place int, poll time.Duration) time.Duration {
	place = max(place, 1)
	front := min(poll, nextPoll)
	d := backoff.Policy{Min: front / 2, Max: front}.Delay(1)
	if place == 1 {
		return d
	}
	p.mu.Lock()
	est := p.per[string(key)]
	p.mu.Unlock()
	mean := s.mean
	if mean == 0 || (est > 0 && mean > est+est/4) {
		// A waiter's own mean can include the idle time a late look of another
		// caused; bounded by the Locker's estimate, late looks do not feed on
		// themselves.
		mean = est
	}
	if mean == 0 {
		maxd := min(poll, time.Duration(place)*nextPoll)
		return backoff.Policy{Min: maxd / 2, Max: maxd}.Delay(1)
	}
	// Half a grant early: a late look idles the lock, an early one costs a look.
	return min(poll, max(d, time.Duration(2*place-3)*mean/2))
}
