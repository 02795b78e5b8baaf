//go:build ha

package ha_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/advisory"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/forupdate"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/migrations"
	"github.com/sqllock/sqllock/optimistic"
	"github.com/sqllock/sqllock/testdb/ha"
	"github.com/sqllock/sqllock/uniqueindex"
)

// lockerOpts are the options of a Locker built by newLocker.
type lockerOpts struct {
	// singleWriter: advisory and forupdate with WithGaleraSingleWriter (the user's
	// promise that every client reaches one Galera node).
	singleWriter bool
	// requireSync: the row strategies with WithRequireSyncReplication.
	requireSync bool
	// logger, if set, is passed with the strategy's WithLogger.
	logger *slog.Logger
	// ttl, if set, is passed with the strategy's WithTTL.
	ttl time.Duration
	// poll, if set, is passed to the row strategies with WithPollInterval.
	poll time.Duration
	// noToken: advisory and forupdate with WithoutToken.
	noToken bool
}

// closer is what the Lockers of this module have to stop their background work.
type closer interface{ Close() error }

// optionSet names a strategy's option constructors; a nil one is not offered by the
// strategy (or not used here).
type optionSet[O any] struct {
	singleWriter, requireSync func() O
	logger                    func(*slog.Logger) O
	ttl, poll                 func(time.Duration) O
	noToken                   func() O
}

// build returns the options o asks for.
func (s optionSet[O]) build(o lockerOpts) []O {
	var opts []O
	add := func(want bool, f func() O) {
		if want && f != nil {
			opts = append(opts, f())
		}
	}
	add(o.singleWriter, s.singleWriter)
	add(o.requireSync, s.requireSync)
	add(o.logger != nil && s.logger != nil, func() O { return s.logger(o.logger) })
	add(o.ttl != 0 && s.ttl != nil, func() O { return s.ttl(o.ttl) })
	add(o.poll != 0 && s.poll != nil, func() O { return s.poll(o.poll) })
	add(o.noToken, s.noToken)
	return opts
}

// newLocker builds a Locker of strategy ("uniqueindex", "optimistic", "fairqueue",
// "forupdate", "advisory") on db with the strategy's public options only.
func newLocker(strategy string, db *sql.DB, d sqllock.Dialect, o lockerOpts) (sqllock.Locker, error) {
	switch strategy {
	case "uniqueindex":
		return uniqueindex.New(db, d, optionSet[uniqueindex.Option]{nil, uniqueindex.WithRequireSyncReplication,
			uniqueindex.WithLogger, uniqueindex.WithTTL, uniqueindex.WithPollInterval, nil}.build(o)...)
	case "optimistic":
		return optimistic.New(db, d, optionSet[optimistic.Option]{nil, optimistic.WithRequireSyncReplication,
			optimistic.WithLogger, optimistic.WithTTL, optimistic.WithPollInterval, nil}.build(o)...)
	case "fairqueue":
		return fairqueue.New(db, d, optionSet[fairqueue.Option]{nil, fairqueue.WithRequireSyncReplication,
			fairqueue.WithLogger, fairqueue.WithTTL, fairqueue.WithPollInterval, nil}.build(o)...)
	case "forupdate":
		return forupdate.New(db, d, optionSet[forupdate.Option]{forupdate.WithGaleraSingleWriter, forupdate.WithRequireSyncReplication,
			forupdate.WithLogger, forupdate.WithTTL, nil, forupdate.WithoutToken}.build(o)...)
	case "advisory":
		return advisory.New(db, d, optionSet[advisory.Option]{advisory.WithGaleraSingleWriter, advisory.WithRequireSyncReplication,
			advisory.WithLogger, advisory.WithTTL, nil, advisory.WithoutToken}.build(o)...)
	}
	return nil, fmt.Errorf("unknown strategy %q", strategy)
}

