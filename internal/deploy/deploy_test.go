package deploy_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/deploy"
	"github.com/sqllock/sqllock/testdb"
)

func TestMain(m *testing.M) { os.Exit(testdb.Main(m)) }

// syncBuffer is a log destination safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestPlainServerAccepted: a server without standbys (PostgreSQL) or without wsrep
// (MariaDB, Oracle MySQL) is accepted by every kind of Locker, with no warning.
func TestPlainServerAccepted(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		var logs syncBuffer
		log := slog.New(slog.NewTextHandler(&logs, nil))
		for _, needs := range []deploy.Needs{{}, {OneNode: true}, {RequireSync: true}, {OneNode: true, RequireSync: true}} {
			g := deploy.New(testdb.Open(t, d), d, "test", needs, log)
			for range 2 {
				if err := g.Check(ctx); err != nil {
					t.Fatalf("%+v: %v", needs, err)
				}
			}
		}
		if logs.String() != "" {
			t.Errorf("warnings on a plain server: %s", logs.String())
		}
	})
}

// TestCheckHonoursCtx: while one caller's probe waits (here for the pool's only
// connection), another caller's Check returns when its own ctx ends; the probe
// then finishes and its answer is kept.
func TestCheckHonoursCtx(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		ctx := testdb.Context(t, time.Minute)
		db := testdb.Open(t, d)
		db.SetMaxOpenConns(1)
		held, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		g := deploy.New(db, d, "test", deploy.Needs{OneNode: true}, slog.New(slog.DiscardHandler))
		first := make(chan error, 1)
		go func() { first <- g.Check(ctx) }()
		short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		if err := g.Check(short); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Check with a 200 ms ctx while another probe waits: %v", err)
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Fatalf("Check kept its caller %v after its ctx ended", took)
		}
		held.Close()
		if err := <-first; err != nil {
			t.Fatalf("the waiting probe: %v", err)
		}
		if err := g.Check(short); err != nil { // answered: no SQL, ctx not looked at
			t.Fatalf("after the answer: %v", err)
		}
	})
}

// TestProbeRefusedByServer: a role that may not read pg_stat_replication (REVOKE
// from PUBLIC, in a database of its own) gets one warning and goes on; with
// RequireSync it is refused, since nothing can tell.
func TestProbeRefusedByServer(t *testing.T) {
	const d = sqllock.Postgres
	ctx := testdb.Context(t, time.Minute)
	admin := testdb.Open(t, d)
	var b [5]byte
	rand.Read(b[:])
	suffix := hex.EncodeToString(b[:])
	dbName, role := "sqllock_deploy_"+suffix, "sqllock_deploy_u_"+suffix
	exec := func(db *sql.DB, q string) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec(admin, "CREATE DATABASE "+dbName)
	exec(admin, "CREATE ROLE "+role+" LOGIN PASSWORD 'p"+suffix+"'")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+dbName+" WITH (FORCE)")
		admin.ExecContext(ctx, "DROP ROLE IF EXISTS "+role)
	})
	u, err := url.Parse(testdb.DSN(t, d))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + dbName
	super, err := sql.Open(testdb.DriverName(d), u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer super.Close()
	exec(super, "REVOKE SELECT ON pg_catalog.pg_stat_replication FROM PUBLIC")
	super.Close()
	u.User = url.UserPassword(role, "p"+suffix)
	low, err := sql.Open(testdb.DriverName(d), u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer low.Close()

	var logs syncBuffer
	g := deploy.New(low, d, "test", deploy.Needs{}, slog.New(slog.NewTextHandler(&logs, nil)))
	for range 3 {
		if err := g.Check(ctx); err != nil {
			t.Fatalf("Check: %v", err)
		}
	}
	if n := strings.Count(logs.String(), "could not check the deployment"); n != 1 {
		t.Errorf("%d warnings, want 1: %s", n, logs.String())
	}
	g = deploy.New(low, d, "test", deploy.Needs{RequireSync: true}, slog.New(slog.DiscardHandler))
	if err := g.Check(ctx); !errors.Is(err, sqllock.ErrUnsafeDeployment) || !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Fatalf("RequireSync without the view: %v", err)
	}
}

