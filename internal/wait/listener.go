package wait

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sqllock/sqllock/internal/backoff"
)

// listener is the one LISTEN connection of a PostgreSQL Hub, opened when a waiter
// first has to wait and closed by Hub.Close. If the driver exposes no *pgx.Conn, or
// the connection fails, waiters poll.
type listener struct {
	cancel context.CancelFunc
	done   chan struct{}
	probes sync.WaitGroup // see probe
}

func startListener(h *Hub) *listener {
	ctx, cancel := context.WithCancel(context.Background())
	lis := &listener{cancel: cancel, done: make(chan struct{})}
	go lis.run(ctx, h)
	return lis
}

func (lis *listener) stop() {
	lis.cancel()
	<-lis.done
	lis.probes.Wait()
}

func (lis *listener) run(ctx context.Context, h *Hub) {
	defer close(lis.done)
	defer h.WakeAll()
	pol := backoff.Policy{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for attempt := 0; ctx.Err() == nil; attempt++ {
		err := lis.listen(ctx, h)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errNotPgx) {
			h.log.Info("sqllock/" + h.strategy + ": the driver exposes no *pgx.Conn; waiters poll")
			return
		}
		h.log.Warn("sqllock/"+h.strategy+": listener failed, waiters poll until it is back", "err", err)
		h.WakeAll()
		if backoff.Sleep(ctx, pol.Delay(attempt), nil) != nil {
			return
		}
	}
}

var errNotPgx = errors.New("the driver connection exposes no *pgx.Conn")

// ProbeWait is how long a new LISTEN session waits for its own test notification,
// sent through the application's pool, before it warns that notifications do not
// reach it.
const ProbeWait = 3 * time.Second

// probe sends a notification with a payload of its own through the pool, as a
// release would, and warns (once per Hub) if the LISTEN session has not seen it
// within ProbeWait: behind a transaction-pooling proxy (pgbouncer
// pool_mode=transaction) LISTEN runs on a server session the proxy hands to other
// clients, and notifications go nowhere; waiters then only poll. The caller closes
// seen when the payload arrives.
func (lis *listener) probe(ctx context.Context, h *Hub) (payload string, seen chan struct{}) {
	b := make([]byte, 8)
	rand.Read(b)
	payload = "sqllock-probe-" + hex.EncodeToString(b)
	seen = make(chan struct{})
	lis.probes.Add(1)
	go func() {
		defer lis.probes.Done()
		if _, err := h.db.ExecContext(ctx, "SELECT pg_notify($1, $2)", h.channel, payload); err != nil {
			return
		}
		t := time.NewTimer(ProbeWait)
		defer t.Stop()
		select {
		case <-seen:
		case <-ctx.Done():
		case <-t.C:
			if h.probeWarned.CompareAndSwap(false, true) {
				h.log.Warn("sqllock/"+h.strategy+": notifications sent through the pool do not reach the listener "+
					"(a transaction-pooling proxy such as pgbouncer pool_mode=transaction?); waiters wake by polling only: "+
					"lower WithPollInterval, or give the Locker a direct or session-pooled connection", "waited", ProbeWait)
			}
		}
	}()
	return payload, seen
}

// listen runs one LISTEN session until it fails or ctx ends. The session is a
// connection of its own, outside the pool (configured like the pool's connections),
// so it never takes a slot of the application's pool. Any driver connection that has
// a Conn() *pgx.Conn method works (pgx's stdlib, and wrappers that expose it).
func (lis *listener) listen(ctx context.Context, h *Hub) error {
	var cfg *pgx.ConnConfig
	conn, err := h.db.Conn(ctx)
	if err != nil {
		return err
	}
	err = conn.Raw(func(dc any) error {
		p, ok := dc.(interface{ Conn() *pgx.Conn })
		if !ok || p.Conn() == nil {
			return errNotPgx
		}
		cfg = p.Conn().Config().Copy()
		// The copy would deliver notifications to the pooled connection's handler.
		cfg.OnNotification = nil
		return nil
	})
	conn.Close()
	if err != nil {
		return err
	}
	pc, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		pc.Close(cctx)
		cancel()
	}()
	if _, err := pc.Exec(ctx, "LISTEN "+h.channel); err != nil {
		return err
	}
	// Releases may have been missed before LISTEN took effect.
	h.WakeAll()
	probe, seen := lis.probe(ctx, h)
	for {
		n, err := pc.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n == nil {
			continue
		}
		if n.Payload == probe {
			close(seen)
			probe = ""
			continue
		}
		if topics := EventTopics(n.Payload); topics != nil {
			h.Publish(topics...) // event topics: see Hub.Publish
			continue
		}
		if key, err := hex.DecodeString(n.Payload); err == nil {
			h.Wake(string(key))
		}
	}
}
