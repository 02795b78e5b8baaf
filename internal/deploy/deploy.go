// Package deploy checks, once per Locker, that the database a strategy was given can
// keep the strategy's promise, and refuses (sqllock.ErrUnsafeDeployment) or warns
// where it cannot:
//
//   - a MariaDB Galera node (wsrep_on), or a MySQL Group Replication member in
//     multi-primary mode or a secondary of a single-primary group: GET_LOCK and row
//     locks are local to the node, not the cluster, so two clients on two nodes both
//     hold "the" lock. The server-local strategies (advisory, forupdate) refuse them
//     unless the user states that every client reaches one writer node
//     (Config.GaleraSingleWriter); the primary of a single-primary group is accepted.
//
//   - a PostgreSQL primary with asynchronous standbys (pg_stat_replication rows, and
//     no synchronous_standby_names or synchronous_commit off/local): a failover to a
//     standby that missed the latest commits forgets leases and tokens, so a held name
//     is granted again and tokens repeat. Every strategy logs one warning per Locker;
//     with Config.RequireSyncReplication it refuses instead.
//
//   - a MySQL source whose replicas replicate asynchronously (SHOW REPLICAS lists
//     some, and semi-synchronous replication is off, waits AFTER_COMMIT, or has
//     fallen back to asynchronous): the same failover hazard, warned of or refused as
//     on PostgreSQL.
//
// The check runs before the first acquisition's own statement, once per Locker: one
// round trip on PostgreSQL and on a MySQL server without a binary log, Galera or Group
// Replication; one more to list a MySQL source's replicas, one to read a Group
// Replication member's state, one to read whether semi-synchronous replication is in
// force. A probe cut short by the caller's ctx or a lost connection runs again next
// time; the outcome is kept for the Locker's life: a deployment changed later (a
// standby added, wsrep switched) is not noticed until a new Locker is made.
package deploy

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/sqlerr"
)

// Needs is what a strategy needs from its database.
type Needs struct {
	// OneNode: the strategy's locks live in one server's memory or transactions
	// (advisory, forupdate): refused on a Galera node and on a Group Replication
	// member that is not a single-primary group's primary, unless SingleWriter.
	OneNode bool
	// SingleWriter is the user's promise that every client of the lock reaches the
	// same Galera node or Group Replication member.
	SingleWriter bool
	// RequireSync refuses a PostgreSQL primary with asynchronous standbys, or a MySQL
	// source with asynchronous replicas, instead of warning; and a server where that
	// cannot be told.
	RequireSync bool
	// MemoryTable: the strategy writes a MEMORY table (advisory's tokens on MySQL),
	// which Group Replication refuses (error 3098): refused on any member of a running
	// group, whatever the promise.
	MemoryTable bool
}

// Guard runs the check of one Locker. The zero value is not usable: use New.
type Guard struct {
	db       *sql.DB
	dialect  sqllock.Dialect
	strategy string
	needs    Needs
	log      *slog.Logger

	done atomic.Bool   // set once the answer is kept
	err  error         // the refusal, read once done
	sem  chan struct{} // one probe at a time; waited for with the caller's ctx
}

// New returns the Guard of a Locker of strategy on db.
func New(db *sql.DB, d sqllock.Dialect, strategy string, needs Needs, log *slog.Logger) *Guard {
	return &Guard{db: db, dialect: d, strategy: strategy, needs: needs, log: log, sem: make(chan struct{}, 1)}
}

// Check returns nil if the Locker may acquire, an error matching
// sqllock.ErrUnsafeDeployment if it must refuse, or, if ctx ended or the connection
// failed during the probe, that error (the probe then runs again on the next call).
// A probe the server refuses (no privilege on a view, a server without it) counts as
// an answer: one warning, and the Locker goes on (or, with RequireSync, refuses: it
// cannot tell); two are answered otherwise: a MySQL user who may not list the
// replicas is told so at Info level (most application users may not), and a Group
// Replication member whose state the user may not read is taken for a running
// member. After the answer it sends no SQL. Callers wait for a probe under way
// only as long as their ctx lets them.
func (g *Guard) Check(ctx context.Context) error {
	if g == nil {
		return nil
	}
	if g.done.Load() {
		return g.err
	}
	select {
	case g.sem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-g.sem }()
	if g.done.Load() {
		return g.err
	}
	var err error
	if g.dialect == sqllock.MySQL {
		err = g.checkMySQL(ctx)
	} else {
		err = g.checkReplication(ctx)
	}
	if err != nil && !errors.Is(err, sqllock.ErrUnsafeDeployment) {
		if ctx.Err() != nil || sqlerr.Is(err, sqlerr.SessionLost) || sqlerr.Is(err, sqlerr.Canceled) {
			return fmt.Errorf("checking the deployment: %w", err)
		}
		if g.needs.RequireSync {
			err = Refusal(g.strategy + ": cannot tell whether the standbys or replicas replicate synchronously (WithRequireSyncReplication): " + err.Error())
		} else {
			g.log.Warn("sqllock: could not check the deployment; going on without the check", "strategy", g.strategy, "err", err)
			err = nil
		}
	}
	g.err = err
	g.done.Store(true)
	return err
}

