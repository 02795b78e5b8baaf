package testdb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/testcontainers/testcontainers-go"
)

// ReplicaPair is a MySQL source with one replica, each in a container of the test
// binary's MySQL image (MariaDB or Oracle MySQL), replicating from the source's
// binary log position at the start (asynchronously until SemiSync says otherwise).
// Both have root (the password in their DSNs) and the database test.
type ReplicaPair struct {
	// Source and Replica are go-sql-driver DSNs, as DSN's: root@tcp(host:port)/test.
	Source, Replica string
	src, rep        *sql.DB
	mariadb         bool
	status          string // the statement that shows the source's binary log position
	repRestart      func(ctx context.Context, kill bool) (string, error)
}

// StartReplicaPair starts a ReplicaPair for t, removed when t ends. It needs
// containers: with the MySQL DSN variable set (existing servers, no containers) it
// skips t, saying so; in CI a pair that cannot start fails t.
func StartReplicaPair(t testing.TB) *ReplicaPair {
	t.Helper()
	dsnVar, imageVar, image := envFor(sqllock.MySQL)
	if os.Getenv(dsnVar) != "" {
		t.Skipf("testdb: a source and replica need containers of the MySQL image; %s names an existing server", dsnVar)
	}
	if v := os.Getenv(imageVar); v != "" {
		image = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	fail := func(err error) *ReplicaPair {
		t.Helper()
		msg := fmt.Sprintf("testdb: source and replica from %s: %v", image, err)
		if CI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
		return nil
	}
	type started struct {
		ctr     testcontainers.Container
		current func(context.Context) (string, error)
		dsn     string
		err     error
	}
	start := func(args ...string) started {
		ctr, current, err := runMySQL(ctx, image, testcontainers.WithCmd(append([]string{"mysqld"}, args...)...))
		if err != nil {
			return started{err: err}
		}
		t.Cleanup(func() { terminate(ctr) })
		dsn, err := current(ctx)
		return started{ctr, current, dsn, err}
	}
	// Both start together: one container start is most of the time.
	repc := make(chan started, 1)
	go func() { repc <- start("--server-id=2", "--log-bin=binlog") }()
	s := start("--server-id=1", "--log-bin=binlog")
	r := <-repc
	if err := errors.Join(s.err, r.err); err != nil {
		return fail(err)
	}
	srcCtr, srcDSN := s.ctr, s.dsn
	p := &ReplicaPair{Source: srcDSN, Replica: r.dsn, repRestart: restarter("mysql replica", r.ctr, r.current)}
	var err error
	if p.src, err = open(sqllock.MySQL, srcDSN); err != nil {
		return fail(err)
	}
	t.Cleanup(func() { p.src.Close() })
	if p.rep, err = open(sqllock.MySQL, r.dsn); err != nil {
		return fail(err)
	}
	t.Cleanup(func() { p.rep.Close() })
	var version string
	if err := p.src.QueryRowContext(ctx, "SELECT VERSION()").Scan(&version); err != nil {
		return fail(err)
	}
	p.mariadb = strings.Contains(strings.ToLower(version), "mariadb")

	srcIP, err := srcCtr.ContainerIP(ctx)
	if err != nil {
		return fail(fmt.Errorf("source's address: %w", err))
	}
	status := "SHOW BINARY LOG STATUS"
	if p.mariadb {
		status = "SHOW MASTER STATUS"
	}
	file, pos, err := binlogPosition(ctx, p.src, status)
	if err != nil && !p.mariadb && strings.Contains(err.Error(), "1064") { // before MySQL 8.2
		status = "SHOW MASTER STATUS"
		file, pos, err = binlogPosition(ctx, p.src, status)
	}
	if err != nil {
		return fail(fmt.Errorf("%s: %w", status, err))
	}
	p.status = status
	stmts := []string{fmt.Sprintf("CHANGE REPLICATION SOURCE TO SOURCE_HOST = '%s', SOURCE_PORT = 3306, SOURCE_USER = 'root', SOURCE_PASSWORD = '%s', SOURCE_LOG_FILE = '%s', SOURCE_LOG_POS = %d, GET_SOURCE_PUBLIC_KEY = 1",
		srcIP, containerPassword, file, pos), "START REPLICA"}
	if p.mariadb {
		stmts = []string{fmt.Sprintf("CHANGE MASTER TO MASTER_HOST = '%s', MASTER_PORT = 3306, MASTER_USER = 'root', MASTER_PASSWORD = '%s', MASTER_LOG_FILE = '%s', MASTER_LOG_POS = %d, MASTER_USE_GTID = no",
			srcIP, containerPassword, file, pos), "START SLAVE"}
	}
	for _, q := range stmts {
		if _, err := p.rep.ExecContext(ctx, q); err != nil {
			return fail(fmt.Errorf("%s: %w", q, err))
		}
	}
	if err := p.await(ctx, "the replica listed by the source", func(ctx context.Context) (bool, error) {
		n, err := p.replicas(ctx)
		return n == 1, err
	}); err != nil {
		return fail(err)
	}
	return p
}

// binlogPosition reads the file and position of the source's binary log (the first
// two columns of status).
func binlogPosition(ctx context.Context, db *sql.DB, status string) (string, int64, error) {
	rows, err := db.QueryContext(ctx, status)
	if err != nil {
		return "", 0, err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return "", 0, err
	}
	if !rows.Next() {
		return "", 0, fmt.Errorf("no binary log (%v)", rows.Err())
	}
	var file string
	var pos int64
	dest := []any{&file, &pos}
	for range cols[2:] {
		dest = append(dest, new(sql.RawBytes))
	}
	return file, pos, rows.Scan(dest...)
}

// replicas counts the replicas the source lists.
func (p *ReplicaPair) replicas(ctx context.Context) (int, error) {
	q := "SHOW REPLICAS"
	if p.mariadb {
		q = "SHOW SLAVE HOSTS"
	}
	rows, err := p.src.QueryContext(ctx, q)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n, rows.Err()
}

// await polls cond every 50 ms until it holds, an error, or 60 s.
func (p *ReplicaPair) await(ctx context.Context, what string, cond func(context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		ok, err := cond(ctx)
		if err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// SemiSync sets the pair's semi-synchronous replication: "off" (asynchronous),
// "after_sync" or "after_commit" (the source's wait point, the replica a
// semi-synchronous one), "fallback" (enabled with AFTER_SYNC, but the replica
// answers as an asynchronous one, so the source's first commit times out, after
// 200 ms, and it goes on asynchronously), or "unacknowledged" (enabled with
// AFTER_SYNC, the replica an asynchronous one, and no commit since: the source's
// status still reads ON, with no semi-synchronous replica connected). It returns
// once the source reports the mode (Rpl_semi_sync_*_status and _clients) and lists
// the replica again.
func (p *ReplicaPair) SemiSync(t testing.TB, mode string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	exec := func(db *sql.DB, qs ...string) {
		t.Helper()
		for _, q := range qs {
			if _, err := db.ExecContext(ctx, q); err != nil {
				t.Fatalf("testdb: %s: %v", q, err)
			}
		}
	}
	ioStop, ioStart := "STOP REPLICA IO_THREAD", "START REPLICA IO_THREAD"
	if p.mariadb {
		ioStop, ioStart = "STOP SLAVE IO_THREAD", "START SLAVE IO_THREAD"
	} else {
		// Oracle MySQL's semi-synchronous replication is a plugin: semisync_source
		// (8.0.26+) or semisync_master; 1125: already installed.
		for _, pl := range []struct {
			db           *sql.DB
			name, before string
		}{{p.src, "source", "master"}, {p.rep, "replica", "slave"}} {
			q := fmt.Sprintf("INSTALL PLUGIN rpl_semi_sync_%s SONAME 'semisync_%s.so'", pl.name, pl.name)
			_, err := pl.db.ExecContext(ctx, q)
			if err != nil && !strings.Contains(err.Error(), "1125") {
				q = fmt.Sprintf("INSTALL PLUGIN rpl_semi_sync_%s SONAME 'semisync_%s.so'", pl.before, pl.before)
				_, err = pl.db.ExecContext(ctx, q)
			}
			if err != nil && !strings.Contains(err.Error(), "1125") {
				t.Fatalf("testdb: %s: %v", q, err)
			}
		}
	}
	// The variables' names: source/replica (MySQL 8.0.26+), else master/slave.
	src, rep := "source", "replica"
	var name, value string
	if err := p.src.QueryRowContext(ctx, "SHOW GLOBAL VARIABLES LIKE 'rpl_semi_sync_source_enabled'").Scan(&name, &value); err != nil {
		src, rep = "master", "slave"
	}
	on, repOn, point, timeout, tick := "OFF", "OFF", "AFTER_SYNC", 10000, true
	wantStatus, wantClients := "OFF", "0"
	switch mode {
	case "off":
	case "after_sync", "after_commit":
		on, repOn, point, wantStatus, wantClients = "ON", "ON", strings.ToUpper(mode), "ON", "1"
	case "fallback":
		on, timeout = "ON", 200
	case "unacknowledged":
		on, wantStatus, tick = "ON", "ON", false
	default:
		t.Fatalf("testdb: SemiSync(%q): want off, after_sync, after_commit, fallback or unacknowledged", mode)
	}
	// Off first: switching it on again starts the source's status afresh (ON).
	exec(p.src, fmt.Sprintf("SET GLOBAL rpl_semi_sync_%s_enabled = OFF", src),
		fmt.Sprintf("SET GLOBAL rpl_semi_sync_%s_timeout = %d", src, timeout),
		fmt.Sprintf("SET GLOBAL rpl_semi_sync_%s_wait_point = '%s'", src, point))
	exec(p.rep, fmt.Sprintf("SET GLOBAL rpl_semi_sync_%s_enabled = %s", rep, repOn), ioStop, ioStart)
	exec(p.src, fmt.Sprintf("SET GLOBAL rpl_semi_sync_%s_enabled = %s", src, on))
	statusVar, clientsVar := "Rpl_semi_sync_"+src+"_status", "Rpl_semi_sync_"+src+"_clients"
	err := p.await(ctx, fmt.Sprintf("%s = %s, %s = %s", statusVar, wantStatus, clientsVar, wantClients), func(ctx context.Context) (bool, error) {
		if tick {
			// A commit: a source switches to semi-sync, or falls back, only at one.
			if _, err := p.src.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS testdb_tick (id int PRIMARY KEY, n int)"); err != nil {
				return false, err
			}
			if _, err := p.src.ExecContext(ctx, "INSERT INTO testdb_tick VALUES (1, 1) ON DUPLICATE KEY UPDATE n = n + 1"); err != nil {
				return false, err
			}
		}
		rows, err := p.src.QueryContext(ctx, "SHOW GLOBAL STATUS WHERE Variable_name IN ('"+statusVar+"', '"+clientsVar+"')")
		if err != nil {
			return false, err
		}
		got := map[string]string{}
		for rows.Next() {
			var k, v string
			if err := rows.Scan(&k, &v); err != nil {
				rows.Close()
				return false, err
			}
			got[k] = v
		}
		rows.Close()
		if got[statusVar] != wantStatus || got[clientsVar] != wantClients {
			return false, rows.Err()
		}
		n, err := p.replicas(ctx)
		return n == 1, err
	})
	if err != nil {
		t.Fatalf("testdb: SemiSync(%q): %v", mode, err)
	}
}

// OpenSource and OpenReplica return a new pool to the source or the replica, closed
// when t ends: one per Locker, as replicas of a service have.
func (p *ReplicaPair) OpenSource(t testing.TB) *sql.DB  { t.Helper(); return p.openPool(t, p.Source) }
func (p *ReplicaPair) OpenReplica(t testing.TB) *sql.DB { t.Helper(); return p.openPool(t, p.Replica) }

func (p *ReplicaPair) openPool(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	db, err := open(sqllock.MySQL, dsn)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// Promote makes the replica a source, as a failover tool does once the source is
// lost: it waits until the replica has applied every event of the source's binary
// log (as far as it goes now), stops replication, forgets the source and lets
// clients write. The source runs on, unaware: from then on both take writes, as
// after a failover that left the former source alive. Transactions open on the
// source stay open there; the replica never sees them.
func (p *ReplicaPair) Promote(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	stmts := []string{"STOP REPLICA", "RESET REPLICA ALL", "SET GLOBAL super_read_only = OFF", "SET GLOBAL read_only = OFF"}
	if p.mariadb {
		stmts = []string{"STOP SLAVE", "RESET SLAVE ALL", "SET GLOBAL read_only = OFF"}
	}
	if err := p.CatchUp(ctx); err != nil {
		t.Fatalf("testdb: %v", err)
	}
	for _, q := range stmts {
		if _, err := p.rep.ExecContext(ctx, q); err != nil {
			t.Fatalf("testdb: promoting the replica: %s: %v", q, err)
		}
	}
}

// CatchUp waits until the replica has applied every event of the source's binary
// log as far as it goes now (at most 60 s), or returns the error that stopped its
// applier (Last_SQL_Error of SHOW REPLICA STATUS).
func (p *ReplicaPair) CatchUp(ctx context.Context) error {
	wait := "SELECT SOURCE_POS_WAIT(?, ?, 60)"
	if p.mariadb {
		wait = "SELECT MASTER_POS_WAIT(?, ?, 60)"
	}
	file, pos, err := binlogPosition(ctx, p.src, p.status)
	if err != nil {
		return fmt.Errorf("%s: %w", p.status, err)
	}
	var events sql.NullInt64 // events waited for; -1: timed out; NULL: the applier stopped
	err = p.rep.QueryRowContext(ctx, wait, file, pos).Scan(&events)
	if err == nil && events.Valid && events.Int64 >= 0 {
		return nil
	}
	return fmt.Errorf("the replica did not apply the source's binary log up to %s:%d (%v, %v): %s", file, pos, events, err, p.applierError(ctx))
}

// applierError returns the replica's Last_SQL_Error, or what kept it from reading it.
func (p *ReplicaPair) applierError(ctx context.Context) string {
	q := "SHOW REPLICA STATUS"
	if p.mariadb {
		q = "SHOW SLAVE STATUS"
	}
	rows, err := p.rep.QueryContext(ctx, q)
	if err != nil {
		return err.Error()
	}
	status, err := rowMaps(rows)
	switch {
	case err != nil:
		return err.Error()
	case len(status) == 0:
		return "no replication configured"
	}
	msg := "Last_SQL_Error: " + status[0]["last_sql_error"].String
	if !p.mariadb {
		// MySQL's parallel applier names only its coordinator there; the worker's
		// error is in performance_schema.
		var code int
		var text string
		err := p.rep.QueryRowContext(ctx, `SELECT LAST_ERROR_NUMBER, LAST_ERROR_MESSAGE
FROM performance_schema.replication_applier_status_by_worker WHERE LAST_ERROR_NUMBER <> 0 LIMIT 1`).Scan(&code, &text)
		if err == nil {
			msg += fmt.Sprintf("; worker: error %d: %s", code, text)
		}
	}
	return msg
}

// RestartReplica stops the replica's server with a clean shutdown and starts it
// again, as an operator restarting a replica does: its MEMORY tables come back
// empty, and replication goes on from where it stopped. Replica (the DSN: the
// mapped port changes) and the pair's pool to it are renewed.
func (p *ReplicaPair) RestartReplica(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn, err := p.repRestart(ctx, false)
	if err != nil {
		t.Fatalf("testdb: restarting the replica: %v", err)
	}
	p.rep.Close()
	p.Replica, p.rep = dsn, p.openPool(t, dsn)
}
