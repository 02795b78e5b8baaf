// Package ha gives tests the HA lab: a 3-node MariaDB Galera cluster, a PostgreSQL 15
// primary with a streaming standby (synchronous or asynchronous) and pgbouncer in
// front of the primary in transaction mode and in session mode, all from Debian
// bookworm packages, and the controls that break them (kill the primary, promote the
// standby, stop or cut off the standby).
//
// Where the lab runs:
//
//   - By default in one container of image SQLLOCK_TEST_HA_IMAGE (default
//     DefaultImage, built by `.ci/images/build.sh ha:bookworm`) started with
//     testcontainers-go, one per test binary, terminated by Main. The DSNs name the
//     ports the engine mapped on its host.
//   - With SQLLOCK_TEST_HA=local, on this host (root): the repository's
//     .ci/images/ha/files/usr/local/bin/ha-lab starts the servers on 127.0.0.1
//     (data under /opt/sqllock-ha) and leaves them running for the next run
//     (`ha-lab down` stops them).
//
// Every server has the superuser halab (password halab) and the database locktest.
// Servers and ports inside the lab: Galera nodes 1-3 on 3311-3313, PostgreSQL on
// 5441 (primary) and 5442 (standby) until a Promote, pgbouncer on 6441 (transaction
// pooling) and 6442 (session pooling), both pointing at the current primary.
//
// StartMySQL gives tests a second lab, of Oracle MySQL (mysql-lab in
// sqllock-ci/mysql:9.7): a Group Replication group of two members in multi-primary
// mode, and a source with one replica (asynchronous or semi-synchronous).
//
// Without a lab (no engine, image missing), Start and StartMySQL skip the test with a
// message saying how to run it, except when the environment variable CI is "true":
// there they fail.
package ha

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql" // registers "mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	"github.com/testcontainers/testcontainers-go"
	tcexec "github.com/testcontainers/testcontainers-go/exec"
	"github.com/testcontainers/testcontainers-go/wait"
)

// DefaultImage is the lab's image when SQLLOCK_TEST_HA_IMAGE is not set.
const DefaultImage = "sqllock-ci/ha:bookworm"

// Environment variables read by this package.
const (
	EnvImage = "SQLLOCK_TEST_HA_IMAGE"
	EnvMode  = "SQLLOCK_TEST_HA" // "local": run ha-lab on this host instead of a container
)

// Credentials and ports of the lab (inside the container, or on the host).
const (
	user     = "halab"
	password = "halab"
	database = "locktest"

	portGaleraBase  = 3310 // node n listens on 3310+n
	portPrimary     = "5441"
	portStandby     = "5442"
	portTransaction = "6441"
	portSession     = "6442"

	// startTimeout bounds the lab's start until every server answers SQL: three
	// Galera nodes joining one after the other take most of it on 2 cores.
	startTimeout = 6 * time.Minute
	// ctlTimeout bounds one ha-lab control command (a reset rebuilds the pair).
	ctlTimeout = 3 * time.Minute
	// scriptPath is ha-lab in the repository (local mode) and in the image.
	scriptPath = ".ci/images/ha/files/usr/local/bin/ha-lab"
)

// Lab is one running HA lab.
type Lab struct {
	local  bool
	script string                            // local: path of ha-lab
	ctr    testcontainers.Container          // container mode
	host   string                            // where the DSNs connect
	ports  map[string]string                 // lab port -> port on host
	ctlMu  sync.Mutex                        // one ha-lab command at a time
	mu     sync.Mutex                        // guards the fields below
	pgRole struct{ primary, standby string } // lab ports of the current primary and standby
}

// theLab is the HA lab of this test binary.
var theLab once[Lab]

// once is a lab started at most once per test binary, and stopped by Main.
type once[L any] struct {
	once sync.Once
	mu   sync.Mutex
	lab  *L
	ctr  testcontainers.Container // the lab's container, if it has one
	err  error
}

// get starts the lab with start on the first call and returns it; if it could not
// start, it fails t (in CI, or in local mode) or skips it, with what and how to run
// the lab in the message.
func (o *once[L]) get(t testing.TB, start func() (*L, testcontainers.Container, error), what, how string) *L {
	t.Helper()
	o.once.Do(func() {
		l, ctr, err := start()
		o.mu.Lock()
		o.lab, o.ctr, o.err = l, ctr, err
		o.mu.Unlock()
	})
	o.mu.Lock()
	l, err := o.lab, o.err
	o.mu.Unlock()
	if err != nil {
		msg := fmt.Sprintf("ha: no %s: %v\n%s", what, err, how)
		if os.Getenv("CI") == "true" || os.Getenv(EnvMode) == "local" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return l
}

// stop terminates the lab's container, if it has one (a local lab stays up); later
// gets fail.
func (o *once[L]) stop(what string) {
	o.mu.Lock()
	ctr := o.ctr
	o.lab, o.ctr, o.err = nil, nil, errors.New("the "+what+" was stopped by Main")
	o.mu.Unlock()
	if ctr == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := ctr.Terminate(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "ha: terminating the %s container: %v\n", what, err)
	}
}

