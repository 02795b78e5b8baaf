// Package wait is how blocked acquirers of the row strategies wait without holding a
// pooled connection: an in-process FIFO per lock key (only the first waiter of a
// Locker sends attempts), wake-up channels, and on PostgreSQL one LISTEN connection
// per Locker that turns NOTIFYs of released keys into wake-ups. MySQL waiters back
// off with jitter (see Hub.Sleep).
package wait

import (
	"context"
	"database/sql"
	"encoding/hex"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/backoff"
)

// Hub is the waiting room of one Locker. It is safe for concurrent use.
type Hub struct {
	db       *sql.DB
	dialect  sqllock.Dialect
	channel  string // PostgreSQL NOTIFY channel, "" for none
	strategy string
	log      *slog.Logger

	mu      sync.Mutex
	queues  map[string]*queue
	waiters map[string]map[chan struct{}]bool
	topics  map[string]time.Time // topics published recently: see SubscribeTopic
	lis     *listener
	closed  bool

	probeWarned atomic.Bool // see listener.probe
}

// NewHub returns the waiting room of a Locker of strategy on db. On PostgreSQL,
// waiters are woken by NOTIFYs on channel whose payload is the hex key of the
// released lock (or a key followed by ':' and events, for targeted wake-ups: see
// EventTopics).
func NewHub(db *sql.DB, d sqllock.Dialect, strategy, channel string, log *slog.Logger) *Hub {
	return &Hub{
		db: db, dialect: d, channel: channel, strategy: strategy, log: log,
		queues: map[string]*queue{}, waiters: map[string]map[chan struct{}]bool{},
		topics: map[string]time.Time{},
	}
}

// Close stops the listener and wakes every waiter (they go on polling). Idempotent.
func (h *Hub) Close() {
	h.mu.Lock()
	lis := h.lis
	h.lis = nil
	h.closed = true
	h.mu.Unlock()
	if lis != nil {
		lis.stop()
	}
}

// queue is the in-process FIFO of one key: a one-slot channel whose blocked senders
// the Go runtime serves in order.
type queue struct {
	slot chan struct{}
	refs int
}

// Slot is a place at the head of a key's in-process queue.
type Slot struct {
	h   *Hub
	key string
	q   *queue
	mu  sync.Mutex
	out bool
}

// Enqueue waits until the caller is the first waiter of key in this Hub, or ctx ends.
func (h *Hub) Enqueue(ctx context.Context, key string) (*Slot, error) {
	h.mu.Lock()
	q := h.queues[key]
	if q == nil {
		q = &queue{slot: make(chan struct{}, 1)}
		h.queues[key] = q
	}
	q.refs++
	h.mu.Unlock()
	select {
	case q.slot <- struct{}{}:
		return &Slot{h: h, key: key, q: q}, nil
	case <-ctx.Done():
		h.unref(key, q)
		return nil, ctx.Err()
	}
}

// Leave hands the slot to the next waiter of the key. Safe to call more than once
// and on a nil Slot.
func (s *Slot) Leave() {
	if s == nil {
		return
	}
	s.mu.Lock()
	if s.out {
		s.mu.Unlock()
		return
	}
	s.out = true
	s.mu.Unlock()
	<-s.q.slot
	s.h.unref(s.key, s.q)
	s.h.Wake(s.key)
}

func (h *Hub) unref(key string, q *queue) {
	h.mu.Lock()
	q.refs--
	if q.refs == 0 && h.queues[key] == q {
		delete(h.queues, key)
	}
	h.mu.Unlock()
}

// Subscribe registers a wake channel for key; call the returned func to unregister.
func (h *Hub) Subscribe(key string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	return ch, h.subscribe(key, ch)
}

// subscribe registers ch (buffered) for key and returns its unregister func.
func (h *Hub) subscribe(key string, ch chan struct{}) func() {
	h.mu.Lock()
	m := h.waiters[key]
	if m == nil {
		m = map[chan struct{}]bool{}
		h.waiters[key] = m
	}
	m[ch] = true
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		if m := h.waiters[key]; m != nil {
			delete(m, ch)
			if len(m) == 0 {
				delete(h.waiters, key)
			}
		}
	}
}

