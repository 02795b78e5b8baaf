// Package deploy checks, once per Locker, that the database a strategy was given can
// keep the strategy's promise, and refuses (sqllock.ErrUnsafeDeployment) or warns
// where it cannot:
//
//   - a MariaDB Galera node (wsrep_on): GET_LOCK and row locks are local to the node,
//     not the cluster, so two clients on two nodes both hold "the" lock. The
//     server-local strategies (advisory, forupdate) refuse it unless the user states
//     that every client reaches one writer node (Config.GaleraSingleWriter).
//   - a PostgreSQL primary with asynchronous standbys (pg_stat_replication rows, and
//     no synchronous_standby_names or synchronous_commit off/local): a failover to a
//     standby that missed the latest commits forgets leases and tokens, so a held name
//     is granted again and tokens repeat. Every strategy logs one warning per Locker;
//     with Config.RequireSyncReplication it refuses instead.
//
// The check runs before the first acquisition's own statement (one round trip, once
// per Locker; an error of the probe is returned and the probe runs again next time)
// and its outcome is kept for the Locker's life: a deployment changed later (a
// standby added, wsrep switched) is not noticed until a new Locker is made.
package deploy

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/sqllock/sqllock"
)

// Needs is what a strategy needs from its database.
type Needs struct {
	// OneNode: the strategy's locks live in one server's memory or transactions
	// (advisory, forupdate): refused on a Galera node unless SingleWriter.
	OneNode bool
	// SingleWriter is the user's promise that every client of the lock reaches the
	// same Galera node.
	SingleWriter bool
	// RequireSync refuses a PostgreSQL primary with asynchronous standbys instead of
	// warning.
	RequireSync bool
}

// Guard runs the check of one Locker. The zero value is not usable: use New.
type Guard struct {
	db       *sql.DB
	dialect  sqllock.Dialect
	strategy string
	needs    Needs
	log      *slog.Logger

	mu   sync.Mutex
	done bool
	err  error // the refusal, kept once done
}

// New returns the Guard of a Locker of strategy on db.
func New(db *sql.DB, d sqllock.Dialect, strategy string, needs Needs, log *slog.Logger) *Guard {
	return &Guard{db: db, dialect: d, strategy: strategy, needs: needs, log: log}
}

// Check returns nil if the Locker may acquire, an error matching
// sqllock.ErrUnsafeDeployment if it must refuse, or the probe's own error (the probe
// then runs again on the next call). After the first conclusive answer it sends no
// SQL.
func (g *Guard) Check(ctx context.Context) error {
	if g == nil {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.done {
		return g.err
	}
	var err error
	if g.dialect == sqllock.MySQL {
		err = g.checkGalera(ctx)
	} else {
		err = g.checkReplication(ctx)
	}
	if err != nil && !errors.Is(err, sqllock.ErrUnsafeDeployment) {
		return fmt.Errorf("checking the deployment: %w", err)
	}
	g.done, g.err = true, err
	return err
}

// Refusal returns an error matching sqllock.ErrUnsafeDeployment with reason.
func Refusal(reason string) error { return refusal{reason} }

type refusal struct{ reason string }

func (r refusal) Error() string { return r.reason }
func (refusal) Unwrap() error   { return sqllock.ErrUnsafeDeployment }

// checkGalera reads wsrep_on (absent on Oracle MySQL and on MariaDB built without
// wsrep: not Galera).
func (g *Guard) checkGalera(ctx context.Context) error {
	if !g.needs.OneNode {
		return nil
	}
	var name, value string
	err := g.db.QueryRowContext(ctx, "SHOW GLOBAL VARIABLES LIKE 'wsrep_on'").Scan(&name, &value)
	if errors.Is(err, sql.ErrNoRows) {
		return nil
	}
	if err != nil {
		return err
	}
	if !strings.EqualFold(value, "ON") {
		return nil
	}
	if g.needs.SingleWriter {
		g.log.Info("sqllock: Galera node accepted on the promise that every client of these locks uses this one writer node",
			"strategy", g.strategy)
		return nil
	}
	return Refusal(g.strategy + ": the server is a Galera node (wsrep_on=ON): its locks are local to the node, " +
		"so clients on two nodes would both hold a lock; use uniqueindex, optimistic or fairqueue, " +
		"or WithGaleraSingleWriter() if every client reaches the same writer node")
}

// replicationProbe reads what decides whether a commit survives a failover.
// pg_stat_replication shows unprivileged users its rows (not their details).
const replicationProbe = `SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),
  (SELECT count(*) FROM pg_stat_replication), pg_is_in_recovery()`

// checkReplication warns of (or refuses) asynchronous standbys.
func (g *Guard) checkReplication(ctx context.Context) error {
	var commit, names string
	var standbys int64
	var recovery bool
	if err := g.db.QueryRowContext(ctx, replicationProbe).Scan(&commit, &names, &standbys, &recovery); err != nil {
		return err
	}
	if standbys == 0 || recovery {
		// No standby sees this server's WAL (or it is a standby: writes fail anyway).
		return nil
	}
	var why string
	switch {
	case strings.TrimSpace(names) == "":
		why = fmt.Sprintf("%d standby(s) replicate asynchronously (synchronous_standby_names is empty)", standbys)
	case commit == "off" || commit == "local":
		why = fmt.Sprintf("synchronous_commit=%s: commits do not wait for the %d standby(s)", commit, standbys)
	default:
		return nil
	}
	msg := g.strategy + ": PostgreSQL primary with asynchronous replication: " + why +
		"; a failover to a standby that missed the latest commits would grant held locks again and repeat fencing tokens"
	if g.needs.RequireSync {
		return Refusal(msg)
	}
	g.log.Warn("sqllock: "+msg+" (WithRequireSyncReplication refuses instead)", "strategy", g.strategy)
	return nil
}