// Start returns the lab of this test binary, started once (later calls return the
// same Lab); it fails t if it cannot start (outside CI, when no container engine or
// image is there, it skips t instead).
//
// Default: a container of image $SQLLOCK_TEST_HA_IMAGE (default DefaultImage) via
// testcontainers (set TESTCONTAINERS_RYUK_DISABLED=true where the engine has no
// reaper, as for testdb), terminated by Main, which TestMain must call. With
// SQLLOCK_TEST_HA=local: the repository's ha-lab run on this host (root) on
// 127.0.0.1.
func Start(t testing.TB) *Lab {
	t.Helper()
	return theLab.get(t, func() (*Lab, testcontainers.Container, error) {
		l, err := start()
		if err != nil {
			return nil, nil, err
		}
		return l, l.ctr, nil
	}, "HA lab", fmt.Sprintf("Build the image (.ci/images/build.sh %s) and run Docker, or run as root with %s=local.",
		strings.TrimPrefix(image(), "sqllock-ci/"), EnvMode))
}

// Main runs m, then stops the lab and the Oracle MySQL lab if they were
// started: it terminates their containers (a local lab stays up). Call it from
// TestMain: func TestMain(m *testing.M) { os.Exit(ha.Main(m)) }.
func Main(m *testing.M) int {
	code := m.Run()
	theMySQL.stop("Oracle MySQL lab")
	theLab.stop("lab")
	return code
}

func image() string {
	if v := os.Getenv(EnvImage); v != "" {
		return v
	}
	return DefaultImage
}

func labPorts() []string {
	ps := []string{portPrimary, portStandby, portTransaction, portSession}
	for n := 1; n <= 3; n++ {
		ps = append(ps, fmt.Sprint(portGaleraBase+n))
	}
	return ps
}

func start() (*Lab, error) {
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout+time.Minute)
	defer cancel()
	l := &Lab{ports: map[string]string{}}
	if os.Getenv(EnvMode) == "local" {
		script, err := findFile(scriptPath)
		if err != nil {
			return nil, err
		}
		l.local, l.script, l.host = true, script, "127.0.0.1"
		for _, p := range labPorts() {
			l.ports[p] = p
		}
		if _, err := l.run(ctx, "up"); err != nil {
			return nil, err
		}
	} else {
		ctr, host, mapped, err := runContainer(ctx, image(), labPorts(), "ha-lab: ready", startTimeout)
		if err != nil {
			return nil, err
		}
		l.ctr, l.host, l.ports = ctr, host, mapped
	}
	if err := l.refreshRoles(ctx); err != nil {
		if l.ctr != nil {
			return nil, errors.Join(err, dumpAndTerminate(l.ctr))
		}
		return nil, err
	}
	return l, nil
}

// runContainer starts a container of img (opts: its command, environment), exposing
// ports, and waits up to timeout for ready in its log. It returns the container,
// the host its ports are mapped on and the mapping (port in the container -> port on
// the host). A container that does not become ready is dumped and removed.
func runContainer(ctx context.Context, img string, ports []string, ready string, timeout time.Duration,
	opts ...testcontainers.ContainerCustomizer) (testcontainers.Container, string, map[string]string, error) {
	var exposed []string
	for _, p := range ports {
		exposed = append(exposed, p+"/tcp")
	}
	ctr, err := testcontainers.Run(ctx, img, append(opts,
		testcontainers.WithExposedPorts(exposed...),
		testcontainers.WithWaitStrategyAndDeadline(timeout, wait.ForLog(ready).WithStartupTimeout(timeout)))...)
	if err != nil {
		err = fmt.Errorf("start container from %s: %w", img, err)
		if ctr != nil {
			err = errors.Join(err, dumpAndTerminate(ctr))
		}
		return nil, "", nil, err
	}
	fail := func(err error) (testcontainers.Container, string, map[string]string, error) {
		return nil, "", nil, errors.Join(err, dumpAndTerminate(ctr))
	}
	host, err := ctr.Host(ctx)
	if err != nil {
		return fail(fmt.Errorf("container host: %w", err))
	}
	mapped := map[string]string{}
	for _, p := range ports {
		m, err := ctr.MappedPort(ctx, p+"/tcp")
		if err != nil {
			return fail(fmt.Errorf("mapped port %s: %w", p, err))
		}
		mapped[p] = m.Port()
	}
	return ctr, host, mapped, nil
}

