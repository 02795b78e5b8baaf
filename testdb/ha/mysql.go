package ha

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tcexec "github.com/testcontainers/testcontainers-go/exec"
)

// DefaultMySQLImage is the image of the Oracle MySQL lab when SQLLOCK_TEST_GR_IMAGE
// is not set: Oracle MySQL from Debian sid (`.ci/images/build.sh mysql:9.7`), which
// carries mysql-lab.
const DefaultMySQLImage = "sqllock-ci/mysql:9.7"

// Environment variables read by StartMySQL.
const (
	EnvMySQLImage = "SQLLOCK_TEST_GR_IMAGE"
	// EnvMySQLRoot is, with SQLLOCK_TEST_HA=local, the root filesystem that has Oracle
	// MySQL's mysql-server in it (default /opt/mysql9-root, which
	// ../shared/tools/mysql9up.sh makes): mysql-lab runs chrooted into it.
	EnvMySQLRoot = "SQLLOCK_TEST_GR_ROOT"
)

const (
	mysqlLabUser     = "grlab"
	mysqlLabPassword = "grlab"
	mysqlScriptPath  = ".ci/images/mysql/files/usr/local/bin/mysql-lab"
	// mysqlStartTimeout bounds the lab's start: four servers initialised and started
	// one after the other, the group formed, the replica started (about 30 s on 2
	// cores).
	mysqlStartTimeout = 4 * time.Minute
)

// mysqlLabPorts are the lab's servers: group members 1 and 2, the source, the replica.
var mysqlLabPorts = [4]string{"3321", "3322", "3331", "3332"}

// MySQLLab is the running Oracle MySQL lab (mysql-lab): a Group Replication group of
// two members in multi-primary mode (both take writes; row changes are certified
// group-wide at commit, GET_LOCK and row locks are local to a member), and a source
// with one replica (GTID-based binary log replication, asynchronous until
// SemiSync). Every server has the user grlab (password grlab, all privileges) and
// the database locktest.
type MySQLLab struct {
	host   string
	ports  [4]string // on the host, as mysqlLabPorts
	ctr    testcontainers.Container
	local  bool
	root   string // local: the root filesystem mysql-lab runs in
	script string // local: mysql-lab in the repository
	ctlMu  sync.Mutex
}

// theMySQL is the Oracle MySQL lab of this test binary.
var theMySQL once[MySQLLab]

// StartMySQL returns the Oracle MySQL lab of this test binary, started once; it
// fails t if it cannot start (outside CI, when no container engine or image is
// there, it skips t instead). Default: a container of $SQLLOCK_TEST_GR_IMAGE
// (default DefaultMySQLImage) running `mysql-lab run`, terminated by Main. With
// SQLLOCK_TEST_HA=local: the repository's mysql-lab run as root, chrooted into
// $SQLLOCK_TEST_GR_ROOT, on 127.0.0.1 (left running; `mysql-lab down` in the root
// stops it).
func StartMySQL(t testing.TB) *MySQLLab {
	t.Helper()
	return theMySQL.get(t, func() (*MySQLLab, testcontainers.Container, error) {
		l, err := startMySQL()
		if err != nil {
			return nil, nil, err
		}
		return l, l.ctr, nil
	}, "Oracle MySQL lab", fmt.Sprintf("Build the image (.ci/images/build.sh mysql:9.7) and run Docker, or run as root with %s=local and %s naming a root filesystem with Oracle MySQL.",
		EnvMode, EnvMySQLRoot))
}

func (l *MySQLLab) dsn(i int) string {
	return fmt.Sprintf("%s:%s@tcp(%s)/%s", mysqlLabUser, mysqlLabPassword, net.JoinHostPort(l.host, l.ports[i]), database)
}

// GroupDSN returns the go-sql-driver DSN of group member 1 or 2:
// "grlab:grlab@tcp(host:port)/locktest", no parameters.
func (l *MySQLLab) GroupDSN(member int) string {
	if member < 1 || member > 2 {
		panic(fmt.Sprintf("ha: no Group Replication member %d (1..2)", member))
	}
	return l.dsn(member - 1)
}