// mustLocker is newLocker for a test: the Locker is closed when the test ends.
func mustLocker(t testing.TB, strategy string, db *sql.DB, d sqllock.Dialect, o lockerOpts) sqllock.Locker {
	t.Helper()
	l, err := newLocker(strategy, db, d, o)
	if err != nil {
		t.Fatalf("%s.New: %v", strategy, err)
	}
	if c, ok := l.(closer); ok {
		t.Cleanup(func() { c.Close() })
	}
	return l
}

// isRefusal reports whether err is a refusal of the deployment: it must match both
// ErrUnsafeDeployment and ErrInvalidOption.
func isRefusal(err error) bool {
	return errors.Is(err, sqllock.ErrUnsafeDeployment) && errors.Is(err, sqllock.ErrInvalidOption)
}

// errKind names the kind of an error for the counts of the logs.
func errKind(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, sqllock.ErrUnsafeDeployment):
		return "refused"
	case errors.Is(err, sqllock.ErrLost):
		return "lost"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, sqllock.ErrNotAcquired):
		return "notacquired"
	case errors.Is(err, sqllock.ErrNotHeld):
		return "notheld"
	}
	var se *sqllock.Error
	if errors.As(err, &se) && se.Kind == nil {
		return "bare" // an error of the library with no sentinel kind
	}
	return "other"
}

// asyncWarnings counts the warnings a Locker logs about asynchronous replication
// (or, if match is set, those whose message contains match).
type asyncWarnings struct {
	match string
	n     atomic.Int64
	mu    sync.Mutex
	msgs  []string
}

func (w *asyncWarnings) logger() *slog.Logger { return slog.New(warnHandler{w}) }

func (w *asyncWarnings) count() int64 { return w.n.Load() }

func (w *asyncWarnings) messages() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.msgs...)
}

type warnHandler struct{ w *asyncWarnings }

func (h warnHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h warnHandler) Handle(_ context.Context, r slog.Record) error {
	match := h.w.match
	if match == "" {
		match = "asynchronous"
	}
	if r.Level >= slog.LevelWarn && strings.Contains(r.Message, match) {
		h.w.n.Add(1)
		h.w.mu.Lock()
		h.w.msgs = append(h.w.msgs, r.Message)
		h.w.mu.Unlock()
	}
	return nil
}

func (h warnHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h warnHandler) WithGroup(string) slog.Handler      { return h }