// Refusal returns an error matching sqllock.ErrUnsafeDeployment with reason.
func Refusal(reason string) error { return refusal{reason} }

type refusal struct{ reason string }

func (r refusal) Error() string { return r.reason }
func (refusal) Unwrap() error   { return sqllock.ErrUnsafeDeployment }

// mysqlProbe reads, in one round trip, the variables the MySQL checks need: those
// of the clusters whose locks are local to a node, Galera's wsrep_on (MariaDB built
// with wsrep) and Group Replication's group_replication_single_primary_mode (MySQL
// with the plugin loaded), and super_read_only (on in a single-primary group's
// secondaries); and those of binary log replication: log_bin, and semi-synchronous
// replication's switch, wait point and replica count (MySQL 8.0.26+ names them
// source, MariaDB and older MySQL master; absent where the plugin is not loaded);
// version tells MariaDB.
const mysqlProbe = `SHOW GLOBAL VARIABLES WHERE Variable_name IN ('wsrep_on', 'group_replication_single_primary_mode', 'super_read_only',
  'log_bin', 'version', 'rpl_semi_sync_source_enabled', 'rpl_semi_sync_master_enabled',
  'rpl_semi_sync_source_wait_point', 'rpl_semi_sync_master_wait_point',
  'rpl_semi_sync_source_wait_for_replica_count', 'rpl_semi_sync_master_wait_for_slave_count')`

// memberProbe reads this server's state and role in its Group Replication group
// (OFFLINE when Group Replication is not running).
const memberProbe = "SELECT MEMBER_STATE, MEMBER_ROLE FROM performance_schema.replication_group_members WHERE MEMBER_ID = @@server_uuid"

// checkNodeLocal refuses the clusters in which a server-local lock (GET_LOCK, a row
// lock) held on one node does not exclude a client of another node: a Galera node,
// and a MySQL Group Replication member in multi-primary mode (every member takes
// writes) or a secondary of a single-primary group. The primary of a single-primary
// group is accepted: clients that write all reach it.
func (g *Guard) checkNodeLocal(ctx context.Context, vars map[string]string) error {
	if !g.needs.OneNode && !g.needs.MemoryTable {
		return nil
	}
	accept := func(what string) error {
		g.log.Info("sqllock: "+what+" accepted on the promise that every client of these locks uses this one writer node",
			"strategy", g.strategy)
		return nil
	}
	if g.needs.OneNode && strings.EqualFold(vars["wsrep_on"], "ON") {
		if g.needs.SingleWriter {
			return accept("Galera node")
		}
		return Refusal(g.strategy + ": the server is a Galera node (wsrep_on=ON): its locks are local to the node, " +
			"so clients on two nodes would both hold a lock; use uniqueindex, optimistic or fairqueue, " +
			"or WithGaleraSingleWriter() if every client reaches the same writer node")
	}
	mode, ok := vars["group_replication_single_primary_mode"]
	if !ok {
		return nil
	}
	multi := !strings.EqualFold(mode, "ON")
	var state, role string
	err := g.db.QueryRowContext(ctx, memberProbe).Scan(&state, &role)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		if ctx.Err() != nil || sqlerr.Is(err, sqlerr.SessionLost) || sqlerr.Is(err, sqlerr.Canceled) {
			return err
		}
		// The state cannot be read (no SELECT on
		// performance_schema.replication_group_members): assume the group runs, and
		// tell a single-primary group's secondary by its super_read_only.
		state, role = "unknown (cannot read performance_schema.replication_group_members: "+err.Error()+")", "PRIMARY"
		if !multi && strings.EqualFold(vars["super_read_only"], "ON") {
			role = "SECONDARY"
		}
	case strings.EqualFold(state, "OFFLINE"):
		return nil // Group Replication is not running: a server of its own
	}
	if g.needs.MemoryTable {
		return Refusal(g.strategy + ": the server is a MySQL Group Replication member (state " + state +
			"): fencing tokens are drawn from a MEMORY table (sqllock_runs), to which Group Replication refuses writes; " +
			"use WithoutToken(), or uniqueindex, optimistic or fairqueue, whose tokens are InnoDB rows")
	}
	if !multi && strings.EqualFold(role, "PRIMARY") {
		return nil
	}
	if g.needs.SingleWriter {
		return accept("Group Replication member")
	}
	why := "a member of a multi-primary group (group_replication_single_primary_mode=OFF): every member takes writes"
	if !multi {
		r := strings.ToLower(role)
		if r == "" { // a member in state ERROR has no role
			r = "member"
		}
		why = "a " + r + " of a single-primary group, not its primary"
	}
	return Refusal(g.strategy + ": the server is a MySQL Group Replication member in state " + state + ", " + why +
		"; its locks are local to the member, so clients on two members would both hold a lock; " +
		"use uniqueindex, optimistic or fairqueue, connect to the group's primary in single-primary mode, " +
		"or WithGaleraSingleWriter() if every client reaches the same member")
}