// dumpAndTerminate prints the end of the container's log to stderr (why it did not
// start) and removes it.
func dumpAndTerminate(ctr testcontainers.Container) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if rc, err := ctr.Logs(ctx); err == nil {
		b, _ := io.ReadAll(rc)
		rc.Close()
		if len(b) > 8000 {
			b = b[len(b)-8000:]
		}
		fmt.Fprintf(os.Stderr, "ha: end of the lab container's log:\n%s\n", b)
	}
	if err := ctr.Terminate(ctx); err != nil {
		return fmt.Errorf("terminate: %w", err)
	}
	return nil
}

// findFile finds path (relative to the repository's root) in the repository above the
// working directory (a test runs in its package's directory).
func findFile(path string) (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		p := filepath.Join(dir, path)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("%s not found above the working directory", path)
		}
		dir = parent
	}
}

// run runs `ha-lab args...` in the lab and returns its combined output; an exit
// code other than 0 is an error that carries the output. Commands run one at a
// time (ha-lab does not lock).
func (l *Lab) run(ctx context.Context, args ...string) (string, error) {
	l.ctlMu.Lock()
	defer l.ctlMu.Unlock()
	name := "ha-lab " + strings.Join(args, " ")
	if l.local {
		cmd := exec.CommandContext(ctx, l.script, args...)
		cmd.Env = append(os.Environ(), "HA_BIND=127.0.0.1")
		cmd.WaitDelay = 10 * time.Second
		out, err := cmd.CombinedOutput()
		if err != nil {
			return string(out), fmt.Errorf("%s: %w\n%s", name, err, out)
		}
		return string(out), nil
	}
	code, r, err := l.ctr.Exec(ctx, append([]string{"ha-lab"}, args...), tcexec.Multiplexed())
	var out []byte
	if r != nil {
		var buf bytes.Buffer
		_, _ = io.Copy(&buf, r)
		out = buf.Bytes()
	}
	if err != nil {
		return string(out), fmt.Errorf("%s: %w\n%s", name, err, out)
	}
	if code != 0 {
		return string(out), fmt.Errorf("%s: exit code %d\n%s", name, code, out)
	}
	return string(out), nil
}

// refreshRoles asks the lab which PostgreSQL server is the primary now.
func (l *Lab) refreshRoles(ctx context.Context) error {
	out, err := l.run(ctx, "pg", "primary")
	if err != nil {
		return err
	}
	primary := strings.TrimSpace(out)
	if i := strings.LastIndexByte(primary, '\n'); i >= 0 {
		primary = strings.TrimSpace(primary[i+1:])
	}
	var standby string
	switch primary {
	case portPrimary:
		standby = portStandby
	case portStandby:
		standby = portPrimary
	default:
		return fmt.Errorf("ha-lab pg primary: unexpected output %q", out)
	}
	l.mu.Lock()
	l.pgRole.primary, l.pgRole.standby = primary, standby
	l.mu.Unlock()
	return nil
}

func (l *Lab) addr(labPort string) string {
	return net.JoinHostPort(l.host, l.ports[labPort])
}

func (l *Lab) pgDSN(labPort string, query url.Values) string {
	query.Set("sslmode", "disable")
	u := url.URL{
		Scheme:   "postgres",
		User:     url.UserPassword(user, password),
		Host:     l.addr(labPort),
		Path:     "/" + database,
		RawQuery: query.Encode(),
	}
	return u.String()
}

// GaleraDSN returns the go-sql-driver DSN of Galera node 1, 2 or 3, as testdb's:
// "halab:halab@tcp(host:port)/locktest", no parameters.
func (l *Lab) GaleraDSN(node int) string {
	if node < 1 || node > 3 {
		panic(fmt.Sprintf("ha: no Galera node %d (1..3)", node))
	}
	return fmt.Sprintf("%s:%s@tcp(%s)/%s", user, password, l.addr(fmt.Sprint(portGaleraBase+node)), database)
}

// PrimaryDSN returns the pgx stdlib DSN of the current PostgreSQL primary: after
// Promote, the former standby.
func (l *Lab) PrimaryDSN() string {
	l.mu.Lock()
	p := l.pgRole.primary
	l.mu.Unlock()
	return l.pgDSN(p, url.Values{})
}

