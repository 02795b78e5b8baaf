// Command sqllock is the operator's tool for the tables of github.com/sqllock/sqllock:
// apply migrations, see who holds which lease, and force a stuck lease free.
//
// Usage:
//
//	sqllock [-dsn DSN] migrate up|down|version
//	sqllock [-dsn DSN] status [--json] [--watch[=2s]] [-name NAME]... [-namespace NS]
//	sqllock [-dsn DSN] force-release [-now] NAME
//	sqllock [-dsn DSN] demo [-strategy S] [-replicas 3] [-duration 10s] [-job 200ms] [--no-tty]
//
// The DSN comes from -dsn or the environment variable SQLLOCK_DSN: a PostgreSQL URL
// or key=value string (postgres://user@host/db) for pgx, otherwise a go-sql-driver
// DSN (user:pass@tcp(host:3306)/db). The dialect is asked from the server.
//
// status lists the held locks of every strategy with their holders and waiters:
// uniqueindex lease rows and optimistic rows (holder host and pid, token, time left by
// the database clock; their waiters wait in their own processes, unseen), fairqueue
// tickets (the lowest holds, the others wait in ticket order), forupdate row locks
// (the holding transaction's session, and the sessions waiting for the row) and
// advisory locks (pg_locks with pg_stat_activity; performance_schema.metadata_locks
// on MySQL; on MariaDB METADATA_LOCK_INFO if installed, else IS_USED_LOCK on the names
// it knows, with waiters from the processlist). Advisory keys are hashes: status maps
// them back to names by hashing every name recorded in the library's tables and those
// given with -name (advisory locks record no name: their tokens are not per name), and says "unknown
// name" otherwise. What the server does not let it see is said in notes (on MariaDB,
// InnoDB shows a forupdate row lock only while someone waits for it).
//
// status --json prints one JSON document, a list of locks:
//
//	[{"strategy": "uniqueindex|optimistic|fairqueue|forupdate|advisory",
//	  "name": "jobs/x" or null (unknown name),
//	  "key": hex SHA-256 of the name (row strategies), "pg:K1:K2" or "pg:bigint:K"
//	         (PostgreSQL advisory), "sqllock:<hex>" (MySQL advisory),
//	  "holder": PARTY or null,
//	  "token": the holder's fencing token where the server shows it, or null,
//	  "since": acquisition time (RFC 3339, database clock, UTC) or null,
//	  "expires_in": seconds left of a row lease (<= 0: expired) or null,
//	  "waiters": [PARTY, ...] in queue order where known,
//	  "note": what could not be seen about this lock, or ""}]
//	PARTY: {"host", "pid" (client process, where recorded), "session" (backend pid,
//	        connection id), "application", "state", "ticket" (fairqueue waiters),
//	        "since" (waiting since)}, each null when unknown.
//
// Notes about the server go to standard error. --watch refreshes every interval
// (clearing the screen on a terminal, separating snapshots with "---" otherwise)
// until interrupted.
//
// demo runs replicas (goroutines, each with its own pool and Locker) that compete
// for one scheduled job lock with the strategy of -strategy, and prints who holds it,
// the token, the waiters and the hand-offs: a redrawn view on a terminal, plain
// lines (t=1.23s replica=2 acquired token=17 waiters=2; handoff from=1 to=3
// after=1.2ms) with --no-tty or when stdout is not one, and a summary line
// (demo: N hand-offs, tokens increasing: yes, overlaps: 0). It keeps its own account
// of who holds the lock and exits non-zero if two replicas held it at once or a
// token did not increase. Without -dsn or SQLLOCK_DSN it starts PostgreSQL in a
// container with testcontainers (Docker), and says so; it migrates the database.
//
// force-release revokes a lease: its holder's next renewal fails, so the holder
// reports ErrLost within one keep-alive interval, and the row stays until its
// current expiry, which lies after the holder's local deadline: nobody else can
// acquire the lock before the holder was told. force-release -now deletes the row
// instead: waiters may take the lock at once, while the holder learns of it only at
// its next renewal (two holders meanwhile) — for a holder known to be dead.
//
// Session locks (advisory) and row locks (forupdate) belong to live sessions: end
// those with pg_terminate_backend or KILL; the holder is told within one keep-alive
// interval, after the lock may already have been granted to another client.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"unicode/utf8"

	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/migrations"
	"github.com/sqllock/sqllock/uniqueindex"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case errors.Is(err, errHelp):
	case errors.Is(err, errUsage):
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "sqllock:", err)
		os.Exit(1)
	}
}

