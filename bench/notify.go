package main

// Notifications: NOTIFY serialises the commits of a whole PostgreSQL database, so a
// phase also counts the notifications sent on the library's channels (and the raw
// NOTIFY cell's), with a LISTEN session of the bench's own.

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sqllock/sqllock"
)

// notifyChannels are the channels the library's releases notify, and the raw
// NOTIFY cell's.
var notifyChannels = []string{"sqllock_lease", "sqllock_optimistic", "sqllock_fairqueue", rawNotifyChannel}

// countNotifications starts counting the notifications on notifyChannels (on
// PostgreSQL; elsewhere it counts nothing) and returns a function that stops
// counting and returns the count (-1 when not counted). It waits a little for
// notifications still on their way when it stops.
func countNotifications(ctx context.Context, t *target) (func() int64, error) {
	if t.d != sqllock.Postgres {
		return func() int64 { return -1 }, nil
	}
	cfg := t.pg.Copy()
	cfg.TLSConfig, cfg.Fallbacks = nil, nil
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	for _, ch := range notifyChannels {
		if _, err := conn.Exec(ctx, "LISTEN "+ch); err != nil {
			conn.Close(context.Background())
			return nil, err
		}
	}
	var n atomic.Int64
	var stopping atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			// A wait that times out leaves the session usable (pgconn closes it on
			// other errors only).
			wctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			_, err := conn.WaitForNotification(wctx)
			cancel()
			switch {
			case err == nil:
				n.Add(1)
			case wctx.Err() != nil && !stopping.Load():
			default:
				return
			}
		}
	}()
	return func() int64 {
		stopping.Store(true)
		<-done
		conn.Close(context.Background())
		return n.Load()
	}, nil
}