// Wake wakes the waiters of key in this Hub.
func (h *Hub) Wake(key string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	poke(h.waiters[key])
}

// Topic is the topic of one event of key, such as the release of one ticket: the
// NOTIFY payload hex(key) + ":" + event (a payload may name several events of its key:
// hex(key) + ":" + event + ":" + event ..., see EventTopics).
func Topic(key []byte, event string) string { return HexKey(key) + ":" + event }

// topicMemory is how long a published topic is remembered for late subscribers.
const topicMemory = time.Minute

// Publish wakes the subscribers of the topics, and remembers them for a while so
// that a subscriber that comes just after is woken too: a topic names one event (a
// ticket's release, its grant), which never happens twice. The topics are recorded
// together: a subscriber woken by one of them finds the others Published.
func (h *Hub) Publish(topics ...string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	if len(h.topics) >= 4096 {
		for t, at := range h.topics {
			if now.Sub(at) > topicMemory || len(h.topics) >= 8192 {
				delete(h.topics, t)
			}
		}
	}
	for _, t := range topics {
		h.topics[t] = now
	}
	for _, t := range topics {
		poke(h.waiters[t])
	}
}

// Published reports whether topic was published recently (see Publish).
func (h *Hub) Published(topic string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	at, ok := h.topics[topic]
	return ok && time.Since(at) < topicMemory
}

// SubscribeTopics registers ch (buffered) for event topics (see Publish): it is
// signalled when any of them is published, and at once if one was published shortly
// before. Call the returned func to unregister.
func (h *Hub) SubscribeTopics(ch chan struct{}, topics ...string) func() {
	cancels := make([]func(), len(topics))
	for i, t := range topics {
		cancels[i] = h.subscribe(t, ch)
	}
	h.mu.Lock()
	for _, t := range topics {
		if at, ok := h.topics[t]; ok && time.Since(at) < topicMemory {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
	h.mu.Unlock()
	return func() {
		for _, c := range cancels {
			c()
		}
	}
}

// WakeAll wakes every waiter in this Hub.
func (h *Hub) WakeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, m := range h.waiters {
		poke(m)
	}
}

func poke(m map[chan struct{}]bool) {
	for ch := range m {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// Listen starts the shared listener on PostgreSQL, once a waiter has to wait.
func (h *Hub) Listen() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.dialect == sqllock.Postgres && h.channel != "" && h.lis == nil && !h.closed {
		h.lis = startListener(h)
	}
}

// Sleep is how a waiter that just failed an attempt waits for the next one: until
// woken (a release in this process, or a NOTIFY on PostgreSQL), until ctx ends, or
// for a pause. On PostgreSQL, with the listener up, the pause is a slow fallback poll
// in [poll/2, poll] (shortened to the holder's remaining time, if known, so that a
// dead holder's expiry is noticed); on MySQL, and while attempts fail with errors, it
// is a capped exponential backoff with full jitter, attempt being the number of
// failed attempts so far. It returns ctx.Err() if ctx ended.
func (h *Hub) Sleep(ctx context.Context, wake <-chan struct{}, attempt int, poll, holderLeft time.Duration, failed bool) error {
	pol := backoff.Policy{Min: 2 * time.Millisecond, Max: poll}
	d := pol.Delay(attempt)
	if h.dialect == sqllock.Postgres && h.channel != "" && !failed {
		h.Listen()
		d = backoff.Policy{Min: poll / 2, Max: poll}.Delay(1)
		if holderLeft > 0 && holderLeft+time.Millisecond < d {
			d = holderLeft + time.Millisecond
		}
	}
	return backoff.Sleep(ctx, d, wake)
}

// EventTopics returns the topics a NOTIFY payload names: hex(key) + ":" + e1 + ":" +
// e2 ... names the events e1, e2 ... of key, whose topics are Topic(key, e1), ...; a
// payload without ':' (a bare hex key) names none.
func EventTopics(payload string) []string {
	key, events, ok := strings.Cut(payload, ":")
	if !ok {
		return nil
	}
	var topics []string
	for e := range strings.SplitSeq(events, ":") {
		topics = append(topics, key+":"+e)
	}
	return topics
}

// HexKey is the NOTIFY payload of a key.
func HexKey(key []byte) string { return hex.EncodeToString(key) }
