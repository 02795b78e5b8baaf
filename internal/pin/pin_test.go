package pin

import (
	"context"
	"database/sql"
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
		conn, err := p.Get(ctx)
		if err != nil {
			t.Fatal(err)
		}
		want := testdb.SessionID(ctx, t, d, conn)
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
		left := len(p.sess)
		p.mu.Unlock()
		if left != 0 {
			t.Errorf("%d sessions remembered after every connection left the Pool", left)
		}
	})
}

// TestStmt: on MySQL, Stmt prepares a statement only on a session the Pool handed
// out again after keeping it (nil on a session used once: the caller runs text),
// prepares it once per session however often it is asked, and closes it when the
// session returns to the application's pool (the session's own Com_stmt_* counts
// show it). On PostgreSQL it always returns nil (pgx prepares by itself).
func TestStmt(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		db := testdb.Open(t, d)
		db.SetMaxIdleConns(1) // the session Close returns is the one db.Conn hands out next
		p := New(db, d, 30*time.Second, slog.New(slog.DiscardHandler))
		defer p.Close()
		ctx := testdb.Context(t, 30*time.Second)
		const q = "SELECT ? + 1"
		conn, err := p.Get(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st := p.Stmt(ctx, conn, q); st != nil {
			t.Fatalf("Stmt on a session used once = %v, want nil", st)
		}
		p.Put(conn)
		if d == sqllock.Postgres {
			return
		}
		again, err := p.Get(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if again != conn {
			t.Fatal("Get did not hand out the kept connection")
		}
		sid := testdb.SessionID(ctx, t, d, again)
		st := p.Stmt(ctx, again, q)
		if st == nil {
			t.Fatal("Stmt on a reused session = nil, want a prepared statement")
		}
		for i := range 3 {
			if p.Stmt(ctx, again, q) != st {
				t.Fatal("Stmt prepared the statement again")
			}
			var got int64
			if err := st.Row(ctx, again, []any{int64(i)}, &got); err != nil || got != int64(i+1) {
				t.Fatalf("the statement: %d, %v; want %d", got, err, i+1)
			}
		}
		// A prepare that fails leaves the session to text: no further prepares.
		if p.Stmt(ctx, again, "SELECT ? +") != nil {
			t.Fatal("Stmt of a statement the server refuses to prepare: want nil")
		}
		before := sessionCount(t, again, "Com_stmt_prepare")
		if p.Stmt(ctx, again, "SELECT ? + 2") != nil {
			t.Fatal("Stmt after a failed prepare on the session: want nil")
		}
		if after := sessionCount(t, again, "Com_stmt_prepare"); after != before {
			t.Errorf("Stmt after a failed prepare sent %d prepares, want 0", after-before)
		}
		p.Put(again)
		p.Close() // returns the kept session to db's pool
		back, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer back.Close()
		if sid2 := testdb.SessionID(ctx, t, d, back); sid2 != sid {
			t.Fatalf("db handed out session %d, not the Pool's %d", sid2, sid)
		}
		counts := map[string]int{}
		for _, k := range []string{"Com_stmt_prepare", "Com_stmt_execute", "Com_stmt_close"} {
			counts[k] = sessionCount(t, back, k)
		}
		// One prepare that worked and one that failed; the one that worked is closed.
		want := map[string]int{"Com_stmt_prepare": 2, "Com_stmt_execute": 3, "Com_stmt_close": 1}
		for k, v := range want {
			if counts[k] != v {
				t.Errorf("%s = %d on the session, want %d (%v)", k, counts[k], v, counts)
			}
		}
	})
}

// sessionCount returns a MySQL status counter of conn's session.
func sessionCount(t *testing.T, conn *sql.Conn, name string) int {
	t.Helper()
	var k string
	var v int
	if err := conn.QueryRowContext(context.Background(), "SHOW SESSION STATUS LIKE '"+name+"'").Scan(&k, &v); err != nil {
		t.Fatal(err)
	}
	return v
}