const usage = `usage:
  sqllock [-dsn DSN] migrate up|down|version
  sqllock [-dsn DSN] status [--json] [--watch[=2s]] [-name NAME]... [-namespace NS]
  sqllock [-dsn DSN] force-release [-now] NAME
  sqllock [-dsn DSN] demo [-strategy S] [-replicas 3] [-duration 10s] [-job 200ms] [--no-tty]
The DSN comes from -dsn or SQLLOCK_DSN.
status --json prints a list of {strategy, name (null: unknown), key, holder, token,
since, expires_in (s), waiters, note}; holder and waiters are {host, pid, session,
application, state, ticket, since}; unknown values are null (see go doc).`

var errUsage = errors.New("bad usage")

// errHelp: the usage was asked for (-h) and printed; exit 0.
var errHelp = errors.New("help")

// parseErr is the error of a failed flag.Parse, which printed the usage already.
func parseErr(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return errHelp
	}
	return errUsage
}

// driverFor picks the database/sql driver of a DSN by its form.
func driverFor(dsn string) string {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") || strings.Contains(dsn, "host=") {
		return "pgx"
	}
	return "mysql"
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("sqllock", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dsn := fs.String("dsn", os.Getenv("SQLLOCK_DSN"), "database DSN (default $SQLLOCK_DSN)")
	fs.Usage = func() { fmt.Fprintln(stderr, usage) }
	if err := fs.Parse(args); err != nil {
		return parseErr(err)
	}
	rest := fs.Args()
	if len(rest) > 0 && rest[0] == "demo" {
		return demo(ctx, rest[1:], *dsn, stdout, stderr)
	}
	if len(rest) == 0 || *dsn == "" {
		fs.Usage()
		return errUsage
	}
	db, err := sql.Open(driverFor(*dsn), *dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	d, err := sqllock.DetectDialect(ctx, db)
	if err != nil {
		return err
	}
	switch {
	case rest[0] == "migrate" && len(rest) == 2:
		return migrate(ctx, db, d, rest[1], stdout)
	case rest[0] == "status":
		return statusCmd(ctx, db, d, rest[1:], stdout, stderr)
	case rest[0] == "force-release" && len(rest) == 2:
		return forceRelease(ctx, db, d, rest[1], false, stdout)
	case rest[0] == "force-release" && len(rest) == 3 && (rest[1] == "-now" || rest[1] == "--now"):
		return forceRelease(ctx, db, d, rest[2], true, stdout)
	}
	fs.Usage()
	return errUsage
}

func migrate(ctx context.Context, db *sql.DB, d sqllock.Dialect, what string, out io.Writer) error {
	switch what {
	case "up":
		if err := migrations.Up(ctx, db, d); err != nil {
			return err
		}
	case "down":
		if err := migrations.Down(ctx, db, d); err != nil {
			return err
		}
	case "version":
	default:
		return errUsage
	}
	v, dirty, err := migrations.Version(ctx, db, d)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%s schema version %d", d, v)
	if dirty {
		fmt.Fprint(out, " (dirty: a migration failed half-way)")
	}
	fmt.Fprintln(out)
	return nil
}

// display shows a name as it is when it is printable UTF-8, quoted otherwise.
func display(name string) string {
	for _, r := range name {
		if r == utf8.RuneError || !strconv.IsPrint(r) {
			return strconv.Quote(name)
		}
	}
	return name
}

func forceRelease(ctx context.Context, db *sql.DB, d sqllock.Dialect, name string, now bool, out io.Writer) error {
	err := uniqueindex.ForceRelease(ctx, db, d, name, now)
	if errors.Is(err, sqllock.ErrNotHeld) {
		return fmt.Errorf("no live lease named %s", display(name))
	}
	if err != nil {
		return err
	}
	if now {
		fmt.Fprintf(out, "released %s now (its holder may still run until its next renewal)\n", display(name))
	} else {
		fmt.Fprintf(out, "revoked %s: its holder is told at its next renewal; the lock is free when the lease expires\n", display(name))
	}
	return nil
}