// checkMySQL runs the MySQL checks: node-local locks (checkNodeLocal), then binary
// log replication (checkBinlogReplication).
func (g *Guard) checkMySQL(ctx context.Context) error {
	vars, err := showVariables(ctx, g.db, mysqlProbe)
	if err != nil {
		return err
	}
	if err := g.checkNodeLocal(ctx, vars); err != nil {
		return err
	}
	return g.checkBinlogReplication(ctx, vars)
}

// showVariables runs a SHOW VARIABLES or SHOW STATUS statement and returns its rows,
// names in lower case.
func showVariables(ctx context.Context, db *sql.DB, query string) (map[string]string, error) {
	rows, err := db.QueryContext(ctx, query)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	vars := map[string]string{}
	for rows.Next() {
		var name, value string
		if err := rows.Scan(&name, &value); err != nil {
			return nil, err
		}
		vars[strings.ToLower(name)] = value
	}
	return vars, rows.Err()
}

// checkBinlogReplication warns of (or, with RequireSync, refuses) a source whose
// replicas replicate asynchronously: a failover to a replica that missed the last
// commits forgets leases and repeats tokens, as on PostgreSQL.
//
// Lossless semi-synchronous replication in force is accepted first, from what every
// user may read: enabled, waiting AFTER_SYNC (a replica has the commit before anyone
// sees it), Rpl_semi_sync_*_status ON (not fallen back to asynchronous after a
// timeout) and at least as many semi-synchronous replicas connected
// (Rpl_semi_sync_*_clients) as a commit waits for (the status reads ON from the
// moment it is enabled, before any replica connects). Otherwise the replicas are
// counted with SHOW REPLICAS (SHOW SLAVE HOSTS on MariaDB and before MySQL 8.0.22),
// which needs the REPLICATION SLAVE privilege (MariaDB: REPLICATION MASTER ADMIN):
// without it the check cannot see them and says so once (Info); it refuses under
// RequireSync, except on a Galera node or a server with Group Replication loaded,
// whose own failover does not lose commits. A server without a binary log has no
// replica.
func (g *Guard) checkBinlogReplication(ctx context.Context, vars map[string]string) error {
	if !strings.EqualFold(vars["log_bin"], "ON") {
		return nil // no binary log: no replica
	}
	mariadb := strings.Contains(strings.ToLower(vars["version"]), "mariadb")
	semi, lossless, err := g.semiSync(ctx, vars, mariadb)
	if err != nil || lossless {
		return err
	}
	show := "SHOW REPLICAS"
	if mariadb {
		show = "SHOW SLAVE HOSTS"
	}
	replicas, err := countRows(ctx, g.db, show)
	if err != nil && !mariadb && sqlerr.IsCode(err, "1064") { // before MySQL 8.0.22
		show = "SHOW SLAVE HOSTS"
		replicas, err = countRows(ctx, g.db, show)
	}
	if err != nil {
		if ctx.Err() != nil || sqlerr.Is(err, sqlerr.SessionLost) || sqlerr.Is(err, sqlerr.Canceled) || !sqlerr.IsCode(err, "1227") {
			return err
		}
		_, gr := vars["group_replication_single_primary_mode"]
		cluster := gr || strings.EqualFold(vars["wsrep_on"], "ON")
		if g.needs.RequireSync && !cluster {
			return Refusal(g.strategy + ": cannot tell whether replicas replicate synchronously (WithRequireSyncReplication): " + show + ": " + err.Error())
		}
		g.log.Info("sqllock: cannot see this server's replicas, so a failover to an asynchronous replica is not checked", "strategy", g.strategy, "err", err)
		return nil
	}
	if replicas == 0 {
		return nil
	}
	why := fmt.Sprintf("%d replica(s) listed by %s, %s", replicas, show, semi)
	return g.asynchronous("MySQL source", "replica", why)
}