// SourceDSN returns the go-sql-driver DSN of the replication source.
func (l *MySQLLab) SourceDSN() string { return l.dsn(2) }

// ReplicaDSN returns the go-sql-driver DSN of the source's replica (read_only).
func (l *MySQLLab) ReplicaDSN() string { return l.dsn(3) }

// SemiSync sets the source's semi-synchronous replication: "off" (asynchronous),
// "after_sync" or "after_commit" (its wait point), or "fallback" (enabled with
// AFTER_SYNC, but fallen back to asynchronous: the replica answers as an
// asynchronous one); it returns once the source reports the mode in force.
func (l *MySQLLab) SemiSync(t testing.TB, mode string) {
	t.Helper()
	l.Ctl(t, "pair", "semisync", mode)
}

// KillSource crashes the source: SIGKILL to its mysqld.
func (l *MySQLLab) KillSource(t testing.TB) { t.Helper(); l.Ctl(t, "pair", "kill-source") }

// ResetPair builds a fresh source and replica, replicating asynchronously; the
// former pair's data is gone. SourceDSN and ReplicaDSN name the new pair.
func (l *MySQLLab) ResetPair(t testing.TB) { t.Helper(); l.Ctl(t, "pair", "reset") }

// Ctl runs `mysql-lab args...` in the lab (an Exec in the container, or the script
// chrooted on this host); it fails t if the command fails.
func (l *MySQLLab) Ctl(t testing.TB, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), ctlTimeout)
	defer cancel()
	l.ctlMu.Lock()
	defer l.ctlMu.Unlock()
	var out []byte
	var err error
	if l.local {
		out, err = l.localCmd(ctx, args...)
	} else {
		var code int
		var r io.Reader
		code, r, err = l.ctr.Exec(ctx, append([]string{"mysql-lab"}, args...), tcexec.Multiplexed())
		if r != nil {
			out, _ = io.ReadAll(r)
		}
		if err == nil && code != 0 {
			err = fmt.Errorf("exit code %d", code)
		}
	}
	if err != nil {
		t.Fatalf("ha: mysql-lab %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// localCmd runs mysql-lab args... chrooted into l.root.
func (l *MySQLLab) localCmd(ctx context.Context, args ...string) ([]byte, error) {
	f, err := os.Open(l.script)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd := exec.CommandContext(ctx, "chroot", append([]string{l.root, "/bin/bash", "-s", "--"}, args...)...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "HOME=/root", "GR_BIND=127.0.0.1"}
	cmd.Stdin = f
	cmd.WaitDelay = 10 * time.Second
	return cmd.CombinedOutput()
}

func startMySQL() (*MySQLLab, error) {
	ctx, cancel := context.WithTimeout(context.Background(), mysqlStartTimeout+time.Minute)
	defer cancel()
	if os.Getenv(EnvMode) == "local" {
		script, err := findFile(mysqlScriptPath)
		if err != nil {
			return nil, err
		}
		root := os.Getenv(EnvMySQLRoot)
		if root == "" {
			root = "/opt/mysql9-root"
		}
		l := &MySQLLab{host: "127.0.0.1", ports: mysqlLabPorts, local: true, root: root, script: script}
		if out, err := l.localCmd(ctx, "up"); err != nil {
			return nil, fmt.Errorf("mysql-lab up in %s: %w\n%s", root, err, out)
		}
		return l, nil
	}
	img := DefaultMySQLImage
	if v := os.Getenv(EnvMySQLImage); v != "" {
		img = v
	}
	ctr, host, mapped, err := runContainer(ctx, img, mysqlLabPorts[:], "mysql-lab: ready", mysqlStartTimeout,
		testcontainers.WithCmd("mysql-lab", "run"),
		testcontainers.WithEnv(map[string]string{"GR_BIND": "0.0.0.0"}))
	if err != nil {
		return nil, err
	}
	l := &MySQLLab{ctr: ctr, host: host}
	for i, p := range mysqlLabPorts {
		l.ports[i] = mapped[p]
	}
	return l, nil
}
