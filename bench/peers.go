package main

// The peer libraries, compared in the same run: cirello.io/pglock on PostgreSQL (over
// lib/pq, the driver it checks for, and over pgx through UnsafeNew) and
// github.com/sanketplus/go-mysql-lock on MySQL.
//
// They are in the default build, at the versions the Go module proxy served when
// they were added (pglock v1.16.1, go-mysql-lock v0.0.7; @latest was refused).
//
// The code follows the libraries' published APIs (pglock: New, UnsafeNew,
// TryCreateTable, AcquireContext, ReleaseContext; go-mysql-lock: NewMysqlLocker,
// ObtainContext, ObtainTimeoutContext, Lock.Release). Both are used with their
// default options: pglock's default lease (20 s) is also how long a client that
// finds the lock taken waits before it tries again, which dominates its contended
// figures.

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"strings"
	"time"

	pglock "cirello.io/pglock"
	"github.com/lib/pq"
	gomysqllock "github.com/sanketplus/go-mysql-lock"

	"github.com/sqllock/sqllock"
)

func init() {
	peerCells = func(d sqllock.Dialect) []cell {
		if d == sqllock.Postgres {
			rowCells := []string{"uniqueindex", "optimistic", "fairqueue"}
			return []cell{
				{name: "pglock (lib/pq)", raw: "raw uniqueindex", pool: openLibPQ, open: openPglock(true)},
				// Listed second: x peer of the row strategies is taken to pglock over pgx,
				// the same driver as theirs.
				{name: "pglock (pgx)", raw: "raw uniqueindex", peerOf: rowCells, open: openPglock(false)},
			}
		}
		return []cell{{name: "go-mysql-lock", raw: "raw advisory",
			peerOf: []string{"advisory", "advisory WithoutToken"}, open: openGoMySQLLock}}
	}
}

// openPglock makes a pglock client over db: with libpq, a lib/pq pool (openLibPQ),
// since pglock.New accepts only lib/pq; otherwise pgx, through UnsafeNew.
func openPglock(libpq bool) func(context.Context, *sql.DB, sqllock.Dialect) (client, error) {
	return func(ctx context.Context, db *sql.DB, _ sqllock.Dialect) (client, error) {
		var c *pglock.Client
		var err error
		if libpq {
			c, err = pglock.New(db)
		} else {
			c, err = pglock.UnsafeNew(db)
		}
		if err != nil {
			return nil, err
		}
		if err := c.TryCreateTable(); err != nil {
			return nil, err
		}
		return funcClient{
			lockFn: func(ctx context.Context, name string) (func(context.Context) error, error) {
				l, err := c.AcquireContext(ctx, name)
				if err != nil {
					return nil, err
				}
				return func(ctx context.Context) error { return c.ReleaseContext(ctx, l) }, nil
			},
			closeFn: func() error { return nil },
		}, nil
	}
}

// openGoMySQLLock: Obtain (GET_LOCK with timeout -1) fails on MariaDB, which refuses a
// negative timeout; there the timeout form is used with an hour.
func openGoMySQLLock(ctx context.Context, db *sql.DB, _ sqllock.Dialect) (client, error) {
	var v string
	if err := db.QueryRowContext(ctx, "SELECT version()").Scan(&v); err != nil {
		return nil, err
	}
	mariadb := strings.Contains(v, "MariaDB")
	l := gomysqllock.NewMysqlLocker(db)
	return funcClient{
		lockFn: func(ctx context.Context, name string) (func(context.Context) error, error) {
			key := fmt.Sprintf("bench:%x", fnv64(name)) // at most 64 characters
			var lk *gomysqllock.Lock
			var err error
			if mariadb {
				lk, err = l.ObtainTimeoutContext(ctx, key, 3600)
			} else {
				lk, err = l.ObtainContext(ctx, key)
			}
			if err != nil {
				return nil, err
			}
			return func(context.Context) error { return lk.Release() }, nil
		},
		closeFn: func() error { return nil },
	}, nil
}

// openLibPQ opens a lib/pq pool to the bench database of t that counts into wc.
func openLibPQ(t *target, wc *wireCount) (*sql.DB, error) {
	c := t.pg
	dsn := fmt.Sprintf("host=%s port=%d user=%s password='%s' dbname=%s sslmode=disable",
		c.Host, c.Port, c.User, strings.ReplaceAll(c.Password, "'", `\'`), c.Database)
	conn, err := pq.NewConnector(dsn)
	if err != nil {
		return nil, err
	}
	conn.Dialer(pqDialer{countingDialer(wc, func() parser { return &pgParser{} })})
	return sql.OpenDB(conn), nil
}

// pqDialer adapts a dial function to lib/pq's Dialer and DialerContext.
type pqDialer struct {
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

func (d pqDialer) Dial(network, addr string) (net.Conn, error) {
	return d.dial(context.Background(), network, addr)
}

func (d pqDialer) DialTimeout(network, addr string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.dial(ctx, network, addr)
}

func (d pqDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	return d.dial(ctx, network, addr)
}