// semiSync tells whether lossless semi-synchronous replication is in force (see
// checkBinlogReplication) and, if not, why not.
func (g *Guard) semiSync(ctx context.Context, vars map[string]string, mariadb bool) (why string, lossless bool, err error) {
	pre := "rpl_semi_sync_source_"
	if _, ok := vars[pre+"enabled"]; !ok {
		pre = "rpl_semi_sync_master_" // MariaDB, MySQL before 8.0.26
	}
	if !strings.EqualFold(vars[pre+"enabled"], "ON") {
		return "semi-synchronous replication off", false, nil
	}
	if point := vars[pre+"wait_point"]; !strings.EqualFold(point, "AFTER_SYNC") {
		if point == "" {
			point = "AFTER_COMMIT (no wait point: MySQL before 5.7.2)"
		}
		return "semi-synchronous replication waiting " + point + ": other sessions see a commit before a replica has it", false, nil
	}
	statusVar, clientsVar := "Rpl_semi_sync_"+pre[len("rpl_semi_sync_"):]+"status", "Rpl_semi_sync_"+pre[len("rpl_semi_sync_"):]+"clients"
	status, err := showVariables(ctx, g.db, "SHOW GLOBAL STATUS WHERE Variable_name IN ('"+statusVar+"', '"+clientsVar+"')")
	if err != nil {
		return "", false, err
	}
	state, clients := status[strings.ToLower(statusVar)], status[strings.ToLower(clientsVar)]
	need := vars["rpl_semi_sync_source_wait_for_replica_count"]
	if need == "" {
		need = vars["rpl_semi_sync_master_wait_for_slave_count"]
	}
	if need == "" {
		need = "1" // MariaDB waits for one
	}
	n, nerr := strconv.Atoi(clients)
	w, werr := strconv.Atoi(need)
	switch {
	case !strings.EqualFold(state, "ON"):
		return fmt.Sprintf("semi-synchronous replication enabled but not in force (%s=%s: it fell back to asynchronous, no semi-synchronous replica answered in time)", statusVar, state), false, nil
	case nerr != nil || werr != nil || n < w:
		return fmt.Sprintf("semi-synchronous replication enabled but with %s semi-synchronous replica(s) connected (%s) where a commit waits for %s", clients, clientsVar, need), false, nil
	}
	return "", true, nil
}

// countRows runs query and counts its rows.
func countRows(ctx context.Context, db *sql.DB, query string) (int, error) {
	rows, err := db.QueryContext(ctx, query)
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

// replicationProbe reads what decides whether a commit survives a failover: the
// physical WAL senders (a logical sender, for CDC or a subscription, has a database
// in pg_stat_activity and is no standby), and how many of them the server reports
// as synchronous. pg_stat_replication shows unprivileged roles its rows but not their
// details: sync_state is then NULL and the settings decide.
const replicationProbe = `SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),
  count(r.pid), count(r.pid) FILTER (WHERE r.sync_state IN ('sync', 'quorum')), count(r.sync_state), pg_is_in_recovery()
FROM pg_catalog.pg_stat_replication r JOIN pg_catalog.pg_stat_activity a ON a.pid = r.pid AND a.datname IS NULL`

// checkReplication warns of (or refuses) asynchronous standbys.
func (g *Guard) checkReplication(ctx context.Context) error {
	var commit, names string
	var standbys, syncs, visible int64
	var recovery bool
	if err := g.db.QueryRowContext(ctx, replicationProbe).Scan(&commit, &names, &standbys, &syncs, &visible, &recovery); err != nil {
		return err
	}
	if standbys == 0 || recovery {
		// No standby sees this server's WAL (or it is a standby: writes fail anyway).
		return nil
	}
	var why string
	switch {
	case commit == "off" || commit == "local":
		why = fmt.Sprintf("synchronous_commit=%s: commits do not wait for the %d standby(s)", commit, standbys)
	case strings.TrimSpace(names) == "":
		why = fmt.Sprintf("%d standby(s) replicate asynchronously (synchronous_standby_names is empty)", standbys)
	case visible == standbys && syncs == 0:
		why = fmt.Sprintf("none of the %d standby(s) is one synchronous_standby_names names", standbys)
	default:
		return nil
	}
	return g.asynchronous("PostgreSQL primary", "standby", why)
}

// asynchronous refuses (RequireSync) or warns once of server, whose copies (standby,
// replica) replicate asynchronously for the reason why.
func (g *Guard) asynchronous(server, copy, why string) error {
	msg := g.strategy + ": " + server + " with asynchronous replication: " + why +
		"; a failover to a " + copy + " that missed the latest commits would grant held locks again and repeat fencing tokens"
	if g.needs.RequireSync {
		return Refusal(msg)
	}
	g.log.Warn("sqllock: "+msg+" (WithRequireSyncReplication refuses instead)", "strategy", g.strategy)
	return nil
}