// TestBinlogReplication: a MySQL source with a replica (containers of the binary's
// MySQL image: MariaDB or Oracle MySQL) is warned of once, or refused under
// RequireSync, with the reason, while the replica replicates asynchronously,
// semi-synchronously waiting AFTER_COMMIT, semi-synchronously fallen back to
// asynchronous, or with semi-sync enabled and no semi-synchronous replica connected
// (the status still reads ON then); with lossless semi-synchronous replication in
// force (AFTER_SYNC) it is accepted without a word, also for a user who may not list
// the replicas. Otherwise such a user is told so at Info level, not warned, and
// refused under RequireSync (the check cannot tell). The replica (a binary log, no
// replica of its own) is accepted without a word.
func TestBinlogReplication(t *testing.T) {
	p := testdb.StartReplicaPair(t)
	ctx := testdb.Context(t, 5*time.Minute)
	open := func(dsn string) *sql.DB {
		db, err := sql.Open("mysql", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		return db
	}
	root := open(p.Source)
	for _, q := range []string{
		"CREATE USER 'deployplain'@'%' IDENTIFIED BY 'deployplain'",
		"GRANT ALL ON test.* TO 'deployplain'@'%'",
	} {
		if _, err := root.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	u, err := mysqlDSNWithUser(p.Source, "deployplain", "deployplain")
	if err != nil {
		t.Fatal(err)
	}
	plain := open(u)

	check := func(db *sql.DB, needs deploy.Needs) (string, error) {
		var logs syncBuffer
		err := deploy.New(db, sqllock.MySQL, "test", needs, slog.New(slog.NewTextHandler(&logs, nil))).Check(ctx)
		return logs.String(), err
	}
	replica := open(p.Replica)
	// Why each mode is unsafe, as the warning says it.
	reasons := map[string]string{
		"off":            "semi-synchronous replication off",
		"after_commit":   "waiting AFTER_COMMIT",
		"fallback":       "fell back to asynchronous",
		"unacknowledged": "with 0 semi-synchronous replica(s) connected",
		"after_sync":     "",
	}
	for _, mode := range []string{"off", "after_commit", "fallback", "unacknowledged", "after_sync"} {
		t.Run(mode, func(t *testing.T) {
			p.SemiSync(t, mode)
			unsafe := mode != "after_sync"
			logs, err := check(root, deploy.Needs{})
			warned := strings.Contains(logs, "level=WARN") && strings.Contains(logs, "asynchronous replication")
			if err != nil || warned != unsafe || !strings.Contains(logs, reasons[mode]) {
				t.Errorf("root: Check = %v, logs %q; want nil, warned %v, saying %q", err, logs, unsafe, reasons[mode])
			}
			_, err = check(root, deploy.Needs{RequireSync: true})
			if unsafe != errors.Is(err, sqllock.ErrUnsafeDeployment) {
				t.Errorf("root, RequireSync: Check = %v; want a refusal: %v", err, unsafe)
			}
			logs, err = check(plain, deploy.Needs{})
			if mode == "after_sync" {
				if err != nil || logs != "" {
					t.Errorf("deployplain: Check = %v, logs %q; want nil and no log", err, logs)
				}
			} else if err != nil || strings.Contains(logs, "level=WARN") || !strings.Contains(logs, "cannot see this server's replicas") {
				t.Errorf("deployplain: Check = %v, logs %q; want nil and one Info line that it cannot see the replicas", err, logs)
			}
			_, err = check(plain, deploy.Needs{RequireSync: true})
			if mode == "after_sync" {
				// Lossless semi-sync in force is told from what any user may read.
				if err != nil {
					t.Errorf("deployplain, RequireSync: Check = %v; want nil (lossless semi-sync, no need to list replicas)", err)
				}
			} else if !errors.Is(err, sqllock.ErrUnsafeDeployment) || !strings.Contains(err.Error(), "cannot tell") {
				t.Errorf("deployplain, RequireSync: Check = %v; want a refusal saying it cannot tell", err)
			}
			// The replica has a binary log and no replica of its own: nothing to say.
			if logs, err := check(replica, deploy.Needs{RequireSync: true}); err != nil || logs != "" {
				t.Errorf("the replica, RequireSync: Check = %v, logs %q; want nil and no log", err, logs)
			}
		})
	}
}

// mysqlDSNWithUser returns dsn (go-sql-driver format) with another user and password.
func mysqlDSNWithUser(dsn, user, password string) (string, error) {
	at := strings.Index(dsn, "@")
	if at < 0 {
		return "", fmt.Errorf("no user in DSN %q", dsn)
	}
	return user + ":" + password + dsn[at:], nil
}
