//go:build ha

package ha_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/wait"
	"github.com/sqllock/sqllock/testdb/ha"
)

// TestListenerProbe: a Locker whose notifications cannot reach its LISTEN session
// (pgbouncer in transaction mode) says so once; directly and through pgbouncer in
// session mode, where notifications work, it says nothing. A waiter makes each
// Locker start its listener. One line per topology:
//
//	NOTIFYPROBE topology=... warnings=...
func TestListenerProbe(t *testing.T) {
	lab := ha.Start(t)
	postgresPair(t, lab, "sync", false)
	for _, top := range []struct {
		name, dsn string
		warn      bool
	}{
		{"pg-sync", lab.PrimaryDSN(), false},
		{"pgbouncer-session", lab.BouncerDSN("session"), false},
		{"pgbouncer-transaction", lab.BouncerDSN("transaction"), true},
	} {
		t.Run(top.name, func(t *testing.T) {
			t.Parallel()
			warns := &asyncWarnings{match: "do not reach the listener"}
			db := lab.Open(t, "pgx", top.dsn)
			l := mustLocker(t, "uniqueindex", db, sqllock.Postgres, lockerOpts{logger: warns.logger(), poll: 200 * time.Millisecond})
			ctx := ctxFor(t, time.Minute)
			name := fmt.Sprintf("ha-notify-probe/%s/%d", top.name, time.Now().UnixNano())
			// The holder is another Locker: a waiter of the holder's own Locker waits
			// in the process, not on the database.
			holder := mustLocker(t, "uniqueindex", lab.Open(t, "pgx", top.dsn), sqllock.Postgres, lockerOpts{})
			held, err := holder.Acquire(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			// A waiter for as long as the probe may take: its wait starts the listener.
			wctx := ctxFor(t, wait.ProbeWait+2*time.Second)
			if _, err := l.Acquire(wctx, name); err == nil {
				t.Fatal("the waiter acquired a held lock")
			}
			held.Release(ctx)
			t.Logf("NOTIFYPROBE topology=%s warnings=%d", top.name, warns.count())
			if got := warns.count() > 0; got != top.warn {
				t.Errorf("warned %v (%d: %q), want %v", got, warns.count(), warns.messages(), top.warn)
			}
		})
	}
}
