package testdb

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"time"

	_ "github.com/go-sql-driver/mysql" // "mysql" driver for the readiness check
	_ "github.com/jackc/pgx/v5/stdlib" // "pgx" driver for the readiness check
	"github.com/moby/moby/api/types/network"
	"github.com/moby/moby/client"
	"github.com/testcontainers/testcontainers-go"
	tcmysql "github.com/testcontainers/testcontainers-go/modules/mysql"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
	"github.com/testcontainers/testcontainers-go/wait"
)

// Credentials of the containers started here.
const (
	containerUser     = "postgres" // PostgreSQL superuser; MySQL uses root
	containerPassword = "sqllock"
	containerDatabase = "test"

	// startupTimeout bounds a container start (and a restart) until it serves SQL
	// on its mapped port. Generous: CI runs many packages at once on 2 cores.
	startupTimeout = 3 * time.Minute
	// stopTimeout is how long a restart waits for a clean shutdown before the
	// engine kills the server (PostgreSQL images stop with SIGINT, a fast shutdown).
	stopTimeout = 30 * time.Second
)

// startPostgres starts a PostgreSQL container from image and returns a DSN for pgx's
// stdlib driver ("postgres://user:pass@host:port/db?sslmode=disable"), a stop func
// that terminates it, and a restart func that stops and starts the SAME container
// (data kept) and returns the new DSN (the mapped port may change).
//
// Works with the official postgres images and with the CI's sqllock-ci/postgres.
// Ready means: the log line the official image prints twice on a first start (a
// restart finds both in the old log), the port listening, and a "SELECT 1" through
// the mapped port; the last also holds after a restart, since the container's
// wait strategy runs again on every start.
func startPostgres(ctx context.Context, image string) (dsn string, restart func(ctx context.Context, kill bool) (string, error), stop func(context.Context) error, err error) {
	pgDSN := func(host, port string) string {
		u := url.URL{
			Scheme:   "postgres",
			User:     url.UserPassword(containerUser, containerPassword),
			Host:     net.JoinHostPort(host, port),
			Path:     "/" + containerDatabase,
			RawQuery: "sslmode=disable",
		}
		return u.String()
	}
	ctr, err := tcpostgres.Run(ctx, image,
		tcpostgres.WithUsername(containerUser),
		tcpostgres.WithPassword(containerPassword),
		tcpostgres.WithDatabase(containerDatabase),
		testcontainers.WithWaitStrategyAndDeadline(startupTimeout,
			wait.ForLog("database system is ready to accept connections").
				WithOccurrence(2).WithStartupTimeout(startupTimeout),
			wait.ForListeningPort("5432/tcp").WithStartupTimeout(startupTimeout),
			wait.ForSQL("5432/tcp", "pgx", func(host string, port network.Port) string {
				return pgDSN(host, port.Port()) + "&connect_timeout=5"
			}).WithStartupTimeout(startupTimeout),
		),
	)
	if err != nil {
		var c testcontainers.Container
		if ctr != nil { // a typed nil must not become a non-nil interface
			c = ctr
		}
		return "", nil, nil, startFailed("postgres", image, c, err)
	}
	current := func(ctx context.Context) (string, error) {
		host, port, err := endpoint(ctx, ctr, "5432/tcp")
		if err != nil {
			return "", err
		}
		return pgDSN(host, port), nil
	}
	return finish(ctx, "postgres", image, ctr, current)
}

// startMySQL starts a MySQL or MariaDB container from image and returns a DSN in
// go-sql-driver format "root:pass@tcp(host:port)/test" (no query parameters), a stop
// func that terminates it, and a restart func that stops and starts the SAME
// container (data kept) and returns the new DSN. It connects as root (the tests need
// KILL and the process list).
//
// Works with the official mysql and mariadb images and with the CI's
// sqllock-ci/mariadb (MariaDB 10.11, 11.8) and sqllock-ci/mysql (Oracle MySQL 9.7
// from Debian). The mysql module's own wait (the log line "port: 3306  MySQL
// Community Server") is replaced: MariaDB never prints it, and Debian's MySQL
// build prints "port: 3306  (Debian)". Ready means the port listening and a
// "SELECT 1" through the mapped port. All these images initialise with a server
// on the Unix socket only, so the check cannot succeed before the real server
// runs. MySQL 9's caching_sha2_password works over TCP without DSN changes.
func startMySQL(ctx context.Context, image string) (dsn string, restart func(ctx context.Context, kill bool) (string, error), stop func(context.Context) error, err error) {
	ctr, current, err := runMySQL(ctx, image)
	if err != nil {
		return "", nil, nil, err
	}
	return finish(ctx, "mysql", image, ctr, current)
}

