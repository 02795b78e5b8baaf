package ha

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

// DefaultGroupImage is the image of the Group Replication lab when
// SQLLOCK_TEST_GR_IMAGE is not set: Oracle MySQL from Debian sid
// (`.ci/images/build.sh mysql:9.7`), which carries gr-lab.
const DefaultGroupImage = "sqllock-ci/mysql:9.7"

// Environment variables read by StartGroup.
const (
	EnvGroupImage = "SQLLOCK_TEST_GR_IMAGE"
	// EnvGroupRoot is, with SQLLOCK_TEST_HA=local, the root filesystem that has Oracle
	// MySQL's mysql-server in it (default /opt/mysql9-root, which
	// ../shared/tools/mysql9up.sh makes): gr-lab runs chrooted into it.
	EnvGroupRoot = "SQLLOCK_TEST_GR_ROOT"
)

const (
	groupUser       = "grlab"
	groupPassword   = "grlab"
	portMemberBase  = 3320 // member n listens on 3320+n
	groupScriptPath = ".ci/images/mysql/files/usr/local/bin/gr-lab"
	// groupStartTimeout bounds the group's start: two members initialised and
	// started one after the other, then the group formed (about 15 s on 2 cores).
	groupStartTimeout = 3 * time.Minute
)

// Group is a running MySQL Group Replication group of two members in
// multi-primary mode (gr-lab): both take writes; row changes are certified
// group-wide at commit, GET_LOCK and row locks are local to a member. Every member
// has the user grlab (password grlab, all privileges) and the database locktest.
type Group struct {
	host  string
	ports [2]string // members 1 and 2 on the host
	ctr   testcontainers.Container
}

var (
	groupOnce sync.Once
	groupMu   sync.Mutex
	theGroup  *Group
	groupErr  error
)

// StartGroup returns the Group Replication lab of this test binary, started once;
// it fails t if it cannot start (outside CI, when no container engine or image is
// there, it skips t instead). Default: a container of $SQLLOCK_TEST_GR_IMAGE
// (default DefaultGroupImage) running `gr-lab run`, terminated by Main. With
// SQLLOCK_TEST_HA=local: the repository's gr-lab run as root, chrooted into
// $SQLLOCK_TEST_GR_ROOT, on 127.0.0.1:3321-3322 (left running; `gr-lab down` in the
// root stops it).
func StartGroup(t testing.TB) *Group {
	t.Helper()
	groupOnce.Do(func() {
		g, err := startGroup()
		groupMu.Lock()
		theGroup, groupErr = g, err
		groupMu.Unlock()
	})
	groupMu.Lock()
	g, err := theGroup, groupErr
	groupMu.Unlock()
	if err != nil {
		msg := fmt.Sprintf("ha: no Group Replication lab: %v\nBuild the image (.ci/images/build.sh mysql:9.7) and run Docker, or run as root with %s=local and %s naming a root filesystem with Oracle MySQL.",
			err, EnvMode, EnvGroupRoot)
		if os.Getenv("CI") == "true" || os.Getenv(EnvMode) == "local" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return g
}

// DSN returns the go-sql-driver DSN of member 1 or 2:
// "grlab:grlab@tcp(host:port)/locktest", no parameters.
func (g *Group) DSN(member int) string {
	if member < 1 || member > 2 {
		panic(fmt.Sprintf("ha: no Group Replication member %d (1..2)", member))
	}
	return fmt.Sprintf("%s:%s@tcp(%s)/%s", groupUser, groupPassword, net.JoinHostPort(g.host, g.ports[member-1]), database)
}

func startGroup() (*Group, error) {
	ctx, cancel := context.WithTimeout(context.Background(), groupStartTimeout+time.Minute)
	defer cancel()
	if os.Getenv(EnvMode) == "local" {
		script, err := findFile(groupScriptPath)
		if err != nil {
			return nil, err
		}
		root := os.Getenv(EnvGroupRoot)
		if root == "" {
			root = "/opt/mysql9-root"
		}
		f, err := os.Open(script)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		cmd := exec.CommandContext(ctx, "chroot", root, "/bin/bash", "-s", "--", "up")
		cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "HOME=/root", "GR_BIND=127.0.0.1"}
		cmd.Stdin = f
		cmd.WaitDelay = 10 * time.Second
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("gr-lab up in %s: %w\n%s", root, err, out)
		}
		return &Group{host: "127.0.0.1", ports: [2]string{fmt.Sprint(portMemberBase + 1), fmt.Sprint(portMemberBase + 2)}}, nil
	}
	img := DefaultGroupImage
	if v := os.Getenv(EnvGroupImage); v != "" {
		img = v
	}
	p1, p2 := fmt.Sprint(portMemberBase+1)+"/tcp", fmt.Sprint(portMemberBase+2)+"/tcp"
	ctr, err := testcontainers.Run(ctx, img,
		testcontainers.WithCmd("gr-lab", "run"),
		testcontainers.WithEnv(map[string]string{"GR_BIND": "0.0.0.0"}),
		testcontainers.WithExposedPorts(p1, p2),
		testcontainers.WithWaitStrategyAndDeadline(groupStartTimeout,
			wait.ForLog("gr-lab: ready").WithStartupTimeout(groupStartTimeout)),
	)
	if err != nil {
		err = fmt.Errorf("start container from %s: %w", img, err)
		if ctr != nil {
			err = errors.Join(err, dumpAndTerminate(ctr))
		}
		return nil, err
	}
	g := &Group{ctr: ctr}
	fail := func(err error) (*Group, error) { return nil, errors.Join(err, dumpAndTerminate(ctr)) }
	if g.host, err = ctr.Host(ctx); err != nil {
		return fail(fmt.Errorf("container host: %w", err))
	}
	for i, p := range []string{p1, p2} {
		mapped, err := ctr.MappedPort(ctx, p)
		if err != nil {
			return fail(fmt.Errorf("mapped port %s: %w", p, err))
		}
		g.ports[i] = mapped.Port()
	}
	return g, nil
}

// stopGroup terminates the group's container, if Main's test binary started one.
func stopGroup() {
	groupMu.Lock()
	g := theGroup
	theGroup, groupErr = nil, errors.New("the group was stopped by Main")
	groupMu.Unlock()
	if g == nil || g.ctr == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := g.ctr.Terminate(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "ha: terminating the group container: %v\n", err)
	}
}
