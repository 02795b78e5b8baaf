//go:build ha

package ha_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb/ha"
)

// TestMySQLReplication: on a MySQL source with one replica, every strategy's Locker
// logs one warning (the replica replicates asynchronously, or semi-synchronously
// waiting AFTER_COMMIT, or semi-synchronous replication is enabled but has fallen
// back to asynchronous: a failover could forget leases and repeat tokens) or, with
// WithRequireSyncReplication, refuses; with lossless semi-synchronous replication
// (AFTER_SYNC, in force) it is silent and accepted, also for a user who may not list
// the replicas (no REPLICATION SLAVE); otherwise such a user gets no warning, and a
// refusal under WithRequireSyncReplication: the Locker cannot tell.
func TestMySQLReplication(t *testing.T) {
	lab := ha.StartMySQL(t)
	src := ha.Open(t, "mysql", lab.SourceDSN())
	migrate(t, src, sqllock.MySQL)
	ctx := ctxFor(t, 5*time.Minute)
	for _, q := range []string{
		"CREATE USER IF NOT EXISTS 'replplain'@'%' IDENTIFIED BY 'replplain'",
		"GRANT ALL ON locktest.* TO 'replplain'@'%'",
	} {
		if _, err := src.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	plain := ha.Open(t, "mysql", strings.Replace(lab.SourceDSN(), "grlab:grlab@", "replplain:replplain@", 1))
	if err := plain.QueryRowContext(ctx, "SHOW REPLICAS").Scan(); err == nil || !strings.Contains(err.Error(), "1227") {
		t.Fatalf("SHOW REPLICAS as replplain: %v; the test wants a user that may not list the replicas", err)
	}
	t.Cleanup(func() { lab.SemiSync(t, "off") })

	strategies := append(append([]string(nil), rowStrategies...), "forupdate", "advisory")
	cycle := func(t *testing.T, l sqllock.Locker, name string) error {
		t.Helper()
		lease, err := l.Acquire(ctxFor(t, 30*time.Second), name)
		if err != nil {
			return err
		}
		if err := lease.Release(ctxFor(t, 30*time.Second)); err != nil {
			t.Errorf("Release: %v", err)
		}
		return nil
	}
	for _, mode := range []string{"off", "after_commit", "fallback", "after_sync"} {
		t.Run(mode, func(t *testing.T) {
			lab.SemiSync(t, mode)
			unsafe := mode != "after_sync"
			for _, s := range strategies {
				name := "ha-repl/" + mode + "/" + s
				warns := &asyncWarnings{}
				if err := cycle(t, mustLocker(t, s, src, sqllock.MySQL, lockerOpts{logger: warns.logger()}), name); err != nil {
					t.Errorf("%s: %v; want the lock (a warning at most)", s, err)
				}
				want := int64(0)
				if unsafe {
					want = 1
				}
				if got := warns.count(); got != want {
					t.Errorf("%s: %d warnings about asynchronous replication %q; want %d", s, got, warns.messages(), want)
				} else if got == 1 && s == "uniqueindex" {
					t.Logf("%s: %s", mode, warns.messages()[0])
				}
				err := cycle(t, mustLocker(t, s, src, sqllock.MySQL, lockerOpts{requireSync: true}), name)
				if unsafe && !isRefusal(err) {
					t.Errorf("%s with WithRequireSyncReplication: %v; want a refusal (ErrUnsafeDeployment)", s, err)
				}
				if !unsafe && err != nil {
					t.Errorf("%s with WithRequireSyncReplication: %v; want the lock", s, err)
				}

				warns = &asyncWarnings{}
				if err := cycle(t, mustLocker(t, s, plain, sqllock.MySQL, lockerOpts{logger: warns.logger()}), name); err != nil {
					t.Errorf("%s as replplain: %v; want the lock", s, err)
				}
				if got := warns.count(); got != 0 {
					t.Errorf("%s as replplain: warnings %q; want none (it cannot see the replicas)", s, warns.messages())
				}
				err = cycle(t, mustLocker(t, s, plain, sqllock.MySQL, lockerOpts{requireSync: true}), name)
				if unsafe && (!isRefusal(err) || !strings.Contains(err.Error(), "cannot tell")) {
					t.Errorf("%s as replplain with WithRequireSyncReplication: %v; want a refusal saying it cannot tell", s, err)
				}
				if !unsafe && err != nil {
					t.Errorf("%s as replplain with WithRequireSyncReplication: %v; want the lock (lossless semi-sync is told without listing replicas)", s, err)
				}
			}
		})
	}
}

// TestMySQLFailoverAsync: with an asynchronous replica that missed the latest
// commits, a failover forgets leases and repeats tokens, as on PostgreSQL
// (TestFailoverAsync): a name held on the source is granted again on the promoted
// replica, with a token already handed out. The test reproduces it, and fails if it
// stops reproducing, so that the warning TestMySQLReplication checks stays the
// measured truth. The source is killed (SIGKILL); the pair is rebuilt afterwards.
func TestMySQLFailoverAsync(t *testing.T) {
	lab := ha.StartMySQL(t)
	lab.ResetPair(t)
	t.Cleanup(func() { lab.ResetPair(t) })
	src := ha.Open(t, "mysql", lab.SourceDSN())
	migrate(t, src, sqllock.MySQL)
	rep := ha.Open(t, "mysql", lab.ReplicaDSN())
	ctx := ctxFor(t, 3*time.Minute)

	// Everything so far (the migrations) reaches the replica; from now on it
	// receives nothing.
	var executed string
	if err := src.QueryRowContext(ctx, "SELECT @@GLOBAL.gtid_executed").Scan(&executed); err != nil {
		t.Fatal(err)
	}
	var timedOut int
	if err := rep.QueryRowContext(ctx, "SELECT WAIT_FOR_EXECUTED_GTID_SET(?, 60)", executed).Scan(&timedOut); err != nil || timedOut != 0 {
		t.Fatalf("the replica did not apply the source's %q: %v (timed out: %d)", executed, err, timedOut)
	}
	if _, err := rep.ExecContext(ctx, "STOP REPLICA"); err != nil {
		t.Fatal(err)
	}

	stamp := time.Now().UnixNano()
	hs := map[string]*history{}
	for _, s := range rowStrategies {
		hs[s] = takeHistory(t, s, mustLocker(t, s, src, sqllock.MySQL, lockerOpts{}), fmt.Sprintf("ha-mysql-failover/%d/%s", stamp, s))
	}

	lab.KillSource(t)
	for _, q := range []string{"RESET REPLICA ALL", "SET GLOBAL super_read_only = OFF", "SET GLOBAL read_only = OFF"} {
		if _, err := rep.ExecContext(ctx, q); err != nil {
			t.Fatalf("promoting the replica: %s: %v", q, err)
		}
	}
	for _, s := range rowStrategies {
		expectRegranted(t, s, rep, sqllock.MySQL, hs[s], "mysql", "the promoted replica")
	}
}
