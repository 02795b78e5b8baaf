package uniqueindex

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/namekey"
	"github.com/sqllock/sqllock/testdb"
)

// Environment of the holder subprocess of TestSIGKILLedHolder.
const (
	helperEnv     = "SQLLOCK_UNIQUEINDEX_HELPER" // dialect
	helperDSNEnv  = "SQLLOCK_UNIQUEINDEX_HELPER_DSN"
	helperNameEnv = "SQLLOCK_UNIQUEINDEX_HELPER_NAME"
)

// TestHelperHolder is the holder process of TestSIGKILLedHolder: it acquires the lock
// with a 2s TTL, prints its token and blocks until it is killed. Without the helper
// environment it returns at once.
func TestHelperHolder(t *testing.T) {
	d, ok := testdb.ChildDialect(helperEnv)
	if !ok {
		return
	}
	db, err := sql.Open(testdb.DriverName(d), os.Getenv(helperDSNEnv))
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	l, err := New(db, d, WithTTL(2*time.Second))
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	lease, err := l.Acquire(context.Background(), os.Getenv(helperNameEnv))
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	fmt.Printf("TOKEN %d\n", lease.Token())
	select {} // renewing until SIGKILL
}

// TestSIGKILLedHolder: a holder process killed with SIGKILL is replaced after its TTL
// by the database clock, and never before: the new acquired_at is not earlier than
// the dead holder's expires_at (both are database times).
func TestSIGKILLedHolder(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		testdb.CheckLeaks(t)
		admin := testdb.Open(t, d)
		name := testdb.Name(t, "killed")
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperHolder$", "-test.count=1")
		cmd.Env = append(os.Environ(), helperEnv+"="+d.String(), helperDSNEnv+"="+testdb.DSN(t, d), helperNameEnv+"="+name)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "TOKEN ") {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("holder process: %q, %v", line, err)
		}
		oldTok, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimPrefix(line, "TOKEN ")), 10, 64)
		// Let it renew a few times, then kill it without any chance to clean up.
		time.Sleep(1500 * time.Millisecond)
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		cmd.Wait()
		killedAt := time.Now()

		// The dead holder's last expiry, on the database clock.
		var oldExp string
		q := testdb.Rebind(d, "SELECT CAST(expires_at AS CHAR(40)) FROM sqllock_lease WHERE lock_key = ? AND token = ?")
		if d == sqllock.Postgres {
			q = "SELECT expires_at::text FROM sqllock_lease WHERE lock_key = $1 AND token = $2"
		}
		if err := admin.QueryRowContext(testdb.Context(t, 30*time.Second), q, namekey.Key(name), oldTok).Scan(&oldExp); err != nil {
			t.Fatalf("dead holder's row: %v", err)
		}

		l := newLocker(t, testdb.Open(t, d), d, WithPollInterval(200*time.Millisecond))
		if _, err := l.TryAcquire(testdb.Context(t, 30*time.Second), name); err == nil {
			t.Fatal("acquired at once after the holder was killed, before its TTL")
		}
		lease, err := l.Acquire(testdb.Context(t, 30*time.Second), name)
		if err != nil {
			t.Fatal(err)
		}
		waited := time.Since(killedAt)
		defer lease.Release(testdb.Context(t, 30*time.Second))
		// Microseconds from the dead holder's expiry to the new acquisition, computed
		// by the database.
		var gap int64
		q = "SELECT TIMESTAMPDIFF(MICROSECOND, CAST(? AS DATETIME(6)), acquired_at) FROM sqllock_lease WHERE lock_key = ? AND token = ?"
		if d == sqllock.Postgres {
			q = "SELECT floor(extract(epoch FROM acquired_at - $1::timestamptz) * 1000000)::bigint FROM sqllock_lease WHERE lock_key = $2 AND token = $3"
		}
		if err := admin.QueryRowContext(testdb.Context(t, 30*time.Second), q, oldExp, namekey.Key(name), lease.Token()).Scan(&gap); err != nil {
			t.Fatal(err)
		}
		if gap < 0 {
			t.Errorf("replaced %dµs before the dead holder's expiry %s (database clock)", -gap, oldExp)
		}
		if lease.Token() <= oldTok {
			t.Errorf("token %d after the dead holder's %d", lease.Token(), oldTok)
		}
		if waited > 2*time.Second+time.Second {
			t.Errorf("replacement took %v after the kill, TTL 2s", waited)
		}
		t.Logf("killed holder (token %d) replaced %v after SIGKILL; new acquired_at - old expires_at = %dµs",
			oldTok, waited.Round(time.Millisecond), gap)
	})
}
