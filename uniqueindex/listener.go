package uniqueindex

import (
	"context"
	"encoding/hex"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock/internal/backoff"
)

// listener is the one LISTEN connection of a PostgreSQL Locker, opened when a waiter
// first has to wait and closed by Locker.Close. If the driver is not pgx's stdlib, or
// the connection fails, waiters poll.
type listener struct {
	cancel context.CancelFunc
	done   chan struct{}
}

func startListener(l *Locker) *listener {
	ctx, cancel := context.WithCancel(context.Background())
	lis := &listener{cancel: cancel, done: make(chan struct{})}
	go lis.run(ctx, l)
	return lis
}

func (lis *listener) stop() {
	lis.cancel()
	<-lis.done
}

func (lis *listener) run(ctx context.Context, l *Locker) {
	defer close(lis.done)
	defer l.wake("", true)
	pol := backoff.Policy{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for attempt := 0; ctx.Err() == nil; attempt++ {
		err := lis.listen(ctx, l)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errNotPgx) {
			l.cfg.logger.Info("sqllock/uniqueindex: driver is not pgx stdlib; waiters poll")
			return
		}
		l.cfg.logger.Warn("sqllock/uniqueindex: listener failed, waiters poll until it is back", "err", err)
		l.wake("", true)
		if backoff.Sleep(ctx, pol.Delay(attempt), nil) != nil {
			return
		}
	}
}

var errNotPgx = errors.New("not a pgx stdlib connection")

// listen runs one LISTEN session until it fails or ctx ends. The session is a
// connection of its own, outside the pool (same configuration as the pool's
// connections), so it never takes a slot of the application's pool.
func (lis *listener) listen(ctx context.Context, l *Locker) error {
	var cfg *pgx.ConnConfig
	conn, err := l.db.Conn(ctx)
	if err != nil {
		return err
	}
	err = conn.Raw(func(dc any) error {
		sc, ok := dc.(*stdlib.Conn)
		if !ok {
			return errNotPgx
		}
		cfg = sc.Conn().Config().Copy()
		// The copy would deliver notifications to the pooled connection's buffer.
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
	if _, err := pc.Exec(ctx, "LISTEN "+channel); err != nil {
		return err
	}
	// Releases may have been missed before LISTEN took effect.
	l.wake("", true)
	for {
		n, err := pc.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n == nil {
			continue
		}
		if key, err := hex.DecodeString(n.Payload); err == nil {
			l.wake(string(key), false)
		}
	}
}
