package pin

import (
	"log/slog"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

// TestSessionID: SessionID returns the server's id of the session, asking the server
// once per session: again for a kept connection (MySQL: Put keeps it and Get hands
// it out again) it sends nothing. It forgets the session when the connection leaves
// the Pool (discarded, or put back into the application's pool).
func TestSessionID(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		var n atomic.Int64
		db := testdb.OpenCounting(t, d, &n)
		p := New(db, d, 30*time.Second, slog.New(slog.DiscardHandler))
		defer p.Close()
		ctx := testdb.Context(t, 30*time.Second)
		q := "SELECT CONNECTION_ID()"
		if d == sqllock.Postgres {
			q = "SELECT pg_backend_pid()"
		}
		conn, err := p.Get(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var want int64
		if err := conn.QueryRowContext(ctx, q).Scan(&want); err != nil {
			t.Fatal(err)
		}
		n.Store(0)
		for i := 0; i < 3; i++ {
			id, err := p.SessionID(ctx, conn)
			if err != nil {
				t.Fatal(err)
			}
			if id != want {
				t.Fatalf("SessionID = %d, want %d", id, want)
			}
		}
		if got := n.Load(); got != 1 {
			t.Errorf("3 calls of SessionID sent %d statements, want 1", got)
		}
		p.Put(conn)
		if d == sqllock.MySQL {
			again, err := p.Get(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if again != conn {
				t.Fatal("Get did not hand out the kept connection")
			}
			n.Store(0)
			if id, err := p.SessionID(ctx, again); err != nil || id != want {
				t.Fatalf("SessionID of the kept connection = %d, %v; want %d", id, err, want)
			}
			if got := n.Load(); got != 0 {
				t.Errorf("SessionID of a kept connection sent %d statements, want 0", got)
			}
			p.Discard(again)
		}
		p.mu.Lock()
		left := len(p.ids)
		p.mu.Unlock()
		if left != 0 {
			t.Errorf("%d sessions remembered after every connection left the Pool", left)
		}
	})
}
