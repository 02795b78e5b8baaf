//go:build ha

package ha_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sqllock/sqllock/testdb/ha"
)

// TestLab is the lab's smoke test: the Galera cluster replicates, the PostgreSQL
// pair replicates in the mode asked for, both pgbouncer ports take writes, and a
// crash of the primary followed by a promotion leaves a writable primary.
func TestLab(t *testing.T) {
	lab := ha.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	t.Run("galera", func(t *testing.T) {
		for n := 1; n <= 3; n++ {
			db := lab.Open(t, "mysql", lab.GaleraDSN(n))
			var name string
			var size int
			if err := db.QueryRowContext(ctx, "SHOW STATUS LIKE 'wsrep_cluster_size'").Scan(&name, &size); err != nil {
				t.Fatalf("node %d: %v", n, err)
			}
			if size != 3 {
				t.Errorf("node %d: wsrep_cluster_size = %d, want 3", n, size)
			}
		}
		n1 := lab.Open(t, "mysql", lab.GaleraDSN(1))
		n3 := lab.Open(t, "mysql", lab.GaleraDSN(3))
		if _, err := n1.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS halab_smoke (k VARCHAR(64) PRIMARY KEY, v BIGINT NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("smoke-%d", time.Now().UnixNano())
		if _, err := n1.ExecContext(ctx, "INSERT INTO halab_smoke (k, v) VALUES (?, 42)", key); err != nil {
			t.Fatal(err)
		}
		// wsrep_sync_wait makes the read on n3 wait for what the cluster committed.
		conn, err := n3.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := conn.ExecContext(ctx, "SET SESSION wsrep_sync_wait = 1"); err != nil {
			t.Fatal(err)
		}
		var v int
		if err := conn.QueryRowContext(ctx, "SELECT v FROM halab_smoke WHERE k = ?", key).Scan(&v); err != nil || v != 42 {
			t.Fatalf("row written on n1, read on n3: v=%d err=%v", v, err)
		}
		t.Log(lab.Ctl(t, "galera", "status"))
	})

	t.Run("postgres", func(t *testing.T) {
		// Sync last: the writes below reach the standby before the crash.
		for _, mode := range []string{"async", "sync"} {
			lab.ResetPostgres(t, mode)
			primary := lab.Open(t, "pgx", lab.PrimaryDSN())
			var state string
			if err := primary.QueryRowContext(ctx,
				"SELECT sync_state FROM pg_stat_replication WHERE application_name = 'halab_standby'").Scan(&state); err != nil {
				t.Fatalf("%s: pg_stat_replication: %v", mode, err)
			}
			if state != mode {
				t.Errorf("after ResetPostgres(%s): sync_state = %q", mode, state)
			}
			standby := lab.Open(t, "pgx", lab.StandbyDSN())
			var recovery bool
			if err := standby.QueryRowContext(ctx, "SELECT pg_is_in_recovery()").Scan(&recovery); err != nil || !recovery {
				t.Errorf("%s: standby pg_is_in_recovery = %v, %v", mode, recovery, err)
			}
		}

		primary := lab.Open(t, "pgx", lab.PrimaryDSN())
		if _, err := primary.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS halab_smoke (k text PRIMARY KEY, v bigint NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		for _, mode := range []string{"transaction", "session"} {
			db := lab.Open(t, "pgx", lab.BouncerDSN(mode))
			if _, err := db.ExecContext(ctx, "INSERT INTO halab_smoke (k, v) VALUES ($1, 1)", "bouncer-"+mode); err != nil {
				t.Errorf("write through pgbouncer %s: %v", mode, err)
			}
		}

		before := lab.PrimaryDSN()
		lab.KillPrimary(t)
		lab.Promote(t)
		if lab.PrimaryDSN() == before {
			t.Errorf("PrimaryDSN did not change with Promote: %s", before)
		}
		promoted := lab.Open(t, "pgx", lab.PrimaryDSN())
		if _, err := promoted.ExecContext(ctx, "INSERT INTO halab_smoke (k, v) VALUES ('after-promote', 2)"); err != nil {
			t.Fatalf("write on the promoted primary: %v", err)
		}
		var n int
		if err := promoted.QueryRowContext(ctx, "SELECT count(*) FROM halab_smoke WHERE k LIKE 'bouncer-%'").Scan(&n); err != nil || n != 2 {
			t.Errorf("rows written through pgbouncer before the failover (sync mode): %d, %v", n, err)
		}
		bouncer := lab.Open(t, "pgx", lab.BouncerDSN("transaction"))
		if _, err := bouncer.ExecContext(ctx, "INSERT INTO halab_smoke (k, v) VALUES ('bouncer-after-promote', 3)"); err != nil {
			t.Errorf("write through pgbouncer after the promotion: %v", err)
		}
		// Leave a healthy pair for the tests that follow.
		lab.ResetPostgres(t, "sync")
	})
}