// runMySQL starts a MySQL or MariaDB container from image (opts: more
// customizers, such as the server's options) and returns it with the function that
// tells its DSN.
func runMySQL(ctx context.Context, image string, opts ...testcontainers.ContainerCustomizer) (testcontainers.Container, func(context.Context) (string, error), error) {
	myDSN := func(host, port string) string {
		return fmt.Sprintf("root:%s@tcp(%s)/%s", containerPassword, net.JoinHostPort(host, port), containerDatabase)
	}
	ctr, err := tcmysql.Run(ctx, image, append([]testcontainers.ContainerCustomizer{
		tcmysql.WithUsername("root"),
		tcmysql.WithPassword(containerPassword),
		tcmysql.WithDatabase(containerDatabase),
		testcontainers.WithWaitStrategyAndDeadline(startupTimeout,
			wait.ForListeningPort("3306/tcp").WithStartupTimeout(startupTimeout),
			wait.ForSQL("3306/tcp", "mysql", func(host string, port network.Port) string {
				return myDSN(host, port.Port()) + "?timeout=5s"
			}).WithStartupTimeout(startupTimeout),
		),
	}, opts...)...)
	if err != nil {
		var c testcontainers.Container
		if ctr != nil { // a typed nil must not become a non-nil interface
			c = ctr
		}
		return nil, nil, startFailed("mysql", image, c, err)
	}
	current := func(ctx context.Context) (string, error) {
		host, port, err := endpoint(ctx, ctr, "3306/tcp")
		if err != nil {
			return "", err
		}
		return myDSN(host, port), nil
	}
	return ctr, current, nil
}

// endpoint returns the host and the mapped host port of the container's port.
func endpoint(ctx context.Context, ctr testcontainers.Container, port string) (string, string, error) {
	host, err := ctr.Host(ctx)
	if err != nil {
		return "", "", fmt.Errorf("container host: %w", err)
	}
	mapped, err := ctr.MappedPort(ctx, port)
	if err != nil {
		return "", "", fmt.Errorf("mapped port %s: %w", port, err)
	}
	return host, mapped.Port(), nil
}

// finish builds the results shared by both start functions.
func finish(ctx context.Context, kind, image string, ctr testcontainers.Container,
	current func(context.Context) (string, error),
) (string, func(context.Context, bool) (string, error), func(context.Context) error, error) {
	dsn, err := current(ctx)
	if err != nil {
		return "", nil, nil, errors.Join(fmt.Errorf("%s container from %s: %w", kind, image, err), terminate(ctr))
	}
	stop := func(ctx context.Context) error {
		if err := ctr.Terminate(ctx); err != nil {
			return fmt.Errorf("terminate %s container: %w", kind, err)
		}
		return nil
	}
	return dsn, restarter(kind, ctr, current), stop, nil
}

// restarter returns the restart func of a container: it stops the container (with
// kill, SIGKILL at once: a crash) and starts it again, and returns the DSN of the
// started server (its mapped port changes).
func restarter(kind string, ctr testcontainers.Container, current func(context.Context) (string, error)) func(context.Context, bool) (string, error) {
	return func(ctx context.Context, kill bool) (string, error) {
		if kill {
			// SIGKILL to the container at once, no stop signal first: a crash.
			cli, err := testcontainers.NewDockerClientWithOpts(ctx)
			if err != nil {
				return "", fmt.Errorf("crash %s container: %w", kind, err)
			}
			_, err = cli.ContainerKill(ctx, ctr.GetContainerID(), client.ContainerKillOptions{Signal: "KILL"})
			cli.Close()
			if err != nil {
				return "", fmt.Errorf("crash %s container: kill: %w", kind, err)
			}
			if err := waitExited(ctx, ctr); err != nil {
				return "", fmt.Errorf("crash %s container: %w", kind, err)
			}
		} else {
			timeout := stopTimeout
			if err := ctr.Stop(ctx, &timeout); err != nil {
				return "", fmt.Errorf("restart %s container: stop: %w", kind, err)
			}
		}
		// Start runs the wait strategy again: the server answers SQL on return.
		if err := ctr.Start(ctx); err != nil {
			return "", fmt.Errorf("restart %s container: start: %w", kind, err)
		}
		return current(ctx)
	}
}

// startFailed wraps a start error and removes whatever was created.
func startFailed(kind, image string, ctr testcontainers.Container, err error) error {
	err = fmt.Errorf("start %s container from %s: %w", kind, image, err)
	if ctr == nil {
		return err
	}
	return errors.Join(err, terminate(ctr))
}

// terminate removes a container that will not be handed out, with its own deadline
// (the caller's context may be what expired).
func terminate(ctr testcontainers.Container) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := ctr.Terminate(ctx); err != nil {
		return fmt.Errorf("terminate: %w", err)
	}
	return nil
}

// waitExited waits until the container's state says it is no longer running.
func waitExited(ctx context.Context, ctr testcontainers.Container) error {
	for {
		st, err := ctr.State(ctx)
		if err != nil {
			return err
		}
		if !st.Running {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