// ctxFor returns a context that ends after d or when the test ends.
func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// withParam returns the URL DSN dsn with the query parameter key set to value, or
// removed when value is "".
func withParam(t testing.TB, dsn, key, value string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("parse DSN: %v", err)
	}
	q := u.Query()
	if value == "" {
		q.Del(key)
	} else {
		q.Set(key, value)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// migrated records the databases already migrated in this binary: PostgreSQL
// servers by system identifier and start time (a ResetPostgres starts new ones; a
// promoted standby, already migrated through replication, is migrated again, which
// changes nothing), the Galera cluster as "galera".
var (
	migratedMu sync.Mutex
	migrated   = map[string]bool{}
)

// migrate applies the library's migrations and creates the hammer's counter table on
// db (of dialect d) once per database.
func migrate(t testing.TB, db *sql.DB, d sqllock.Dialect) {
	t.Helper()
	ctx := ctxFor(t, 2*time.Minute)
	var key string
	if d == sqllock.MySQL {
		// Galera is migrated through node 1, a Group Replication group through member
		// 1: the server's address tells them apart, and on Oracle MySQL its uuid a
		// server made afresh at the same address (ResetPair). MariaDB has no
		// server_uuid (error 1193); its lab servers are never made afresh.
		err := db.QueryRowContext(ctx, "SELECT CONCAT(@@hostname, ':', @@port, '/', @@server_uuid)").Scan(&key)
		if sqlerr.IsCode(err, "1193") {
			err = db.QueryRowContext(ctx, "SELECT CONCAT(@@hostname, ':', @@port)").Scan(&key)
		}
		if err != nil {
			t.Fatalf("server address: %v", err)
		}
	} else {
		// The lab may build a new pair from a copy of one data directory (same system
		// identifier): the postmaster's start time tells the servers apart.
		if err := db.QueryRowContext(ctx,
			"SELECT system_identifier::text || '@' || pg_postmaster_start_time()::text FROM pg_control_system()").Scan(&key); err != nil {
			t.Fatalf("pg_control_system: %v", err)
		}
	}
	migratedMu.Lock()
	defer migratedMu.Unlock()
	if migrated[key] {
		return
	}
	if err := migrations.Up(ctx, db, d); err != nil {
		t.Fatalf("migrations.Up (%v): %v", d, err)
	}
	ddl := "CREATE TABLE IF NOT EXISTS ha_counter (k text PRIMARY KEY, n bigint NOT NULL)"
	if d == sqllock.MySQL {
		ddl = "CREATE TABLE IF NOT EXISTS ha_counter (k varchar(191) PRIMARY KEY, n bigint NOT NULL)"
	}
	if _, err := db.ExecContext(ctx, ddl); err != nil {
		t.Fatalf("create ha_counter: %v", err)
	}
	migrated[key] = true
}

// pgPair describes the lab's PostgreSQL pair as the primary reports it.
type pgPair struct {
	syncStreaming, streaming int
	names                    string
}

func readPair(ctx context.Context, db *sql.DB) (pgPair, error) {
	var p pgPair
	err := db.QueryRowContext(ctx, `SELECT
  (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'),
  (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'),
  current_setting('synchronous_standby_names')`).Scan(&p.syncStreaming, &p.streaming, &p.names)
	return p, err
}

// postgresPair makes sure the lab's PostgreSQL pair replicates in mode ("sync" or
// "async") and returns a pool on the migrated primary. With fresh set it always
// builds a new pair (ResetPostgres); otherwise only when the pair is not in the mode.
func postgresPair(t *testing.T, lab *ha.Lab, mode string, fresh bool) *sql.DB {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	if !fresh {
		db := lab.Open(t, "pgx", lab.PrimaryDSN())
		p, err := readPair(ctx, db)
		ok := err == nil && (mode == "sync" && p.syncStreaming == 1 && p.names != "" ||
			mode == "async" && p.streaming == 1 && p.syncStreaming == 0)
		if ok {
			migrate(t, db, sqllock.Postgres)
			return db
		}
		db.Close()
		t.Logf("PostgreSQL pair not in %s mode (%+v, %v): reset", mode, p, err)
	}
	lab.ResetPostgres(t, mode)
	db := lab.Open(t, "pgx", lab.PrimaryDSN())
	migrate(t, db, sqllock.Postgres)
	waitReplayed(t, db)
	return db
}

// waitReplayed waits until the standby has replayed everything the primary wrote so
// far (pg_stat_replication.replay_lsn), so that a promotion keeps it.
func waitReplayed(t testing.TB, primary *sql.DB) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	var lsn string
	if err := primary.QueryRowContext(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
		t.Fatalf("pg_current_wal_lsn: %v", err)
	}
	for {
		var n int
		err := primary.QueryRowContext(ctx,
			"SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND replay_lsn >= $1::pg_lsn", lsn).Scan(&n)
		if err == nil && n > 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the standby did not replay up to %s: %v", lsn, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// galera returns a pool on Galera node n, the cluster migrated.
func galera(t testing.TB, lab *ha.Lab, n int) *sql.DB {
	t.Helper()
	migrate(t, lab.Open(t, "mysql", lab.GaleraDSN(1)), sqllock.MySQL)
	return lab.Open(t, "mysql", lab.GaleraDSN(n))
}

// openGroupMember returns a pool on Group Replication member n, the group migrated
// (through member 1).
func openGroupMember(t testing.TB, l *ha.MySQLLab, n int) *sql.DB {
	t.Helper()
	migrate(t, ha.Open(t, "mysql", l.GroupDSN(1)), sqllock.MySQL)
	return ha.Open(t, "mysql", l.GroupDSN(n))
}