// StandbyDSN returns the pgx stdlib DSN of the standby (a hot standby: read-only).
// After Promote it names the former primary, which is down until ResetPostgres.
func (l *Lab) StandbyDSN() string {
	l.mu.Lock()
	p := l.pgRole.standby
	l.mu.Unlock()
	return l.pgDSN(p, url.Values{})
}

// BouncerDSN returns the pgx stdlib DSN of pgbouncer in mode "transaction" or
// "session", with default_query_exec_mode=simple_protocol (pgx's default statement
// cache breaks under transaction pooling); edit it to try other modes. pgbouncer
// keeps its port across a Promote: it points at the current primary.
func (l *Lab) BouncerDSN(mode string) string {
	port := portTransaction
	switch mode {
	case "transaction":
	case "session":
		port = portSession
	default:
		panic(fmt.Sprintf("ha: pgbouncer mode %q: want transaction or session", mode))
	}
	return l.pgDSN(port, url.Values{"default_query_exec_mode": {"simple_protocol"}})
}

// Ctl runs `ha-lab args...` in the lab (an Exec in the container, or the script on
// this host) and returns its combined output; it fails t if the command fails.
func (l *Lab) Ctl(t testing.TB, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), ctlTimeout)
	defer cancel()
	t0 := time.Now()
	out, err := l.run(ctx, args...)
	if err != nil {
		t.Fatalf("ha: %v", err)
	}
	t.Logf("ha-lab %s (%v)", strings.Join(args, " "), time.Since(t0).Round(10*time.Millisecond))
	return out
}

// ResetPostgres builds a fresh primary + standby pair in mode "sync"
// (synchronous_standby_names names the standby) or "async", with pgbouncer pointing
// at the primary; PrimaryDSN and StandbyDSN name the new pair. Data of the former
// pair is gone.
func (l *Lab) ResetPostgres(t testing.TB, mode string) {
	t.Helper()
	if mode != "sync" && mode != "async" {
		t.Fatalf("ha: ResetPostgres(%q): want sync or async", mode)
	}
	l.Ctl(t, "pg", "reset", mode)
	l.refresh(t)
}

// KillPrimary crashes the primary: SIGKILL to its postmaster and every backend at
// once, no checkpoint, no shutdown.
func (l *Lab) KillPrimary(t testing.TB) {
	t.Helper()
	l.Ctl(t, "pg", "kill-primary")
}

// Promote promotes the standby and waits until it accepts writes; pgbouncer then
// points at it. After it, PrimaryDSN names the promoted server.
func (l *Lab) Promote(t testing.TB) {
	t.Helper()
	l.Ctl(t, "pg", "promote")
	l.refresh(t)
}

// StandbyStop stops the standby (fast shutdown).
func (l *Lab) StandbyStop(t testing.TB) { t.Helper(); l.Ctl(t, "pg", "standby", "stop") }

// StandbyStart starts the standby and waits until it streams from the primary again.
func (l *Lab) StandbyStart(t testing.TB) { t.Helper(); l.Ctl(t, "pg", "standby", "start") }

// StandbyCut keeps the standby running (readable) but stops it receiving WAL: its
// WAL receiver is gone when this returns, so the primary's commits no longer reach
// it (and in sync mode, wait for it).
func (l *Lab) StandbyCut(t testing.TB) { t.Helper(); l.Ctl(t, "pg", "standby", "cut") }

// StandbyHeal undoes StandbyCut and waits until the standby streams again.
func (l *Lab) StandbyHeal(t testing.TB) { t.Helper(); l.Ctl(t, "pg", "standby", "heal") }

func (l *Lab) refresh(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), ctlTimeout)
	defer cancel()
	if err := l.refreshRoles(ctx); err != nil {
		t.Fatalf("ha: %v", err)
	}
}

// Open opens a pool with driver ("pgx" or "mysql") to dsn and pings it, retrying for
// up to 30 s (a server that just started or was promoted); the pool is closed when
// the test ends.
func (l *Lab) Open(t testing.TB, driver, dsn string) *sql.DB {
	t.Helper()
	return Open(t, driver, dsn)
}

// Open is Lab.Open for any of the labs' servers (MySQLLab's).
func Open(t testing.TB, driver, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatalf("ha: open %s: %v", driver, err)
	}
	t.Cleanup(func() { db.Close() })
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = db.PingContext(ctx)
		cancel()
		if err == nil {
			return db
		}
		if time.Now().After(deadline) {
			t.Fatalf("ha: ping %s %s: %v", driver, redact(dsn), err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// redact hides nothing secret (the lab's password is public) but keeps messages
// short: the DSN without its query.
func redact(dsn string) string {
	if i := strings.IndexByte(dsn, '?'); i >= 0 {
		return dsn[:i]
	}
	return dsn
}
